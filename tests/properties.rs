//! Property tests (a fuzzer on stable Rust) of the prefill rewrite and the decode injection:
//! arbitrary bytes never panic; for any JSON object, decode gets the client's exact bytes with
//! only `kv_transfer_params` changed (and prompt logprobs it cannot compute removed), and
//! prefill gets every limit capped and the rewrite rules applied; the scanner's SIMD
//! mask of string bytes marks exactly what its portable one does; the quick look for one
//! member of decode's answer finds what the validating scanner finds; a stream cut into any
//! chunks reaches the client as it would whole, only its usage chunk changed.
//!
//! `PD_PROPTEST_CASES` sets the number of cases per property (default 2,000).

use pd_filter::api::Api;
use pd_filter::held_bytes::HeldBytes;
use pd_filter::json::{
    find_top_level_member, special_mask, special_mask_bytewise, JsonObject, MemberSearch,
};
use pd_filter::protocol::rewrite::REMOTE_DECODE_REQUEST;
use pd_filter::protocol::usage::{prompt_usage_for_decode, EventStream, Rewritten};
use pd_filter::protocol::{prepare, read_prefill_answer, PreparedRequest};
use proptest::prelude::*;
use serde_json::{Map, Value};

fn cases() -> u32 {
    std::env::var("PD_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

/// Keys the rewrite treats specially, plus ordinary ones and one spelled with an escape.
const KEYS: &[&str] = &[
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "min_tokens",
    "min_completion_tokens",
    "n",
    "stream",
    "stream_options",
    "kv_transfer_params",
    "prompt",
    "messages",
    "input",
    "model",
    "temperature",
    "seed",
    "é",
    "prompt_logprobs",
    "tool_choice",
    "tools",
    "structured_outputs",
    "guided_regex",
];

/// A value for `key`: for the keys whose meaning the rewrite reads, a mix of the values that
/// matter and arbitrary ones.
fn value_for(key: &'static str) -> BoxedStrategy<String> {
    let picked = |values: &'static [&'static str]| {
        prop_oneof![
            3 => prop::sample::select(values).prop_map(str::to_owned),
            1 => json_value(),
        ]
        .boxed()
    };
    match key {
        "stream" => picked(&["true", "false", "1", "0", "\"false\"", "\"yes\"", "null"]),
        "prompt_logprobs" => picked(&[
            "0", "1", "-1", "false", "true", "0.0", "-0.0", "\"0\"", "null",
        ]),
        "tool_choice" => picked(&[
            "\"required\"",
            "\"required\"",
            "\"auto\"",
            "\"none\"",
            "null",
        ]),
        "tools" => picked(&[
            r#"[{"type":"function","function":{"name":"f"}}]"#,
            r#"[{"function":{"name":"a","name":"b"}},{"function":{"name":"c"}}]"#,
            r#"[{"function":{"parameters":{}}}]"#,
            "[]",
        ]),
        "structured_outputs" => picked(&[
            r#"{"regex":"a+"}"#,
            r#"{"json":{"type":"object"}}"#,
            r#"{"choice":["a"],"regex":null}"#,
            r#"{"regex":"a","choice":["b"]}"#,
            r#"{"grammar":"g"}"#,
            "null",
        ]),
        "guided_regex" => picked(&["\"a+\"", "null"]),
        _ => json_value().boxed(),
    }
}

fn json_value() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("null".to_owned()),
        any::<bool>().prop_map(|b| b.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| format!("{f:e}")),
        "[0-9]{20,40}".prop_map(|digits| format!("1{digits}")),
        any::<String>().prop_map(|s| serde_json::to_string(&s).unwrap()),
        "[a-z \\\\\"\u{e9}\u{1F600}]{0,12}".prop_map(|s| serde_json::to_string(&s).unwrap()),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5)
                .prop_map(|items| format!("[{}]", items.join(","))),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..5).prop_map(|members| {
                let members: Vec<String> = members
                    .into_iter()
                    .map(|(k, v)| format!("\"{k}\":{v}"))
                    .collect();
                format!("{{{}}}", members.join(","))
            }),
        ]
    })
}

fn whitespace() -> impl Strategy<Value = String> {
    "[ \t\n\r]{0,3}"
}

/// A JSON object as text: keys may repeat, spacing varies.
fn json_object() -> impl Strategy<Value = String> {
    object_of(KEYS, 10)
}

/// Keys of requests with tools and prompt logprobs, where the rewrite reads several members
/// together: drawn often enough (some twice as often) that their combinations come up.
const FOCUSED_KEYS: &[&str] = &[
    "tools",
    "tools",
    "tool_choice",
    "tool_choice",
    "structured_outputs",
    "structured_outputs",
    "guided_regex",
    "stream",
    "prompt_logprobs",
    "messages",
    "max_tokens",
];

fn object_of(keys: &'static [&'static str], most: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(
        (
            prop::sample::select(keys).prop_flat_map(|key| (Just(key), value_for(key))),
            whitespace(),
            whitespace(),
            any::<bool>(),
        ),
        0..most,
    )
    .prop_flat_map(|members| (Just(members), whitespace(), whitespace()))
    .prop_map(|(members, lead, tail)| {
        let members: Vec<String> = members
            .into_iter()
            .map(|((key, value), ws1, ws2, escape)| {
                let key = if escape && key == "max_tokens" {
                    "max\\u005ftokens".to_owned()
                } else {
                    key.to_owned()
                };
                format!("{ws1}\"{key}\"{ws2}:{ws1}{value}{ws2}")
            })
            .collect();
        format!("{lead}{{{}}}{tail}", members.join(","))
    })
}

fn api() -> impl Strategy<Value = Api> {
    prop_oneof![
        Just(Api::Completions),
        Just(Api::ChatCompletions),
        Just(Api::Responses),
    ]
}

/// The object as a JSON parser that keeps the last duplicate (like Python's) sees it.
/// The prepared request; `None` when the filter refused it as vLLM would: a completions
/// request with several prompts (vLLM serves `prompt_embeds`, then `prompt`: a list is one
/// prompt per item unless it is a list of numbers, one prompt's tokens), `stream_options` without
/// `stream` (Python's truth of each), `prompt_logprobs` other than 0 with `stream`, or
/// `kv_transfer_params` neither an object nor null, which is then checked to be so. Every
/// other object is accepted.
fn prepared_unless_several_prompts(api: Api, text: &str) -> Option<PreparedRequest> {
    match prepare(api, text.as_bytes()) {
        Ok(prepared) => Some(prepared),
        Err(error) => {
            let object = parse_last_wins(text.as_bytes());
            let field = |key: &str| object.get(key).cloned().unwrap_or(Value::Null);
            let prompts = |value: Value| match value {
                Value::Null => 0,
                Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_number) => 1,
                Value::Array(items) => items.len(),
                _ => 1,
            };
            let several = prompts(field("prompt_embeds")) + prompts(field("prompt")) > 1;
            let truthy = |value: &Value| match value {
                Value::Null | Value::Bool(false) => false,
                Value::Number(number) => number.as_f64() != Some(0.0),
                Value::String(text) => !text.is_empty(),
                Value::Array(items) => !items.is_empty(),
                Value::Object(members) => !members.is_empty(),
                Value::Bool(true) => true,
            };
            let options_without_stream = api != Api::Responses
                && truthy(&field("stream_options"))
                && !truthy(&field("stream"));
            // vLLM refuses prompt logprobs other than 0 with a stream (Python's truth).
            let zero = |value: &Value| *value == Value::Bool(false) || value.as_f64() == Some(0.0);
            let streamed_prompt_logprobs = api != Api::Responses
                && !field("prompt_logprobs").is_null()
                && truthy(&field("stream"))
                && !zero(&field("prompt_logprobs"));
            let client_kv = field("kv_transfer_params");
            let kv_vllm_refuses = !client_kv.is_null() && !client_kv.is_object();
            assert!(
                (api == Api::Completions && several)
                    || kv_vllm_refuses
                    || options_without_stream
                    || streamed_prompt_logprobs
                    || vllm_refuses_the_limits(api, &object)
                    || vllm_cannot_read_a_capped_field(api, &object),
                "refused: {text}: {}",
                error.message
            );
            None
        }
    }
}

/// What vLLM refuses in the fields prefill's copy changes, where the request's own plain
/// integers settle it: `n` or the limit below 1, `min_tokens` below 0 or above the limit
/// (completions: `max_tokens`, 16 when absent; chat: `max_completion_tokens or max_tokens`
/// in Python's sense), `max_output_tokens` below 1 on responses.
fn vllm_refuses_the_limits(api: Api, object: &Map<String, Value>) -> bool {
    let int = |key: &str| object.get(key).and_then(Value::as_i64);
    let limit = match api {
        Api::Completions if !object.contains_key("max_tokens") => Some(16),
        Api::Completions => int("max_tokens"),
        Api::ChatCompletions => match object.get("max_completion_tokens") {
            None | Some(Value::Null) => int("max_tokens"),
            Some(_) if int("max_completion_tokens") == Some(0) => int("max_tokens"),
            Some(_) => int("max_completion_tokens"),
        },
        Api::Responses => return int("max_output_tokens").is_some_and(|limit| limit < 1),
        _ => return false,
    };
    let minimum = int("min_tokens");
    int("n").is_some_and(|n| n < 1)
        || limit.is_some_and(|limit| limit < 1)
        || minimum.is_some_and(|minimum| minimum < 0 || limit.is_some_and(|limit| minimum > limit))
}

/// A value vLLM's model refuses in a field prefill's copy overwrites: for an integer, the
/// wrong kind of value, `null` where it is not optional, a fractional number or a string
/// without a digit, or with an ASCII letter or a control character other than whitespace;
/// for a bool, a number other than 0 and 1 or a string outside pydantic's
/// words; for `stream_options`, anything but an object or null.
fn vllm_cannot_read_a_capped_field(api: Api, object: &Map<String, Value>) -> bool {
    let not_int = |value: &Value, optional: bool| match value {
        Value::Null => !optional,
        Value::Bool(_) => false,
        Value::Number(number) => number.as_f64().is_some_and(|n| n.fract() != 0.0),
        Value::String(text) => {
            !text.chars().any(|c| c.is_ascii_digit())
                || text.chars().any(|c| {
                    c.is_ascii_alphabetic()
                        || (c.is_ascii_control()
                            && !matches!(c, '\t' | '\n' | '\u{b}' | '\u{c}' | '\r'))
                })
        }
        Value::Array(_) | Value::Object(_) => true,
    };
    let not_bool = |value: &Value| match value {
        Value::Null | Value::Bool(_) => false,
        Value::Number(number) => number.as_f64().is_some_and(|n| n != 0.0 && n != 1.0),
        Value::String(text) => ![
            "true", "false", "yes", "no", "on", "off", "1", "0", "t", "f", "y", "n",
        ]
        .iter()
        .any(|word| text.eq_ignore_ascii_case(word)),
        Value::Array(_) | Value::Object(_) => true,
    };
    let fields: &[(&str, u8)] = match api {
        // 0: int, 1: optional int, 2: optional bool, 3: optional object.
        Api::Completions => &[
            ("max_tokens", 1),
            ("n", 0),
            ("min_tokens", 0),
            ("stream", 2),
            ("stream_options", 3),
        ],
        Api::ChatCompletions => &[
            ("max_tokens", 1),
            ("max_completion_tokens", 1),
            ("n", 1),
            ("min_tokens", 0),
            ("stream", 2),
            ("stream_options", 3),
        ],
        Api::Responses => &[
            ("max_output_tokens", 1),
            ("stream", 2),
            ("background", 2),
            ("store", 2),
        ],
        _ => &[],
    };
    fields.iter().any(|&(key, kind)| {
        object.get(key).is_some_and(|value| match kind {
            0 => not_int(value, false),
            1 => not_int(value, true),
            2 => not_bool(value),
            _ => !matches!(value, Value::Null | Value::Object(_)),
        })
    })
}

fn parse_last_wins(text: &[u8]) -> Map<String, Value> {
    match serde_json::from_slice(text).expect("valid JSON") {
        Value::Object(map) => map,
        other => panic!("not an object: {other}"),
    }
}

/// How many members named `key` the top-level object has.
fn top_level_count(text: &[u8], key: &str) -> usize {
    JsonObject::parse(text)
        .expect("valid object")
        .members()
        .iter()
        .filter(|member| member.key == key)
        .count()
}

/// A value as pydantic's lax bool reads true: `true`, a number equal to 1, or a string such
/// as "true", "yes", "on", "1" in any case.
fn lax_true(value: Option<&Value>) -> bool {
    match value {
        Some(Value::Bool(flag)) => *flag,
        Some(Value::Number(number)) => number.as_f64() == Some(1.0),
        Some(Value::String(text)) => ["true", "1", "yes", "on", "t", "y"]
            .iter()
            .any(|word| text.trim().eq_ignore_ascii_case(word)),
        _ => false,
    }
}

/// Whether the prompt logprobs of a request go to decode: never on completions and chat, where
/// decode on prefill's KV cannot compute them.
fn decode_drops_prompt_logprobs(api: Api, original: &Map<String, Value>) -> bool {
    api != Api::Responses
        && original
            .get("prompt_logprobs")
            .is_some_and(|v| !v.is_null())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(api in api(), body in prop::collection::vec(any::<u8>(), 0..256)) {
        if let Err(error) = prepare(api, &body) {
            prop_assert_eq!(error.status, 400);
        }
        let _ = read_prefill_answer(Some(200), &body);
    }

    /// The quick look for one top-level member (decode's answers) finds the member the
    /// validating scanner keeps (the last of its key, escapes decoded), or says it has none,
    /// or says it cannot tell; on any bytes it never panics and stays within them.
    #[test]
    fn the_quick_member_search_finds_what_the_scanner_keeps(
        text in json_object(),
        key in prop::sample::select(KEYS),
        noise in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let object = JsonObject::parse(text.as_bytes()).expect("valid object");
        let kept = object
            .members()
            .iter()
            .rev()
            .find(|member| member.key == key)
            .map(|member| member.value.clone());
        match find_top_level_member(text.as_bytes(), key) {
            MemberSearch::Found(range) => prop_assert_eq!(Some(range), kept, "{}", text),
            MemberSearch::Absent => prop_assert_eq!(None, kept, "{}", text),
            MemberSearch::Unsure => {}
        }
        if let MemberSearch::Found(range) = find_top_level_member(&noise, key) {
            prop_assert!(range.end <= noise.len() && range.start < range.end);
        }
    }

    /// The SIMD mask of the string bytes that need a look (SSE2 here; wasm simd128 is checked
    /// by the unit tests under `make test-wasm`) against the bytewise one, on text that is
    /// mostly plain with a few bytes that need a look, from every start.
    #[test]
    fn the_simd_mask_marks_the_bytes_the_bytewise_one_does(
        bytes in prop::collection::vec(
            prop_oneof![
                20 => 0x20u8..0x80,
                1 => prop::sample::select(b"\"\\\x00\x1f\x7f\x80\xc3\xff".to_vec()),
                1 => any::<u8>(),
            ],
            0..300,
        ),
    ) {
        for at in 0..=bytes.len() {
            prop_assert_eq!(special_mask(&bytes, at), special_mask_bytewise(&bytes, at));
        }
    }

    /// The filter's own JSON scanner against serde_json, on valid objects with a few bytes
    /// overwritten (with JSON's special characters, likely, or anything).
    #[test]
    fn the_scanner_accepts_exactly_what_json_parsers_accept(
        text in json_object(),
        edits in prop::collection::vec(
            (
                any::<prop::sample::Index>(),
                prop_oneof![
                    prop::sample::select(b"{}[]\",:\\ \t0-.eE+tfnu\x01\xc3\xa9\xff".to_vec()),
                    any::<u8>(),
                ],
            ),
            0..3,
        ),
    ) {
        let mut bytes = text.into_bytes();
        for (index, byte) in edits {
            if !bytes.is_empty() {
                let at = index.index(bytes.len());
                bytes[at] = byte;
            }
        }
        // The scanner also reads Python's NaN and infinities, which serde_json does not.
        let python_only = |word: &[u8]| bytes.windows(word.len()).any(|w| w == word);
        prop_assume!(!python_only(b"NaN") && !python_only(b"Infinity"));
        let is_object = bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
        let expected = is_object
            && std::str::from_utf8(&bytes).is_ok()
            && serde_json::from_slice::<serde::de::IgnoredAny>(&bytes).is_ok();
        prop_assert_eq!(
            JsonObject::parse(&bytes).is_ok(),
            expected,
            "{}",
            String::from_utf8_lossy(&bytes)
        );
    }

    #[test]
    fn decode_gets_the_original_with_only_kv_transfer_params_changed(
        api in api(),
        text in json_object(),
        kv in json_value().prop_map(|v| format!("{{\"remote_block_ids\":{v}}}")),
    ) {
        let Some(prepared) = prepared_unless_several_prompts(api, &text) else {
            return Ok(());
        };
        let decode = prepared.decode.body_with_kv(text.as_bytes(), kv.as_bytes());
        prop_assert_eq!(decode.len(), prepared.decode.len_with_kv(kv.len()));
        prop_assert_eq!(top_level_count(&decode, "kv_transfer_params"), 1);
        prop_assert!(decode.len() <= text.len() + kv.len() + 32);

        let mut expected = parse_last_wins(text.as_bytes());
        let drops_prompt_logprobs = decode_drops_prompt_logprobs(api, &expected);
        if drops_prompt_logprobs {
            expected.remove("prompt_logprobs");
        }
        expected.insert("kv_transfer_params".to_owned(), serde_json::from_str(&kv).unwrap());
        prop_assert_eq!(parse_last_wins(&decode), expected);

        // Byte for byte: the output is the input with kv text inserted or swapped in: as the
        // first member where the client sent none, and only the head is written then.
        let edit = prepared.decode.edit_with_kv(text.as_bytes(), kv.as_bytes());
        // Where only a head is written, the filter keeps none of the client's bytes while
        // prefill works: the edit must not need them, and there is nothing to strip.
        if prepared.decode.head_len().is_some_and(|len| len < text.len()) {
            prop_assert_eq!(&prepared.decode.edit_with_kv(b"", kv.as_bytes()), &edit);
            prop_assert_eq!(prepared.decode.body_without_kv(text.as_bytes()), None);
        }
        let decode_text = String::from_utf8(decode).unwrap();
        if !text.contains("\"kv_transfer_params\"") && !drops_prompt_logprobs {
            // Whitespace before the brace is not written again when only the head is.
            let lead = if text.contains(':') { text.find('{').unwrap() } else { 0 };
            prop_assert_eq!(decode_text.len(), text.len() - lead + kv.len() + "\"kv_transfer_params\":".len() + usize::from(text.contains(':')));
            if text.contains(':') {
                let open = lead + 1;
                prop_assert_eq!(edit.replaced_len, open);
                prop_assert_eq!(
                    &decode_text,
                    &format!("{{\"kv_transfer_params\":{kv},{}", &text[open..])
                );
            } else {
                let close = text.rfind('}').unwrap();
                prop_assert!(decode_text.starts_with(&text[..close]));
                prop_assert!(decode_text.ends_with(&text[close..]));
            }
        }
    }

    #[test]
    fn prefill_has_every_limit_capped(api in api(), text in json_object()) {
        check_prefill(api, &text)?;
    }

}

proptest! {
    // Five times as many cases: the combinations that matter are a few in a thousand.
    #![proptest_config(ProptestConfig { cases: cases() * 5, ..ProptestConfig::default() })]

    /// The same, on requests made mostly of tools, constraints, streams and prompt logprobs.
    #[test]
    fn prefill_of_tool_and_logprob_requests(
        api in prop_oneof![Just(Api::ChatCompletions), Just(Api::Completions)],
        text in object_of(FOCUSED_KEYS, 8),
    ) {
        check_prefill(api, &text)?;
    }
}

/// Prefill's body for `text`: every limit capped, not streamed, the KV request, and every
/// other member as the client sent it but where the rewrite's rules say otherwise.
fn check_prefill(api: Api, text: &str) -> Result<(), TestCaseError> {
    let Some(prepared) = prepared_unless_several_prompts(api, text) else {
        return Ok(());
    };
    let original = parse_last_wins(text.as_bytes());
    let prefill = parse_last_wins(&prepared.prefill_body);
    prop_assert_eq!(
        top_level_count(&prepared.prefill_body, "kv_transfer_params"),
        1
    );
    prop_assert!(prepared.prefill_body.len() <= text.len() + REMOTE_DECODE_REQUEST.len() + 112);
    let one = Value::from(1);

    // Responses has no max_tokens: capped where the client sent one, never added.
    if api == Api::Responses {
        prop_assert_eq!(
            prefill.get("max_tokens"),
            original.get("max_tokens").map(|_| &one)
        );
        prop_assert_eq!(prefill.get("store"), Some(&Value::Bool(false)));
        let background = original.get("background").map(|_| Value::Bool(false));
        prop_assert_eq!(prefill.get("background"), background.as_ref());
    } else {
        prop_assert_eq!(prefill.get("max_tokens"), Some(&one));
    }
    for key in ["max_completion_tokens", "n"] {
        prop_assert_eq!(prefill.get(key), original.get(key).map(|_| &one));
    }
    if api == Api::Responses || original.contains_key("max_output_tokens") {
        prop_assert_eq!(prefill.get("max_output_tokens"), Some(&one));
    } else {
        prop_assert!(!prefill.contains_key("max_output_tokens"));
    }
    prop_assert_eq!(prefill.get("stream"), Some(&Value::Bool(false)));
    for key in ["min_completion_tokens", "stream_options"] {
        prop_assert!(!prefill.contains_key(key));
    }
    // Prefill's one token is never a stop where vLLM reads min_tokens.
    let holds_off_a_stop = matches!(api, Api::Completions | Api::ChatCompletions | Api::Messages);
    prop_assert_eq!(prefill.get("min_tokens"), holds_off_a_stop.then_some(&one));
    let remote_decode: Value = serde_json::from_slice(REMOTE_DECODE_REQUEST).unwrap();
    prop_assert_eq!(prefill.get("kv_transfer_params"), Some(&remote_decode));
    // A stream carries no prompt logprobs: prefill is not asked for them.
    let streamed = lax_true(original.get("stream"));
    let drops_prompt_logprobs = api != Api::Responses && streamed;
    if drops_prompt_logprobs {
        prop_assert!(!prefill.contains_key("prompt_logprobs"));
    }
    // Chat's "required" names the first tool, and the one output constraint vLLM refuses
    // beside a named tool goes.
    let first_tool_name = original
        .get("tools")
        .and_then(|tools| tools.get(0))
        .and_then(|tool| tool.get("function"))
        .and_then(|function| function.get("name"))
        .and_then(Value::as_str);
    let names_a_tool = api == Api::ChatCompletions
        && original.get("tool_choice") == Some(&Value::from("required"))
        && first_tool_name.is_some();
    let outputs = original
        .get("structured_outputs")
        .cloned()
        .unwrap_or(Value::Null);
    // Counted per spelling: a vLLM that reads structured_outputs ignores guided_regex.
    let constraints = ["json", "regex", "choice"]
        .iter()
        .filter(|kind| outputs.get(**kind).is_some_and(|v| !v.is_null()))
        .count();
    let legacy = usize::from(original.get("guided_regex").is_some_and(|v| !v.is_null()));
    let drops_constraint = names_a_tool && (constraints == 1 || (constraints == 0 && legacy == 1));
    if let (true, Some(name)) = (names_a_tool, first_tool_name) {
        let named = serde_json::json!({"type": "function", "function": {"name": name}});
        prop_assert_eq!(prefill.get("tool_choice"), Some(&named));
    }
    if drops_constraint {
        prop_assert!(!prefill.contains_key("structured_outputs"));
        prop_assert!(!prefill.contains_key("guided_regex"));
    }
    for (key, value) in &original {
        let rewritten = [
            "max_tokens",
            "max_completion_tokens",
            "max_output_tokens",
            "n",
            "stream",
            "min_tokens",
            "min_completion_tokens",
            "stream_options",
            "kv_transfer_params",
        ];
        let responses_only = ["store", "background"];
        let rewritten_here = (api == Api::Responses && responses_only.contains(&key.as_str()))
            || (drops_prompt_logprobs && key == "prompt_logprobs")
            || (names_a_tool && key == "tool_choice")
            || (drops_constraint && (key == "structured_outputs" || key == "guided_regex"));
        if !rewritten.contains(&key.as_str()) && !rewritten_here {
            prop_assert_eq!(prefill.get(key), Some(value));
        }
    }
    Ok(())
}

/// One server-sent event of a chat stream as vLLM writes it, ended by a blank line in one of
/// the three spellings the SSE format allows: a token, the usage chunk, a comment, `[DONE]`.
fn stream_event() -> impl Strategy<Value = String> {
    let body = prop_oneof![
        4 => "[a-z \u{e9}]{0,12}".prop_map(|word| format!(
            r#"data: {{"id":"c","object":"chat.completion.chunk","choices":[{{"index":0,"delta":{{"content":"{word}"}}}}]}}"#
        )),
        1 => (1u64..5000, 0u64..5000).prop_map(|(prompt, cached)| format!(
            r#"data: {{"id":"c","choices":[],"usage":{{"prompt_tokens":{prompt},"completion_tokens":3,"total_tokens":{},"prompt_tokens_details":{{"cached_tokens":{cached}}}}}}}"#,
            prompt + 3
        )),
        1 => Just(": ping".to_owned()),
        1 => Just(r#"data: {"usage":null,"choices":[]}"#.to_owned()),
    ];
    (body, prop::sample::select(vec!["\n", "\r\n", "\r"]))
        .prop_map(|(body, newline)| format!("{body}{newline}{newline}"))
}

/// What the client gets for a stream fed to the rewriter in chunks ending at `cuts`. After
/// each chunk, the rewriter holds back no more than the part of an event whose end has not
/// come (`event_ends`: where each event of the stream ends): every whole event goes on at once.
fn streamed_in_chunks(stream: &[u8], event_ends: &[usize], cuts: &[usize]) -> Vec<u8> {
    let usage = br#"{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8,"prompt_tokens_details":{"cached_tokens":2}}"#;
    let prompt = prompt_usage_for_decode(Api::ChatCompletions, usage, b"{}").expect("counts");
    let mut events = EventStream::new(HeldBytes::new(usize::MAX), usize::MAX);
    let mut ends: Vec<usize> = cuts.iter().map(|cut| cut % (stream.len() + 1)).collect();
    ends.push(stream.len());
    ends.sort_unstable();
    let mut out = Vec::new();
    let mut start = 0;
    for (index, &end) in ends.iter().enumerate() {
        let chunk = &stream[start..end];
        let last = index + 1 == ends.len();
        match events.on_chunk(Api::ChatCompletions, &prompt, chunk, last) {
            Rewritten::AsIs => out.extend_from_slice(chunk),
            Rewritten::Replaced(bytes) => out.extend_from_slice(&bytes),
            Rewritten::GaveUp { held } => {
                out.extend_from_slice(&held);
                out.extend_from_slice(chunk);
            }
        }
        let last_whole_event = event_ends.iter().filter(|&&at| at <= end).max();
        let unended = end - last_whole_event.copied().unwrap_or(0);
        assert!(
            events.held_len() <= unended,
            "{} bytes held after {:?}",
            events.held_len(),
            String::from_utf8_lossy(&stream[..end])
        );
        start = end;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// However decode's stream is cut into chunks (an event across several, several in
    /// one, empty chunks), the client gets the same bytes, each whole event as soon as its
    /// chunk arrives: every event in order, each as decode wrote it but for the usage chunk,
    /// whose prompt counts are prefill's.
    #[test]
    fn a_stream_cut_anywhere_comes_out_as_the_stream_fed_whole(
        events in prop::collection::vec(stream_event(), 1..12),
        cuts in prop::collection::vec(any::<usize>(), 0..10),
    ) {
        let stream = events.concat();
        let event_ends: Vec<usize> = events
            .iter()
            .scan(0, |end, event| {
                *end += event.len();
                Some(*end)
            })
            .collect();
        let whole = streamed_in_chunks(stream.as_bytes(), &event_ends, &[]);
        let cut = streamed_in_chunks(stream.as_bytes(), &event_ends, &cuts);
        prop_assert_eq!(String::from_utf8_lossy(&cut), String::from_utf8_lossy(&whole));
        // Event by event: only a usage chunk changes, and only its counts.
        let sent = String::from_utf8_lossy(&whole).into_owned();
        let mut rest = sent.as_str();
        for event in &events {
            let Some(tail) = rest.strip_prefix(event.as_str()) else {
                prop_assert!(event.contains("\"usage\":{"), "{:?} changed in {:?}", event, sent);
                prop_assert!(rest.contains("\"prompt_tokens\":7,"), "{:?}", rest);
                prop_assert!(rest.contains("\"cached_tokens\":2}"), "{:?}", rest);
                let newline = if event.ends_with("\r\n\r\n") { "\r\n\r\n" } else if event.ends_with("\n\n") { "\n\n" } else { "\r\r" };
                let end = rest.find(newline).map(|at| at + newline.len());
                rest = rest.get(end.unwrap_or(rest.len())..).unwrap_or_default();
                continue;
            };
            rest = tail;
        }
        prop_assert_eq!(rest, "");
    }
}
