//! The OpenAI-style APIs the filter orchestrates.

/// An OpenAI-style generation API; each caps generation in its own fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Completions,
    ChatCompletions,
    Responses,
}

impl Api {
    pub const ALL: [Api; 3] = [Api::Completions, Api::ChatCompletions, Api::Responses];

    /// The API a configured path serves, told by how the path ends.
    pub fn from_path(path: &str) -> Option<Api> {
        if path.ends_with("/chat/completions") {
            Some(Api::ChatCompletions)
        } else if path.ends_with("/completions") {
            Some(Api::Completions)
        } else if path.ends_with("/responses") {
            Some(Api::Responses)
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
        }
    }
}
