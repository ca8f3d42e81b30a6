//! To a client, a P/D pair behind the filter answers like one vLLM: usage with prefill's
//! prompt counts and decode's output counts, vLLM's own errors, the request id both workers
//! logged, and one trace over both legs.

mod common;

use common::{answer_text, expected_decode_text, harness, unique_id, Reply, Request};
use serde_json::{json, Value};

/// The mock prefill reports this many prompt tokens from its own prefix cache; the mock
/// decode reports its whole prompt as cached (the KV it pulled), as vLLM does under P/D.
const PREFILL_CACHED: u64 = 2;

struct Api {
    path: &'static str,
    prompt: &'static str,
    output: &'static str,
    details: &'static str,
}

const APIS: [Api; 3] = [
    Api {
        path: "/v1/completions",
        prompt: "prompt_tokens",
        output: "completion_tokens",
        details: "prompt_tokens_details",
    },
    Api {
        path: "/v1/chat/completions",
        prompt: "prompt_tokens",
        output: "completion_tokens",
        details: "prompt_tokens_details",
    },
    Api {
        path: "/v1/responses",
        prompt: "input_tokens",
        output: "output_tokens",
        details: "input_tokens_details",
    },
];

fn body(api: &Api, words: &str, stream: bool) -> Value {
    let text = format!("{words} mock:prefill_cached_tokens={PREFILL_CACHED}");
    let mut body = match api.path {
        "/v1/completions" => json!({"model": "m", "prompt": text, "max_tokens": 5}),
        "/v1/chat/completions" => json!({"model": "m", "max_tokens": 5,
            "messages": [{"role": "user", "content": text}]}),
        _ => json!({"model": "m", "input": text, "max_output_tokens": 5}),
    };
    if stream {
        body["stream"] = json!(true);
        if api.path != "/v1/responses" {
            body["stream_options"] = json!({"include_usage": true});
        }
    }
    body
}

/// Sends `body` to `api` on the default listener with `x-request-id: id`.
async fn post(api: &Api, id: &str, body: &Value) -> Reply {
    Request::post("default", api.path)
        .id(id)
        .body(body.to_string())
        .send()
        .await
}

/// The usage the client got: the answer's, the usage chunk's, or `response.completed`'s.
fn client_usage(answer: &str) -> Value {
    if let Ok(object) = serde_json::from_str::<Value>(answer) {
        return object["usage"].clone();
    }
    answer
        .split("\n\n")
        .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .find_map(|data| {
            let usage = data
                .get("usage")
                .or_else(|| data["response"].get("usage"))?;
            (!usage.is_null()).then(|| usage.clone())
        })
        .expect("a usage event")
}

/// One answer of `api` for a prompt starting "count" (`words`), streamed or not: its id, the
/// reply, the usage the client got and a name for the case. Checked on the way: a 200 on
/// the KV decode reused, prefill's cache hits and decode's 5 output tokens in the usage, and
/// every other byte decode's (its text and, for streams, an intact stream).
async fn counted(api: &Api, words: &str, stream: bool) -> (String, Reply, Value, String) {
    let id = unique_id("usage");
    let sent = body(api, words, stream);
    let reply = post(api, &id, &sent).await;
    let case = format!("{} stream={stream}", api.path);
    assert_eq!(reply.status, 200, "{case}: {}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"), "{case}");
    let usage = client_usage(&reply.body);
    assert_eq!(
        usage[api.details]["cached_tokens"], PREFILL_CACHED,
        "{case}: {usage}"
    );
    assert_eq!(usage[api.output], 5, "{case}: {usage}");
    let (text, _, ended) = answer_text(&reply.body);
    assert!(ended, "{case}");
    assert_eq!(text, expected_decode_text("count", 5), "{case}");
    (id, reply, usage, case)
}

#[tokio::test]
async fn usage_has_prefills_prompt_counts_and_decodes_output_counts() {
    let h = harness();
    for api in &APIS {
        for stream in [false, true] {
            let (id, reply, usage, case) = counted(api, "count my tokens", stream).await;
            assert_eq!(h.only_prefill(&id).json()["stream"], false, "{case}");
            let prompt = usage[api.prompt].as_u64().unwrap();
            assert_eq!(usage["total_tokens"], prompt + 5, "{case}: {usage}");
            if !stream {
                // Headers held (as shipped): the rewritten answer's own length, as vLLM
                // would announce it, rather than chunks.
                let length = reply.body.len().to_string();
                assert_eq!(
                    reply.header("content-length"),
                    Some(length.as_str()),
                    "{case}"
                );
                assert_eq!(reply.header("transfer-encoding"), None, "{case}");
            }
        }
    }
}

/// vLLM reads `stream` as pydantic's lax boolean ("1", "yes", 1 stream; "false" does not),
/// after checking `stream_options` against Python's truth of the raw value: the filter
/// reads it the same way, so prefill is never streamed and the usage is merged into the
/// stream or the JSON answer decode gives.
#[tokio::test]
async fn a_stream_spelled_as_pydantic_reads_it_is_merged_as_a_stream() {
    let h = harness();
    for api in &APIS[..2] {
        for (spelling, streams) in [
            (json!("1"), true),
            (json!("Yes"), true),
            (json!(1), true),
            (json!("false"), false),
        ] {
            let id = unique_id("lax-stream");
            let mut sent = body(api, "count in any spelling", true);
            sent["stream"] = spelling.clone();
            let reply = post(api, &id, &sent).await;
            let case = format!("{} stream={spelling}", api.path);
            assert_eq!(reply.status, 200, "{case}: {}", reply.body);
            assert_eq!(reply.header("x-mock-kv"), Some("reused"), "{case}");
            let is_stream = reply
                .header("content-type")
                .is_some_and(|t| t.starts_with("text/event-stream"));
            assert_eq!(is_stream, streams, "{case}");
            let usage = client_usage(&reply.body);
            assert_eq!(
                usage[api.details]["cached_tokens"], PREFILL_CACHED,
                "{case}: {usage}"
            );
            assert_eq!(h.only_prefill(&id).json()["stream"], false, "{case}");
            assert_eq!(h.only_decode(&id).json()["stream"], spelling, "{case}");
        }
    }
}

/// Decode's JSON answer ended by trailers (a proxy before vLLM, or an HTTP/2 decode cluster,
/// may add them): Envoy gives the filter no end of the body, only the trailers, and the
/// usage is merged there all the same.
#[tokio::test]
async fn an_answer_that_ends_with_trailers_gets_prefills_prompt_counts() {
    let h = harness();
    let id = unique_id("trailers");
    let sent = json!({"model": "m", "max_tokens": 4,
        "prompt": format!("ends with trailers mock:prefill_cached_tokens={PREFILL_CACHED}")});
    let reply = Request::post("decode_trailers", "/v1/completions")
        .id(&id)
        .body(sent.to_string())
        .send()
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let answer = reply.json();
    let decodes: Value = serde_json::from_str(common::TRAILERS_ANSWER).unwrap();
    let usage = &answer["usage"];
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], PREFILL_CACHED,
        "{usage}"
    );
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert_ne!(prompt, 999, "decode's own prompt count: {usage}");
    assert_eq!(usage["completion_tokens"], 4, "{usage}");
    assert_eq!(usage["total_tokens"], prompt + 4, "{usage}");
    // Every other member is decode's.
    let mut rest = answer.clone();
    let mut decodes_rest = decodes.clone();
    rest["usage"] = Value::Null;
    decodes_rest["usage"] = Value::Null;
    assert_eq!(rest, decodes_rest);
    assert_eq!(h.prefill_requests(&id).len(), 1);
}

/// A gzip stream of stored blocks (what `mock:decode_gzip` writes), inflated; `None` when it
/// is not one or its checksum fails.
fn gunzip_stored(bytes: &[u8]) -> Option<Vec<u8>> {
    let mut rest = bytes.strip_prefix(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff][..])?;
    let mut plain = Vec::new();
    loop {
        let (&header, after) = rest.split_first()?;
        let len = usize::from(u16::from_le_bytes([*after.first()?, *after.get(1)?]));
        plain.extend_from_slice(after.get(4..4 + len)?);
        rest = after.get(4 + len..)?;
        if header == 1 {
            break;
        }
    }
    (rest.get(..4)? == mock_vllm::crc32(&plain).to_le_bytes()).then_some(plain)
}

/// Decode is never asked to compress, but a proxy in front of it may: a compressed answer
/// goes to the client as it came, its usage decode's (the filter cannot read it), and
/// streamed events are not held.
#[tokio::test]
async fn a_compressed_answer_goes_on_as_decode_wrote_it() {
    for api in &APIS {
        for stream in [false, true] {
            let id = unique_id("gzip");
            let sent = body(api, "count mock:decode_gzip", stream);
            let reply = post(api, &id, &sent).await;
            let case = format!("{} stream={stream}", api.path);
            assert_eq!(reply.status, 200, "{case}");
            assert_eq!(reply.header("content-encoding"), Some("gzip"), "{case}");
            assert_eq!(reply.header("x-mock-kv"), Some("reused"), "{case}");
            let plain = gunzip_stored(&reply.bytes)
                .unwrap_or_else(|| panic!("{case}: not the gzip stream decode sent"));
            let plain = String::from_utf8(plain).unwrap();
            let usage = client_usage(&plain);
            let prompt = usage[api.prompt].as_u64().unwrap();
            assert_eq!(
                usage[api.details]["cached_tokens"], prompt,
                "{case}: decode's own count: {usage}"
            );
        }
    }
}

#[tokio::test]
async fn under_vllm_0_33_the_client_sees_prefills_cache_writes_and_decodes_own_hits() {
    // vLLM 0.33 and later hand prefill's cache hits to decode in kv_transfer_params
    // (`remote_prefill_cached_tokens`), and decode reports them itself. Prefill's cache
    // writes are not handed over: decode, which pulled those tokens, reports none, and the
    // client gets prefill's. A responses stream cut at its limit ends in
    // `response.incomplete` there.
    let h = harness();
    for api in &APIS {
        let writes = if api.path == "/v1/responses" {
            "cache_write_tokens"
        } else {
            "created_cache_tokens"
        };
        for stream in [false, true] {
            let words = "count mock:prefill_hands_cached_tokens";
            let (id, reply, usage, case) = counted(api, words, stream).await;
            let handed = &h.only_decode(&id).json()["kv_transfer_params"];
            assert_eq!(
                handed["remote_prefill_cached_tokens"], PREFILL_CACHED,
                "{case}"
            );
            let prompt = usage[api.prompt].as_u64().unwrap();
            assert_eq!(
                usage[api.details][writes],
                prompt - PREFILL_CACHED,
                "{case}: {usage}"
            );
            // Prefill's answer has `"multimodal_tokens":null`; a stream leaves it out.
            if api.details == "prompt_tokens_details" {
                let multimodal = usage[api.details].get("multimodal_tokens");
                let expected = (!stream).then_some(&serde_json::Value::Null);
                assert_eq!(multimodal, expected, "{case}: {usage}");
            }
            if api.path == "/v1/responses" && stream {
                assert!(
                    reply.body.contains("event: response.incomplete\n"),
                    "{case}: {}",
                    reply.body
                );
            }
        }
    }
}

/// vLLM's default, without `--enable-prompt-tokens-details` on either pool: both legs count
/// the prompt alike and report no details, so the client gets one vLLM's usage whether the
/// filter merges (a JSON answer) or leaves a stream unread.
#[tokio::test]
async fn usage_without_prompt_details_is_one_vllms() {
    let h = harness();
    for api in &APIS[..2] {
        for stream in [false, true] {
            let id = unique_id("usage-no-details");
            let sent = body(api, "count my tokens mock:no_prompt_details", stream);
            let case = format!("{} stream={stream}", api.path);
            let reply = post(api, &id, &sent).await;
            assert_eq!(reply.status, 200, "{case}: {}", reply.body);
            assert_eq!(reply.header("x-mock-kv"), Some("reused"), "{case}");
            let usage = client_usage(&reply.body);
            let prefills = h.only_prefill(&id);
            assert!(
                usage.get("prompt_tokens_details").is_none(),
                "{case}: {usage}"
            );
            assert_eq!(usage["completion_tokens"], 5, "{case}: {usage}");
            let prompt = usage["prompt_tokens"].as_u64().unwrap();
            assert_eq!(usage["total_tokens"], prompt + 5, "{case}: {usage}");
            let (text, _, ended) = answer_text(&reply.body);
            assert!(ended, "{case}");
            assert_eq!(text, expected_decode_text("count", 5), "{case}");
            assert_eq!(prefills.json()["stream"], false, "{case}");
            assert!(prompt > 0, "{case}");
        }
    }
}

#[tokio::test]
async fn usage_is_decodes_when_configured_so() {
    let id = unique_id("usage-decode");
    let sent = body(&APIS[0], "leave my usage", false);
    let reply = Request::post("usage_decode", APIS[0].path)
        .id(&id)
        .body(sent.to_string())
        .send()
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let usage = client_usage(&reply.body);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["prompt_tokens"]
    );
}

#[tokio::test]
async fn prefill_errors_reach_the_client_as_vllm_wrote_them() {
    let id = unique_id("vllm-error");
    let reply = Request::post("default", "/v1/completions")
        .id(&id)
        .body(json!({"prompt": "bad mock:prefill_status=400", "max_tokens": 3}).to_string())
        .send()
        .await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    let error = reply.json();
    assert_eq!(error["error"]["message"], "mock prefill failure 400");
    assert_eq!(reply.header("x-request-id"), Some(id.as_str()));
    // A worker started with `--api-key` refuses a wrong key in a shape of its own.
    let reply = Request::post("default", "/v1/completions")
        .id(&unique_id("vllm-error-401"))
        .body(json!({"prompt": "key mock:prefill_status=401", "max_tokens": 3}).to_string())
        .send()
        .await;
    assert_eq!(reply.status, 401);
    assert_eq!(reply.json(), json!({"error": "Unauthorized"}));
}

#[tokio::test]
async fn prefills_retry_after_reaches_the_client_with_its_error() {
    let h = harness();
    // A rate limiter in front of prefill says how long to wait; SDKs wait as advised, and
    // the filter does not ask the same prefill again at once (SDKs retry on their own).
    for status in [429, 503] {
        let id = unique_id("prefill-retry-after");
        let prompt = format!("wait mock:prefill_status={status} mock:prefill_retry_after=3");
        let reply = Request::post("default", "/v1/completions")
            .id(&id)
            .body(json!({"prompt": prompt, "max_tokens": 3}).to_string())
            .send()
            .await;
        assert_eq!(reply.status, status, "{}", reply.body);
        assert_eq!(reply.header("retry-after"), Some("3"), "{status}");
        assert_eq!(h.prefill_requests(&id).len(), 1, "{status}");
    }
}

#[tokio::test]
async fn every_answer_carries_the_request_id_both_legs_logged() {
    let h = harness();
    let sent = body(&APIS[1], "which id", false).to_string();
    let reply = Request::post("default", APIS[1].path)
        .body(&sent)
        .send()
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let id = reply
        .header("x-request-id")
        .expect("x-request-id")
        .to_owned();
    assert_eq!(
        h.only_prefill(&id).header("x-request-id"),
        Some(id.as_str())
    );
    assert_eq!(h.only_decode(&id).header("x-request-id"), Some(id.as_str()));
}

#[tokio::test]
async fn trace_priority_and_session_headers_reach_prefill() {
    let h = harness();
    let id = unique_id("trace");
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let reply = Request::post("default", APIS[0].path)
        .id(&id)
        .header("traceparent", traceparent)
        .header("tracestate", "vendor=1")
        .header("x-b3-traceid", "80f198ee56343ba864fe8b2a57d3eff7")
        .header("x-vllm-priority", "-5")
        .header("x-session-id", "session-7")
        .body(body(&APIS[0], "trace me", false).to_string())
        .send()
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let prefill = h.only_prefill(&id);
    assert_eq!(prefill.header("traceparent"), Some(traceparent));
    assert_eq!(prefill.header("tracestate"), Some("vendor=1"));
    assert_eq!(
        prefill.header("x-b3-traceid"),
        Some("80f198ee56343ba864fe8b2a57d3eff7")
    );
    // vLLM reads the priority header before the body's: prefill schedules as decode does.
    assert_eq!(prefill.header("x-vllm-priority"), Some("-5"));
    // vLLM tags the KV cache events of the blocks prefill stores with the session.
    assert_eq!(prefill.header("x-session-id"), Some("session-7"));
}

/// The filter reads both answers (prefill's for its KV, decode's for the usage merge): it
/// asks both for an uncompressed one, whatever the client accepts.
#[tokio::test]
async fn prefill_is_asked_for_an_uncompressed_answer() {
    let h = harness();
    let id = unique_id("identity");
    let reply = Request::post("default", APIS[0].path)
        .id(&id)
        .header("accept-encoding", "gzip, br")
        .body(body(&APIS[0], "compress me", false).to_string())
        .send()
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        h.only_prefill(&id).header("accept-encoding"),
        Some("identity")
    );
    assert_eq!(
        h.only_decode(&id).header("accept-encoding"),
        Some("identity")
    );
}

#[tokio::test]
async fn prompt_logprobs_come_from_prefill() {
    let h = harness();
    for api in &APIS[..2] {
        let id = unique_id("prompt-logprobs");
        let mut sent = body(api, "how likely is this prompt", false);
        sent["prompt_logprobs"] = json!(1);
        let reply = post(api, &id, &sent).await;
        assert_eq!(reply.status, 200, "{}: {}", api.path, reply.body);
        assert_eq!(reply.header("x-mock-kv"), Some("reused"));
        let answer = reply.json();
        let logprobs = match api.path {
            "/v1/completions" => answer["choices"][0]["prompt_logprobs"].clone(),
            _ => answer["prompt_logprobs"].clone(),
        };
        // One entry per prompt token, the first without a logprob, as vLLM answers.
        let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        assert_eq!(
            logprobs.as_array().map(Vec::len),
            Some(prompt_tokens),
            "{answer}"
        );
        assert_eq!(logprobs[0], Value::Null);
        assert_eq!(h.only_prefill(&id).json()["prompt_logprobs"], 1);
        assert!(h.only_decode(&id).json().get("prompt_logprobs").is_none());
    }

    let id = unique_id("prompt-logprobs-stream");
    let mut sent = body(&APIS[0], "stream my logprobs", true);
    sent["prompt_logprobs"] = json!(1);
    let reply = post(&APIS[0], &id, &sent).await;
    reply.assert_error(400, "are not available when `stream=True`");
    assert_eq!(reply.json()["error"]["param"], "prompt_logprobs");
    assert!(h.prefill_requests(&id).is_empty());

    // vLLM takes 0 with a stream and streams no prompt logprobs: so does the pair, neither
    // leg asked for them (decode refuses them beside KV).
    let id = unique_id("prompt-logprobs-stream-0");
    sent["prompt_logprobs"] = json!(0);
    let reply = post(&APIS[0], &id, &sent).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.body.ends_with("data: [DONE]\n\n"), "{}", reply.body);
    assert!(h.only_prefill(&id).json().get("prompt_logprobs").is_none());
    assert!(h.only_decode(&id).json().get("prompt_logprobs").is_none());
}

#[tokio::test]
async fn an_echo_with_logprobs_has_prefills_prompt_before_decodes_tokens() {
    // The OpenAI legacy way to score a prompt and a continuation in one request: the
    // prompt's logprobs are prefill's, the continuation's decode's, in one answer as one
    // vLLM writes it.
    let h = harness();
    let prompt = "Grüße, wörld 😀 \"quoted\"\tend";
    // Headers held for prefill (as envoy.yaml ships) and passed at once (as under Istio).
    for listener in ["default", "usage_decode"] {
        let id = unique_id("echo-many-tokens");
        let sent = json!({"model": "m", "prompt": prompt, "echo": true, "logprobs": 1,
            "max_tokens": 4, "n": 2});
        let reply = Request::post(listener, "/v1/completions")
            .id(&id)
            .body(sent.to_string())
            .send()
            .await;
        assert_eq!(reply.status, 200, "{listener}: {}", reply.body);
        assert_eq!(reply.header("x-mock-kv"), Some("reused"));
        let answer = reply.json();
        let prefill = h.only_prefill(&id).json();
        assert_eq!(
            (
                &prefill["echo"],
                &prefill["max_tokens"],
                &prefill["logprobs"]
            ),
            (&json!(true), &json!(0), &json!(1))
        );
        let decode = h.only_decode(&id).json();
        assert_eq!(decode.get("echo"), None);
        assert_eq!(decode.get("prompt_logprobs"), None);
        assert_eq!(
            (&decode["max_tokens"], &decode["n"]),
            (&json!(4), &json!(2))
        );

        let prompt_tokens = prompt.split_whitespace().count();
        let choices = answer["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2, "{answer}");
        for choice in choices {
            let text = choice["text"].as_str().unwrap();
            assert_eq!(text, format!("{prompt}{}", expected_decode_text(prompt, 4)));
            let logprobs = &choice["logprobs"];
            let tokens: Vec<&str> = logprobs["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|token| token.as_str().unwrap())
                .collect();
            assert_eq!(tokens.len(), prompt_tokens + 4, "{choice}");
            assert_eq!(tokens.concat(), text);
            // Offsets in code points, as vLLM counts them, running on from prompt to answer.
            let mut at = 0;
            for (i, token) in tokens.iter().enumerate() {
                assert_eq!(logprobs["text_offset"][i], json!(at), "{choice}");
                at += token.chars().count();
            }
            for array in ["token_logprobs", "top_logprobs"] {
                assert_eq!(logprobs[array].as_array().unwrap().len(), tokens.len());
                assert_eq!(logprobs[array][0], Value::Null, "the prompt's first token");
            }
            assert_eq!(
                choice["prompt_logprobs"].as_array().map(Vec::len),
                Some(prompt_tokens),
                "{choice}"
            );
        }
        assert_eq!(answer["usage"]["completion_tokens"], 2 * 4);
    }

    // A stream's first chunk would need prefill's echo: refused before either leg runs.
    let id = unique_id("echo-stream");
    let sent = json!({"prompt": "a b", "echo": true, "logprobs": 1, "max_tokens": 4,
        "stream": true});
    let reply = post(&APIS[0], &id, &sent).await;
    reply.assert_error(400, "echo with logprobs cannot be served");
    assert!(h.prefill_requests(&id).is_empty());
}

#[tokio::test]
async fn a_streamed_token_reaches_the_client_while_the_next_is_generated() {
    // Decode streams an event every 150 ms; with usage merging on, each must still reach the
    // client as it comes, not once the answer is whole.
    for api in &APIS {
        let id = unique_id("pace");
        let mut sent = body(api, "pace mock:decode_token_delay_ms=150", true);
        sent["stream"] = json!(true);
        let reply = post(api, &id, &sent).await;
        assert_eq!(reply.status, 200, "{}: {}", api.path, reply.body);
        let streaming = reply.latency.saturating_sub(reply.first_bytes);
        assert!(
            streaming.as_millis() >= 500,
            "{}: first bytes at {:?}, whole answer at {:?}",
            api.path,
            reply.first_bytes,
            reply.latency
        );
        let usage = client_usage(&reply.body);
        assert_eq!(
            usage[api.details]["cached_tokens"], PREFILL_CACHED,
            "{}",
            api.path
        );
    }
}

/// The data of each event of a server-sent stream, parsed.
fn events(stream: &str) -> Vec<Value> {
    stream
        .split("\n\n")
        .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .collect()
}

/// Sends `request` and checks the two legs every orchestrated request has: a 200 on KV
/// decode reused, prefill asked for one unstreamed answer for remote decode. Returns the
/// reply and the bodies prefill and decode got.
async fn served_on_prefills_kv(request: Request, id: &str, case: &str) -> (Reply, Value, Value) {
    let h = harness();
    let reply = request.id(id).send().await;
    assert_eq!(reply.status, 200, "{case}: {}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"), "{case}");
    let prefill = h.only_prefill(id).json();
    assert_eq!(prefill["stream"], false, "{case}: {prefill}");
    assert_eq!(
        prefill["kv_transfer_params"]["do_remote_decode"], true,
        "{case}"
    );
    (reply, prefill, h.only_decode(id).json())
}

#[tokio::test]
async fn vllms_messages_api_runs_prefill_then_decode_and_counts_like_one_vllm() {
    let h = harness();
    for stream in [false, true] {
        let id = unique_id("messages");
        let text = format!("tell me about messages mock:prefill_cached_tokens={PREFILL_CACHED}");
        let sent = json!({"model": "m", "max_tokens": 5, "stream": stream,
                          "messages": [{"role": "user", "content": text}]});
        let case = format!("stream={stream}");
        let request = Request::post("default", "/v1/messages")
            .header("x-api-key", "sk-client")
            .body(sent.to_string());
        let (reply, prefill, decode) = served_on_prefills_kv(request, &id, &case).await;
        // Anthropic-style clients send their key in x-api-key: prefill gets it too.
        assert_eq!(
            h.only_prefill(&id).header("x-api-key"),
            Some("sk-client"),
            "{case}"
        );
        assert_eq!(prefill["max_tokens"], 1, "{case}: {prefill}");
        assert_eq!(decode["max_tokens"], 5, "{case}");
        assert_eq!(decode["stream"], stream, "{case}");
        assert_eq!(decode["messages"], sent["messages"], "{case}");

        let prompt_words = text.split_whitespace().count() as u64;
        let usages: Vec<Value> = if stream {
            let events = events(&reply.body);
            let deltas = events
                .iter()
                .filter(|e| e["type"] == "content_block_delta")
                .count();
            assert_eq!(deltas, 5, "{case}: {}", reply.body);
            assert_eq!(events.last().unwrap()["type"], "message_stop");
            events
                .iter()
                .filter_map(|e| e.get("usage").or_else(|| e["message"].get("usage")))
                .cloned()
                .collect()
        } else {
            vec![reply.json()["usage"].clone()]
        };
        assert_eq!(usages.len(), if stream { 2 } else { 1 }, "{case}");
        for usage in &usages {
            assert_eq!(usage["input_tokens"], prompt_words, "{case}: {usage}");
            assert_eq!(
                usage["cache_read_input_tokens"], PREFILL_CACHED,
                "{case}: {usage}"
            );
        }
        assert_eq!(usages.last().unwrap()["output_tokens"], 5, "{case}");
    }
}

#[tokio::test]
async fn a_forced_tool_choice_is_served_as_one_vllm_serves_it() {
    // With one token, vLLM refuses a forced tool choice it must parse: a chat answer under
    // "required" (read as a list of tool calls by vLLM 0.11), a Messages answer for a named
    // tool (its arguments read as JSON). The mocks refuse them the same way.
    let cases = [
        (
            "/v1/chat/completions",
            json!({"model": "m", "max_tokens": 5, "tool_choice": "required",
                   "messages": [{"role": "user", "content": "weather?"}],
                   "tools": [{"type": "function", "function": {"name": "get_weather"}}]}),
        ),
        (
            "/v1/messages",
            json!({"model": "m", "max_tokens": 5,
                   "tool_choice": {"type": "tool", "name": "get_weather"},
                   "messages": [{"role": "user", "content": "weather?"}],
                   "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}),
        ),
    ];
    for (path, sent) in cases {
        let id = unique_id("forced-tool");
        let request = Request::post("default", path).body(sent.to_string());
        let (_, prefill, decode) = served_on_prefills_kv(request, &id, path).await;
        assert_ne!(prefill["tool_choice"], sent["tool_choice"], "{path}");
        assert_eq!(
            prefill["tools"], sent["tools"],
            "{path}: the prompt's tools"
        );
        assert_eq!(decode["tool_choice"], sent["tool_choice"], "{path}");
        assert_eq!(decode["max_tokens"], 5, "{path}");
    }
}

/// Messages requests may change their tools mid-conversation (`tool_addition` and
/// `tool_removal` blocks in system messages, vLLM 0.34): a tool named in `tool_choice` that
/// only such a block declares is served, and one a block removed is refused by prefill.
#[tokio::test]
async fn a_messages_tool_choice_counts_the_tools_the_conversation_adds_and_removes() {
    let h = harness();
    let define = json!({"type": "tool_addition", "tool": {"type": "tool_definition",
        "definition": {"name": "get_weather", "input_schema": {"type": "object"}}}});
    let remove = json!({"type": "tool_removal",
        "tool": {"type": "tool_reference", "name": "get_weather"}});
    let body = |tools: Value, change: &Value| {
        json!({"model": "m", "max_tokens": 5,
               "tool_choice": {"type": "tool", "name": "get_weather"}, "tools": tools,
               "messages": [{"role": "system", "content": [change]},
                            {"role": "user", "content": "weather?"}]})
    };
    let added = body(json!([]), &define);
    let id = unique_id("messages-added-tool");
    let request = Request::post("default", "/v1/messages").body(added.to_string());
    let (_, prefill, decode) = served_on_prefills_kv(request, &id, "/v1/messages").await;
    assert_eq!(prefill["tool_choice"], json!({"type": "any"}));
    assert_eq!(prefill["messages"], added["messages"], "the prompt's tools");
    assert_eq!(decode["tool_choice"], added["tool_choice"]);

    let declared = json!([{"name": "get_weather", "input_schema": {"type": "object"}}]);
    let removed = body(declared, &remove);
    let id = unique_id("messages-removed-tool");
    let reply = Request::post("default", "/v1/messages")
        .id(&id)
        .body(removed.to_string())
        .send()
        .await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert_eq!(
        h.only_prefill(&id).json()["tool_choice"],
        removed["tool_choice"]
    );
    assert!(h.decode_requests(&id).is_empty(), "decode was called");
}

/// A Messages `tool_choice` vLLM refuses (no name, or one no tool has) is not turned into
/// `any` for prefill: prefill refuses it, in vLLM's words, before computing the prompt, and
/// decode never gets it.
#[tokio::test]
async fn a_messages_tool_choice_vllm_refuses_is_refused_by_prefill() {
    let h = harness();
    for (choice, message) in [
        (
            json!({"type": "tool"}),
            "tool_choice.name is required when type is 'tool'",
        ),
        (
            json!({"type": "tool", "name": "nope"}),
            "The tool `nope` specified in `tool_choice` does not match any of the specified \
             `tools`",
        ),
    ] {
        let id = unique_id("messages-bad-tool");
        let sent = json!({"model": "m", "max_tokens": 5, "tool_choice": choice,
                          "messages": [{"role": "user", "content": "weather?"}],
                          "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]});
        let reply = Request::post("default", "/v1/messages")
            .id(&id)
            .body(sent.to_string())
            .send()
            .await;
        assert_eq!(reply.status, 400, "{choice}: {}", reply.body);
        assert_eq!(reply.json()["error"]["message"], message, "{choice}");
        assert_eq!(h.only_prefill(&id).json()["tool_choice"], choice);
        assert!(
            h.decode_requests(&id).is_empty(),
            "{choice}: decode was called"
        );
    }
}

#[tokio::test]
async fn vllms_cohere_api_runs_prefill_then_decode_and_answers_in_cohere_shape() {
    for stream in [false, true] {
        let id = unique_id("cohere");
        let sent = json!({"model": "m", "max_tokens": 5, "stream": stream,
                          "messages": [{"role": "user", "content": "cohere says hello"}]});
        let case = format!("stream={stream}");
        let request = Request::post("default", "/cohere/v2/chat").body(sent.to_string());
        let (reply, prefill, decode) = served_on_prefills_kv(request, &id, &case).await;
        assert_eq!(prefill["max_tokens"], 1, "{case}: {prefill}");
        assert_eq!(prefill["messages"], sent["messages"], "{case}");
        let mut expected = sent.clone();
        expected["kv_transfer_params"] = decode["kv_transfer_params"].clone();
        assert_eq!(
            decode, expected,
            "{case}: the client's body and prefill's KV"
        );
        assert_eq!(
            decode["kv_transfer_params"]["do_remote_prefill"], true,
            "{case}"
        );
        let (text, _, ended) = answer_text(&reply.body);
        assert!(ended, "{case}: {}", reply.body);
        assert_eq!(text, expected_decode_text("cohere", 5), "{case}");
        if !stream {
            // As decode wrote it: vLLM's decode reports the hits prefill handed over (none
            // here), not the KV it pulled.
            assert_eq!(reply.json()["usage"]["cached_tokens"], 0, "{}", reply.body);
        }
        if stream {
            let events = events(&reply.body);
            assert_eq!(events.last().unwrap()["type"], "message-end", "{case}");
            assert!(reply.body.ends_with("data: [DONE]\n\n"), "{case}");
        }
    }
    // Errors in Cohere's shape: prefill's as vLLM wrote it, the filter's own alike.
    let refused = json!({"model": "m", "max_tokens": 5,
        "messages": [{"role": "user", "content": "no mock:prefill_status=400"}]});
    let reply = Request::post("default", "/cohere/v2/chat")
        .body(refused.to_string())
        .send()
        .await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert_eq!(reply.json(), json!({"message": "mock prefill failure 400"}));
    let reply = Request::post("default", "/cohere/v2/chat")
        .body("{not json")
        .send()
        .await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert!(reply.json()["message"].is_string(), "{}", reply.body);
    assert!(reply.json().get("error").is_none(), "{}", reply.body);
}

#[tokio::test]
async fn vllms_tokens_in_api_is_capped_in_sampling_params_and_runs_prefill_then_decode() {
    for stream in [false, true] {
        let id = unique_id("generate");
        let sent = json!({"token_ids": [101, 102, 103],
                          "sampling_params": {"max_tokens": 5, "min_tokens": 3, "temperature": 0},
                          "max_tokens": 99, "stream": stream});
        let case = format!("stream={stream}");
        let request = Request::post("default", "/inference/v1/generate").body(sent.to_string());
        let (reply, prefill, decode) = served_on_prefills_kv(request, &id, &case).await;
        assert_eq!(
            prefill["sampling_params"],
            json!({"max_tokens": 1, "min_tokens": 1, "temperature": 0}),
            "{case}"
        );
        assert_eq!(prefill["max_tokens"], 99, "{case}: not this API's limit");
        assert_eq!(decode["sampling_params"], sent["sampling_params"], "{case}");
        assert_eq!(decode["stream"], stream, "{case}");

        let token_ids: Vec<Value> = if stream {
            assert!(reply.body.ends_with("data: [DONE]\n\n"), "{case}");
            events(&reply.body)
                .iter()
                .flat_map(|e| e["choices"][0]["token_ids"].as_array().cloned().unwrap())
                .collect()
        } else {
            reply.json()["choices"][0]["token_ids"]
                .as_array()
                .cloned()
                .unwrap()
        };
        // The mock decode's own five tokens for this prompt (all 0 on a KV mismatch).
        assert_eq!(
            token_ids,
            vec![json!(426), json!(612), json!(656), json!(327), json!(101)],
            "{case}"
        );
    }
}
