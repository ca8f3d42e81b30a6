//! Errors the client is answered with, in the OpenAI shape.

/// An error answered to the client: `{"error":{"message","type","param","code"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientError {
    pub status: u16,
    pub error_type: String,
    pub message: String,
    /// An upstream's own error body, answered as it was written instead of ours.
    pub verbatim: Option<Vec<u8>>,
}

impl ClientError {
    pub fn new(status: u16, message: impl Into<String>) -> ClientError {
        ClientError {
            status,
            error_type: default_error_type(status).to_owned(),
            message: message.into(),
            verbatim: None,
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

    pub fn unsupported_media_type(content_type: &str) -> ClientError {
        let shown: String = content_type.chars().take(64).collect();
        ClientError::new(
            415,
            format!("content-type must be application/json, got {shown:?}"),
        )
    }

    pub fn internal(message: impl Into<String>) -> ClientError {
        ClientError::new(500, message)
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
