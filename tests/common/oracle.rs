//! What each leg must receive for a client body, checked against what the mocks recorded.
//!
//! Prefill gets the client's body with every limit capped to 1 (`max_tokens` added when
//! absent but on /v1/responses, which has none, where `max_output_tokens` is; `store` and
//! `background` false there), `stream` false, `min_tokens` 1 on completions, chat and Messages
//! (none on /v1/responses), no `min_completion_tokens` or `stream_options`, and `kv_transfer_params`
//! asking for a remote
//! decode, each edited member once however often the client repeated it; every other member
//! byte for byte, in order. Decode gets the client's bytes with exactly one
//! `kv_transfer_params`, what prefill issued for that prompt: in place where the client had
//! one, else added at the end.

use std::fmt;
use std::ops::Range;

use mock_vllm::RecordedRequest;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{json, Value};

use super::request::{Reply, Request};
use super::{harness, mock_fingerprint};

const KV: &str = "kv_transfer_params";
/// Set to 1 on prefill where the client has them.
const CAPPED: [&str; 4] = [
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "n",
];
/// Never sent to prefill (but `min_tokens`, which completions, chat and Messages get as 1).
const REMOVED: [&str; 3] = ["min_tokens", "min_completion_tokens", "stream_options"];

/// The `kv_transfer_params` the filter sends prefill.
pub fn remote_decode_request() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
           "remote_block_ids": null, "remote_host": null, "remote_port": null})
}

/// The top-level members of a JSON object in order, duplicates included, each value as
/// written.
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MembersVisitor;
        impl<'de> Visitor<'de> for MembersVisitor {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(MembersVisitor)
    }
}

fn members(text: &str) -> Result<Vec<(String, &RawValue)>, String> {
    serde_json::from_str::<Members>(text)
        .map(|m| m.0)
        .map_err(|e| format!("not a JSON object ({e}): {text}"))
}

/// The top-level members of a JSON object body in order, duplicates kept, each value as its
/// raw JSON text; `None` when the bytes are not one JSON object.
pub fn members_of(body: &[u8]) -> Option<Vec<(String, String)>> {
    let members: Members = serde_json::from_slice(body).ok()?;
    let owned = members.0.into_iter();
    Some(
        owned
            .map(|(key, raw)| (key, raw.get().to_owned()))
            .collect(),
    )
}

fn utf8<'a>(what: &str, bytes: &'a [u8]) -> Result<&'a str, String> {
    std::str::from_utf8(bytes).map_err(|e| format!("{what} is not UTF-8: {e}"))
}

/// Where `raw`, a value borrowed from `text`, stands in it.
fn range_in(text: &str, raw: &RawValue) -> Range<usize> {
    let start = raw.get().as_ptr() as usize - text.as_ptr() as usize;
    start..start + raw.get().len()
}

/// The prompt text the mocks see in a client body (and fingerprint for the KV they issue).
pub fn mock_prompt(path: &str, body: &Value) -> Result<String, String> {
    let texts: Vec<&str> = match path {
        "/v1/completions" => vec![body["prompt"].as_str().ok_or("prompt is not a string")?],
        "/v1/chat/completions" => body["messages"]
            .as_array()
            .ok_or("no messages")?
            .iter()
            .filter_map(|message| message["content"].as_str())
            .collect(),
        "/v1/responses" => body["instructions"]
            .as_str()
            .into_iter()
            .chain(Some(body["input"].as_str().ok_or("input is not a string")?))
            .collect(),
        _ => return Err(format!("no prompt on {path}")),
    };
    Ok(texts.join("\n"))
}

/// Checks what prefill got for a client that sent `client` to `path`; says what is wrong.
pub fn check_prefill(path: &str, client: &[u8], prefill: &RecordedRequest) -> Result<(), String> {
    if prefill.path != path {
        return Err(format!(
            "prefill was called on {}, not {path}",
            prefill.path
        ));
    }
    if prefill.header("content-type") != Some("application/json") {
        let content_type = prefill.header("content-type");
        return Err(format!("prefill got content-type {content_type:?}"));
    }
    let client_text = utf8("the client's body", client)?;
    let prefill_text = utf8("the prefill body", &prefill.body)?;
    let sent = members(client_text)?;
    let got = members(prefill_text)?;
    let responses = path == "/v1/responses";
    // Prefill's one token must not be a stop where vLLM reads min_tokens.
    let holds_off_a_stop = !responses;
    // A chat request's "required" tool choice names a tool on prefill, and the one output
    // constraint vLLM refuses beside a named tool goes (checked by their tests).
    let names_a_tool = path == "/v1/chat/completions"
        && sent
            .iter()
            .rev()
            .find(|(key, _)| key == "tool_choice")
            .is_some_and(|(_, value)| value.get() == r#""required""#);
    let last = |key: &str| -> Value {
        sent.iter()
            .rev()
            .find(|(k, _)| k == key)
            .and_then(|(_, raw)| serde_json::from_str(raw.get()).ok())
            .unwrap_or(Value::Null)
    };
    let outputs = last("structured_outputs");
    // Counted per spelling: a vLLM that reads structured_outputs ignores the guided_ ones.
    let constraints = ["json", "regex", "choice"]
        .iter()
        .filter(|kind| !outputs[**kind].is_null())
        .count();
    let legacy = ["guided_json", "guided_regex", "guided_choice"]
        .iter()
        .filter(|key| !last(key).is_null())
        .count();
    let drops_constraint = names_a_tool && (constraints == 1 || (constraints == 0 && legacy == 1));
    let edited = |key: &str| {
        CAPPED.contains(&key)
            || REMOVED.contains(&key)
            || key == "stream"
            || key == KV
            || (responses && (key == "store" || key == "background"))
            || (names_a_tool && key == "tool_choice")
            || (drops_constraint
                && [
                    "structured_outputs",
                    "guided_json",
                    "guided_regex",
                    "guided_choice",
                ]
                .contains(&key))
    };
    let kept = |members: &[(String, &RawValue)]| -> Vec<(String, String)> {
        members
            .iter()
            .filter(|(key, _)| !edited(key))
            .map(|(key, value)| (key.clone(), value.get().to_owned()))
            .collect()
    };
    if kept(&sent) != kept(&got) {
        return Err(format!(
            "prefill did not keep the client's other members as sent: {prefill_text}"
        ));
    }
    let values = |members: &[(String, &RawValue)], key: &str| -> Vec<Value> {
        members
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, raw)| serde_json::from_str(raw.get()).unwrap_or(Value::Null))
            .collect()
    };
    let always = |key: &str| {
        ((key == "max_tokens" || key == "min_tokens") && !responses)
            || key == "stream"
            || key == KV
            || (responses && (key == "max_output_tokens" || key == "store"))
    };
    let mut required = vec![("stream", json!(false)), (KV, remote_decode_request())];
    if responses {
        required.extend([("store", json!(false)), ("background", json!(false))]);
    }
    if holds_off_a_stop {
        required.push(("min_tokens", json!(1)));
    }
    let rules = CAPPED
        .iter()
        .map(|key| (*key, json!(1)))
        .chain(required.iter().map(|(key, value)| (*key, value.clone())));
    for (key, value) in rules {
        let mut expected = values(&sent, key).len().min(1);
        if always(key) {
            expected = expected.max(1);
        }
        let found = values(&got, key);
        if found.len() != expected || found.iter().any(|v| *v != value) {
            return Err(format!(
                "prefill must get {expected} {key} of {value}: {prefill_text}"
            ));
        }
    }
    let removed = REMOVED
        .iter()
        .filter(|key| !(holds_off_a_stop && **key == "min_tokens"));
    if let Some(key) = removed
        .into_iter()
        .find(|key| !values(&got, key).is_empty())
    {
        return Err(format!("{key} reached prefill: {prefill_text}"));
    }
    Ok(())
}

/// Checks that decode got the client's bytes with only `kv_transfer_params` set to what the
/// prefill mock issued for this prompt; returns those `kv_transfer_params`.
pub fn check_decode(path: &str, client: &[u8], decode: &RecordedRequest) -> Result<Value, String> {
    if decode.path != path {
        return Err(format!("decode was called on {}, not {path}", decode.path));
    }
    let client_text = utf8("the client's body", client)?;
    let decode_text = utf8("the decode body", &decode.body)?;
    let sent = members(client_text)?;
    let got = members(decode_text)?;
    if got.iter().filter(|(key, _)| key == KV).count() != 1 {
        return Err(format!(
            "decode must get exactly one kv_transfer_params: {decode_text}"
        ));
    }
    if sent.iter().filter(|(key, _)| key == KV).count() > 1 {
        // The client repeated it: its other members must be kept as sent, in order.
        let others = |members: &[(String, &RawValue)]| -> Vec<(String, String)> {
            members
                .iter()
                .filter(|(key, _)| key != KV)
                .map(|(key, value)| (key.clone(), value.get().to_owned()))
                .collect()
        };
        if others(&sent) != others(&got) {
            return Err(format!(
                "decode did not keep the client's other members as sent: {decode_text}"
            ));
        }
        let kv_text = got
            .iter()
            .find(|(key, _)| key == KV)
            .map(|(_, raw)| raw.get())
            .unwrap_or_default();
        return check_issued(path, client_text, kv_text);
    }
    let existing: Vec<Range<usize>> = sent
        .iter()
        .filter(|(key, _)| key == KV)
        .map(|(_, raw)| range_in(client_text, raw))
        .collect();
    // Where a new member goes: first, right after the opening brace and followed by a comma
    // (only the head of the body changes); into an empty object, before its closing brace.
    let (at, member, after) = if sent.is_empty() {
        let brace = client_text.rfind('}').unwrap_or(client_text.len());
        (brace, format!("\"{KV}\":"), "")
    } else {
        let brace = client_text.find('{').map_or(0, |at| at + 1);
        (brace, format!("\"{KV}\":"), ",")
    };
    // The client's body with `kv` where its kv_transfer_params stood, or added.
    let splice = |kv: &str| -> String {
        if existing.is_empty() {
            let (head, tail) = client_text.split_at(at);
            return format!("{head}{member}{kv}{after}{tail}");
        }
        let mut out = String::new();
        let mut cursor = 0;
        for range in &existing {
            out.push_str(&client_text[cursor..range.start]);
            out.push_str(kv);
            cursor = range.end;
        }
        out.push_str(&client_text[cursor..]);
        out
    };
    // Every copy of the new kv_transfer_params has the same length: find it from the sizes.
    let unchanged = splice("").len();
    let copies = existing.len().max(1);
    let added = decode_text.len().checked_sub(unchanged);
    let Some(added) = added.filter(|added| added % copies == 0) else {
        return Err(format!(
            "decode did not get the client's body plus kv_transfer_params: {decode_text}"
        ));
    };
    let start = existing
        .first()
        .map_or(at + member.len(), |range| range.start);
    let kv_text = decode_text
        .get(start..start + added / copies)
        .ok_or_else(|| format!("decode body too short: {decode_text}"))?;
    if splice(kv_text) != decode_text {
        return Err(format!(
            "decode got more than the client's bytes with kv_transfer_params set: {decode_text}"
        ));
    }
    check_issued(path, client_text, kv_text)
}

/// Checks that `kv_text` is what the prefill mock issued for the client's prompt.
fn check_issued(path: &str, client_text: &str, kv_text: &str) -> Result<Value, String> {
    let kv: Value = serde_json::from_str(kv_text)
        .map_err(|e| format!("decode's kv_transfer_params are not JSON ({e}): {kv_text}"))?;
    let client_json: Value = serde_json::from_str(client_text).unwrap_or(Value::Null);
    let prompt = mock_prompt(path, &client_json)?;
    let engine = kv["remote_engine_id"].as_str().unwrap_or_default();
    let tokens = prompt.split_whitespace().count().max(1) as u64;
    let issued = kv["do_remote_prefill"] == json!(true)
        && engine.starts_with("mock-prefill-")
        && kv["remote_request_id"]
            .as_str()
            .is_some_and(|id| id.starts_with(&format!("{engine}-req-")))
        && kv["mock_prompt_fingerprint"] == json!(mock_fingerprint(&prompt))
        && kv["remote_num_tokens"] == json!(tokens + 1);
    if !issued {
        return Err(format!(
            "decode's kv_transfer_params are not what prefill issued for {prompt:?}: {kv}"
        ));
    }
    Ok(kv)
}

/// Asserts what prefill got for a client that sent `client` to `path` ([`check_prefill`]).
pub fn assert_prefill_got(path: &str, client: impl AsRef<[u8]>, prefill: &RecordedRequest) {
    if let Err(problem) = check_prefill(path, client.as_ref(), prefill) {
        panic!("{problem}");
    }
}

/// Asserts what decode got for a client that sent `client` to `path` ([`check_decode`]);
/// returns the `kv_transfer_params` it got.
pub fn assert_decode_got(path: &str, client: impl AsRef<[u8]>, decode: &RecordedRequest) -> Value {
    check_decode(path, client.as_ref(), decode).unwrap_or_else(|problem| panic!("{problem}"))
}

/// Asserts the one prefill and the one decode request of `id` are what they must be for a
/// client that sent `client` to `path`; returns the `kv_transfer_params` decode got.
pub fn assert_legs(id: &str, path: &str, client: impl AsRef<[u8]>) -> Value {
    let h = harness();
    assert_prefill_got(path, client.as_ref(), &h.only_prefill(id));
    assert_decode_got(path, client.as_ref(), &h.only_decode(id))
}

/// Sends `body` to `path` on `listener` with `x-request-id: id` and asserts it was served on
/// the KV its own prefill made: 200, `x-mock-kv: reused`, and both legs got what they must
/// ([`assert_legs`]). Returns the reply and the `kv_transfer_params` decode got.
pub async fn assert_served(listener: &str, path: &str, id: &str, body: &str) -> (Reply, Value) {
    let reply = Request::post(listener, path).id(id).body(body).send().await;
    assert_eq!(reply.status, 200, "{listener} {path}: {}", reply.body);
    let kv_outcome = reply.header("x-mock-kv");
    assert_eq!(
        kv_outcome,
        Some("reused"),
        "{listener} {path}: {}",
        reply.body
    );
    let kv = assert_legs(id, path, body);
    (reply, kv)
}

/// Sends `body` to `path` on `listener` with `x-request-id: id` and asserts it was served
/// without prefill's KV: 200, `x-mock-kv: recomputed`, and decode got exactly the client's
/// bytes. Returns the reply.
pub async fn assert_recomputed(listener: &str, path: &str, id: &str, body: &str) -> Reply {
    let reply = Request::post(listener, path).id(id).body(body).send().await;
    assert_eq!(reply.status, 200, "{listener} {path}: {}", reply.body);
    let kv_outcome = reply.header("x-mock-kv");
    assert_eq!(kv_outcome, Some("recomputed"), "{listener}: {}", reply.body);
    assert_decode_got_client_bytes(body, &harness().only_decode(id));
    reply
}

/// Asserts `reply` is an OpenAI-style error with this status whose message contains `text`,
/// carrying the request id `id`, and that nothing reached decode.
pub fn assert_error_without_decode(reply: &Reply, id: &str, status: u16, text: &str) {
    reply.assert_error(status, text);
    assert_eq!(reply.header("x-request-id"), Some(id), "{}", reply.body);
    let decoded = harness().decode_requests(id);
    assert!(decoded.is_empty(), "decode was called for {id}");
}

/// Sends `body` to `path` on `listener` with `x-request-id: id` and asserts the answer is an
/// error with this status and text and nothing reached decode
/// ([`assert_error_without_decode`]). Returns the reply.
pub async fn assert_refused(
    listener: &str,
    path: &str,
    id: &str,
    body: impl AsRef<[u8]>,
    status: u16,
    text: &str,
) -> Reply {
    let reply = Request::post(listener, path).id(id).body(body).send().await;
    assert_error_without_decode(&reply, id, status, text);
    reply
}

/// Asserts decode got exactly the client's bytes (prefill gave it nothing to add).
pub fn assert_decode_got_client_bytes(client: impl AsRef<[u8]>, decode: &RecordedRequest) {
    assert_eq!(
        String::from_utf8_lossy(&decode.body),
        String::from_utf8_lossy(client.as_ref()),
        "decode did not get the client's body as sent"
    );
}
