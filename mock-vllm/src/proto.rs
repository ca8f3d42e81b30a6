//! Request validation and answer building, the way vLLM's OpenAI server does it (simplified).

use serde_json::{json, Map, Value};

/// Words generated at most per choice, so a huge limit cannot exhaust memory.
const MAX_GENERATED: u64 = 8192;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Completions,
    Chat,
    Responses,
}

impl Endpoint {
    pub(crate) fn from_path(path: &str) -> Option<Endpoint> {
        match path {
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/chat/completions" => Some(Endpoint::Chat),
            "/v1/responses" => Some(Endpoint::Responses),
            _ => None,
        }
    }
}

/// A validated inference request.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub endpoint: Endpoint,
    pub stream: bool,
    pub include_usage: bool,
    pub limit: u64,
    pub n: u64,
    pub model: String,
    pub prompt: String,
    /// `kv_transfer_params` as sent: `None` when absent.
    pub kv: Option<Value>,
    /// `prompt_logprobs` asked for (completions and chat).
    pub prompt_logprobs: Option<u64>,
}

impl Parsed {
    pub(crate) fn prompt_tokens(&self) -> u64 {
        (self.prompt.split_whitespace().count() as u64).max(1)
    }

    /// vLLM's `prompt_logprobs` for the prompt: none for the first token, then each token's
    /// logprob (made up, but a function of the prompt).
    pub(crate) fn prompt_logprobs_value(&self) -> Value {
        let mut list = vec![Value::Null];
        for (i, word) in self.prompt.split_whitespace().enumerate().skip(1) {
            let logprob = -((word.len() + i) as f64) / 10.0;
            list.push(json!({ (1000 + i).to_string():
                {"logprob": logprob, "rank": 1, "decoded_token": word} }));
        }
        Value::Array(list)
    }

    pub(crate) fn fingerprint(&self) -> String {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in self.prompt.bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        format!("{hash:016x}")
    }
}

pub(crate) fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Parsed, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("request body is not valid JSON: {e}"))?;
    let obj = value
        .as_object()
        .ok_or("request body must be a JSON object")?;
    let stream = obj.get("stream") == Some(&Value::Bool(true));
    let stream_options = obj.get("stream_options").filter(|v| !v.is_null());
    if stream_options.is_some() && !stream {
        return Err("Stream options can only be defined when stream=True.".into());
    }
    let include_usage = stream_options
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);

    let int = |key: &str| -> Result<Option<i64>, String> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_i64()
                .map(Some)
                .ok_or_else(|| format!("{key} must be an integer")),
        }
    };
    let (limit_name, limit) = match endpoint {
        Endpoint::Completions => ("max_tokens", int("max_tokens")?.unwrap_or(16)),
        Endpoint::Chat => match int("max_completion_tokens")? {
            Some(v) => ("max_completion_tokens", v),
            None => ("max_tokens", int("max_tokens")?.unwrap_or(16)),
        },
        // max_tokens is not in the Responses schema: only max_output_tokens counts, and
        // without it the limit is "the rest of the context", simulated as 40.
        Endpoint::Responses => ("max_output_tokens", int("max_output_tokens")?.unwrap_or(40)),
    };
    if limit < 1 {
        return Err(format!("{limit_name} must be at least 1, got {limit}."));
    }
    let min = match (int("min_tokens")?, int("min_completion_tokens")?) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    if let Some(min) = min.filter(|&m| m > limit) {
        return Err(format!(
            "min_tokens must be less than or equal to max_tokens={limit}, got {min}."
        ));
    }
    let n = match endpoint {
        Endpoint::Responses => 1,
        _ => int("n")?.unwrap_or(1),
    };
    if n < 1 {
        return Err(format!("n must be at least 1, got {n}."));
    }
    let prompt = match endpoint {
        Endpoint::Completions => completion_prompt(obj)?,
        Endpoint::Chat => chat_prompt(obj)?,
        Endpoint::Responses => responses_prompt(obj)?,
    };
    Ok(Parsed {
        endpoint,
        stream,
        include_usage,
        limit: limit as u64,
        n: n as u64,
        model: obj
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("mock-model")
            .to_string(),
        prompt,
        kv: obj.get("kv_transfer_params").cloned(),
        prompt_logprobs: obj.get("prompt_logprobs").and_then(Value::as_u64),
    })
}

fn completion_prompt(obj: &Map<String, Value>) -> Result<String, String> {
    const BAD: &str = "prompt must be a string, an array of strings or an array of token ids";
    let ids = |items: &[Value]| -> Option<String> {
        let ids: Option<Vec<String>> = items
            .iter()
            .map(|v| v.as_u64().map(|i| i.to_string()))
            .collect();
        ids.map(|ids| ids.join(" "))
    };
    match obj.get("prompt") {
        None | Some(Value::Null) => Err("prompt is required".into()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(items)) if !items.is_empty() => {
            if let Some(text) = ids(items) {
                return Ok(text);
            }
            let parts: Option<Vec<String>> = items
                .iter()
                .map(|item| match item {
                    Value::String(s) => Some(s.clone()),
                    Value::Array(inner) => ids(inner),
                    _ => None,
                })
                .collect();
            parts.map(|p| p.join("\n")).ok_or_else(|| BAD.into())
        }
        Some(_) => Err(BAD.into()),
    }
}

/// Text of a `content` field: a string, or an array of parts whose `text` is kept.
fn content_text(content: Option<&Value>, what: &str) -> Result<Option<String>, String> {
    match content {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::new();
            for part in parts {
                match part {
                    Value::String(s) => texts.push(s.as_str()),
                    Value::Object(o) => texts.extend(o.get("text").and_then(Value::as_str)),
                    _ => return Err(format!("{what} parts must be objects")),
                }
            }
            Ok(Some(texts.join("\n")))
        }
        Some(_) => Err(format!("{what} must be a string or an array of parts")),
    }
}

fn chat_prompt(obj: &Map<String, Value>) -> Result<String, String> {
    let messages = obj
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("messages must be an array of messages")?;
    let mut texts = Vec::new();
    for message in messages {
        let message = message
            .as_object()
            .ok_or("each message must be an object")?;
        texts.extend(content_text(message.get("content"), "message content")?);
    }
    Ok(texts.join("\n"))
}

fn responses_prompt(obj: &Map<String, Value>) -> Result<String, String> {
    let mut texts = Vec::new();
    match obj.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => texts.push(s.clone()),
        Some(_) => return Err("instructions must be a string".into()),
    }
    match obj.get("input") {
        Some(Value::String(s)) => texts.push(s.clone()),
        Some(Value::Array(items)) => {
            for item in items {
                match item {
                    Value::String(s) => texts.push(s.clone()),
                    Value::Object(o) => {
                        texts.extend(content_text(o.get("content"), "input content")?)
                    }
                    _ => return Err("input items must be objects".into()),
                }
            }
        }
        None | Some(Value::Null) => return Err("input is required".into()),
        Some(_) => return Err("input must be a string or an array of input items".into()),
    }
    Ok(texts.join("\n"))
}

/// The generated tokens of one choice: each one a word followed by a space.
pub(crate) fn generate(role_word: &str, prompt: &str, count: u64, garbage: bool) -> Vec<String> {
    let first = prompt.split_whitespace().next().unwrap_or("nothing");
    let cycle = ["mock", role_word, "answer", "for", first];
    (0..count.min(MAX_GENERATED) as usize)
        .map(|i| match garbage {
            true => "GARBAGE ".to_string(),
            false => format!("{} ", cycle[i % cycle.len()]),
        })
        .collect()
}

/// Everything needed to render one answer, streamed or not.
pub(crate) struct Answer {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub n: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens found in the prefix cache: under P/D, all of decode's (it counts the
    /// KV pulled from prefill as a hit), and prefill's own hits on prefill.
    pub cached_tokens: u64,
    pub tokens: Vec<String>,
}

impl Answer {
    fn usage(&self) -> Value {
        let out = self.tokens.len() as u64 * self.n;
        let total = self.prompt_tokens + out;
        match self.endpoint {
            Endpoint::Responses => json!({"input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": total}),
            _ => json!({"prompt_tokens": self.prompt_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "completion_tokens": out, "total_tokens": total}),
        }
    }

    /// The non-streamed response object.
    pub(crate) fn object(&self) -> Value {
        let text = self.tokens.concat();
        let choices = |f: &dyn Fn(u64) -> Value| (0..self.n).map(f).collect::<Vec<_>>();
        match self.endpoint {
            Endpoint::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": choices(&|i| json!({"index": i, "text": text,
                    "finish_reason": "length", "logprobs": null})),
                "usage": self.usage(),
            }),
            Endpoint::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": choices(&|i| json!({"index": i,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length", "logprobs": null})),
                "usage": self.usage(),
            }),
            Endpoint::Responses => json!({
                "id": self.id, "object": "response", "created_at": self.created,
                "status": "completed", "model": self.model,
                "output": [{"type": "message", "id": format!("msg-{}", self.id),
                    "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
                "usage": self.usage(),
            }),
        }
    }

    /// The server-sent events of the streamed answer, each a complete `...\n\n` event.
    pub(crate) fn events(&self, include_usage: bool) -> Vec<String> {
        let data = |v: Value| format!("data: {v}\n\n");
        let last = self.tokens.len().saturating_sub(1);
        let mut events = Vec::new();
        for (i, token) in self.tokens.iter().enumerate() {
            let finish = if i == last {
                json!("length")
            } else {
                Value::Null
            };
            for c in 0..self.n {
                events.push(match self.endpoint {
                    Endpoint::Completions => data(json!({
                        "id": self.id, "object": "text_completion", "created": self.created,
                        "model": self.model, "choices": [{"index": c, "text": token,
                            "logprobs": null, "finish_reason": finish}]})),
                    Endpoint::Chat => {
                        let delta = match i {
                            0 => json!({"role": "assistant", "content": token}),
                            _ => json!({"content": token}),
                        };
                        data(json!({
                            "id": self.id, "object": "chat.completion.chunk",
                            "created": self.created, "model": self.model,
                            "choices": [{"index": c, "delta": delta, "logprobs": null,
                                "finish_reason": finish}]}))
                    }
                    Endpoint::Responses => format!(
                        "event: response.output_text.delta\ndata: {}\n\n",
                        json!({"type": "response.output_text.delta", "delta": token})
                    ),
                });
            }
        }
        match self.endpoint {
            Endpoint::Responses => events.push(format!(
                "event: response.completed\ndata: {}\n\n",
                json!({"type": "response.completed", "response": self.object()})
            )),
            _ => {
                if include_usage {
                    let object = match self.endpoint {
                        Endpoint::Chat => "chat.completion.chunk",
                        _ => "text_completion",
                    };
                    events.push(data(json!({"id": self.id, "object": object,
                        "created": self.created, "model": self.model,
                        "choices": [], "usage": self.usage()})));
                }
                events.push("data: [DONE]\n\n".to_string());
            }
        }
        events
    }
}

/// Decode side: how the KV cache of a request would be obtained.
pub(crate) fn kv_outcome(
    kv: Option<&Value>,
    fingerprint: &str,
    prompt_tokens: u64,
) -> &'static str {
    let Some(kv) = kv.filter(|v| !v.is_null()) else {
        return "recomputed";
    };
    let Some(o) = kv.as_object() else {
        return "mismatch";
    };
    let is_str = |k: &str| o.get(k).is_some_and(Value::is_string);
    let reusable = o.get("do_remote_prefill") == Some(&Value::Bool(true))
        && o.get("remote_block_ids").is_some_and(Value::is_array)
        && is_str("remote_engine_id")
        && is_str("remote_request_id")
        && is_str("remote_host")
        && o.get("remote_port").and_then(Value::as_u64).is_some()
        && o.get("mock_prompt_fingerprint").and_then(Value::as_str) == Some(fingerprint)
        && o.get("remote_num_tokens").and_then(Value::as_u64) == Some(prompt_tokens + 1);
    if reusable {
        "reused"
    } else {
        "mismatch"
    }
}

/// vLLM's error body.
pub(crate) fn error_body(status: u16, message: &str) -> Value {
    let kind = match status {
        400 => "BadRequestError",
        401 => "AuthenticationError",
        403 => "PermissionDeniedError",
        404 => "NotFoundError",
        422 => "UnprocessableEntityError",
        429 => "RateLimitError",
        500..=599 => "InternalServerError",
        _ => "APIError",
    };
    json!({"error": {"message": message, "type": kind, "param": null, "code": status}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(endpoint: Endpoint, body: Value) -> Result<String, String> {
        parse(endpoint, body.to_string().as_bytes()).map(|p| p.prompt)
    }

    #[test]
    fn prompt_text_per_endpoint() {
        let c = Endpoint::Completions;
        assert_eq!(
            prompt(c, json!({"prompt": ["a b", "c"]})).unwrap(),
            "a b\nc"
        );
        assert_eq!(prompt(c, json!({"prompt": [1, 22, 3]})).unwrap(), "1 22 3");
        assert!(prompt(c, json!({"prompt": 5})).is_err());
        let chat = json!({"messages": [{"content": "x"},
            {"content": [{"type": "text", "text": "y z"}]}]});
        assert_eq!(prompt(Endpoint::Chat, chat).unwrap(), "x\ny z");
        assert!(prompt(Endpoint::Chat, json!({"messages": "x"})).is_err());
        let resp = json!({"instructions": "be brief",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]});
        assert_eq!(prompt(Endpoint::Responses, resp).unwrap(), "be brief\nhi");
        assert!(parse(c, b"[1]").is_err());
    }

    #[test]
    fn limits_tokens_and_fingerprint() {
        let p = parse(
            Endpoint::Chat,
            br#"{"messages":[],"max_tokens":3,"max_completion_tokens":7}"#,
        )
        .unwrap();
        assert_eq!((p.limit, p.prompt_tokens()), (7, 1));
        assert_eq!(p.fingerprint(), "cbf29ce484222325"); // FNV-1a of ""
        let err = parse(Endpoint::Completions, br#"{"prompt":"a","max_tokens":0}"#).unwrap_err();
        assert_eq!(err, "max_tokens must be at least 1, got 0.");
    }
}
