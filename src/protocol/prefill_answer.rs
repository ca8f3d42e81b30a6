//! What the prefill answer means for the request: `kv_transfer_params` for decode, an answer
//! without them, or a failure mapped to the status the client gets.

use std::time::Duration;

use crate::json::JsonObject;

use super::errors::{default_error_type, ClientError};
use super::rewrite::KV_TRANSFER_PARAMS;

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

/// Why Envoy would not send a call it was asked to make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallRefused {
    /// Envoy has no cluster of that name.
    NoSuchCluster,
    /// Envoy refused it at once: the cluster's pool full, or no healthy host.
    AtOnce,
}

impl PrefillFailure {
    fn new(kind: FailureKind, status: u16, message: String) -> PrefillFailure {
        PrefillFailure {
            kind,
            error: ClientError::new(status, message),
        }
    }

    /// The callout could not even be sent.
    pub fn not_dispatched(cluster: &str, refused: CallRefused) -> PrefillFailure {
        let why = match refused {
            CallRefused::NoSuchCluster => "Envoy has no such cluster",
            CallRefused::AtOnce => {
                "Envoy refused the call at once (the cluster's pool of connections and requests \
                 is full, or it has no healthy host)"
            }
        };
        PrefillFailure::new(
            FailureKind::Unreachable,
            503,
            format!("prefill request could not be sent to cluster {cluster:?}: {why}"),
        )
    }

    /// The call ended without headers once `prefill_timeout_ms` had passed: Envoy resets a
    /// timed-out call whose answer had begun (prefill's headers came, the rest was slow)
    /// where it answers 504 for one that had not.
    pub fn timed_out_mid_answer(timeout: Duration) -> PrefillFailure {
        PrefillFailure::new(
            FailureKind::Timeout,
            504,
            format!(
                "prefill began its answer but did not finish it within prefill_timeout_ms ({} ms)",
                timeout.as_millis()
            ),
        )
    }

    /// 2xx without usable `kv_transfer_params`, where the operator wants an error for it.
    pub fn no_kv_transfer_params(reason: &str) -> PrefillFailure {
        PrefillFailure::new(FailureKind::NoKvTransferParams, 502, reason.to_owned())
    }

    /// Whether another attempt may succeed: the request never reached a working prefill
    /// (connection refused, reset before any answer, or prefill said it is unavailable).
    /// Never a 4xx, never a timeout, and never a reset after the answer began (502): vLLM
    /// starts a non-streamed answer once the prompt is computed, so that prefill holds its
    /// KV, and another attempt would compute the prompt again.
    pub fn is_retryable(&self) -> bool {
        match self.kind {
            FailureKind::Unreachable => true,
            FailureKind::Reset | FailureKind::Status => self.error.status == 503,
            FailureKind::Timeout | FailureKind::NoKvTransferParams => false,
        }
    }

    /// Whether the request itself was refused (a 4xx): decode would refuse it too.
    pub fn is_client_error(&self) -> bool {
        (400..500).contains(&self.error.status)
    }
}

/// What decode needs of a prefill answer that handed over KV, as raw JSON text of the
/// answer: read in the one pass that validated it.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub struct PrefillKv<'a> {
    /// `kv_transfer_params`, an object.
    pub kv: &'a [u8],
    /// `usage`, when the answer has one.
    pub usage: Option<&'a [u8]>,
}

/// What the prefill answer means for the request.
#[derive(Debug, PartialEq, Eq)]
pub enum PrefillAnswer<'a> {
    /// Forward these `kv_transfer_params` (raw JSON object text) to decode.
    KvTransferParams(PrefillKv<'a>),
    /// A 2xx answer without usable `kv_transfer_params`; the reason is logged.
    NoKvTransferParams(String),
    Failed(PrefillFailure),
}

impl PrefillAnswer<'_> {
    /// The answer with prefill's `retry-after` (whole seconds; a rate limiter in front of
    /// prefill, say) kept on its failure, so that the client waits as advised.
    pub fn with_retry_after(mut self, retry_after: Option<&str>) -> Self {
        if let PrefillAnswer::Failed(failure) = &mut self {
            let seconds = retry_after.and_then(|value| value.trim().parse::<u32>().ok());
            if seconds.is_some() {
                failure.error.retry_after_seconds = seconds;
            }
        }
        self
    }
}

/// Reads the prefill answer. `status` is `None` when the callout ended without response
/// headers: the connection was reset after the answer had started, or Envoy reset the call
/// itself because the prefill cluster was updated or removed (a CDS change resets Envoy's
/// calls in flight, though not its routed requests).
pub fn read_prefill_answer(status: Option<u16>, body: &[u8]) -> PrefillAnswer<'_> {
    let fail = |kind, status, message: String| {
        PrefillAnswer::Failed(PrefillFailure::new(kind, status, message))
    };
    let Some(status) = status else {
        return fail(
            FailureKind::Reset,
            502,
            "the prefill call was reset before its answer was complete: prefill closed its \
             connection, Envoy updated or removed the prefill cluster, or the answer was \
             larger than Envoy takes for a call (about 32 MiB, as very many prompt logprobs \
             make)"
                .to_owned(),
        );
    };
    match status {
        200..=299 => match find_kv_transfer_params(body) {
            Ok(handed) => PrefillAnswer::KvTransferParams(handed),
            Err(reason) => PrefillAnswer::NoKvTransferParams(reason),
        },
        400..=499 => {
            let (error_type, message) = upstream_error(body);
            PrefillAnswer::Failed(PrefillFailure {
                kind: FailureKind::Status,
                error: ClientError {
                    status,
                    error_type: error_type.unwrap_or_else(|| default_error_type(status).to_owned()),
                    // The log names the leg; the client gets vLLM's own error, as a single
                    // vLLM would have answered it.
                    message: format!("prefill rejected the request ({status}): {message}"),
                    param: None,
                    verbatim: vllm_error_body(body),
                    retry_after_seconds: None,
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
        _ => {
            let message = upstream_error(body).1;
            // Envoy's own answer when prefill's was not HTTP (a protocol error): no answer
            // began, as when the connection is reset before one.
            if status == 502 && message.starts_with(ENVOY_RESET_BEFORE_HEADERS) {
                return fail(
                    FailureKind::Reset,
                    503,
                    format!("prefill is unavailable ({status}): {message}"),
                );
            }
            fail(
                FailureKind::Status,
                502,
                format!("prefill failed ({status}): {message}"),
            )
        }
    }
}

/// How Envoy's own answer to a call begins when the connection failed or broke before any
/// answer from the upstream.
const ENVOY_RESET_BEFORE_HEADERS: &str =
    "upstream connect error or disconnect/reset before headers";

/// Envoy answers a callout it could not complete with its own 503 and a text body; a 503
/// from prefill itself is an error status.
fn envoy_503_kind(message: &str) -> FailureKind {
    if message.contains("no healthy upstream") || message.contains("connection failure") {
        FailureKind::Unreachable
    } else if message.starts_with(ENVOY_RESET_BEFORE_HEADERS) {
        FailureKind::Reset
    } else {
        FailureKind::Status
    }
}

fn find_kv_transfer_params(body: &[u8]) -> Result<PrefillKv<'_>, String> {
    let object = JsonObject::parse(body).map_err(|e| {
        // A compressed answer (a proxy before prefill that ignores `accept-encoding:
        // identity`) reads as bytes that are not JSON: say so, since its KV is then stranded
        // on prefill until vLLM's own timeout (no release can name it).
        if body.starts_with(&[0x1f, 0x8b]) {
            format!("prefill answer is not a JSON object: it is gzip-compressed, though the call asked for accept-encoding: identity ({e})")
        } else {
            format!("prefill answer is not a JSON object: {e}")
        }
    })?;
    let kv = match object.last_value(KV_TRANSFER_PARAMS) {
        None => return Err("prefill answer has no kv_transfer_params".to_owned()),
        Some(b"null") => return Err("prefill answer has kv_transfer_params null".to_owned()),
        // `{}` names no KV for decode to pull: decode would compute the prompt itself.
        Some(value) if is_empty_object(value) => {
            return Err("prefill answer has kv_transfer_params {}".to_owned())
        }
        Some(value) if value.starts_with(b"{") => value,
        Some(_) => {
            return Err("kv_transfer_params in the prefill answer is not an object".to_owned())
        }
    };
    Ok(PrefillKv {
        kv,
        usage: object.last_value("usage"),
    })
}

/// Whether a JSON value (valid, as the scan found it) is an object without members.
fn is_empty_object(value: &[u8]) -> bool {
    value.starts_with(b"{")
        && value
            .iter()
            .filter(|byte| !byte.is_ascii_whitespace())
            .nth(2)
            .is_none()
}

const MAX_QUOTED_UPSTREAM_TEXT: usize = 512;
const MAX_VERBATIM_ERROR: usize = 64 * 1024;

/// A vLLM error answer (`{"error":{…}}`, the older `{"object":"error",…}`, the
/// Cohere-style API's `{"message":"…"}`, or `{"error":"Unauthorized"}` from a server started
/// with `--api-key`), to pass on as it is; anything else is answered in the filter's own
/// words.
fn vllm_error_body(body: &[u8]) -> Option<Vec<u8>> {
    if body.len() > MAX_VERBATIM_ERROR {
        return None;
    }
    let object = JsonObject::parse(body).ok()?;
    let is_error = object
        .last_value("error")
        .is_some_and(|v| v.starts_with(b"{") || v.starts_with(b"\""))
        || object.last_value("object") == Some(b"\"error\"")
        || object
            .last_value("message")
            .is_some_and(|v| v.starts_with(b"\""));
    is_error.then(|| body.to_vec())
}

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
    /// vLLM's older `{"object":"error","message",…}` and its Cohere API's `{"message"}`.
    #[derive(serde::Deserialize)]
    struct Flat {
        message: String,
        #[serde(rename = "type")]
        error_type: Option<String>,
    }
    if let Ok(Envelope { error }) = serde_json::from_slice::<Envelope>(body) {
        if let Some(message) = error.message {
            return (error.error_type, truncated(&message).to_owned());
        }
    }
    if let Ok(flat) = serde_json::from_slice::<Flat>(body) {
        return (flat.error_type, truncated(&flat.message).to_owned());
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        return (None, "no details in the answer".to_owned());
    }
    (None, truncated(text).to_owned())
}

fn truncated(text: &str) -> &str {
    let mut end = text.len().min(MAX_QUOTED_UPSTREAM_TEXT);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(status: Option<u16>, body: &[u8]) -> PrefillFailure {
        match read_prefill_answer(status, body) {
            PrefillAnswer::Failed(failure) => failure,
            other => panic!("not a failure: {other:?}"),
        }
    }

    #[test]
    fn prefill_kv_transfer_params_are_taken_verbatim() {
        let body = br#"{"id":"x","kv_transfer_params":{"remote_block_ids":[1, 2],"remote_port":5600, "x":1e400},"usage":{"prompt_tokens":3}}"#;
        assert_eq!(
            read_prefill_answer(Some(200), body),
            PrefillAnswer::KvTransferParams(PrefillKv {
                kv: br#"{"remote_block_ids":[1, 2],"remote_port":5600, "x":1e400}"#,
                usage: Some(br#"{"prompt_tokens":3}"#),
            })
        );
    }

    #[test]
    fn a_gzip_compressed_prefill_answer_says_so() {
        let body = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03";
        match read_prefill_answer(Some(200), body) {
            PrefillAnswer::NoKvTransferParams(message) => {
                assert!(message.contains("not a JSON object"), "{message}");
                assert!(message.contains("gzip-compressed"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn prefill_without_usable_kv_is_told_apart() {
        for body in [
            &br#"{"id":"x"}"#[..],
            br#"{"kv_transfer_params":null}"#,
            br#"{"kv_transfer_params":"s"}"#,
            br#"{"kv_transfer_params":{}}"#,
            b"{\"kv_transfer_params\":{ \n\t}}",
            b"not json",
            b"",
        ] {
            assert!(matches!(
                read_prefill_answer(Some(200), body),
                PrefillAnswer::NoKvTransferParams(_)
            ));
        }
        let failure = PrefillFailure::no_kv_transfer_params("none");
        assert_eq!(failure.kind, FailureKind::NoKvTransferParams);
        assert_eq!(failure.error.status, 502);
        assert!(!failure.is_retryable());
    }

    #[test]
    fn prefill_client_errors_pass_on_as_vllm_wrote_them() {
        let body = br#"{"error":{"message":"min_tokens must be less than or equal to max_tokens=1, got 200.","type":"BadRequestError","param":null,"code":400}}"#;
        let rejected = failure(Some(400), body);
        assert_eq!(rejected.kind, FailureKind::Status);
        assert_eq!(rejected.error.to_json(), body);
        let old_shape = br#"{"object":"error","message":"m","type":"BadRequestError","code":400}"#;
        assert_eq!(failure(Some(422), old_shape).error.to_json(), old_shape);
        let cohere = br#"{"message":"max_tokens must be non-negative","id":"r1"}"#;
        assert_eq!(failure(Some(400), cohere).error.to_json(), cohere);
        let api_key = br#"{"error":"Unauthorized"}"#;
        let unauthorized = failure(Some(401), api_key);
        assert_eq!(unauthorized.error.status, 401);
        assert_eq!(unauthorized.error.to_json(), api_key);
        // Quoted by its message where the filter names prefill's failure.
        let unavailable = failure(Some(503), br#"{"message":"overloaded","id":"r2"}"#);
        assert_eq!(
            unavailable.error.message,
            "prefill is unavailable (503): overloaded"
        );
        let text = failure(Some(404), b"Not Found").error.to_json();
        assert!(text.starts_with(br#"{"error":{"message":"prefill rejected the request (404)"#));
        let err = rejected.error;
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
        let protocol_error = b"upstream connect error or disconnect/reset before headers. reset reason: protocol error";
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
            (
                Some(502),
                br#"{"error":{"message":"bad"}}"#,
                502,
                Status,
                "prefill failed (502): bad",
            ),
            (Some(502), protocol_error, 503, Reset, "protocol error"),
        ];
        for (status, body, expected, kind, text) in cases {
            let failure = failure(*status, body);
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
    fn retries_only_where_prefill_never_started_the_work() {
        assert!(failure(Some(503), b"no healthy upstream").is_retryable());
        assert!(failure(Some(503), br#"{"error":{"message":"busy"}}"#).is_retryable());
        let terminated = b"upstream connect error or disconnect/reset before headers. reset reason: connection termination";
        assert!(failure(Some(503), terminated).is_retryable());
        let protocol_error = b"upstream connect error or disconnect/reset before headers. reset reason: protocol error";
        assert!(failure(Some(502), protocol_error).is_retryable());
        // Reset after the answer began: prefill computed the prompt and holds its KV.
        assert!(!failure(None, b"").is_retryable());
        assert!(!failure(Some(504), b"upstream request timeout").is_retryable());
        assert!(!failure(Some(500), b"").is_retryable());
        assert!(!failure(Some(429), b"").is_retryable());
        assert!(failure(Some(429), b"").is_client_error());
    }

    #[test]
    fn prefills_retry_after_stays_on_its_failure() {
        let seconds = |status, retry_after| match read_prefill_answer(status, b"")
            .with_retry_after(retry_after)
        {
            PrefillAnswer::Failed(failure) => failure.error.retry_after_seconds,
            _ => None,
        };
        assert_eq!(seconds(Some(429), Some("3")), Some(3));
        assert_eq!(seconds(Some(503), Some(" 20 ")), Some(20));
        // An HTTP date, or nonsense, is not passed on.
        assert_eq!(
            seconds(Some(503), Some("Wed, 21 Oct 2026 07:28:00 GMT")),
            None
        );
        assert_eq!(seconds(Some(503), Some("-1")), None);
        assert_eq!(seconds(Some(503), None), None);
    }

    #[test]
    fn long_upstream_text_is_truncated_on_a_char_boundary() {
        let body = "é".repeat(1000);
        assert!(failure(Some(500), body.as_bytes()).error.message.len() < 600);
        let json = format!(r#"{{"error":{{"message":"{}"}}}}"#, "é".repeat(1000));
        assert!(failure(Some(400), json.as_bytes()).error.message.len() < 600);
    }
}
