//! The P/D protocol, free of any host calls: what the prefill request looks like, how the
//! prefill answer is read, what decode receives, and which error the client gets.

use std::net::{IpAddr, SocketAddr};
use std::ops::Range;

use crate::config::MissingKvPolicy;
use crate::json_object::{Edit, TopLevelObject};
use crate::json_scan::JsonErrorKind;

/// The OpenAI-style API a request is for; each caps generation in its own fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
    Responses,
}

impl Endpoint {
    pub fn from_path(path: &str) -> Option<Endpoint> {
        if path.ends_with("/chat/completions") {
            Some(Endpoint::ChatCompletions)
        } else if path.ends_with("/completions") {
            Some(Endpoint::Completions)
        } else if path.ends_with("/responses") {
            Some(Endpoint::Responses)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Responses => "responses",
        }
    }
}

pub const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// What the prefill request asks of vLLM's NIXL connector: keep the KV for a remote decode.
pub const REMOTE_DECODE_REQUEST: &[u8] = br#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// An error answered to the client in the OpenAI shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientError {
    pub status: u16,
    pub error_type: String,
    pub message: String,
}

impl ClientError {
    fn new(status: u16, message: impl Into<String>) -> ClientError {
        ClientError {
            status,
            error_type: default_error_type(status).to_owned(),
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ClientError {
        ClientError::new(400, message)
    }

    pub fn payload_too_large(limit: usize) -> ClientError {
        ClientError::new(
            413,
            format!("request body is larger than the limit of {limit} bytes"),
        )
    }

    pub fn unsupported_media_type(content_type: &str) -> ClientError {
        ClientError::new(
            415,
            format!("content-type must be application/json, got {content_type:?}"),
        )
    }

    pub fn internal(message: impl Into<String>) -> ClientError {
        ClientError::new(500, message)
    }

    /// `{"error":{"message":…,"type":…,"param":null,"code":status}}`
    pub fn to_json(&self) -> Vec<u8> {
        #[derive(serde::Serialize)]
        struct Envelope<'a> {
            error: Detail<'a>,
        }
        #[derive(serde::Serialize)]
        struct Detail<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            error_type: &'a str,
            param: Option<()>,
            code: u16,
        }
        let envelope = Envelope {
            error: Detail {
                message: &self.message,
                error_type: &self.error_type,
                param: None,
                code: self.status,
            },
        };
        serde_json::to_vec(&envelope).unwrap_or_else(|_| {
            br#"{"error":{"message":"pd-filter error","type":"InternalServerError","param":null,"code":500}}"#.to_vec()
        })
    }
}

fn default_error_type(status: u16) -> &'static str {
    match status {
        400 => "BadRequestError",
        401 => "AuthenticationError",
        403 => "PermissionDeniedError",
        404 => "NotFoundError",
        413 => "RequestTooLargeError",
        415 => "UnsupportedMediaTypeError",
        422 => "UnprocessableEntityError",
        429 => "RateLimitError",
        502 => "BadGatewayError",
        503 => "ServiceUnavailableError",
        504 => "GatewayTimeoutError",
        405..=412 | 414 | 416..=421 | 423..=428 | 430..=499 => "InvalidRequestError",
        _ => "InternalServerError",
    }
}

/// Checks the request's content-type: JSON, or absent (curl without `-H`).
pub fn check_content_type(content_type: Option<&str>) -> Result<(), ClientError> {
    let Some(value) = content_type else {
        return Ok(());
    };
    let essence = value.split(';').next().unwrap_or("").trim();
    let is_json = essence.eq_ignore_ascii_case("application/json")
        || (essence.len() > 5
            && essence
                .get(essence.len() - 5..)
                .is_some_and(|tail| tail.eq_ignore_ascii_case("+json")));
    if is_json {
        Ok(())
    } else {
        Err(ClientError::unsupported_media_type(value))
    }
}

/// A client request that passed validation: the body for prefill, and where decode's
/// `kv_transfer_params` go in the original body (kept by the caller).
#[derive(Debug)]
pub struct PreparedRequest {
    pub prefill_body: Vec<u8>,
    pub decode_plan: DecodePlan,
    /// The body's `model`, when it is a string.
    pub model: Option<String>,
}

/// Where `kv_transfer_params` go in the original body, found during the one parse.
#[derive(Debug)]
pub struct DecodePlan {
    /// Values of every client `kv_transfer_params` member: replaced.
    existing: Vec<Range<usize>>,
    /// When there is none: offset of the closing brace, and whether a comma is needed.
    insert_at: usize,
    needs_comma: bool,
}

/// Validates the client body and writes the prefill request for it.
pub fn prepare(endpoint: Endpoint, body: &[u8]) -> Result<PreparedRequest, ClientError> {
    if body.is_empty() {
        return Err(ClientError::bad_request("request body is empty"));
    }
    let object = TopLevelObject::parse(body).map_err(|e| {
        let what = match e.kind {
            JsonErrorKind::InvalidUtf8 => "is not valid UTF-8",
            JsonErrorKind::Syntax(_) => "is not a JSON object",
        };
        ClientError::bad_request(format!("request body {what}: {e}"))
    })?;
    let prefill_body = prefill_body(endpoint, &object);
    let existing: Vec<Range<usize>> = object
        .members()
        .iter()
        .filter(|m| m.key == KV_TRANSFER_PARAMS)
        .map(|m| m.value.clone())
        .collect();
    let decode_plan = DecodePlan {
        existing,
        insert_at: object.close_brace(),
        needs_comma: !object.members().is_empty(),
    };
    let model = object
        .last_value("model")
        .filter(|value| value.starts_with(b"\""))
        .and_then(|value| serde_json::from_slice::<String>(value).ok());
    Ok(PreparedRequest {
        prefill_body,
        decode_plan,
        model,
    })
}

/// The client's body, capped to one generated token, not streamed, asking for remote decode.
fn prefill_body(endpoint: Endpoint, object: &TopLevelObject) -> Vec<u8> {
    const ONE: &[u8] = b"1";
    let edit = |key: &str| match key {
        "max_tokens" | "max_completion_tokens" | "max_output_tokens" | "n" => Edit::Replace(ONE),
        "stream" => Edit::Replace(b"false"),
        KV_TRANSFER_PARAMS => Edit::Replace(REMOTE_DECODE_REQUEST),
        "min_tokens" | "min_completion_tokens" | "stream_options" => Edit::Remove,
        _ => Edit::Keep,
    };
    let mut append: Vec<(&str, &[u8])> = Vec::with_capacity(4);
    if !object.has("max_tokens") {
        append.push(("max_tokens", ONE));
    }
    if endpoint == Endpoint::Responses && !object.has("max_output_tokens") {
        append.push(("max_output_tokens", ONE));
    }
    if !object.has("stream") {
        append.push(("stream", b"false"));
    }
    if !object.has(KV_TRANSFER_PARAMS) {
        append.push((KV_TRANSFER_PARAMS, REMOTE_DECODE_REQUEST));
    }
    object.splice(edit, &append)
}

/// The client's original body with `kv_transfer_params` set to what prefill returned;
/// every other byte is kept.
pub fn decode_body(original: &[u8], plan: &DecodePlan, kv_transfer_params: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(original.len() + kv_transfer_params.len() + 32);
    if plan.existing.is_empty() {
        let (head, tail) = original.split_at(plan.insert_at.min(original.len()));
        out.extend_from_slice(head);
        if plan.needs_comma {
            out.push(b',');
        }
        out.extend_from_slice(b"\"kv_transfer_params\":");
        out.extend_from_slice(kv_transfer_params);
        out.extend_from_slice(tail);
    } else {
        let mut cursor = 0;
        for range in &plan.existing {
            out.extend_from_slice(original.get(cursor..range.start).unwrap_or_default());
            out.extend_from_slice(kv_transfer_params);
            cursor = range.end;
        }
        out.extend_from_slice(original.get(cursor..).unwrap_or_default());
    }
    out
}

/// Why a prefill leg failed, as counted in the stats and named in the logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Prefill answered an error status.
    Status,
    /// No answer within the prefill timeout.
    Timeout,
    /// The connection was reset before or during the answer.
    Reset,
    /// Prefill could not be reached, or the callout could not be sent.
    Unreachable,
    /// A 2xx answer without usable `kv_transfer_params`.
    NoKvTransferParams,
}

impl FailureKind {
    pub const ALL: [FailureKind; 5] = [
        FailureKind::Status,
        FailureKind::Timeout,
        FailureKind::Reset,
        FailureKind::Unreachable,
        FailureKind::NoKvTransferParams,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FailureKind::Status => "status",
            FailureKind::Timeout => "timeout",
            FailureKind::Reset => "reset",
            FailureKind::Unreachable => "unreachable",
            FailureKind::NoKvTransferParams => "no_kv_transfer_params",
        }
    }
}

/// A failed prefill leg: what kind of failure, and what the client is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillFailure {
    pub kind: FailureKind,
    pub error: ClientError,
}

impl PrefillFailure {
    /// The callout could not even be sent (for example, the cluster does not exist).
    pub fn not_dispatched(cluster: &str) -> PrefillFailure {
        let error = ClientError::new(
            503,
            format!(
                "prefill request could not be sent to cluster {cluster:?}; is it defined in Envoy?"
            ),
        );
        PrefillFailure {
            kind: FailureKind::Unreachable,
            error,
        }
    }
}

/// What the prefill answer means for the request.
#[derive(Debug, PartialEq, Eq)]
pub enum PrefillOutcome<'a> {
    /// Forward these `kv_transfer_params` (raw JSON object text) to decode.
    KvTransferParams(&'a [u8]),
    /// Send the original body to decode without them; the reason is logged.
    RecomputeOnDecode(String),
}

/// Reads the prefill answer. `status` is `None` when the callout ended without response
/// headers (the connection was reset after the answer had started).
pub fn interpret_prefill_response<'a>(
    status: Option<u16>,
    body: &'a [u8],
    policy: MissingKvPolicy,
) -> Result<PrefillOutcome<'a>, PrefillFailure> {
    let fail = |kind, status, message: String| {
        Err(PrefillFailure {
            kind,
            error: ClientError::new(status, message),
        })
    };
    let Some(status) = status else {
        return fail(
            FailureKind::Reset,
            502,
            "prefill connection was reset before its answer was complete".to_owned(),
        );
    };
    match status {
        200..=299 => match find_kv_transfer_params(body) {
            Ok(kv) => Ok(PrefillOutcome::KvTransferParams(kv)),
            Err(reason) => match policy {
                MissingKvPolicy::RecomputeOnDecode => Ok(PrefillOutcome::RecomputeOnDecode(reason)),
                MissingKvPolicy::Fail => fail(FailureKind::NoKvTransferParams, 502, reason),
            },
        },
        400..=499 => {
            let (error_type, message) = upstream_error(body);
            Err(PrefillFailure {
                kind: FailureKind::Status,
                error: ClientError {
                    status,
                    error_type: error_type.unwrap_or_else(|| default_error_type(status).to_owned()),
                    message: format!("prefill rejected the request ({status}): {message}"),
                },
            })
        }
        503 => {
            let message = upstream_error(body).1;
            fail(
                envoy_503_kind(&message),
                503,
                format!("prefill is unavailable (503): {message}"),
            )
        }
        504 => fail(
            FailureKind::Timeout,
            504,
            format!("prefill timed out (504): {}", upstream_error(body).1),
        ),
        _ => fail(
            FailureKind::Status,
            502,
            format!("prefill failed ({status}): {}", upstream_error(body).1),
        ),
    }
}

impl PrefillFailure {
    /// Whether another attempt may succeed: the request never reached a working prefill
    /// (connection refused or reset, or prefill said it is unavailable). Never a 4xx, never
    /// a timeout.
    pub fn is_retryable(&self) -> bool {
        match self.kind {
            FailureKind::Unreachable | FailureKind::Reset => true,
            FailureKind::Status => self.error.status == 503,
            FailureKind::Timeout | FailureKind::NoKvTransferParams => false,
        }
    }

    /// Whether the request itself was refused (a 4xx): decode would refuse it too.
    pub fn is_client_error(&self) -> bool {
        (400..500).contains(&self.error.status)
    }
}

const MAX_SCHEDULED_HOSTS: usize = 16;

/// Parses a scheduler's prefill host header: one `ip:port` or a comma-separated list.
/// Only IP addresses are accepted: the callout goes to exactly that address.
pub fn parse_prefill_hosts(header: &str, value: &str) -> Result<Vec<SocketAddr>, ClientError> {
    let hosts: Vec<&str> = value
        .split(',')
        .map(str::trim)
        .filter(|host| !host.is_empty())
        .collect();
    if hosts.is_empty() || hosts.len() > MAX_SCHEDULED_HOSTS {
        return Err(ClientError::bad_request(format!(
            "{header} must list 1 to {MAX_SCHEDULED_HOSTS} prefill hosts as ip:port"
        )));
    }
    hosts
        .into_iter()
        .map(|host| {
            host.parse::<SocketAddr>().map_err(|_| {
                let shown: String = host.chars().take(64).collect();
                ClientError::bad_request(format!(
                    "{header} has {shown:?}, which is not an ip:port prefill host"
                ))
            })
        })
        .collect()
}

/// When prefill reports its side channel on a loopback or empty `remote_host` (vLLM's
/// default), the same `kv_transfer_params` with the host the callout actually reached.
/// `None` when there is nothing to replace.
pub fn with_reachable_remote_host(kv_transfer_params: &[u8], host: IpAddr) -> Option<Vec<u8>> {
    let object = TopLevelObject::parse(kv_transfer_params).ok()?;
    let current = object.last_value("remote_host")?;
    let current: String = serde_json::from_slice(current).ok()?;
    let is_local = current.is_empty()
        || current.eq_ignore_ascii_case("localhost")
        || current
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified());
    if !is_local {
        return None;
    }
    let replacement = format!("\"{host}\"");
    Some(object.splice(
        |key| {
            if key == "remote_host" {
                Edit::Replace(replacement.as_bytes())
            } else {
                Edit::Keep
            }
        },
        &[],
    ))
}

/// Envoy answers a callout it could not complete with its own 503 and a text body; a 503
/// from prefill itself is an error status.
fn envoy_503_kind(message: &str) -> FailureKind {
    if message.contains("no healthy upstream") || message.contains("connection failure") {
        FailureKind::Unreachable
    } else if message.starts_with("upstream connect error or disconnect/reset") {
        FailureKind::Reset
    } else {
        FailureKind::Status
    }
}

fn find_kv_transfer_params(body: &[u8]) -> Result<&[u8], String> {
    let object = TopLevelObject::parse(body)
        .map_err(|e| format!("prefill answer is not a JSON object: {e}"))?;
    match object.last_value(KV_TRANSFER_PARAMS) {
        None => Err("prefill answer has no kv_transfer_params".to_owned()),
        Some(b"null") => Err("prefill answer has kv_transfer_params null".to_owned()),
        Some(value) if value.starts_with(b"{") => Ok(value),
        Some(_) => Err("kv_transfer_params in the prefill answer is not an object".to_owned()),
    }
}

const MAX_QUOTED_UPSTREAM_TEXT: usize = 512;

/// The `error.type` and `error.message` of an upstream error body, or its text.
fn upstream_error(body: &[u8]) -> (Option<String>, String) {
    #[derive(serde::Deserialize)]
    struct Envelope {
        error: Detail,
    }
    #[derive(serde::Deserialize)]
    struct Detail {
        message: Option<String>,
        #[serde(rename = "type")]
        error_type: Option<String>,
    }
    if let Ok(Envelope { error }) = serde_json::from_slice::<Envelope>(body) {
        if let Some(message) = error.message {
            return (error.error_type, message);
        }
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        return (None, "no details in the answer".to_owned());
    }
    let mut end = text.len().min(MAX_QUOTED_UPSTREAM_TEXT);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    (None, text.get(..end).unwrap_or_default().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn prefill_json(endpoint: Endpoint, body: &str) -> Value {
        let prepared = prepare(endpoint, body.as_bytes()).unwrap();
        serde_json::from_slice(&prepared.prefill_body).unwrap()
    }

    fn remote_decode() -> Value {
        serde_json::from_slice(REMOTE_DECODE_REQUEST).unwrap()
    }

    #[test]
    fn completions_prefill_is_capped_unstreamed_and_asks_for_remote_decode() {
        let body = r#"{"model":"m","prompt":"hi","max_tokens":200,"min_tokens":50,"stream":true,"stream_options":{"include_usage":true},"n":3,"temperature":0.7}"#;
        assert_eq!(
            prefill_json(Endpoint::Completions, body),
            json!({"model":"m","prompt":"hi","max_tokens":1,"stream":false,"n":1,
                   "temperature":0.7,"kv_transfer_params":remote_decode()})
        );
    }

    #[test]
    fn min_tokens_without_max_tokens_is_removed_and_max_tokens_added() {
        let body = r#"{"prompt":"hi","min_tokens":200,"min_completion_tokens":3}"#;
        assert_eq!(
            prefill_json(Endpoint::Completions, body),
            json!({"prompt":"hi","max_tokens":1,"stream":false,"kv_transfer_params":remote_decode()})
        );
    }

    #[test]
    fn chat_caps_both_limits_where_present() {
        let body = r#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":300,"max_tokens":100}"#;
        let prefill = prefill_json(Endpoint::ChatCompletions, body);
        assert_eq!(prefill["max_completion_tokens"], 1);
        assert_eq!(prefill["max_tokens"], 1);
        let only_completion = prefill_json(
            Endpoint::ChatCompletions,
            r#"{"messages":[],"max_completion_tokens":300}"#,
        );
        assert_eq!(only_completion["max_completion_tokens"], 1);
        assert_eq!(only_completion["max_tokens"], 1);
    }

    #[test]
    fn responses_are_capped_with_max_output_tokens_even_when_absent() {
        let absent = prefill_json(Endpoint::Responses, r#"{"input":"hi","max_tokens":9}"#);
        assert_eq!(absent["max_output_tokens"], 1);
        let present = prefill_json(
            Endpoint::Responses,
            r#"{"input":"hi","max_output_tokens":900}"#,
        );
        assert_eq!(present["max_output_tokens"], 1);
        let not_responses = prefill_json(Endpoint::Completions, r#"{"prompt":"hi"}"#);
        assert!(not_responses.get("max_output_tokens").is_none());
    }

    #[test]
    fn client_kv_transfer_params_are_replaced_on_prefill() {
        let prefill = prefill_json(
            Endpoint::Completions,
            r#"{"prompt":"x","kv_transfer_params":"junk","kv_transfer_params":{"a":1}}"#,
        );
        assert_eq!(prefill["kv_transfer_params"], remote_decode());
    }

    #[test]
    fn duplicate_limit_keys_are_all_capped() {
        let prepared = prepare(
            Endpoint::Completions,
            br#"{"max_tokens":5,"prompt":"x","max_tokens":7}"#,
        )
        .unwrap();
        let text = String::from_utf8(prepared.prefill_body).unwrap();
        assert!(
            text.starts_with(r#"{"max_tokens":1,"prompt":"x","max_tokens":1,"#),
            "{text}"
        );
    }

    #[test]
    fn escaped_keys_are_recognised() {
        let prefill = prefill_json(
            Endpoint::Completions,
            r#"{"prompt":"x","max\u005ftokens":50}"#,
        );
        assert_eq!(prefill["max_tokens"], 1);
    }

    #[test]
    fn decode_body_keeps_every_other_byte() {
        let original = "{\"prompt\": \"caf\\u00e9 \u{1F600}\",\n \"max_tokens\": 123456789012345678901234567890, \"temperature\": 1.50e0, \"stream\": true }";
        let prepared = prepare(Endpoint::Completions, original.as_bytes()).unwrap();
        let decode = decode_body(original.as_bytes(), &prepared.decode_plan, br#"{"k":1}"#);
        let expected = format!(
            "{},\"kv_transfer_params\":{{\"k\":1}}}}",
            &original[..original.len() - 1]
        );
        assert_eq!(String::from_utf8(decode).unwrap(), expected);
    }

    #[test]
    fn decode_body_replaces_client_kv_transfer_params_in_place() {
        let original = br#"{"kv_transfer_params": 7, "prompt":"x"}"#;
        let prepared = prepare(Endpoint::Completions, original).unwrap();
        let decode = decode_body(original, &prepared.decode_plan, br#"{"k":1}"#);
        assert_eq!(decode, br#"{"kv_transfer_params": {"k":1}, "prompt":"x"}"#);
    }

    #[test]
    fn decode_body_of_an_empty_object() {
        let prepared = prepare(Endpoint::Completions, b"{}").unwrap();
        assert_eq!(
            decode_body(b"{}", &prepared.decode_plan, b"{}"),
            br#"{"kv_transfer_params":{}}"#
        );
    }

    #[test]
    fn bad_bodies_are_400_with_a_reason() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "empty"),
            (b"not json", "not a JSON object"),
            (b"[1,2]", "not a JSON object"),
            (b"\"text\"", "not a JSON object"),
            (b"{\"prompt\":\"\xff\"}", "not valid UTF-8"),
            (b"{\"a\":1} {}", "not a JSON object"),
        ];
        for (body, reason) in cases {
            let err = prepare(Endpoint::Completions, body).unwrap_err();
            assert_eq!(err.status, 400);
            assert!(err.message.contains(reason), "{}", err.message);
        }
    }

    #[test]
    fn content_type_must_be_json_when_given() {
        assert!(check_content_type(None).is_ok());
        assert!(check_content_type(Some("application/json")).is_ok());
        assert!(check_content_type(Some("Application/JSON; charset=utf-8")).is_ok());
        assert!(check_content_type(Some("application/vnd.api+json")).is_ok());
        let err = check_content_type(Some("application/x-www-form-urlencoded")).unwrap_err();
        assert_eq!(err.status, 415);
    }

    #[test]
    fn error_body_has_the_openai_shape() {
        let body = ClientError::bad_request("say \"no\"").to_json();
        assert_eq!(
            String::from_utf8(body).unwrap(),
            r#"{"error":{"message":"say \"no\"","type":"BadRequestError","param":null,"code":400}}"#
        );
    }

    const POLICY: MissingKvPolicy = MissingKvPolicy::RecomputeOnDecode;

    #[test]
    fn prefill_kv_transfer_params_are_taken_verbatim() {
        let body = br#"{"id":"x","kv_transfer_params":{"remote_block_ids":[1, 2],"remote_port":5600, "x":1e400}}"#;
        assert_eq!(
            interpret_prefill_response(Some(200), body, POLICY).unwrap(),
            PrefillOutcome::KvTransferParams(
                br#"{"remote_block_ids":[1, 2],"remote_port":5600, "x":1e400}"#
            )
        );
    }

    #[test]
    fn prefill_without_usable_kv_follows_the_policy() {
        for body in [
            &br#"{"id":"x"}"#[..],
            br#"{"kv_transfer_params":null}"#,
            br#"{"kv_transfer_params":"s"}"#,
            b"not json",
            b"",
        ] {
            assert!(matches!(
                interpret_prefill_response(Some(200), body, POLICY),
                Ok(PrefillOutcome::RecomputeOnDecode(_))
            ));
            let failure =
                interpret_prefill_response(Some(200), body, MissingKvPolicy::Fail).unwrap_err();
            assert_eq!(failure.kind, FailureKind::NoKvTransferParams);
            assert_eq!(failure.error.status, 502);
        }
    }

    #[test]
    fn prefill_client_errors_pass_on_status_and_message() {
        let body = br#"{"error":{"message":"min_tokens must be less than or equal to max_tokens=1, got 200.","type":"BadRequestError","param":null,"code":400}}"#;
        let failure = interpret_prefill_response(Some(400), body, POLICY).unwrap_err();
        assert_eq!(failure.kind, FailureKind::Status);
        let err = failure.error;
        assert_eq!(err.status, 400);
        assert_eq!(err.error_type, "BadRequestError");
        assert_eq!(
            err.message,
            "prefill rejected the request (400): min_tokens must be less than or equal to max_tokens=1, got 200."
        );
    }

    #[test]
    fn prefill_server_failures_map_to_gateway_statuses() {
        use FailureKind::*;
        let refused = b"upstream connect error or disconnect/reset before headers. reset reason: remote connection failure, transport failure reason: delayed connect error: Connection refused";
        let terminated = b"upstream connect error or disconnect/reset before headers. reset reason: connection termination";
        type Case<'a> = (Option<u16>, &'a [u8], u16, FailureKind, &'a str);
        let cases: &[Case] = &[
            (None, b"", 502, Reset, "reset"),
            (
                Some(500),
                br#"{"error":{"message":"boom"}}"#,
                502,
                Status,
                "prefill failed (500): boom",
            ),
            (
                Some(503),
                br#"{"error":{"message":"overloaded"}}"#,
                503,
                Status,
                "prefill is unavailable (503): overloaded",
            ),
            (Some(503), refused, 503, Unreachable, "Connection refused"),
            (
                Some(503),
                b"no healthy upstream",
                503,
                Unreachable,
                "no healthy upstream",
            ),
            (Some(503), terminated, 503, Reset, "connection termination"),
            (
                Some(504),
                b"upstream request timeout",
                504,
                Timeout,
                "prefill timed out (504): upstream request timeout",
            ),
            (Some(302), b"", 502, Status, "no details"),
        ];
        for (status, body, expected, kind, text) in cases {
            let failure = interpret_prefill_response(*status, body, POLICY).unwrap_err();
            assert_eq!(failure.error.status, *expected);
            assert_eq!(failure.kind, *kind, "{}", failure.error.message);
            assert!(
                failure.error.message.contains(text),
                "{}",
                failure.error.message
            );
        }
    }

    #[test]
    fn the_model_is_read_from_the_body() {
        let model = |body: &str| {
            prepare(Endpoint::Completions, body.as_bytes())
                .unwrap()
                .model
        };
        assert_eq!(
            model(r#"{"model":"llama","prompt":"x"}"#).as_deref(),
            Some("llama")
        );
        assert_eq!(model(r#"{"model":"a\u002fb"}"#).as_deref(), Some("a/b"));
        assert_eq!(model(r#"{"model":7}"#), None);
        assert_eq!(model(r#"{"prompt":"x"}"#), None);
    }

    #[test]
    fn retries_only_where_prefill_never_started_the_work() {
        let failure = |status: Option<u16>, body: &[u8]| {
            interpret_prefill_response(status, body, MissingKvPolicy::Fail).unwrap_err()
        };
        assert!(failure(Some(503), b"no healthy upstream").is_retryable());
        assert!(failure(Some(503), br#"{"error":{"message":"busy"}}"#).is_retryable());
        assert!(failure(None, b"").is_retryable());
        assert!(!failure(Some(504), b"upstream request timeout").is_retryable());
        assert!(!failure(Some(500), b"").is_retryable());
        assert!(!failure(Some(429), b"").is_retryable());
        assert!(failure(Some(429), b"").is_client_error());
        assert!(!failure(Some(200), b"{}").is_retryable());
    }

    #[test]
    fn scheduler_hosts_must_be_ip_and_port() {
        let hosts = parse_prefill_hosts("x-h", " 10.0.0.1:8000, [fd00::1]:9000 ").unwrap();
        assert_eq!(hosts.len(), 2);
        assert_eq!(hosts[1].to_string(), "[fd00::1]:9000");
        for bad in [
            "",
            " , ",
            "10.0.0.1",
            "host:80",
            "10.0.0.1:99999",
            "10.0.0.1:80/x",
        ] {
            let err = parse_prefill_hosts("x-h", bad).unwrap_err();
            assert_eq!(err.status, 400);
            assert!(err.message.starts_with("x-h "), "{}", err.message);
        }
        let many = vec!["10.0.0.1:1"; 17].join(",");
        assert!(parse_prefill_hosts("x-h", &many).is_err());
    }

    #[test]
    fn loopback_remote_host_is_replaced_by_the_host_reached() {
        let host: IpAddr = "10.1.2.3".parse().unwrap();
        for local in ["localhost", "127.0.0.1", "", "::1", "0.0.0.0"] {
            let kv = format!(r#"{{"remote_host": "{local}", "remote_port": 5600}}"#);
            let replaced = with_reachable_remote_host(kv.as_bytes(), host).unwrap();
            assert_eq!(
                String::from_utf8(replaced).unwrap(),
                r#"{"remote_host": "10.1.2.3", "remote_port": 5600}"#
            );
        }
        assert_eq!(
            with_reachable_remote_host(br#"{"remote_host":"10.9.9.9"}"#, host),
            None
        );
        assert_eq!(
            with_reachable_remote_host(br#"{"remote_port":1}"#, host),
            None
        );
    }

    #[test]
    fn long_upstream_text_is_truncated_on_a_char_boundary() {
        let body = "é".repeat(1000);
        let failure = interpret_prefill_response(Some(500), body.as_bytes(), POLICY).unwrap_err();
        assert!(failure.error.message.len() < 600);
    }
}
