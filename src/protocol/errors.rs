//! Errors the client is answered with, in the shape of the API it called.

use crate::api::Api;

/// An error answered to the client: `{"error":{"message","type","param","code"}}`, or
/// Anthropic's `{"type":"error","error":{"type","message"}}` on the Messages API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientError {
    pub status: u16,
    pub error_type: String,
    pub message: String,
    /// The request field the error is about, as vLLM names it in `error.param`.
    pub param: Option<&'static str>,
    /// An upstream's own error body, answered as it was written instead of ours.
    pub verbatim: Option<Vec<u8>>,
    /// Sent as `retry-after`: how long a client waits before it tries again.
    pub retry_after_seconds: Option<u32>,
}

impl ClientError {
    pub fn new(status: u16, message: impl Into<String>) -> ClientError {
        ClientError {
            status,
            error_type: default_error_type(status).to_owned(),
            message: message.into(),
            param: None,
            verbatim: None,
            retry_after_seconds: None,
        }
    }

    /// The client has `limit` requests whose prefill still runs after it left them
    /// (`max_abandoned_prefills_per_client`).
    pub fn too_many_abandoned_prefills(limit: u32) -> ClientError {
        ClientError {
            // Clients (the OpenAI SDK among them) wait this long before they try again.
            retry_after_seconds: Some(1),
            ..ClientError::new(
                429,
                format!(
                    "this client has {limit} or more requests whose prefill is still running \
                     after they ended (the client left, or decode could not be reached); retry \
                     once they have finished"
                ),
            )
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ClientError {
        ClientError::new(400, message)
    }

    /// A 400 about one field of the request, named as vLLM names it.
    pub fn invalid_field(param: &'static str, message: impl Into<String>) -> ClientError {
        ClientError {
            param: Some(param),
            ..ClientError::bad_request(message)
        }
    }

    pub fn payload_too_large(limit: usize) -> ClientError {
        ClientError::new(
            413,
            format!("request body is larger than the limit of {limit} bytes"),
        )
    }

    /// The decode request (the client's body with prefill's `kv_transfer_params`) would not
    /// fit in the limit: Envoy would refuse to buffer it.
    pub fn decode_body_too_large(limit: usize) -> ClientError {
        ClientError::new(
            413,
            format!(
                "request body is too large: with the prefill's kv_transfer_params added it \
                 exceeds the limit of {limit} bytes"
            ),
        )
    }

    /// The VM holds as much as `max_vm_held_bytes` lets it: a whole body or prompt logprobs
    /// more would go past it.
    pub fn vm_budget_full(limit: usize) -> ClientError {
        ClientError::new(
            503,
            format!(
                "pd-filter is holding as many large request bodies and prompt logprobs as it \
                 may ({limit} bytes per Envoy worker, max_vm_held_bytes); retry shortly"
            ),
        )
    }

    /// Envoy could not connect to decode for the model's recent requests: none goes to
    /// prefill until decode answers again. A 503's `retry-after` of a second: decode may
    /// answer a KV release or a probe any time.
    pub fn decode_unreachable() -> ClientError {
        ClientError::new(
            503,
            "the decode servers for this model cannot be reached; retry shortly",
        )
    }

    /// Prefill's prompt logprobs (`size` bytes) would make decode's answer larger than the
    /// answers the filter holds: the limit less `room` bytes kept for the rest of it.
    pub fn prompt_logprobs_too_large(size: usize, limit: usize, room: usize) -> ClientError {
        ClientError::bad_request(format!(
            "the prompt logprobs for this request are {size} bytes; with {room} bytes kept for \
             the rest of the answer, that is more than this gateway's limit of {limit} bytes \
             for an answer; ask for fewer prompt_logprobs or a shorter prompt"
        ))
    }

    /// Prefill's answer, which is the client's whole answer, is larger than the gateway
    /// sends in one piece.
    pub fn answer_too_large(size: usize, limit: usize) -> ClientError {
        ClientError::bad_request(format!(
            "the answer to this request is {size} bytes, more than this gateway's limit of \
             {limit} bytes for an answer it writes at once; ask for fewer logprobs or a \
             shorter prompt"
        ))
    }

    /// A method that is POST in another case (`post`).
    pub fn method_not_post(method: &str) -> ClientError {
        ClientError::new(
            405,
            format!(
                "method {method:?} is not allowed here: HTTP methods are case-sensitive; use POST"
            ),
        )
    }

    /// A request for a protocol upgrade (WebSocket) on a path the filter orchestrates or
    /// strips. Envoy as shipped refuses upgrades itself; Istio's gateway lets WebSocket
    /// upgrades through, and decode would get the headers of a request whose body waits for
    /// a prefill that never starts.
    pub fn upgrade_refused(protocol: &str) -> ClientError {
        let shown: String = protocol.chars().take(64).collect();
        ClientError::bad_request(format!(
            "protocol upgrade {shown:?} is not served on this path: send the request as plain HTTP"
        ))
    }

    /// A media type that is not JSON: 400 and vLLM's words, as vLLM answers it (older
    /// releases answered 415), so that SDKs raise their bad-request error.
    pub fn content_type_not_json(content_type: &str) -> ClientError {
        let shown: String = content_type.chars().take(64).collect();
        ClientError::bad_request(format!(
            "Unsupported Media Type: Only 'application/json' is allowed (content-type {shown:?})"
        ))
    }

    /// A body in a content coding (`gzip`, ...), which neither the filter nor vLLM decodes.
    pub fn body_encoded(coding: &str) -> ClientError {
        let shown: String = coding.chars().take(64).collect();
        ClientError::bad_request(format!(
            "request body has content-encoding {shown:?}, which is not supported: send the \
             JSON body uncompressed"
        ))
    }

    pub fn internal(message: impl Into<String>) -> ClientError {
        ClientError::new(500, message)
    }

    /// The body for a client of `api`. vLLM answers Anthropic's shape on the Messages API,
    /// whose SDKs read `error.type` in Anthropic's words, and Cohere's (`{"message","id"}`,
    /// the id being the request's, where it has one) on the Cohere-style API; the OpenAI
    /// shape elsewhere.
    pub fn body_for(&self, api: Option<Api>, request_id: &str) -> Vec<u8> {
        match api {
            _ if self.verbatim.is_some() => self.to_json(),
            Some(Api::Messages) => self.to_anthropic_json(),
            Some(Api::CohereChat) => self.to_cohere_json(request_id),
            _ => self.to_json(),
        }
    }

    fn to_cohere_json(&self, request_id: &str) -> Vec<u8> {
        #[derive(serde::Serialize)]
        struct CohereError<'a> {
            message: &'a str,
            #[serde(skip_serializing_if = "str::is_empty")]
            id: &'a str,
        }
        let body = CohereError {
            message: &self.message,
            id: request_id,
        };
        serde_json::to_vec(&body).unwrap_or_else(|_| br#"{"message":"pd-filter error"}"#.to_vec())
    }

    /// In vLLM's member order (`json!` would sort the keys).
    fn to_anthropic_json(&self) -> Vec<u8> {
        #[derive(serde::Serialize)]
        struct Envelope<'a> {
            #[serde(rename = "type")]
            kind: &'a str,
            error: Detail<'a>,
        }
        #[derive(serde::Serialize)]
        struct Detail<'a> {
            #[serde(rename = "type")]
            error_type: &'a str,
            message: &'a str,
        }
        let envelope = Envelope {
            kind: "error",
            error: Detail {
                error_type: anthropic_error_type(self.status),
                message: &self.message,
            },
        };
        serde_json::to_vec(&envelope).unwrap_or_else(|_| {
            br#"{"type":"error","error":{"type":"api_error","message":"pd-filter error"}}"#.to_vec()
        })
    }

    pub fn to_json(&self) -> Vec<u8> {
        if let Some(body) = &self.verbatim {
            return body.clone();
        }
        #[derive(serde::Serialize)]
        struct Envelope<'a> {
            error: Detail<'a>,
        }
        #[derive(serde::Serialize)]
        struct Detail<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            error_type: &'a str,
            param: Option<&'a str>,
            code: u16,
        }
        let envelope = Envelope {
            error: Detail {
                message: &self.message,
                error_type: &self.error_type,
                param: self.param,
                code: self.status,
            },
        };
        serde_json::to_vec(&envelope).unwrap_or_else(|_| {
            br#"{"error":{"message":"pd-filter error","type":"InternalServerError","param":null,"code":500}}"#.to_vec()
        })
    }
}

/// Anthropic's `error.type` for a status, as vLLM's Messages API words it.
fn anthropic_error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

pub fn default_error_type(status: u16) -> &'static str {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_body_has_the_openai_shape() {
        let body = ClientError::bad_request("say \"no\"").to_json();
        assert_eq!(
            String::from_utf8(body).unwrap(),
            r#"{"error":{"message":"say \"no\"","type":"BadRequestError","param":null,"code":400}}"#
        );
    }

    #[test]
    fn messages_clients_get_anthropics_shape() {
        let body = ClientError::bad_request("no").body_for(Some(Api::Messages), "");
        assert_eq!(
            String::from_utf8(body).unwrap(),
            r#"{"type":"error","error":{"type":"invalid_request_error","message":"no"}}"#
        );
        for (status, kind) in [
            (413, "request_too_large"),
            (415, "invalid_request_error"),
            (502, "api_error"),
            (503, "overloaded_error"),
            (504, "api_error"),
        ] {
            let body = ClientError::new(status, "x").body_for(Some(Api::Messages), "");
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(body["error"]["type"], kind, "{status}");
        }
        let openai = ClientError::bad_request("no");
        assert_eq!(
            openai.body_for(Some(Api::ChatCompletions), ""),
            openai.to_json()
        );
        assert_eq!(openai.body_for(None, ""), openai.to_json());
        let verbatim = ClientError {
            verbatim: Some(b"as written".to_vec()),
            ..ClientError::bad_request("no")
        };
        assert_eq!(verbatim.body_for(Some(Api::Messages), ""), b"as written");
    }

    #[test]
    fn cohere_clients_get_cohere_shape() {
        let error = ClientError::new(413, "too \"big\"");
        assert_eq!(
            String::from_utf8(error.body_for(Some(Api::CohereChat), "")).unwrap(),
            r#"{"message":"too \"big\""}"#
        );
        assert_eq!(
            String::from_utf8(error.body_for(Some(Api::CohereChat), "r-1")).unwrap(),
            r#"{"message":"too \"big\"","id":"r-1"}"#
        );
    }

    #[test]
    fn statuses_have_their_openai_type() {
        assert_eq!(
            ClientError::payload_too_large(5).error_type,
            "RequestTooLargeError"
        );
        assert_eq!(ClientError::decode_body_too_large(5).status, 413);
        assert_eq!(default_error_type(418), "InvalidRequestError");
        assert_eq!(default_error_type(599), "InternalServerError");
    }
}
