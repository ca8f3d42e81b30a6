//! Request validation and answer building, the way vLLM's OpenAI server does it (simplified).

use serde_json::{json, Map, Value};

/// Words generated at most per choice, so a huge limit cannot exhaust memory.
const MAX_GENERATED: u64 = 8192;
/// The context length `/v1/models` reports.
pub(crate) const MAX_MODEL_LEN: u64 = 131_072;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Completions,
    Chat,
    Responses,
    /// vLLM's Anthropic-style Messages API.
    Messages,
    /// vLLM's tokens-in/tokens-out API.
    Generate,
    /// vLLM's Cohere-style chat API (vLLM 0.33).
    Cohere,
}

impl Endpoint {
    pub(crate) fn from_path(path: &str) -> Option<Endpoint> {
        match path {
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/chat/completions" => Some(Endpoint::Chat),
            "/v1/responses" => Some(Endpoint::Responses),
            "/v1/messages" => Some(Endpoint::Messages),
            "/inference/v1/generate" => Some(Endpoint::Generate),
            "/cohere/v2/chat" => Some(Endpoint::Cohere),
            _ => None,
        }
    }
}

/// A validated inference request.
#[derive(Debug, Clone)]
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
    /// `prompt_logprobs` asked for (completions, chat and generate).
    pub prompt_logprobs: Option<u64>,
    /// Generate: the `request_id` the request named.
    pub request_id: Option<String>,
    /// `min_tokens` (completions, chat, Messages; generate's `sampling_params`): 0 when absent.
    pub min_tokens: u64,
    /// Completions: `echo`, the prompt written before the generated text.
    pub echo: bool,
    /// Completions: `logprobs` asked for, the answer's per-token logprobs.
    pub logprobs: bool,
}

/// The prompt's length in the mock's tokens: its words, at least one.
fn word_tokens(prompt: &str) -> u64 {
    (prompt.split_whitespace().count() as u64).max(1)
}

/// The prompt as the mock's tokens, written out: each word with the whitespace after it
/// (the first with any before it too), so that they make up the prompt.
pub(crate) fn prompt_pieces(prompt: &str) -> Vec<String> {
    let mut pieces: Vec<String> = Vec::new();
    let mut current = String::new();
    let mut in_word = false;
    for c in prompt.chars() {
        if !c.is_whitespace() && !in_word && current.chars().any(|c| !c.is_whitespace()) {
            pieces.push(std::mem::take(&mut current));
        }
        in_word = !c.is_whitespace();
        current.push(c);
    }
    pieces.push(current);
    pieces
}

impl Parsed {
    pub(crate) fn prompt_tokens(&self) -> u64 {
        word_tokens(&self.prompt)
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
    let value: Value = serde_json::from_slice(&without_python_numbers(body))
        .map_err(|e| format!("request body is not valid JSON: {e}"))?;
    let obj = value
        .as_object()
        .ok_or("request body must be a JSON object")?;
    match endpoint {
        Endpoint::Messages => return parse_messages(obj),
        Endpoint::Generate => return parse_generate(obj),
        Endpoint::Cohere => return parse_cohere(obj),
        _ => {}
    }
    let (stream, include_usage) = stream_flags(obj)?;
    let int = |key: &str| int_field(obj, key);
    // The limit the request sets; `None` where vLLM takes the rest of the context (chat
    // without one, or completions' `max_tokens: null`: an absent one is 16).
    let set_limit = match endpoint {
        Endpoint::Chat => match int("max_completion_tokens")? {
            None => int("max_tokens")?,
            set => set,
        },
        // max_tokens is not in the Responses schema: only max_output_tokens counts, and
        // without it the limit is "the rest of the context", simulated as 40.
        Endpoint::Responses => int("max_output_tokens")?.or(Some(40)),
        // Completions.
        _ => match obj.get("max_tokens") {
            None => Some(16),
            Some(_) => int("max_tokens")?,
        },
    };
    let echoes = endpoint == Endpoint::Completions && obj.get("echo") == Some(&Value::Bool(true));
    // vLLM takes completions' `max_tokens: 0` with `echo` as the prompt alone: it generates
    // one token (which hands the KV over) and leaves it out of the answer.
    let echo_alone = echoes && set_limit == Some(0);
    if let Some(limit) = set_limit.filter(|_| !echo_alone) {
        check_limit(limit)?;
    }
    let min = match (int("min_tokens")?, int("min_completion_tokens")?) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    let prompt = match endpoint {
        Endpoint::Chat => chat_prompt(obj)?,
        Endpoint::Responses => responses_prompt(obj)?,
        // Completions.
        _ => completion_prompt(obj)?,
    };
    // The context left after the prompt; none for a prompt longer than the context, which
    // the mock takes (tests send long ones).
    let room = MAX_MODEL_LEN
        .checked_sub(word_tokens(&prompt))
        .filter(|room| *room > 0)
        .and_then(|room| i64::try_from(room).ok());
    if let Some(limit) = set_limit.or(room) {
        check_min(min, if echo_alone { 1 } else { limit })?;
    }
    // Without a limit the mock's answer stops by itself after 16 tokens (as a model ends
    // its answer), or after min_tokens.
    let limit = set_limit.unwrap_or_else(|| min.unwrap_or(0).max(16).min(room.unwrap_or(i64::MAX)));
    let n = match endpoint {
        Endpoint::Responses => 1,
        _ => int("n")?.unwrap_or(1),
    };
    check_n(n)?;
    check_greedy(obj, n)?;
    if endpoint == Endpoint::Chat {
        check_structured_outputs(obj)?;
    }
    if endpoint == Endpoint::Chat
        && limit == 1
        && obj.get("tool_choice") == Some(&json!("required"))
    {
        // vLLM 0.11 reads the answer under "required" as a whole list of tool calls.
        return Err(
            "1 validation error for list[function-wrap[__log_extra_fields__()]]: \
                    Invalid JSON: EOF while parsing a list"
                .into(),
        );
    }
    if set_limit.is_some() {
        check_context(limit, word_tokens(&prompt))?;
    }
    Ok(Parsed {
        endpoint,
        stream,
        include_usage,
        limit: limit as u64,
        n: n as u64,
        model: model_or_default(obj),
        prompt,
        kv: obj.get("kv_transfer_params").cloned(),
        prompt_logprobs: prompt_logprobs(endpoint, obj),
        request_id: None,
        min_tokens: min.unwrap_or(0).max(0) as u64,
        echo: echoes,
        logprobs: endpoint == Endpoint::Completions
            && obj.get("logprobs").is_some_and(|v| !v.is_null()),
    })
}

/// The prompt logprobs a request asks for: its `prompt_logprobs`, or, on completions with
/// `echo`, its `logprobs` (vLLM's `CompletionRequest.to_sampling_params` does the same).
/// Only completions and chat have the field; the other APIs ignore it, as vLLM's models do.
fn prompt_logprobs(endpoint: Endpoint, obj: &Map<String, Value>) -> Option<u64> {
    let asked = obj.get("prompt_logprobs").and_then(Value::as_u64);
    let echo = obj.get("echo") == Some(&Value::Bool(true));
    match endpoint {
        Endpoint::Completions if asked.is_none() && echo => {
            obj.get("logprobs").and_then(Value::as_u64)
        }
        Endpoint::Completions | Endpoint::Chat => asked,
        _ => None,
    }
}

/// `stream`, and `stream_options.include_usage` (options only allowed on a stream). vLLM
/// checks the options against Python's truth of the raw values, before pydantic reads
/// `stream` as a lax boolean: `"stream": "false"` passes the check and does not stream.
fn stream_flags(obj: &Map<String, Value>) -> Result<(bool, bool), String> {
    let stream = lax_bool(obj, "stream")?;
    let stream_options = obj.get("stream_options").filter(|v| python_truthy(v));
    if stream_options.is_some() && !obj.get("stream").is_some_and(python_truthy) {
        return Err("Stream options can only be defined when stream=True.".into());
    }
    let include_usage = stream
        && stream_options
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
    Ok((stream, include_usage))
}

/// Python's truth of a value as `json.loads` gives it.
fn python_truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(items) => !items.is_empty(),
        Value::Object(members) => !members.is_empty(),
    }
}

/// A boolean field as pydantic's lax mode reads it (false when absent or null).
fn lax_bool(obj: &Map<String, Value>, key: &str) -> Result<bool, String> {
    let invalid = || format!("{key}: Input should be a valid boolean");
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(1.0) => Ok(true),
            Some(0.0) => Ok(false),
            _ => Err(invalid()),
        },
        Some(Value::String(s)) => match s.to_ascii_lowercase().as_str() {
            "1" | "on" | "t" | "true" | "y" | "yes" => Ok(true),
            "0" | "off" | "f" | "false" | "n" | "no" => Ok(false),
            _ => Err(invalid()),
        },
        Some(_) => Err(invalid()),
    }
}

/// `body` with Python's `NaN`, `Infinity` and `-Infinity` (which vLLM's `json.loads` reads)
/// outside strings written as `null`, for serde_json, which does not read them.
pub(crate) fn without_python_numbers(body: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    const WORDS: [&[u8]; 3] = [b"-Infinity", b"Infinity", b"NaN"];
    if !WORDS
        .iter()
        .any(|word| body.windows(word.len()).any(|w| w == *word))
    {
        return std::borrow::Cow::Borrowed(body);
    }
    let mut out = Vec::with_capacity(body.len());
    let (mut in_string, mut escaped, mut at) = (false, false, 0);
    while at < body.len() {
        let byte = body[at];
        if in_string {
            in_string = escaped || byte != b'"';
            escaped = !escaped && byte == b'\\';
        } else if byte == b'"' {
            in_string = true;
        } else if let Some(word) = WORDS.iter().find(|word| body[at..].starts_with(word)) {
            out.extend_from_slice(b"null");
            at += word.len();
            continue;
        }
        out.push(byte);
        at += 1;
    }
    std::borrow::Cow::Owned(out)
}

/// An optional integer member of `obj`, read as pydantic reads an int in its lax mode: a
/// whole number (`3`, `3.0`), a bool, or a string holding one (`" +03 "`, `"1_6"`, `"3.0"`).
fn int_field(obj: &Map<String, Value>, key: &str) -> Result<Option<i64>, String> {
    let whole = |f: f64| (f.is_finite() && f.fract() == 0.0).then_some(f as i64);
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v {
            Value::Bool(b) => Some(i64::from(*b)),
            Value::Number(n) => n.as_i64().or_else(|| n.as_f64().and_then(whole)),
            Value::String(s) => {
                let digits = s.trim().replace('_', "");
                digits
                    .parse::<i64>()
                    .ok()
                    .or_else(|| digits.parse::<f64>().ok().and_then(whole))
            }
            _ => None,
        }
        .map(Some)
        .ok_or_else(|| format!("{key} must be an integer")),
    }
}

/// vLLM 0.34's `SamplingParams` check, whichever field of the request set the limit.
fn check_limit(limit: i64) -> Result<(), String> {
    if limit < 1 {
        return Err(format!(
            "max_tokens must be at least 1, got {limit}. (parameter=max_tokens, value={limit})"
        ));
    }
    Ok(())
}

/// vLLM refuses a limit that does not fit in the context beside the prompt, naming both chat
/// limits whichever was sent. (The mock takes prompts of any length: tests send long ones.)
fn check_context(limit: i64, prompt_tokens: u64) -> Result<(), String> {
    let Some(room) = MAX_MODEL_LEN.checked_sub(prompt_tokens) else {
        return Ok(());
    };
    if u64::try_from(limit).is_ok_and(|limit| limit > room) {
        return Err(format!(
            "'max_tokens' or 'max_completion_tokens' is too large: {limit}. This model's maximum \
             context length is {MAX_MODEL_LEN} tokens and your request has {prompt_tokens} \
             input tokens ({limit} > {MAX_MODEL_LEN} - {prompt_tokens})."
        ));
    }
    Ok(())
}

fn check_min(min: Option<i64>, limit: i64) -> Result<(), String> {
    if let Some(min) = min.filter(|&m| m > limit) {
        return Err(format!(
            "min_tokens must be less than or equal to max_tokens={limit}, got {min}."
        ));
    }
    Ok(())
}

/// vLLM's `check_structured_outputs_count` on chat: one kind of constraint at most, and
/// none beside a tool named in `tool_choice`.
fn check_structured_outputs(obj: &Map<String, Value>) -> Result<(), String> {
    let Some(outputs) = obj.get("structured_outputs").and_then(Value::as_object) else {
        return Ok(());
    };
    let kinds = ["json", "regex", "choice"]
        .iter()
        .filter(|kind| outputs.get(**kind).is_some_and(|value| !value.is_null()))
        .count();
    if kinds > 1 {
        return Err(
            "You can only use one kind of constraints for structured outputs \
                    ('json', 'regex' or 'choice')."
                .into(),
        );
    }
    // Absent reads as "none"; an explicit null is no open choice to vLLM.
    let open_choice = [json!("none"), json!("auto"), json!("required")];
    let open = obj
        .get("tool_choice")
        .is_none_or(|choice| open_choice.contains(choice));
    if kinds > 0 && !open {
        return Err(
            "You can only either use constraints for structured outputs or tools, not both.".into(),
        );
    }
    Ok(())
}

/// vLLM's bound on `n` (`VLLM_MAX_N_SEQUENCES`, 16384 by default).
const MAX_N: i64 = 16384;

fn check_n(n: i64) -> Result<(), String> {
    if n < 1 {
        return Err(format!("n must be at least 1, got {n}."));
    }
    if n > MAX_N {
        return Err(format!("n must be at most {MAX_N}, got {n}."));
    }
    Ok(())
}

/// More than one choice needs sampling: vLLM refuses `n` above 1 at a temperature of 0.
fn check_greedy(params: &Map<String, Value>, n: i64) -> Result<(), String> {
    let greedy = params.get("temperature").and_then(Value::as_f64) == Some(0.0);
    if greedy && n > 1 {
        return Err(format!("n must be 1 when using greedy sampling, got {n}."));
    }
    Ok(())
}

/// `POST /v1/messages`: `max_tokens` is required; `min_tokens` as in vLLM 0.34; there is no
/// `n` or `stream_options` (ignored if sent).
fn parse_messages(obj: &Map<String, Value>) -> Result<Parsed, String> {
    let model = match obj.get("model") {
        None | Some(Value::Null) => return Err("model is required".into()),
        Some(Value::String(s)) if s.is_empty() => return Err("Model is required".into()),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err("model must be a string".into()),
    };
    let limit = int_field(obj, "max_tokens")?.ok_or("max_tokens is required")?;
    if limit < 1 {
        return Err("max_tokens must be positive".into());
    }
    let messages = match obj.get("messages") {
        None | Some(Value::Null) => return Err("messages is required".into()),
        Some(Value::Array(messages)) => messages,
        Some(_) => return Err("messages must be an array of messages".into()),
    };
    let mut texts = Vec::new();
    texts.extend(blocks_text(obj.get("system"), "system")?);
    for message in messages {
        let message = message
            .as_object()
            .ok_or("each message must be an object")?;
        match message.get("role").and_then(Value::as_str) {
            Some("user" | "assistant" | "system") => {}
            _ => return Err("message role must be 'user', 'assistant' or 'system'".into()),
        }
        match blocks_text(message.get("content"), "message content")? {
            Some(text) => texts.push(text),
            None => return Err("message content is required".into()),
        }
    }
    let named_tool =
        obj.get("tool_choice").and_then(|choice| choice.get("type")) == Some(&json!("tool"));
    if named_tool {
        let name = obj
            .get("tool_choice")
            .and_then(|choice| choice.get("name"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        if name.is_empty() {
            return Err("tool_choice.name is required when type is 'tool'".into());
        }
        if !tools_in_effect(obj)?.iter().any(|tool| tool == name) {
            return Err(format!(
                "The tool `{name}` specified in `tool_choice` does not match any of the \
                 specified `tools`"
            ));
        }
    }
    if named_tool && limit == 1 {
        // vLLM reads a named tool's generated arguments as JSON for the answer.
        return Err(
            "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)".into(),
        );
    }
    let stream = lax_bool(obj, "stream")?;
    // vLLM 0.34's Messages model has `min_tokens`, checked as chat checks it.
    let min_tokens = int_field(obj, "min_tokens")?;
    check_min(min_tokens, limit)?;
    Ok(Parsed {
        min_tokens: min_tokens.unwrap_or(0).max(0) as u64,
        ..one_sequence(Endpoint::Messages, obj, stream, limit, model, &texts)
    })
}

/// A request of an API that generates one sequence and has no prompt logprobs: Messages and
/// Cohere's chat, whose streams report usage in events of their own.
fn one_sequence(
    endpoint: Endpoint,
    obj: &Map<String, Value>,
    stream: bool,
    limit: i64,
    model: String,
    texts: &[String],
) -> Parsed {
    Parsed {
        endpoint,
        stream,
        include_usage: false,
        limit: limit as u64,
        n: 1,
        model,
        prompt: texts.join("\n"),
        kv: obj.get("kv_transfer_params").cloned(),
        prompt_logprobs: None,
        request_id: None,
        min_tokens: 0,
        echo: false,
        logprobs: false,
    }
}

/// `POST /cohere/v2/chat`: one limit, `max_tokens` (non-negative to its own model, and at
/// least 1 to the chat request it becomes; without it, the rest of the context, simulated as
/// 40); no `n`, `min_tokens` or `stream_options`.
fn parse_cohere(obj: &Map<String, Value>) -> Result<Parsed, String> {
    let model = match obj.get("model") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        _ => return Err("model is required".into()),
    };
    let limit = int_field(obj, "max_tokens")?.unwrap_or(40);
    if limit < 0 {
        return Err("max_tokens must be non-negative".into());
    }
    check_limit(limit)?;
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(stream)) => *stream,
        Some(_) => return Err("stream must be a boolean".into()),
    };
    if obj.get("tool_choice") == Some(&json!("REQUIRED")) && obj.get("tools").is_none() {
        return Err(r#"tool_choice="REQUIRED" requires at least one tool in tools."#.into());
    }
    let messages = match obj.get("messages") {
        Some(Value::Array(messages)) if !messages.is_empty() => messages,
        _ => return Err("messages must contain at least one message".into()),
    };
    let mut texts = Vec::new();
    for message in messages {
        let message = message
            .as_object()
            .ok_or("each message must be an object")?;
        match message.get("role").and_then(Value::as_str) {
            Some("user" | "assistant" | "system" | "tool" | "developer") => {}
            _ => return Err("message role must be user, assistant, system or tool".into()),
        }
        if let Some(text) = content_text(message.get("content"), "message content")? {
            texts.push(text);
        }
    }
    Ok(one_sequence(
        Endpoint::Cohere,
        obj,
        stream,
        limit,
        model,
        &texts,
    ))
}

/// Text of an Anthropic `content` or `system`: a string, or content blocks (objects with a
/// `type`) whose `text` is kept.
/// The names of a Messages request's tools at the end of its conversation, as vLLM 0.34
/// resolves them: `tools`, then each `tool_addition` block (a `tool_definition` declares a
/// tool, a `tool_reference` brings back a declared one) and `tool_removal` block (a
/// `tool_reference`) of the messages, in order.
fn tools_in_effect(obj: &Map<String, Value>) -> Result<Vec<String>, String> {
    let name_of = |value: Option<&Value>| value.and_then(Value::as_str).map(str::to_owned);
    let mut declared: Vec<String> = obj
        .get("tools")
        .and_then(Value::as_array)
        .map(|tools| {
            tools
                .iter()
                .filter_map(|t| name_of(t.get("name")))
                .collect()
        })
        .unwrap_or_default();
    let mut removed: Vec<String> = Vec::new();
    let messages = obj.get("messages").and_then(Value::as_array);
    let blocks = messages
        .into_iter()
        .flatten()
        .filter_map(|message| message.get("content").and_then(Value::as_array))
        .flatten();
    for block in blocks {
        let kind = block.get("type").and_then(Value::as_str);
        if !matches!(kind, Some("tool_addition" | "tool_removal")) {
            continue;
        }
        let tool = block.get("tool");
        let name = match tool.and_then(|t| t.get("type")).and_then(Value::as_str) {
            Some("tool_definition") if kind == Some("tool_addition") => {
                let name = name_of(tool.and_then(|t| t.get("definition")?.get("name")))
                    .ok_or("a tool_definition needs a definition with a name")?;
                if !declared.contains(&name) {
                    declared.push(name.clone());
                }
                name
            }
            Some("tool_reference") => {
                let name = name_of(tool.and_then(|t| t.get("name")))
                    .ok_or("a tool_reference needs a name")?;
                if !declared.contains(&name) {
                    return Err(format!(
                        "{} references tool {name:?}, which is not declared in tools",
                        kind.unwrap_or_default()
                    ));
                }
                name
            }
            _ => return Err("tool_removal only accepts a tool_reference".into()),
        };
        removed.retain(|other| *other != name);
        if kind == Some("tool_removal") {
            removed.push(name);
        }
    }
    declared.retain(|name| !removed.contains(name));
    Ok(declared)
}

fn blocks_text(content: Option<&Value>, what: &str) -> Result<Option<String>, String> {
    match content {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(blocks)) => {
            let mut texts = Vec::new();
            for block in blocks {
                let block = block
                    .as_object()
                    .filter(|b| b.get("type").is_some_and(Value::is_string))
                    .ok_or_else(|| format!("{what} blocks must be objects with a type"))?;
                texts.extend(block.get("text").and_then(Value::as_str));
            }
            Ok(Some(texts.join("\n")))
        }
        Some(_) => Err(format!(
            "{what} must be a string or an array of content blocks"
        )),
    }
}

/// `POST /inference/v1/generate`: the limits are in `sampling_params` only (a top-level
/// `max_tokens` is not in the schema, so it is ignored).
fn parse_generate(obj: &Map<String, Value>) -> Result<Parsed, String> {
    let (stream, include_usage) = stream_flags(obj)?;
    let params = match obj.get("sampling_params") {
        None | Some(Value::Null) => return Err("sampling_params is required".into()),
        Some(Value::Object(params)) => params,
        Some(_) => return Err("sampling_params must be an object".into()),
    };
    let limit = int_field(params, "max_tokens")?.unwrap_or(16);
    check_limit(limit)?;
    let min_tokens = int_field(params, "min_tokens")?;
    check_min(min_tokens, limit)?;
    let n = int_field(params, "n")?.unwrap_or(1);
    check_n(n)?;
    check_greedy(params, n)?;
    const BAD_IDS: &str = "token_ids must be a non-empty array of non-negative integers";
    let ids = match obj.get("token_ids") {
        None | Some(Value::Null) => return Err("token_ids is required".into()),
        Some(Value::Array(ids)) if !ids.is_empty() => ids,
        Some(_) => return Err(BAD_IDS.into()),
    };
    let ids: Option<Vec<String>> = ids
        .iter()
        .map(|v| v.as_u64().map(|i| i.to_string()))
        .collect();
    let prompt = ids.ok_or(BAD_IDS)?.join(" ");
    let request_id = match obj.get("request_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err("request_id must be a string".into()),
    };
    // -1 asks for all of them.
    let prompt_logprobs = int_field(params, "prompt_logprobs")?.map(|v| v.max(0) as u64);
    Ok(Parsed {
        endpoint: Endpoint::Generate,
        stream,
        include_usage,
        limit: limit as u64,
        n: n as u64,
        model: model_or_default(obj),
        prompt,
        kv: obj.get("kv_transfer_params").cloned(),
        prompt_logprobs,
        request_id,
        min_tokens: min_tokens.unwrap_or(0).max(0) as u64,
        echo: false,
        logprobs: false,
    })
}

/// The request's `model`, or the mock's own name for an API where it is optional.
fn model_or_default(obj: &Map<String, Value>) -> String {
    obj.get("model")
        .and_then(Value::as_str)
        .unwrap_or("mock-model")
        .to_string()
}

fn completion_prompt(obj: &Map<String, Value>) -> Result<String, String> {
    completion_prompts(obj).map(|prompts| prompts.join("\n"))
}

/// Completions' prompts, each as the mock's text: a string, or token ids written as words.
/// A list of strings or of token lists is one prompt per item.
fn completion_prompts(obj: &Map<String, Value>) -> Result<Vec<String>, String> {
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
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) if !items.is_empty() => {
            if let Some(text) = ids(items) {
                return Ok(vec![text]);
            }
            items
                .iter()
                .map(|item| match item {
                    Value::String(s) => Some(s.clone()),
                    Value::Array(inner) => ids(inner),
                    _ => None,
                })
                .collect::<Option<Vec<String>>>()
                .ok_or_else(|| BAD.into())
        }
        Some(_) => Err(BAD.into()),
    }
}

/// A completions request with several prompts: each prompt, which vLLM answers as a
/// request of its own, its choices one after the other in one answer. `None` for one.
pub(crate) fn batched_prompts(body: &[u8]) -> Option<Vec<String>> {
    let value: Value = serde_json::from_slice(&without_python_numbers(body)).ok()?;
    completion_prompts(value.as_object()?)
        .ok()
        .filter(|prompts| prompts.len() > 1)
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

/// Generate: the id of a generated token (the mock's words as small integers: a number is
/// itself, GARBAGE is 0, any other word the sum of its bytes).
pub(crate) fn token_id(token: &str) -> u64 {
    let word = token.trim();
    match word.parse() {
        Ok(id) => id,
        Err(_) if word == "GARBAGE" => 0,
        Err(_) => word.bytes().map(u64::from).sum(),
    }
}

/// Everything needed to render one answer, streamed or not.
pub(crate) struct Answer {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub n: u64,
    /// The request's token limit: a choice that reached it stopped for its length.
    pub limit: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens found in the prefix cache: under P/D, all of decode's (it counts the
    /// KV pulled from prefill as a hit), and prefill's own hits on prefill.
    pub cached_tokens: u64,
    /// Prompt tokens computed and written to the prefix cache, reported as vLLM 0.33 does
    /// (`mock:prefill_hands_cached_tokens`): the rest of prefill's prompt, about none of
    /// decode's. `None` as vLLM 0.11 answers, which does not report them.
    pub cache_writes: Option<u64>,
    /// Completions and chat report `prompt_tokens_details` (vLLM with
    /// `--enable-prompt-tokens-details`); without, their usage has the counts alone.
    pub prompt_details: bool,
    pub tokens: Vec<String>,
    /// Completions with `echo`: the prompt's tokens, written before the generated ones.
    pub echoed: Vec<String>,
    /// Completions with `logprobs`: each token's logprob in the answer.
    pub logprobs: bool,
}

impl Answer {
    /// Messages and generate: why generation stopped (the others always say "length").
    fn stop_reason(&self) -> &'static str {
        let by_limit = self.tokens.len() as u64 >= self.limit;
        match (self.endpoint, by_limit) {
            (Endpoint::Messages, true) => "max_tokens",
            (Endpoint::Messages, false) => "end_turn",
            (Endpoint::Cohere, true) => "MAX_TOKENS",
            (Endpoint::Cohere, false) => "COMPLETE",
            (_, true) => "length",
            (_, false) => "stop",
        }
    }

    /// vLLM 0.33 ends a response cut by `max_output_tokens` as incomplete.
    fn incomplete(&self) -> bool {
        self.cache_writes.is_some() && self.tokens.len() as u64 >= self.limit
    }

    fn usage(&self) -> Value {
        let out = self.tokens.len() as u64 * self.n;
        let total = self.prompt_tokens.saturating_add(out);
        let mut usage = match self.endpoint {
            Endpoint::Messages => return self.message_usage(out),
            Endpoint::Cohere => json!({
                "billed_units": {"input_tokens": self.prompt_tokens, "output_tokens": out},
                "tokens": {"input_tokens": self.prompt_tokens, "output_tokens": out},
                "cached_tokens": self.cached_tokens}),
            Endpoint::Responses => json!({"input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": total}),
            _ if !self.prompt_details => json!({"prompt_tokens": self.prompt_tokens,
                "completion_tokens": out, "total_tokens": total}),
            _ => json!({"prompt_tokens": self.prompt_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "completion_tokens": out, "total_tokens": total}),
        };
        if let Some(writes) = self.cache_writes.filter(|_| self.prompt_details) {
            match self.endpoint {
                Endpoint::Responses => {
                    usage["input_tokens_details"]["cache_write_tokens"] = json!(writes)
                }
                Endpoint::Cohere => {}
                _ => usage["prompt_tokens_details"]["created_cache_tokens"] = json!(writes),
            }
        }
        usage
    }

    /// Completions' and chat's usage in a non-streamed answer: vLLM 0.34 writes its unset
    /// details there as null, and leaves them out of a stream's usage chunk.
    fn answer_usage(&self) -> Value {
        let mut usage = self.usage();
        if self.cache_writes.is_some() && self.prompt_details {
            usage["prompt_tokens_details"]["multimodal_tokens"] = Value::Null;
        }
        usage
    }

    fn message_usage(&self, output_tokens: u64) -> Value {
        match self.cache_writes {
            // vLLM 0.33: input_tokens leave out cache reads and writes.
            Some(writes) => json!({
                "input_tokens": self.prompt_tokens.saturating_sub(self.cached_tokens + writes),
                "output_tokens": output_tokens,
                "cache_read_input_tokens": self.cached_tokens,
                "cache_creation_input_tokens": writes}),
            None => json!({"input_tokens": self.prompt_tokens, "output_tokens": output_tokens,
                "cache_read_input_tokens": self.cached_tokens}),
        }
    }

    /// Messages: the message object, `content` given.
    fn message(&self, content: Value, stop_reason: Value, usage: Value) -> Value {
        json!({"id": self.id, "type": "message", "role": "assistant", "content": content,
            "model": self.model, "stop_reason": stop_reason, "stop_sequence": null,
            "usage": usage})
    }

    /// Completions' `logprobs` as vLLM's `_create_completion_logprobs` writes them: the
    /// echoed prompt's tokens (the first without a logprob), then the generated ones, each
    /// offset where the one before it ended, counted in code points (Python's `len`).
    fn completion_logprobs(&self) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let mut offsets = Vec::new();
        let mut token_logprobs = Vec::new();
        let mut top_logprobs = Vec::new();
        let mut at = 0;
        let tokens: Vec<&String> = self.echoed.iter().chain(&self.tokens).collect();
        for (i, token) in tokens.iter().enumerate() {
            offsets.push(at);
            at += token.chars().count();
            if i == 0 && !self.echoed.is_empty() {
                token_logprobs.push(Value::Null);
                top_logprobs.push(Value::Null);
            } else {
                let logprob = -((token.len() + i) as f64) / 10.0;
                token_logprobs.push(json!(logprob));
                top_logprobs.push(json!({ token.as_str(): logprob }));
            }
        }
        json!({"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs})
    }

    /// The non-streamed response object.
    pub(crate) fn object(&self) -> Value {
        let text = self.tokens.concat();
        let choices = |f: &dyn Fn(u64) -> Value| (0..self.n).map(f).collect::<Vec<_>>();
        match self.endpoint {
            Endpoint::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": choices(&|i| json!({"index": i,
                    "text": self.echoed.concat() + &text,
                    "finish_reason": "length", "logprobs": self.completion_logprobs()})),
                "usage": self.answer_usage(),
            }),
            Endpoint::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": choices(&|i| json!({"index": i,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length", "logprobs": null})),
                "usage": self.answer_usage(),
            }),
            Endpoint::Responses => json!({
                "id": self.id, "object": "response", "created_at": self.created,
                "status": if self.incomplete() { "incomplete" } else { "completed" },
                "model": self.model,
                "output": [{"type": "message", "id": format!("msg-{}", self.id),
                    "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
                "usage": self.usage(),
            }),
            Endpoint::Messages => self.message(
                json!([{"type": "text", "text": text}]),
                json!(self.stop_reason()),
                self.usage(),
            ),
            Endpoint::Cohere => json!({
                "id": self.id, "finish_reason": self.stop_reason(),
                "message": {"role": "assistant",
                    "content": [{"type": "text", "text": text}]},
                "usage": self.usage(),
            }),
            Endpoint::Generate => {
                let ids: Vec<u64> = self.tokens.iter().map(|t| token_id(t)).collect();
                json!({"request_id": self.id,
                    "choices": choices(&|i| json!({"index": i, "logprobs": null,
                        "finish_reason": self.stop_reason(), "token_ids": ids})),
                    "prompt_logprobs": null})
            }
        }
    }

    /// The server-sent events of the streamed answer, each a complete `...\n\n` event.
    pub(crate) fn events(&self, include_usage: bool) -> Vec<String> {
        let data = |v: Value| format!("data: {v}\n\n");
        let event = |kind: &str, v: Value| format!("event: {kind}\ndata: {v}\n\n");
        if self.endpoint == Endpoint::Responses {
            return self.response_events();
        }
        let last = self.tokens.len().saturating_sub(1);
        let mut events = Vec::new();
        if self.endpoint == Endpoint::Cohere {
            events.push(data(json!({"type": "message-start", "id": self.id,
                "delta": {"message": {"role": "assistant"}}})));
            events.push(data(json!({"type": "content-start", "index": 0,
                "delta": {"message": {"content": {"type": "text", "text": ""}}}})));
        }
        if self.endpoint == Endpoint::Messages {
            let start = self.message(json!([]), Value::Null, self.message_usage(0));
            events.push(event(
                "message_start",
                json!({"type": "message_start", "message": start}),
            ));
            events.push(event(
                "content_block_start",
                json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}),
            ));
        }
        for (i, token) in self.tokens.iter().enumerate() {
            let finish = match (i == last, self.endpoint) {
                (false, _) => Value::Null,
                (true, Endpoint::Generate) => json!(self.stop_reason()),
                (true, _) => json!("length"),
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
                    Endpoint::Responses => unreachable!("streamed by response_events"),
                    Endpoint::Messages => event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": 0,
                            "delta": {"type": "text_delta", "text": token}}),
                    ),
                    Endpoint::Generate => data(json!({"request_id": self.id,
                        "choices": [{"index": c, "logprobs": null, "finish_reason": finish,
                            "token_ids": [token_id(token)]}]})),
                    Endpoint::Cohere => data(json!({"type": "content-delta", "index": 0,
                        "delta": {"message": {"content": {"text": token}}}})),
                });
            }
        }
        match self.endpoint {
            Endpoint::Messages => {
                events.push(event(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": 0}),
                ));
                events.push(event(
                    "message_delta",
                    json!({"type": "message_delta",
                        "delta": {"stop_reason": self.stop_reason(), "stop_sequence": null},
                        "usage": self.usage()}),
                ));
                events.push(event("message_stop", json!({"type": "message_stop"})));
            }
            // The tokens API has no usage.
            Endpoint::Generate => events.push("data: [DONE]\n\n".to_string()),
            Endpoint::Cohere => {
                events.push(data(json!({"type": "content-end", "index": 0})));
                events.push(data(json!({"type": "message-end", "id": self.id,
                    "delta": {"finish_reason": self.stop_reason(), "usage": self.usage()}})));
                events.push("data: [DONE]\n\n".to_string());
            }
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

impl Answer {
    /// A responses stream in vLLM's sequence of events, each numbered: the response
    /// created and in progress (no usage yet), its message item and text part opened, the
    /// text deltas, everything closed again, and the whole response last
    /// (`response.completed`, or `response.incomplete` where vLLM 0.33 stopped at the limit).
    fn response_events(&self) -> Vec<String> {
        let text = self.tokens.concat();
        let item_id = format!("msg-{}", self.id);
        let mut started = self.object();
        started["status"] = json!("in_progress");
        started["output"] = json!([]);
        started["usage"] = Value::Null;
        let part = |text: &str| json!({"type": "output_text", "text": text, "annotations": []});
        let item = |status: &str, content: Value| {
            json!({"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": content})
        };
        let at_text = json!({"item_id": item_id, "output_index": 0, "content_index": 0});
        let with = |base: &Value, more: Value| {
            let mut merged = base.clone();
            if let (Some(merged), Some(more)) = (merged.as_object_mut(), more.as_object()) {
                merged.extend(more.clone());
            }
            merged
        };
        let last = if self.incomplete() {
            "response.incomplete"
        } else {
            "response.completed"
        };
        let mut bodies = vec![
            ("response.created", json!({"response": started})),
            ("response.in_progress", json!({"response": started})),
            (
                "response.output_item.added",
                json!({"output_index": 0, "item": item("in_progress", json!([]))}),
            ),
            (
                "response.content_part.added",
                with(&at_text, json!({"part": part("")})),
            ),
        ];
        for token in &self.tokens {
            let delta = json!({"delta": token, "logprobs": []});
            bodies.push(("response.output_text.delta", with(&at_text, delta)));
        }
        bodies.extend([
            (
                "response.output_text.done",
                with(&at_text, json!({"text": text, "logprobs": []})),
            ),
            (
                "response.content_part.done",
                with(&at_text, json!({"part": part(&text)})),
            ),
            (
                "response.output_item.done",
                json!({"output_index": 0, "item": item("completed", json!([part(&text)]))}),
            ),
            (last, json!({"response": self.object()})),
        ]);
        bodies
            .into_iter()
            .enumerate()
            .map(|(sequence_number, (kind, body))| {
                let data = with(
                    &json!({"type": kind, "sequence_number": sequence_number}),
                    body,
                );
                format!("event: {kind}\ndata: {data}\n\n")
            })
            .collect()
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

/// vLLM's error body for a request to `endpoint`: Cohere's shape on the Cohere-style API.
pub(crate) fn endpoint_error_body(endpoint: Endpoint, status: u16, message: &str) -> Value {
    match endpoint {
        Endpoint::Cohere => json!({"message": message}),
        // vLLM's Messages API answers its handler's errors in Anthropic's shape.
        Endpoint::Messages => {
            let kind = match status {
                401 => "authentication_error",
                403 => "permission_error",
                404 => "not_found_error",
                413 => "request_too_large",
                429 => "rate_limit_error",
                503 => "overloaded_error",
                500..=599 => "api_error",
                _ => "invalid_request_error",
            };
            json!({"type": "error", "error": {"type": kind, "message": message}})
        }
        _ => error_body(status, message),
    }
}

/// vLLM's error body.
pub(crate) fn error_body(status: u16, message: &str) -> Value {
    if status == 401 {
        // vLLM's `--api-key` check answers before any endpoint, in a shape of its own.
        return json!({"error": "Unauthorized"});
    }
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
    fn chat_structured_outputs_as_vllm_checks_them() {
        let chat = |extra: Value| {
            let mut body = json!({"messages": [{"content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}]});
            for (key, value) in extra.as_object().unwrap() {
                body[key] = value.clone();
            }
            parse(Endpoint::Chat, body.to_string().as_bytes()).map(|_| ())
        };
        let named = json!({"type": "function", "function": {"name": "f"}});
        let refused = chat(json!({"tool_choice": named, "structured_outputs": {"regex": "a"}}));
        assert_eq!(
            refused.unwrap_err(),
            "You can only either use constraints for structured outputs or tools, not both."
        );
        assert!(chat(json!({"structured_outputs": {"regex": "a", "choice": ["b"]}})).is_err());
        for choice in ["none", "auto", "required"] {
            let body = json!({"tool_choice": choice, "max_tokens": 5,
                "structured_outputs": {"json": {}}});
            assert_eq!(chat(body), Ok(()), "{choice}");
        }
        let grammar = json!({"tool_choice": named, "structured_outputs": {"grammar": "g"}});
        assert_eq!(chat(grammar), Ok(()));
    }

    /// Without a limit vLLM takes the rest of the context (chat without one, completions'
    /// `max_tokens: null`; an absent one is 16): a min_tokens within it is served.
    #[test]
    fn min_tokens_without_a_limit_is_held_to_the_context() {
        let chat = |extra: Value| {
            let mut body = json!({"messages": [{"role": "user", "content": "hi there"}]});
            for (key, value) in extra.as_object().unwrap() {
                body[key] = value.clone();
            }
            parse(Endpoint::Chat, body.to_string().as_bytes()).map(|p| p.limit)
        };
        assert_eq!(chat(json!({"min_tokens": 20})), Ok(20));
        assert_eq!(chat(json!({})), Ok(16), "the answer ends by itself");
        assert_eq!(chat(json!({"max_tokens": null, "min_tokens": 3})), Ok(16));
        assert!(chat(json!({"min_tokens": 200_000}))
            .unwrap_err()
            .starts_with("min_tokens must be less than or equal to max_tokens=131070"));
        let completions = |body: Value| {
            parse(Endpoint::Completions, body.to_string().as_bytes()).map(|p| p.limit)
        };
        assert_eq!(
            completions(json!({"prompt": "a b", "max_tokens": null, "min_tokens": 500})),
            Ok(500)
        );
        assert!(completions(json!({"prompt": "a b", "min_tokens": 20})).is_err());
        // A prompt past the context: the mock takes it, and answers as without a limit.
        let long = "w ".repeat(MAX_MODEL_LEN as usize + 10);
        assert_eq!(
            completions(json!({"prompt": long, "max_tokens": null})),
            Ok(16)
        );
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
        assert_eq!(
            err,
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
        );
    }

    #[test]
    fn a_limit_past_the_context_is_refused_like_vllm() {
        let fits = json!({"prompt": "two words", "max_tokens": MAX_MODEL_LEN - 2});
        assert!(parse(Endpoint::Completions, fits.to_string().as_bytes()).is_ok());
        let huge =
            br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":99999999999999999999}"#;
        let err = parse(Endpoint::Chat, huge).unwrap_err();
        assert!(
            err.starts_with("'max_tokens' or 'max_completion_tokens' is too large"),
            "{err}"
        );
        let err = parse_err(
            Endpoint::Responses,
            json!({"input": "two words", "max_output_tokens": MAX_MODEL_LEN - 1}),
        );
        assert!(
            err.contains(&format!("({} > {MAX_MODEL_LEN} - 2)", MAX_MODEL_LEN - 1)),
            "{err}"
        );
    }

    #[test]
    fn n_is_bounded_and_needs_sampling() {
        let chat = |extra: Value| {
            let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            body
        };
        for n in [
            json!(16385),
            json!(18_446_744_073_709_551_615u64),
            json!(1e30),
        ] {
            let err = parse_err(Endpoint::Chat, chat(json!({"n": n})));
            assert!(err.starts_with("n must be at most 16384"), "{err}");
        }
        assert_eq!(
            parse_err(Endpoint::Chat, chat(json!({"n": 3, "temperature": 0}))),
            "n must be 1 when using greedy sampling, got 3."
        );
        assert_eq!(
            parse_ok(Endpoint::Chat, chat(json!({"n": 3, "temperature": 0.5}))).n,
            3
        );
        let generate = json!({"token_ids": [1], "sampling_params": {"n": 2, "temperature": 0.0}});
        assert_eq!(
            parse_err(Endpoint::Generate, generate),
            "n must be 1 when using greedy sampling, got 2."
        );
    }

    fn parse_err(endpoint: Endpoint, body: Value) -> String {
        parse(endpoint, body.to_string().as_bytes()).unwrap_err()
    }

    fn parse_ok(endpoint: Endpoint, body: Value) -> Parsed {
        parse(endpoint, body.to_string().as_bytes()).unwrap()
    }

    fn answer(parsed: &Parsed, tokens: Vec<String>, cached_tokens: u64) -> Answer {
        Answer {
            endpoint: parsed.endpoint,
            id: parsed.request_id.clone().unwrap_or("id-1".into()),
            created: 7,
            model: parsed.model.clone(),
            n: parsed.n,
            limit: parsed.limit,
            prompt_tokens: parsed.prompt_tokens(),
            cached_tokens,
            cache_writes: None,
            prompt_details: true,
            tokens,
            echoed: if parsed.echo {
                prompt_pieces(&parsed.prompt)
            } else {
                Vec::new()
            },
            logprobs: parsed.logprobs,
        }
    }

    #[test]
    fn completions_echo_writes_the_prompt_and_its_logprobs_first() {
        let parsed = parse_ok(
            Endpoint::Completions,
            json!({"prompt": "é tu", "echo": true, "logprobs": 1, "max_tokens": 2}),
        );
        let object = answer(&parsed, vec!["x ".into(), "😀".into()], 0).object();
        let choice = &object["choices"][0];
        assert_eq!(choice["text"], json!("é tux 😀"));
        assert_eq!(
            choice["logprobs"]["tokens"],
            json!(["é ", "tu", "x ", "😀"])
        );
        assert_eq!(choice["logprobs"]["text_offset"], json!([0, 2, 4, 6]));
        assert_eq!(choice["logprobs"]["token_logprobs"][0], Value::Null);
        assert!(choice["logprobs"]["token_logprobs"][1].is_number());
        // Without echo, the generated tokens alone; without logprobs, none.
        let parsed = parse_ok(
            Endpoint::Completions,
            json!({"prompt": "é tu", "logprobs": 1, "max_tokens": 2}),
        );
        let object = answer(&parsed, vec!["x ".into()], 0).object();
        assert_eq!(object["choices"][0]["text"], json!("x "));
        assert_eq!(object["choices"][0]["logprobs"]["text_offset"], json!([0]));
        let parsed = parse_ok(Endpoint::Completions, json!({"prompt": "a", "echo": true}));
        let object = answer(&parsed, vec!["x ".into()], 0).object();
        assert_eq!(object["choices"][0]["text"], json!("ax "));
        assert_eq!(object["choices"][0]["logprobs"], Value::Null);
        // The prompt alone, with min_tokens as the filter sends prefill.
        let parsed = parse_ok(
            Endpoint::Completions,
            json!({"prompt": "a", "echo": true, "logprobs": 0, "max_tokens": 0, "min_tokens": 1}),
        );
        assert_eq!(parsed.limit, 0);
    }

    /// Splits SSE text into (event name, data) pairs.
    fn sse(events: &[String]) -> Vec<(Option<String>, String)> {
        events
            .iter()
            .map(|e| {
                let e = e
                    .strip_suffix("\n\n")
                    .expect("event ends with a blank line");
                match e.split_once('\n') {
                    Some((name, data)) => (
                        Some(name.strip_prefix("event: ").unwrap().to_string()),
                        data.strip_prefix("data: ").unwrap().to_string(),
                    ),
                    None => (None, e.strip_prefix("data: ").unwrap().to_string()),
                }
            })
            .collect()
    }

    #[test]
    fn prompt_pieces_make_up_the_prompt_one_per_token() {
        for prompt in ["the quick  fox", " lead and trail\n", "one", "", "é 😀 x"] {
            let pieces = prompt_pieces(prompt);
            assert_eq!(pieces.concat(), prompt);
            assert_eq!(pieces.len() as u64, word_tokens(prompt), "{prompt:?}");
        }
    }

    #[test]
    fn completions_echo_with_logprobs_asks_for_prompt_logprobs() {
        let asked = |body: Value| parse_ok(Endpoint::Completions, body).prompt_logprobs;
        assert_eq!(
            asked(json!({"prompt": "a", "echo": true, "logprobs": 2})),
            Some(2)
        );
        assert_eq!(
            asked(json!({"prompt": "a", "echo": true, "logprobs": 2, "prompt_logprobs": 0})),
            Some(0)
        );
        assert_eq!(asked(json!({"prompt": "a", "echo": true})), None);
        assert_eq!(asked(json!({"prompt": "a", "logprobs": 2})), None);
        assert_eq!(
            asked(json!({"prompt": "a", "echo": false, "logprobs": 2})),
            None
        );
    }

    #[test]
    fn messages_validation() {
        let m = Endpoint::Messages;
        let ok = json!({"model": "m", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]});
        let with = |key: &str, value: Value| {
            let mut body = ok.clone();
            match value {
                Value::Null => {
                    body.as_object_mut().unwrap().remove(key);
                }
                value => body[key] = value,
            }
            body
        };
        assert_eq!(
            parse_err(m, with("max_tokens", Value::Null)),
            "max_tokens is required"
        );
        assert_eq!(
            parse_err(m, with("max_tokens", json!(0))),
            "max_tokens must be positive"
        );
        assert_eq!(
            parse_err(m, with("max_tokens", json!(-3))),
            "max_tokens must be positive"
        );
        assert_eq!(
            parse_err(m, with("max_tokens", json!("four"))),
            "max_tokens must be an integer"
        );
        assert_eq!(
            parse_err(m, with("model", Value::Null)),
            "model is required"
        );
        assert_eq!(parse_err(m, with("model", json!(""))), "Model is required");
        assert_eq!(
            parse_err(m, with("messages", Value::Null)),
            "messages is required"
        );
        assert!(parse(m, with("messages", json!("hi")).to_string().as_bytes()).is_err());
        let bad_role = with("messages", json!([{"role": "tool", "content": "x"}]));
        assert!(parse_err(m, bad_role).contains("role"));
        let no_content = with("messages", json!([{"role": "user"}]));
        assert_eq!(parse_err(m, no_content), "message content is required");
        let bad_block = with("messages", json!([{"role": "user", "content": ["x"]}]));
        assert!(parse_err(m, bad_block).contains("blocks"));
        assert!(parse_err(m, with("system", json!(3))).starts_with("system"));
        // Not in the schema: no n, no stream_options.
        let mut body = with("n", json!(0));
        body["stream_options"] = json!({"include_usage": true});
        let p = parse_ok(m, body);
        assert_eq!(
            (p.limit, p.n, p.stream, p.include_usage),
            (4, 1, false, false)
        );
        // min_tokens, as vLLM 0.34 reads it.
        assert_eq!(parse_ok(m, with("min_tokens", json!(2))).min_tokens, 2);
        assert_eq!(
            parse_err(m, with("min_tokens", json!(99))),
            "min_tokens must be less than or equal to max_tokens=4, got 99."
        );
        assert_eq!(p.prompt_logprobs, None);
    }

    #[test]
    fn messages_prompt_and_kv() {
        let body = json!({"model": "claude", "max_tokens": 9, "stream": true,
            "system": [{"type": "text", "text": "be brief"}],
            "messages": [{"role": "user", "content": "why is"},
                {"role": "assistant", "content": [{"type": "text", "text": "the sky"},
                    {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
            "kv_transfer_params": {"do_remote_decode": true},
            "temperature": 0.5, "top_k": 3, "stop_sequences": ["x"], "metadata": {}});
        let p = parse_ok(Endpoint::Messages, body);
        assert_eq!(p.prompt, "be brief\nwhy is\nthe sky");
        assert_eq!((p.limit, p.stream, p.model.as_str()), (9, true, "claude"));
        assert_eq!(p.kv, Some(json!({"do_remote_decode": true})));
        let p = parse_ok(
            Endpoint::Messages,
            json!({"model": "m", "max_tokens": 1, "system": "sys",
                "messages": [{"role": "user", "content": "a"}]}),
        );
        assert_eq!(p.prompt, "sys\na");
    }

    #[test]
    fn messages_answer_and_usage() {
        let p = parse_ok(
            Endpoint::Messages,
            json!({"model": "m", "max_tokens": 3,
                "messages": [{"role": "user", "content": "one two three four"}]}),
        );
        let tokens = generate("decode", &p.prompt, p.limit, false);
        let a = answer(&p, tokens, 4);
        assert_eq!(
            a.object(),
            json!({"id": "id-1", "type": "message", "role": "assistant",
                "content": [{"type": "text", "text": "mock decode answer "}],
                "model": "m", "stop_reason": "max_tokens", "stop_sequence": null,
                "usage": {"input_tokens": 4, "output_tokens": 3, "cache_read_input_tokens": 4}})
        );
        // Fewer tokens than the limit (prefill stops at 40): the turn ended.
        let a = answer(&p, generate("prefill", &p.prompt, 2, false), 0);
        assert_eq!(a.object()["stop_reason"], "end_turn");
        assert_eq!(a.object()["usage"]["output_tokens"], 2);
        assert_eq!(a.object()["usage"]["cache_read_input_tokens"], 0);
    }

    #[test]
    fn messages_event_sequence() {
        let p = parse_ok(
            Endpoint::Messages,
            json!({"model": "m", "max_tokens": 2, "stream": true,
                "messages": [{"role": "user", "content": "a b c"}]}),
        );
        let a = answer(&p, generate("decode", &p.prompt, 2, false), 3);
        let events = sse(&a.events(true));
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        let data: Vec<Value> = events
            .iter()
            .map(|(_, d)| serde_json::from_str(d).unwrap())
            .collect();
        for (name, value) in names.iter().zip(&data) {
            assert_eq!(value["type"], *name);
        }
        assert_eq!(
            data[0]["message"],
            json!({"id": "id-1", "type": "message", "role": "assistant", "content": [],
                "model": "m", "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 3, "output_tokens": 0, "cache_read_input_tokens": 3}})
        );
        assert_eq!(
            data[1],
            json!({"type": "content_block_start", "index": 0,
                "content_block": {"type": "text", "text": ""}})
        );
        assert_eq!(
            data[2],
            json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": "mock "}})
        );
        assert_eq!(data[3]["delta"]["text"], "decode ");
        assert_eq!(data[4], json!({"type": "content_block_stop", "index": 0}));
        assert_eq!(
            data[5],
            json!({"type": "message_delta",
                "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
                "usage": {"input_tokens": 3, "output_tokens": 2, "cache_read_input_tokens": 3}})
        );
        assert_eq!(data[6], json!({"type": "message_stop"}));
    }

    #[test]
    fn generate_validation() {
        let g = Endpoint::Generate;
        assert_eq!(
            parse_err(g, json!({"token_ids": [1]})),
            "sampling_params is required"
        );
        assert_eq!(
            parse_err(g, json!({"token_ids": [1], "sampling_params": [1]})),
            "sampling_params must be an object"
        );
        let bad = "token_ids must be a non-empty array of non-negative integers";
        for ids in [json!([]), json!([1, -2]), json!("1 2"), json!([1.5])] {
            let body = json!({"token_ids": ids, "sampling_params": {}});
            assert_eq!(parse_err(g, body), bad);
        }
        assert_eq!(
            parse_err(g, json!({"sampling_params": {}})),
            "token_ids is required"
        );
        let body = json!({"token_ids": [1], "sampling_params": {"max_tokens": 0}});
        assert_eq!(
            parse_err(g, body),
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
        );
        let body = json!({"token_ids": [1], "sampling_params": {"max_tokens": 2, "min_tokens": 3}});
        assert_eq!(
            parse_err(g, body),
            "min_tokens must be less than or equal to max_tokens=2, got 3."
        );
        let body = json!({"token_ids": [1], "sampling_params": {"n": 0}});
        assert_eq!(parse_err(g, body), "n must be at least 1, got 0.");
        let body = json!({"token_ids": [1], "sampling_params": {},
            "stream_options": {"include_usage": true}});
        assert_eq!(
            parse_err(g, body),
            "Stream options can only be defined when stream=True."
        );
        let body = json!({"token_ids": [1], "sampling_params": {}, "request_id": 5});
        assert_eq!(parse_err(g, body), "request_id must be a string");
    }

    #[test]
    fn stream_is_read_as_pydantic_reads_a_boolean() {
        let c = Endpoint::Completions;
        let options = json!({"include_usage": true});
        for truthy in [
            json!("1"),
            json!("TRUE"),
            json!("yes"),
            json!(1),
            json!(1.0),
        ] {
            let p = parse_ok(
                c,
                json!({"prompt": "x", "stream": truthy, "stream_options": options}),
            );
            assert!(p.stream && p.include_usage, "{truthy}");
        }
        // Python's truth lets "false" past the options check; pydantic reads it as false.
        let p = parse_ok(
            c,
            json!({"prompt": "x", "stream": "false", "stream_options": options}),
        );
        assert!(!p.stream && !p.include_usage);
        let p = parse_ok(
            c,
            json!({"prompt": "x", "stream": false, "stream_options": {}}),
        );
        assert!(!p.stream);
        assert_eq!(
            parse_err(
                c,
                json!({"prompt": "x", "stream": 0, "stream_options": options})
            ),
            "Stream options can only be defined when stream=True."
        );
        assert_eq!(
            parse_err(c, json!({"prompt": "x", "stream": "maybe"})),
            "stream: Input should be a valid boolean"
        );
        let m = parse_ok(
            Endpoint::Messages,
            json!({"model": "c", "max_tokens": 3, "stream": "on",
                   "messages": [{"role": "user", "content": "x"}]}),
        );
        assert!(m.stream);
    }

    #[test]
    fn generate_limits_live_in_sampling_params() {
        let g = Endpoint::Generate;
        // A top-level max_tokens (or min_tokens, n) is not in the schema: ignored.
        let p = parse_ok(
            g,
            json!({"token_ids": [5, 6, 7], "max_tokens": 1, "min_tokens": 99, "n": 0,
                "sampling_params": {"temperature": 0}}),
        );
        assert_eq!((p.limit, p.n), (16, 1));
        assert_eq!((p.prompt.as_str(), p.prompt_tokens()), ("5 6 7", 3));
        assert_eq!(
            (p.model.as_str(), p.request_id.as_deref()),
            ("mock-model", None)
        );
        let p = parse_ok(
            g,
            json!({"token_ids": [1], "model": "m", "request_id": "r-1", "stream": true,
                "stream_options": {"include_usage": true}, "cache_salt": "s", "priority": 0,
                "kv_transfer_params": {"do_remote_decode": true},
                "sampling_params": {"max_tokens": 3, "min_tokens": 3, "n": 2,
                    "prompt_logprobs": 1}}),
        );
        assert_eq!((p.limit, p.n, p.stream), (3, 2, true));
        assert_eq!(
            (p.model.as_str(), p.request_id.as_deref()),
            ("m", Some("r-1"))
        );
        assert_eq!(p.prompt_logprobs, Some(1));
        assert_eq!(p.kv, Some(json!({"do_remote_decode": true})));
        // The same ids as a completions prompt give the same fingerprint.
        let c = parse_ok(Endpoint::Completions, json!({"prompt": [1]}));
        assert_eq!(p.fingerprint(), c.fingerprint());
    }

    #[test]
    fn generate_answer_and_events() {
        let p = parse_ok(
            Endpoint::Generate,
            json!({"token_ids": [42, 7], "request_id": "r-9",
                "sampling_params": {"max_tokens": 5, "n": 2}}),
        );
        let a = answer(&p, generate("decode", &p.prompt, p.limit, false), 2);
        // mock decode answer for 42 mock: words as small integers, numbers as themselves.
        let ids = json!([426, 612, 656, 327, 42]);
        assert_eq!(
            a.object(),
            json!({"request_id": "r-9", "prompt_logprobs": null, "choices": [
                {"index": 0, "logprobs": null, "finish_reason": "length", "token_ids": ids},
                {"index": 1, "logprobs": null, "finish_reason": "length", "token_ids": ids}]})
        );
        assert!(a.object().get("usage").is_none());
        let garbage = answer(&p, generate("decode", &p.prompt, 3, true), 0);
        assert_eq!(
            garbage.object()["choices"][0]["token_ids"],
            json!([0, 0, 0])
        );
        assert_eq!(garbage.object()["choices"][0]["finish_reason"], "stop");

        let a = answer(&p, generate("decode", &p.prompt, 2, false), 0);
        let events = sse(&a.events(true));
        assert_eq!(events.len(), 5, "{events:?}");
        assert!(events.iter().all(|(name, _)| name.is_none()));
        assert_eq!(events[4].1, "[DONE]");
        let chunks: Vec<Value> = events[..4]
            .iter()
            .map(|(_, d)| serde_json::from_str(d).unwrap())
            .collect();
        assert_eq!(
            chunks[0],
            json!({"request_id": "r-9", "choices": [{"index": 0, "logprobs": null,
                "finish_reason": null, "token_ids": [426]}]})
        );
        assert_eq!(chunks[1]["choices"][0]["index"], 1);
        assert_eq!(
            chunks[3]["choices"][0],
            json!({"index": 1, "logprobs": null, "finish_reason": "stop", "token_ids": [612]})
        );
    }
}
