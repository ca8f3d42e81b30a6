//! The generation APIs the filter orchestrates: OpenAI-style, and two more vLLM serves.

/// A generation API; each caps generation in its own fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Completions,
    ChatCompletions,
    Responses,
    /// vLLM's Anthropic-style Messages API (`/v1/messages`).
    Messages,
    /// vLLM's tokens-in, tokens-out API (`/inference/v1/generate`): its limits are in
    /// `sampling_params`, and its answer counts no usage.
    Generate,
    /// vLLM's Cohere-style chat API (`/cohere/v2/chat`, vLLM 0.33 and later): one limit,
    /// `max_tokens`, and errors in Cohere's shape.
    CohereChat,
}

impl Api {
    pub const ALL: [Api; 6] = [
        Api::Completions,
        Api::ChatCompletions,
        Api::Responses,
        Api::Messages,
        Api::Generate,
        Api::CohereChat,
    ];

    /// The API a configured path serves, told by how the path ends.
    pub fn from_path(path: &str) -> Option<Api> {
        if path.ends_with("/v2/chat") {
            Some(Api::CohereChat)
        } else if path.ends_with("/chat/completions") {
            Some(Api::ChatCompletions)
        } else if path.ends_with("/completions") {
            Some(Api::Completions)
        } else if path.ends_with("/responses") {
            Some(Api::Responses)
        } else if path.ends_with("/messages") {
            Some(Api::Messages)
        } else if path.ends_with("/generate") {
            Some(Api::Generate)
        } else {
            None
        }
    }

    /// The name used in stats and logs.
    pub fn name(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::ChatCompletions => "chat_completions",
            Api::Responses => "responses",
            Api::Messages => "messages",
            Api::Generate => "generate",
            Api::CohereChat => "cohere_chat",
        }
    }
}
