//! vLLM's own checks of the fields prefill's copy of a request changes: the generation limit,
//! `min_tokens`, `n` (with greedy sampling too), and `store` on the Responses API, on every
//! API that has them (the tokens-in API keeps them in `sampling_params`). Prefill's copy
//! always passes them (one token, no minimum, one choice, nothing stored), so a request that
//! fails one would cost a whole prefill, and then a KV release, before decode refused it. The
//! filter refuses such a request itself, in vLLM's words. Only what the request alone
//! settles is checked: values written as plain JSON integers, limits vLLM does not lower
//! further. Anything else is left for vLLM to judge.

use crate::api::Api;
use crate::json::JsonObject;

use super::errors::ClientError;
use super::rewrite::truthy;

/// `max_tokens` when a completions request has none (vLLM's `CompletionRequest`).
const COMPLETIONS_DEFAULT_MAX_TOKENS: i64 = 16;

/// The 400 vLLM answers a request with, when prefill's copy would pass where the client's
/// request fails. `sampling_params`: the request's, read as an object.
pub fn refuse_what_vllm_refuses(
    api: Api,
    object: &JsonObject,
    sampling_params: Option<&JsonObject>,
) -> Result<(), ClientError> {
    check_capped_fields_readable(api, object, sampling_params)?;
    match api {
        Api::Completions | Api::ChatCompletions => {
            check_n(object)?;
            let limit = match api {
                Api::Completions => completions_limit(object),
                _ => chat_limit(object),
            };
            check_limit(limit)?;
            check_min_tokens(object, limit)
        }
        Api::Responses => {
            check_limit(integer(object, "max_output_tokens"))?;
            check_background(object)
        }
        Api::Messages => check_messages_limit(object),
        // Without an object there, vLLM refuses prefill's copy as it would the client's.
        Api::Generate => sampling_params.map_or(Ok(()), check_sampling_params),
        Api::CohereChat => check_cohere_limit(object),
    }
}

/// What vLLM's request model declares a field that prefill's copy overwrites to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Declared {
    /// `int`: `null` is refused.
    Int,
    /// `int | None`.
    OptionalInt,
    /// `bool | None`.
    OptionalBool,
    /// An object, or `null`.
    OptionalObject,
}

/// The fields prefill's copy overwrites (or removes) at the top level, per API, as vLLM
/// declares them. Other keys the copy overwrites are not fields of that API's model, which
/// vLLM ignores.
fn capped_fields(api: Api) -> &'static [(&'static str, Declared)] {
    use Declared::*;
    match api {
        Api::Completions => &[
            ("max_tokens", OptionalInt),
            ("n", Int),
            ("min_tokens", Int),
            ("stream", OptionalBool),
            ("stream_options", OptionalObject),
        ],
        Api::ChatCompletions => &[
            ("max_tokens", OptionalInt),
            ("max_completion_tokens", OptionalInt),
            ("n", OptionalInt),
            ("min_tokens", Int),
            ("stream", OptionalBool),
            ("stream_options", OptionalObject),
        ],
        Api::Responses => &[
            ("max_output_tokens", OptionalInt),
            ("stream", OptionalBool),
            ("background", OptionalBool),
            ("store", OptionalBool),
        ],
        // `max_tokens` is required: its absence goes to prefill as sent. `min_tokens` is
        // left out: vLLM before 0.34 has no such field and ignores any value.
        Api::Messages => &[("max_tokens", Int), ("stream", OptionalBool)],
        Api::Generate => &[("stream", OptionalBool), ("stream_options", OptionalObject)],
        Api::CohereChat => &[("max_tokens", OptionalInt), ("stream", OptionalBool)],
    }
}

/// `sampling_params` fields of the tokens-in API that prefill's copy overwrites.
const CAPPED_SAMPLING_PARAMS: &[(&str, Declared)] = &[
    ("max_tokens", Declared::OptionalInt),
    ("n", Declared::Int),
    ("min_tokens", Declared::Int),
];

/// A value vLLM's request model refuses for a field prefill's copy overwrites. Prefill
/// would be served its own valid value, compute the whole prompt and hold its KV, and only
/// decode would refuse the client's: such a request is refused before prefill. Only values
/// pydantic refuses in any reading are caught (the wrong kind of JSON value, `null` where
/// the field is not optional, a number with a fractional part for an integer, `NaN` or an
/// infinity, a string without a digit for an integer or outside pydantic's words for a
/// bool); anything else is left for vLLM to judge.
fn check_capped_fields_readable(
    api: Api,
    object: &JsonObject,
    sampling_params: Option<&JsonObject>,
) -> Result<(), ClientError> {
    for &(field, declared) in capped_fields(api) {
        check_readable(object, field, declared)?;
    }
    if let Some(params) = sampling_params.filter(|_| api == Api::Generate) {
        for &(field, declared) in CAPPED_SAMPLING_PARAMS {
            check_readable(params, field, declared)?;
        }
    }
    Ok(())
}

fn check_readable(
    object: &JsonObject,
    field: &'static str,
    declared: Declared,
) -> Result<(), ClientError> {
    let Some(value) = object.last_value(field) else {
        return Ok(());
    };
    let refused = match declared {
        Declared::Int => value == b"null" || surely_not_an_int(value),
        Declared::OptionalInt => surely_not_an_int(value),
        Declared::OptionalBool => surely_not_a_bool(value),
        Declared::OptionalObject => !matches!(value.first(), Some(b'{' | b'n')),
    };
    if !refused {
        return Ok(());
    }
    let kind = match declared {
        Declared::Int | Declared::OptionalInt => "an integer",
        Declared::OptionalBool => "a boolean",
        Declared::OptionalObject => "an object",
    };
    Err(ClientError::invalid_field(
        field,
        format!(
            "{field} must be {kind}, as vLLM reads it; got {}",
            shown(value)
        ),
    ))
}

/// A value no reading of pydantic's lax mode takes as an int: an object, an array, a string
/// with no digit in it, or with an ASCII letter (`"1e1"`, `"0x10"`, `"inf"`) or a control
/// character that is not whitespace (`"1\u0000"`) anywhere in it, `NaN` or an infinity, or a
/// number written with a fraction or exponent whose value has a fractional part or is beyond
/// any float. (An integer literal is an int to Python; one longer than Python reads has its
/// whole body refused on parsing.)
fn surely_not_an_int(value: &[u8]) -> bool {
    if is_nan_or_infinite(value) {
        return true;
    }
    let integer_literal = !value.iter().any(|byte| matches!(byte, b'.' | b'e' | b'E'));
    match value.first() {
        Some(b'{' | b'[') => true,
        Some(b'"') => serde_json::from_slice::<String>(value)
            .is_ok_and(|text| string_surely_not_an_int(&text)),
        Some(b'-' | b'0'..=b'9') if integer_literal => false,
        Some(b'-' | b'0'..=b'9') => std::str::from_utf8(value)
            .ok()
            .and_then(|text| text.parse::<f64>().ok())
            .is_some_and(|number| !number.is_finite() || number.fract() != 0.0),
        _ => false,
    }
}

/// A string pydantic's lax mode never reads as an int. It reads one as Rust's `str::trim`
/// leaves it (Unicode whitespace, which takes in ASCII's tab, line feed, vertical tab, form
/// feed and carriage return), then a sign, digits with `_` between them and a fraction of
/// zeros: never a letter (no exponent, radix prefix, `inf` or `nan`), never another control
/// character, and at least one digit.
fn string_surely_not_an_int(text: &str) -> bool {
    let whitespace = |byte: u8| matches!(byte, b'\t' | b'\n' | 0x0b | 0x0c | b'\r');
    !text.bytes().any(|byte| byte.is_ascii_digit())
        || text.bytes().any(|byte| {
            byte.is_ascii_alphabetic() || (byte.is_ascii_control() && !whitespace(byte))
        })
}

/// A value pydantic's lax mode never takes as a bool: an object, an array, a number other
/// than 0 and 1 (`NaN` and the infinities too), or a string outside the words it reads
/// (`true`, `yes`, `on`, `1`, ... in any case). `null` is read as unset.
fn surely_not_a_bool(value: &[u8]) -> bool {
    const WORDS: [&str; 12] = [
        "true", "false", "yes", "no", "on", "off", "1", "0", "t", "f", "y", "n",
    ];
    if is_nan_or_infinite(value) {
        return true;
    }
    match value.first() {
        Some(b'{' | b'[') => true,
        Some(b'"') => serde_json::from_slice::<String>(value)
            .is_ok_and(|text| !WORDS.iter().any(|word| text.eq_ignore_ascii_case(word))),
        Some(b'-' | b'0'..=b'9') => std::str::from_utf8(value)
            .ok()
            .and_then(|text| text.parse::<f64>().ok())
            .is_some_and(|number| number != 0.0 && number != 1.0),
        _ => false,
    }
}

/// `NaN`, `Infinity` or `-Infinity`: floats to Python's json (so to vLLM), which the
/// validated document can hold nowhere but as a whole value.
fn is_nan_or_infinite(value: &[u8]) -> bool {
    matches!(value, b"NaN" | b"Infinity" | b"-Infinity")
}

/// A client's value as an error message shows it: its first 64 characters.
fn shown(value: &[u8]) -> String {
    String::from_utf8_lossy(value).chars().take(64).collect()
}

/// The Messages API's `max_tokens`, which is required and must be positive (vLLM's
/// `AnthropicMessagesRequest`). Its `min_tokens` is left to vLLM: 0.34 checks it against
/// `max_tokens`, earlier versions have no such field and ignore it.
fn check_messages_limit(object: &JsonObject) -> Result<(), ClientError> {
    match integer(object, "max_tokens") {
        Some(limit) if limit < 1 => Err(ClientError::invalid_field(
            "max_tokens",
            "max_tokens must be positive",
        )),
        Some(limit) => check_thinking_budget(object, limit),
        None => Ok(()),
    }
}

/// Enabled thinking's `budget_tokens` against `max_tokens`, which vLLM (0.33 and 0.34)
/// checks on every request but a prefill leg's: a request that fails it would be prefilled,
/// then refused by decode.
fn check_thinking_budget(object: &JsonObject, limit: i64) -> Result<(), ClientError> {
    let Some(thinking) = object
        .last_value("thinking")
        .and_then(|value| JsonObject::parse(value).ok())
    else {
        return Ok(());
    };
    // Read as vLLM reads it, escapes and all (`"\u0065nabled"` is `enabled`).
    let enabled = thinking
        .last_value("type")
        .filter(|value| value.len() <= 64)
        .and_then(|value| serde_json::from_slice::<String>(value).ok())
        .is_some_and(|kind| kind == "enabled");
    match integer(&thinking, "budget_tokens") {
        Some(budget) if enabled && budget >= limit => Err(ClientError::invalid_field(
            "thinking",
            "thinking.budget_tokens must be less than max_tokens",
        )),
        _ => Ok(()),
    }
}

/// The Cohere-style API's `max_tokens`: its own model refuses one below 0, and vLLM's chat,
/// which it becomes, one of 0.
fn check_cohere_limit(object: &JsonObject) -> Result<(), ClientError> {
    match integer(object, "max_tokens") {
        Some(limit) if limit < 0 => Err(ClientError::invalid_field(
            "max_tokens",
            "max_tokens must be non-negative",
        )),
        limit => check_limit(limit),
    }
}

/// The tokens-in API's `sampling_params`, checked as vLLM's `SamplingParams` checks itself:
/// its `max_tokens` is 16 when not given.
fn check_sampling_params(params: &JsonObject) -> Result<(), ClientError> {
    check_n(params)?;
    let limit = if params.has("max_tokens") {
        integer(params, "max_tokens")
    } else {
        Some(COMPLETIONS_DEFAULT_MAX_TOKENS)
    };
    check_limit(limit)?;
    check_min_tokens(params, limit)
}

/// A member written as a plain JSON integer (what pydantic reads as one without doubt).
fn integer(object: &JsonObject, key: &str) -> Option<i64> {
    let value = object.last_value(key)?;
    let digits = value.strip_prefix(b"-").unwrap_or(value);
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(value).ok()?.parse().ok()
}

/// The limit a completions request sets: its `max_tokens`, 16 when it has none. vLLM takes
/// `max_tokens: 0` with `echo` as "the prompt only", so such a request sets none here.
fn completions_limit(object: &JsonObject) -> Option<i64> {
    if !object.has("max_tokens") {
        return Some(COMPLETIONS_DEFAULT_MAX_TOKENS);
    }
    let limit = integer(object, "max_tokens")?;
    let echoes = object.last_value("echo").is_some_and(truthy);
    (limit != 0 || !echoes).then_some(limit)
}

/// The limit a chat request sets: `max_completion_tokens`, else `max_tokens`. vLLM 0.11
/// reads `max_completion_tokens or max_tokens`, where a 0 gives way; later versions take a 0
/// as the limit and refuse it. Either way a `min_tokens` above `max_tokens` is refused, and
/// a 0 with no `max_tokens` is left to vLLM.
fn chat_limit(object: &JsonObject) -> Option<i64> {
    let newer = object
        .last_value("max_completion_tokens")
        .filter(|value| *value != b"null");
    match newer.map(|_| integer(object, "max_completion_tokens")) {
        None | Some(Some(0)) => integer(object, "max_tokens"),
        Some(limit) => limit,
    }
}

fn check_limit(limit: Option<i64>) -> Result<(), ClientError> {
    match limit {
        Some(limit) if limit < 1 => Err(ClientError::invalid_field(
            "max_tokens",
            format!(
                "max_tokens must be at least 1, got {limit}. (parameter=max_tokens, value={limit})"
            ),
        )),
        _ => Ok(()),
    }
}

/// `min_tokens`, which prefill's copy sets to 1, against the request's own limit. vLLM may
/// lower that limit further (to the context left after the prompt, or the model's default),
/// which only the worker knows.
fn check_min_tokens(object: &JsonObject, limit: Option<i64>) -> Result<(), ClientError> {
    let Some(min_tokens) = integer(object, "min_tokens") else {
        return Ok(());
    };
    if min_tokens < 0 {
        return Err(ClientError::invalid_field(
            "min_tokens",
            format!("min_tokens must be greater than or equal to 0, got {min_tokens}."),
        ));
    }
    match limit {
        Some(limit) if min_tokens > limit => Err(ClientError::invalid_field(
            "min_tokens",
            format!(
                "min_tokens must be less than or equal to max_tokens={limit}, got {min_tokens}."
            ),
        )),
        _ => Ok(()),
    }
}

/// `n`, which prefill's copy sets to 1. More than one choice needs sampling: vLLM refuses it
/// with a temperature of 0 (greedy), which only a temperature the request writes settles
/// (without one, vLLM takes the model's default).
fn check_n(object: &JsonObject) -> Result<(), ClientError> {
    match integer(object, "n") {
        Some(n) if n < 1 => Err(ClientError::invalid_field(
            "n",
            format!("n must be at least 1, got {n}."),
        )),
        Some(n) if n > 1 && is_greedy(object) => Err(ClientError::bad_request(format!(
            "n must be 1 when using greedy sampling, got {n}."
        ))),
        _ => Ok(()),
    }
}

/// A `temperature` written as a JSON number equal to zero (`0`, `0.0`, `-0`, `0e3`). The
/// value is valid JSON, so only a number parses as one (no `inf` or `NaN` there).
fn is_greedy(object: &JsonObject) -> bool {
    object
        .last_value("temperature")
        .and_then(|value| std::str::from_utf8(value).ok())
        .and_then(|text| text.parse::<f64>().ok())
        .is_some_and(|temperature| temperature == 0.0)
}

/// `background` needs `store` (vLLM's `validate_background`, which reads the raw values:
/// any true `background`, and a `store` given as false or 0). A null `store` is left to
/// vLLM: 0.34 refuses it beside `background`, later versions read it as the default, true.
/// Prefill's copy stores nothing and runs in the foreground.
fn check_background(object: &JsonObject) -> Result<(), ClientError> {
    let background = object.last_value("background").is_some_and(truthy);
    let no_store = object
        .last_value("store")
        .is_some_and(|store| store != b"null" && !truthy(store));
    if background && no_store {
        return Err(ClientError::invalid_field(
            "background",
            "background can only be used when `store` is true",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(api: Api, body: &str) -> Result<(), ClientError> {
        let object =
            JsonObject::parse(body.as_bytes()).map_err(|_| ClientError::internal("json"))?;
        let sampling_params = object
            .last_value("sampling_params")
            .and_then(|text| JsonObject::parse(text).ok());
        refuse_what_vllm_refuses(api, &object, sampling_params.as_ref())
    }

    fn refusal(api: Api, body: &str) -> (Option<&'static str>, String) {
        match check(api, body) {
            Err(error) => {
                assert_eq!(error.status, 400, "{body}");
                (error.param, error.message)
            }
            Ok(()) => panic!("not refused: {body}"),
        }
    }

    #[test]
    fn a_minimum_above_the_requests_own_limit_is_refused_in_vllms_words() {
        let cases = [
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":4,"min_tokens":5}"#,
                4,
                5,
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","min_tokens":20}"#,
                16,
                20,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"max_tokens":3,"min_tokens":9}"#,
                3,
                9,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"max_tokens":50,"max_completion_tokens":3,"min_tokens":9}"#,
                3,
                9,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"max_completion_tokens":-0,"max_tokens":2,"min_tokens":9}"#,
                2,
                9,
            ),
        ];
        for (api, body, limit, minimum) in cases {
            let (param, message) = refusal(api, body);
            assert_eq!(param, Some("min_tokens"));
            assert_eq!(
                message,
                format!(
                    "min_tokens must be less than or equal to max_tokens={limit}, got {minimum}."
                )
            );
        }
        let (_, message) = refusal(Api::Completions, r#"{"prompt":"hi","min_tokens":-1}"#);
        assert_eq!(
            message,
            "min_tokens must be greater than or equal to 0, got -1."
        );
    }

    #[test]
    fn limits_below_one_and_no_choices_are_refused() {
        let cases = [
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":0}"#,
                "max_tokens",
                "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"max_completion_tokens":-3}"#,
                "max_tokens",
                "max_tokens must be at least 1, got -3. (parameter=max_tokens, value=-3)",
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"max_tokens":0}"#,
                "max_tokens",
                "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            ),
            (
                Api::Responses,
                r#"{"input":"hi","max_output_tokens":0}"#,
                "max_tokens",
                "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","n":0}"#,
                "n",
                "n must be at least 1, got 0.",
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"n":-1}"#,
                "n",
                "n must be at least 1, got -1.",
            ),
        ];
        for (api, body, param, message) in cases {
            assert_eq!(
                refusal(api, body),
                (Some(param), message.to_owned()),
                "{body}"
            );
        }
    }

    #[test]
    fn the_messages_limit_must_be_positive() {
        for body in [
            r#"{"messages":[],"max_tokens":0}"#,
            r#"{"messages":[],"max_tokens":-4}"#,
        ] {
            assert_eq!(
                refusal(Api::Messages, body),
                (Some("max_tokens"), "max_tokens must be positive".to_owned())
            );
        }
    }

    #[test]
    fn messages_thinking_must_leave_room_for_the_answer() {
        for body in [
            r#"{"messages":[],"max_tokens":1024,"thinking":{"type":"enabled","budget_tokens":1024}}"#,
            r#"{"messages":[],"max_tokens":2000,"thinking":{"budget_tokens":4096,"type":"enabled"}}"#,
            r#"{"messages":[],"max_tokens":20,"thinking":{"type":"\u0065nabled","budget_\u0074okens":20}}"#,
        ] {
            assert_eq!(
                refusal(Api::Messages, body),
                (
                    Some("thinking"),
                    "thinking.budget_tokens must be less than max_tokens".to_owned()
                ),
                "{body}"
            );
        }
        for body in [
            r#"{"messages":[],"max_tokens":2048,"thinking":{"type":"enabled","budget_tokens":1024}}"#,
            r#"{"messages":[],"max_tokens":100,"thinking":{"type":"disabled"}}"#,
            r#"{"messages":[],"max_tokens":100,"thinking":{"type":"adaptive","budget_tokens":4096}}"#,
            r#"{"messages":[],"max_tokens":100,"thinking":{"type":"enabled","budget_tokens":"4096"}}"#,
            r#"{"messages":[],"max_tokens":100,"thinking":null}"#,
            r#"{"messages":[],"max_tokens":"100","thinking":{"type":"enabled","budget_tokens":4096}}"#,
        ] {
            assert_eq!(check(Api::Messages, body), Ok(()), "{body}");
        }
    }

    #[test]
    fn the_tokens_in_apis_sampling_params_are_checked_as_vllm_checks_them() {
        let cases = [
            (
                r#"{"token_ids":[1],"sampling_params":{"max_tokens":2,"min_tokens":5}}"#,
                Some("min_tokens"),
                "min_tokens must be less than or equal to max_tokens=2, got 5.",
            ),
            (
                r#"{"token_ids":[1],"sampling_params":{"min_tokens":17}}"#,
                Some("min_tokens"),
                "min_tokens must be less than or equal to max_tokens=16, got 17.",
            ),
            (
                r#"{"token_ids":[1],"sampling_params":{"max_tokens":0}}"#,
                Some("max_tokens"),
                "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            ),
            (
                r#"{"token_ids":[1],"sampling_params":{"n":0}}"#,
                Some("n"),
                "n must be at least 1, got 0.",
            ),
            (
                r#"{"token_ids":[1],"sampling_params":{"n":2,"temperature":0.0}}"#,
                None,
                "n must be 1 when using greedy sampling, got 2.",
            ),
        ];
        for (body, param, message) in cases {
            assert_eq!(
                refusal(Api::Generate, body),
                (param, message.to_owned()),
                "{body}"
            );
        }
    }

    #[test]
    fn several_choices_without_sampling_are_refused() {
        for (api, body) in [
            (
                Api::ChatCompletions,
                r#"{"messages":[],"n":3,"temperature":0}"#,
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","n":2,"temperature":-0}"#,
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","temperature":0.5,"n":2,"temperature":0e0}"#,
            ),
            // Python reads it as 0.0 too.
            (
                Api::Completions,
                r#"{"prompt":"hi","n":2,"temperature":1e-400}"#,
            ),
        ] {
            let (param, message) = refusal(api, body);
            assert_eq!(param, None, "{body}");
            assert!(
                message.starts_with("n must be 1 when using greedy sampling, got "),
                "{message}"
            );
        }
    }

    #[test]
    fn background_without_store_is_refused_on_responses() {
        for body in [
            r#"{"input":"hi","background":true,"store":false}"#,
            r#"{"input":"hi","background":1,"store":0}"#,
        ] {
            let (param, message) = refusal(Api::Responses, body);
            assert_eq!(param, Some("background"));
            assert_eq!(message, "background can only be used when `store` is true");
        }
    }

    #[test]
    fn cohere_limits_are_checked_as_vllm_checks_them() {
        let (param, message) = refusal(Api::CohereChat, r#"{"messages":[],"max_tokens":-1}"#);
        assert_eq!(param, Some("max_tokens"));
        assert_eq!(message, "max_tokens must be non-negative");
        let (param, message) = refusal(Api::CohereChat, r#"{"messages":[],"max_tokens":0}"#);
        assert_eq!(param, Some("max_tokens"));
        assert_eq!(
            message,
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
        );
        for body in [
            r#"{"messages":[],"max_tokens":1}"#,
            r#"{"messages":[],"max_tokens":"-1"}"#,
            r#"{"messages":[]}"#,
        ] {
            assert_eq!(check(Api::CohereChat, body), Ok(()), "{body}");
        }
        // Messages' min_tokens: vLLM versions disagree (a field only since 0.34).
        for body in [
            r#"{"messages":[],"max_tokens":64,"min_tokens":100}"#,
            r#"{"messages":[],"max_tokens":64,"min_tokens":-1}"#,
        ] {
            assert_eq!(check(Api::Messages, body), Ok(()), "{body}");
        }
    }

    #[test]
    fn values_vllm_cannot_read_in_fields_prefill_overwrites_are_refused_before_prefill() {
        // Prefill's copy would carry its own valid value and be served; only decode would
        // refuse the client's.
        let cases = [
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":4,"min_tokens":5.5}"#,
                "min_tokens",
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","min_tokens":null}"#,
                "min_tokens",
            ),
            (Api::Completions, r#"{"prompt":"hi","n":null}"#, "n"),
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":7.5}"#,
                "max_tokens",
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":"many"}"#,
                "max_tokens",
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","stream":true,"stream_options":"yes"}"#,
                "stream_options",
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"min_tokens":null}"#,
                "min_tokens",
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"max_completion_tokens":[5]}"#,
                "max_completion_tokens",
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"stream":"yes please"}"#,
                "stream",
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"stream":2}"#,
                "stream",
            ),
            (
                Api::Responses,
                r#"{"input":"hi","max_output_tokens":"lots"}"#,
                "max_output_tokens",
            ),
            (Api::Responses, r#"{"input":"hi","store":{}}"#, "store"),
            (
                Api::Responses,
                r#"{"input":"hi","background":"later"}"#,
                "background",
            ),
            (
                Api::Messages,
                r#"{"messages":[],"max_tokens":null}"#,
                "max_tokens",
            ),
            (
                Api::Messages,
                r#"{"messages":[],"max_tokens":2.5}"#,
                "max_tokens",
            ),
            (
                Api::Messages,
                r#"{"messages":[],"max_tokens":"abc"}"#,
                "max_tokens",
            ),
            // Strings with a digit that pydantic still reads as no int: an exponent, a radix
            // prefix, a letter, a control character that is not whitespace. Prefill's copy
            // (its own value there) would be served, and decode would refuse the client's.
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":"1e1"}"#,
                "max_tokens",
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"max_completion_tokens":"0x10"}"#,
                "max_completion_tokens",
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"n":"1\u0000"}"#,
                "n",
            ),
            (
                Api::Responses,
                r#"{"input":"hi","max_output_tokens":"1E0"}"#,
                "max_output_tokens",
            ),
            (
                Api::Messages,
                r#"{"messages":[],"max_tokens":"5 tokens"}"#,
                "max_tokens",
            ),
            (
                Api::CohereChat,
                r#"{"messages":[],"max_tokens":"\u001c1"}"#,
                "max_tokens",
            ),
            (
                Api::Generate,
                r#"{"token_ids":[1],"sampling_params":{"min_tokens":"1e0"}}"#,
                "min_tokens",
            ),
            (
                Api::CohereChat,
                r#"{"messages":[],"max_tokens":2.5}"#,
                "max_tokens",
            ),
            (
                Api::Generate,
                r#"{"token_ids":[1],"sampling_params":{"n":null}}"#,
                "n",
            ),
            (
                Api::Generate,
                r#"{"token_ids":[1],"sampling_params":{"min_tokens":null}}"#,
                "min_tokens",
            ),
            (
                Api::Generate,
                r#"{"token_ids":[1],"sampling_params":{"max_tokens":1.5}}"#,
                "max_tokens",
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":1e400}"#,
                "max_tokens",
            ),
            (
                Api::Generate,
                r#"{"token_ids":[1],"stream":"no way"}"#,
                "stream",
            ),
            // Python's json reads NaN and the infinities as floats, which pydantic takes
            // for neither an int nor a bool.
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":NaN}"#,
                "max_tokens",
            ),
            (Api::Completions, r#"{"prompt":"hi","n":-Infinity}"#, "n"),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"min_tokens":Infinity}"#,
                "min_tokens",
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"stream":Infinity}"#,
                "stream",
            ),
            (Api::Responses, r#"{"input":"hi","store":NaN}"#, "store"),
            (
                Api::Generate,
                r#"{"token_ids":[1],"sampling_params":{"max_tokens":-Infinity}}"#,
                "max_tokens",
            ),
        ];
        for (api, body, field) in cases {
            assert_eq!(refusal(api, body).0, Some(field), "{body}");
        }
        // Every spelling pydantic may read is left to vLLM, and so are fields an API does
        // not have (Messages' min_tokens before vLLM 0.34). Python reads an integer literal
        // of any length.
        let big_limit = format!(r#"{{"prompt":"hi","max_tokens":1{}}}"#, "0".repeat(400));
        let readable = [
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":"16","n":"1_0","temperature":1}"#,
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":null,"n":1.0,"min_tokens":true}"#,
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":1e2,"stream":"Yes"}"#,
            ),
            // Whitespace pydantic trims (Unicode's, ASCII's vertical tab and form feed too),
            // a sign, `_` between digits and a fraction of zeros: all ints to pydantic.
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":"\u000b+1_6\f","n":"\u00a01.00\u3000"}"#,
            ),
            (Api::Completions, &big_limit),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"n":null,"max_tokens":null,"stream":null}"#,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"stream":"off","stream_options":null}"#,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"stream":1,"stream_options":{}}"#,
            ),
            (
                Api::Responses,
                r#"{"input":"hi","max_output_tokens":null,"store":"f"}"#,
            ),
            (
                Api::Messages,
                r#"{"messages":[],"max_tokens":"100","min_tokens":null}"#,
            ),
            (
                Api::Generate,
                r#"{"token_ids":[1],"sampling_params":{"max_tokens":null}}"#,
            ),
            (Api::CohereChat, r#"{"messages":[],"max_tokens":null}"#),
        ];
        for (api, body) in readable {
            assert_eq!(check(api, body), Ok(()), "{body}");
        }
    }

    #[test]
    fn what_the_request_alone_does_not_settle_is_left_to_vllm() {
        let cases = [
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":5,"min_tokens":5}"#,
            ),
            (Api::Completions, r#"{"prompt":"hi","min_tokens":16}"#),
            // The prompt alone, with its logprobs: vLLM's way of scoring a text.
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":0,"echo":true}"#,
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":null,"min_tokens":500}"#,
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":"2","min_tokens":5}"#,
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":2.0,"min_tokens":5}"#,
            ),
            (Api::Completions, r#"{"prompt":"hi","n":"0"}"#),
            // Chat without a limit: vLLM's is the context left, which only it knows.
            (Api::ChatCompletions, r#"{"messages":[],"min_tokens":5000}"#),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"max_completion_tokens":null,"min_tokens":9}"#,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"max_completion_tokens":0}"#,
            ),
            (Api::Responses, r#"{"input":"hi","max_output_tokens":1}"#),
            (
                Api::Responses,
                r#"{"input":"hi","background":true,"store":null}"#,
            ),
            (Api::Responses, r#"{"input":"hi","background":true}"#),
            (
                Api::Responses,
                r#"{"input":"hi","background":false,"store":false}"#,
            ),
            (Api::Messages, r#"{"messages":[],"max_tokens":1}"#),
            (Api::Messages, r#"{"messages":[],"max_tokens":"0"}"#),
            // Without a temperature of its own the request samples at the model's default.
            (Api::ChatCompletions, r#"{"messages":[],"n":3}"#),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"n":3,"temperature":null}"#,
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","n":2,"temperature":0.001}"#,
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","n":2,"temperature":"0"}"#,
            ),
            (Api::Completions, r#"{"prompt":"hi","n":1,"temperature":0}"#),
            (
                Api::Generate,
                r#"{"token_ids":[1],"sampling_params":{"max_tokens":null,"min_tokens":500}}"#,
            ),
            (
                Api::Generate,
                r#"{"token_ids":[1],"sampling_params":{"max_tokens":8,"min_tokens":8,"n":2}}"#,
            ),
            (Api::Generate, r#"{"token_ids":[1]}"#),
            (Api::Generate, r#"{"token_ids":[1],"sampling_params":[]}"#),
            // The last sampling_params is the one vLLM reads.
            (
                Api::Generate,
                r#"{"sampling_params":{"max_tokens":2,"min_tokens":5},"sampling_params":{"max_tokens":9,"min_tokens":5}}"#,
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","max_tokens":99999999999999999999999,"min_tokens":5}"#,
            ),
        ];
        for (api, body) in cases {
            assert!(check(api, body).is_ok(), "{body}");
        }
    }
}
