//! Prompt logprobs are computed where the prompt is computed: on prefill. A decode worker
//! that pulls the KV never runs the prompt, so the filter asks prefill for them, keeps them
//! out of decode's request, and puts prefill's into decode's answer.

use serde_json::Value;

use crate::api::Api;

/// Prefill's `prompt_logprobs` from its answer: per choice on completions, top-level on chat.
pub fn from_prefill_answer(api: Api, answer: &[u8]) -> Option<Value> {
    let answer: Value = serde_json::from_slice(answer).ok()?;
    let logprobs = match api {
        Api::ChatCompletions => answer.get("prompt_logprobs")?,
        Api::Completions => answer.get("choices")?.get(0)?.get("prompt_logprobs")?,
        Api::Responses | Api::Messages | Api::Generate => return None,
    };
    (!logprobs.is_null()).then(|| logprobs.clone())
}

/// Decode's answer with prefill's `prompt_logprobs` where vLLM puts them: in every choice
/// on completions (they share the prompt), top-level on chat.
pub fn into_answer(api: Api, answer: &[u8], logprobs: &Value) -> Option<Vec<u8>> {
    let mut answer: Value = serde_json::from_slice(answer).ok()?;
    match api {
        Api::ChatCompletions => {
            answer
                .as_object_mut()?
                .insert("prompt_logprobs".to_owned(), logprobs.clone());
        }
        Api::Completions => {
            for choice in answer.get_mut("choices")?.as_array_mut()? {
                if let Some(choice) = choice.as_object_mut() {
                    choice.insert("prompt_logprobs".to_owned(), logprobs.clone());
                }
            }
        }
        Api::Responses | Api::Messages | Api::Generate => return None,
    }
    serde_json::to_vec(&answer).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prefills_prompt_logprobs_go_where_vllm_puts_them() {
        let logprobs = json!([null, {"5": {"logprob": -0.5}}]);
        let completion = json!({"choices": [{"text": "a", "prompt_logprobs": logprobs}]});
        let found = from_prefill_answer(Api::Completions, completion.to_string().as_bytes());
        assert_eq!(found, Some(logprobs.clone()));
        let decode = json!({"choices": [{"text": "x"}, {"text": "y"}]}).to_string();
        let merged: Value = serde_json::from_slice(
            &into_answer(Api::Completions, decode.as_bytes(), &logprobs).unwrap(),
        )
        .unwrap();
        assert_eq!(merged["choices"][1]["prompt_logprobs"], logprobs);

        let chat = json!({"choices": [], "prompt_logprobs": logprobs}).to_string();
        assert_eq!(
            from_prefill_answer(Api::ChatCompletions, chat.as_bytes()),
            Some(logprobs.clone())
        );
        let merged: Value = serde_json::from_slice(
            &into_answer(Api::ChatCompletions, b"{\"choices\":[]}", &logprobs).unwrap(),
        )
        .unwrap();
        assert_eq!(merged["prompt_logprobs"], logprobs);
        assert_eq!(
            from_prefill_answer(Api::Completions, b"{\"choices\":[{}]}"),
            None
        );
        assert_eq!(from_prefill_answer(Api::Responses, chat.as_bytes()), None);
    }
}
