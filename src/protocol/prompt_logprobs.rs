//! Prompt logprobs are computed where the prompt is computed: on prefill. A decode worker
//! that pulls the KV never runs the prompt, so the filter asks prefill for them, keeps them
//! out of decode's request, and puts prefill's into decode's answer. Both are handled as
//! text: prefill's logprobs go in byte for byte (no number is read and written again), and
//! every other byte of decode's answer stays where it was.

use super::echo::EchoedPrompt;
use crate::api::Api;
use crate::json::{array_element_ranges, array_elements, Edit, JsonObject};

const PROMPT_LOGPROBS: &str = "prompt_logprobs";

/// Prefill's `prompt_logprobs` from its answer, as written: per choice on completions,
/// top-level on chat. `None` when absent or null.
pub fn from_prefill_answer(api: Api, answer: &[u8]) -> Option<Vec<u8>> {
    let answer = JsonObject::parse(answer).ok()?;
    let logprobs = match api {
        Api::ChatCompletions => answer.last_value(PROMPT_LOGPROBS)?,
        Api::Completions => {
            let choices = answer.last_value("choices")?;
            let first = *array_elements(choices)?.first()?;
            JsonObject::parse(first).ok()?.last_value(PROMPT_LOGPROBS)?
        }
        Api::Responses | Api::Messages | Api::Generate | Api::CohereChat => return None,
    };
    (logprobs != b"null").then(|| logprobs.to_vec())
}

/// Decode's answer with what prefill computed for the prompt where vLLM puts it: its
/// `prompt_logprobs` in every choice on completions (they share the prompt), top-level on
/// chat; and on completions, its echo of the prompt before each choice's own text and
/// logprobs. `None` when the answer is not one to write them into, or would be longer than
/// `limit` bytes with them: that is known from the number of choices decode wrote, before
/// anything is built.
pub fn into_answer(
    api: Api,
    answer: &[u8],
    logprobs: Option<&[u8]>,
    echoed: Option<&EchoedPrompt>,
    limit: usize,
) -> Option<Vec<u8>> {
    let object = JsonObject::parse(answer).ok()?;
    let per_choice = logprobs
        .map_or(0, |logprobs| logprobs.len().saturating_add(MEMBER_OVERHEAD))
        .saturating_add(echoed.map_or(0, EchoedPrompt::added_len));
    let fits = |copies: usize| {
        per_choice
            .saturating_mul(copies)
            .saturating_add(answer.len())
            <= limit
    };
    match api {
        Api::ChatCompletions => {
            let logprobs = logprobs?;
            fits(1).then(|| with_member(&object, logprobs))
        }
        Api::Completions if logprobs.is_some() || echoed.is_some() => {
            let choices = object.last_value("choices")?;
            let ranges = array_element_ranges(choices)?;
            if !fits(ranges.len()) {
                return None;
            }
            let mut written = Vec::with_capacity(choices.len() + per_choice * ranges.len());
            let mut cursor = 0;
            for choice in ranges {
                written.extend_from_slice(choices.get(cursor..choice.start)?);
                let object = JsonObject::parse(choices.get(choice.clone())?).ok()?;
                written.extend_from_slice(&choice_with(&object, logprobs, echoed)?);
                cursor = choice.end;
            }
            written.extend_from_slice(choices.get(cursor..)?);
            let splice = object.splice_member("choices", Edit::Slot);
            Some(splice.write(object.text(), &written))
        }
        _ => None,
    }
}

/// The most a `"prompt_logprobs":` member adds to an object beside its value.
const MEMBER_OVERHEAD: usize = PROMPT_LOGPROBS.len() + 4;

/// `object` with `prompt_logprobs` set to `logprobs`: in place of its own, or added.
fn with_member(object: &JsonObject, logprobs: &[u8]) -> Vec<u8> {
    let append: &[(&str, Edit)] = if object.has(PROMPT_LOGPROBS) {
        &[]
    } else {
        &[(PROMPT_LOGPROBS, Edit::Slot)]
    };
    let edit = |key: &str| {
        if key == PROMPT_LOGPROBS {
            Edit::Slot
        } else {
            Edit::Keep
        }
    };
    object.splice(edit, append).write(object.text(), logprobs)
}

/// A completions choice with prefill's prompt logprobs and its echo of the prompt, each
/// where given. `None` when the choice has no text and logprobs for the echo to go before.
fn choice_with(
    choice: &JsonObject,
    logprobs: Option<&[u8]>,
    echoed: Option<&EchoedPrompt>,
) -> Option<Vec<u8>> {
    let Some(echoed) = echoed else {
        return Some(match logprobs {
            Some(logprobs) => with_member(choice, logprobs),
            None => choice.text().to_vec(),
        });
    };
    let (text, echoed_logprobs) =
        echoed.before(choice.last_value("text")?, choice.last_value("logprobs")?)?;
    let sets_prompt_logprobs = logprobs.is_some();
    let edit = |key: &str| match key {
        PROMPT_LOGPROBS if sets_prompt_logprobs => Edit::Value(0),
        "text" => Edit::Value(1),
        "logprobs" => Edit::Value(2),
        _ => Edit::Keep,
    };
    let append: &[(&str, Edit)] = if sets_prompt_logprobs && !choice.has(PROMPT_LOGPROBS) {
        &[(PROMPT_LOGPROBS, Edit::Value(0))]
    } else {
        &[]
    };
    let values = [logprobs.unwrap_or_default(), &text, &echoed_logprobs];
    Some(
        choice
            .splice(edit, append)
            .write_values(choice.text(), &values),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    const LOGPROBS: &str =
        r#"[null, {"5": {"logprob": -1.9106709150239054, "rank": 1}, "3": {"logprob": -2.5}}]"#;

    #[test]
    fn prefills_prompt_logprobs_go_where_vllm_puts_them() {
        let completion =
            format!(r#"{{"choices": [{{"text": "a", "prompt_logprobs": {LOGPROBS}}}]}}"#);
        let found = from_prefill_answer(Api::Completions, completion.as_bytes()).unwrap();
        assert_eq!(found, LOGPROBS.as_bytes());
        let decode = r#"{"id":"d","choices":[ {"text":"x","prompt_logprobs":null} ,{"text":"y"}],"usage":{}}"#;
        let merged = into_answer(
            Api::Completions,
            decode.as_bytes(),
            Some(&found),
            None,
            usize::MAX,
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(merged).unwrap(),
            format!(
                r#"{{"id":"d","choices":[ {{"text":"x","prompt_logprobs":{LOGPROBS}}} ,{{"text":"y","prompt_logprobs":{LOGPROBS}}}],"usage":{{}}}}"#
            )
        );

        let chat = format!(r#"{{"choices": [], "prompt_logprobs": {LOGPROBS}}}"#);
        let found = from_prefill_answer(Api::ChatCompletions, chat.as_bytes()).unwrap();
        assert_eq!(found, LOGPROBS.as_bytes());
        let decode = r#"{"z":1,"a":2,"choices":[],"prompt_logprobs":null,"usage":{}}"#;
        let merged = into_answer(
            Api::ChatCompletions,
            decode.as_bytes(),
            Some(&found),
            None,
            usize::MAX,
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(merged).unwrap(),
            format!(r#"{{"z":1,"a":2,"choices":[],"prompt_logprobs":{LOGPROBS},"usage":{{}}}}"#),
            "decode's members keep their order, prefill's numbers their digits"
        );
        let merged = into_answer(
            Api::ChatCompletions,
            b"{\"choices\":[]}",
            Some(&found),
            None,
            usize::MAX,
        )
        .unwrap();
        let merged: Value = serde_json::from_slice(&merged).unwrap();
        assert_eq!(merged["prompt_logprobs"][1]["5"]["rank"], json!(1));

        assert_eq!(
            from_prefill_answer(Api::Completions, b"{\"choices\":[{}]}"),
            None
        );
        assert_eq!(
            from_prefill_answer(
                Api::Completions,
                br#"{"choices":[{"prompt_logprobs":null}]}"#
            ),
            None
        );
        assert_eq!(from_prefill_answer(Api::Responses, chat.as_bytes()), None);
        assert_eq!(
            into_answer(
                Api::Completions,
                b"{\"choices\":7}",
                Some(&found),
                None,
                usize::MAX
            ),
            None
        );
    }

    #[test]
    fn an_answer_too_large_with_them_is_known_before_it_is_built() {
        let logprobs = LOGPROBS.as_bytes();
        // Each of decode's choices gets a copy: the answer's size follows from their number,
        // whatever the request said `n` was.
        let choices = vec![r#"{"text":"x"}"#; 1000].join(",");
        let answer = format!(r#"{{"id":"d","choices":[{choices}]}}"#);
        let needed = into_answer(
            Api::Completions,
            answer.as_bytes(),
            Some(logprobs),
            None,
            usize::MAX,
        )
        .unwrap()
        .len();
        let limit = answer.len() + 1000 * (logprobs.len() + MEMBER_OVERHEAD);
        assert!(needed <= limit, "{needed} > {limit}");
        assert!(into_answer(
            Api::Completions,
            answer.as_bytes(),
            Some(logprobs),
            None,
            limit
        )
        .is_some());
        assert_eq!(
            into_answer(
                Api::Completions,
                answer.as_bytes(),
                Some(logprobs),
                None,
                needed - 1
            ),
            None
        );
        let chat = br#"{"id":"c","choices":[]}"#;
        assert_eq!(
            into_answer(Api::ChatCompletions, chat, Some(logprobs), None, chat.len()),
            None
        );
    }
}
