//! `echo` with `logprobs` on completions. vLLM then answers each choice with the prompt's
//! text before the generated text, and the prompt's tokens before the generated ones in
//! `logprobs`, their logprobs computed with the prompt: on prefill, which decode on
//! prefill's KV never runs. So prefill is asked for the prompt alone (`echo` with
//! `max_tokens: 0`), decode generates without `echo`, and prefill's part goes before each of
//! decode's choices. Both are handled as text: no logprob is read and written again, and only
//! decode's `text_offset` numbers change, shifted by the prompt's length as vLLM counts it.

use crate::json::{array_element_ranges, array_elements, Edit, JsonObject};

/// The members of a completions choice's `logprobs`, in the order vLLM writes them.
const ARRAYS: [&str; 4] = ["text_offset", "token_logprobs", "tokens", "top_logprobs"];
const TEXT_OFFSET: usize = 0;
const TOKENS: usize = 2;

/// Prefill's echo of the prompt, as it wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EchoedPrompt {
    /// The echoed text: the inside of prefill's JSON string, escapes as written.
    text: Vec<u8>,
    /// The inside of each of prefill's `logprobs` arrays, in [`ARRAYS`]'s order.
    arrays: [Vec<u8>; 4],
    /// Where the first generated token starts in the text, as vLLM counts `text_offset`:
    /// the prompt's last offset and the length of its last token, in Unicode code points
    /// (Python's `len`).
    generated_offset: u64,
}

impl EchoedPrompt {
    /// The echo in prefill's answer to a request for the prompt alone: its first choice's
    /// `text` and `logprobs`. `None` when they are not there as vLLM writes them.
    pub fn from_prefill_answer(answer: &[u8]) -> Option<EchoedPrompt> {
        let answer = JsonObject::parse(answer).ok()?;
        let choices = array_elements(answer.last_value("choices")?)?;
        let choice = JsonObject::parse(choices.first()?).ok()?;
        let text = string_inside(choice.last_value("text")?)?.to_vec();
        let logprobs = JsonObject::parse(choice.last_value("logprobs")?).ok()?;
        let mut arrays: [Vec<u8>; 4] = Default::default();
        for (array, key) in arrays.iter_mut().zip(ARRAYS) {
            *array = array_inside(logprobs.last_value(key)?)?.to_vec();
        }
        let offsets = array_elements(logprobs.last_value(ARRAYS[TEXT_OFFSET])?)?;
        let tokens = array_elements(logprobs.last_value(ARRAYS[TOKENS])?)?;
        let generated_offset = match (offsets.last(), tokens.last()) {
            (Some(offset), Some(token)) => {
                let length = python_len(string_inside(token)?)?;
                read_offset(offset)?.checked_add(u64::try_from(length).ok()?)?
            }
            (None, None) => 0,
            _ => return None,
        };
        Some(EchoedPrompt {
            text,
            arrays,
            generated_offset,
        })
    }

    /// The most bytes the echo adds to one choice, but for decode's offsets growing by the
    /// shift (a few digits each).
    pub fn added_len(&self) -> usize {
        self.arrays
            .iter()
            .map(|array| array.len() + 1)
            .fold(self.text.len(), usize::saturating_add)
    }

    /// Decode's choice `text` and `logprobs` with the echo before their own: the values to
    /// write in their place. `None` when decode's are not a string and an object of arrays.
    pub fn before(&self, text: &[u8], logprobs: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
        let generated = string_inside(text)?;
        let mut echoed_text = Vec::with_capacity(self.text.len() + generated.len() + 2);
        echoed_text.push(b'"');
        echoed_text.extend_from_slice(&self.text);
        echoed_text.extend_from_slice(generated);
        echoed_text.push(b'"');

        let decodes = JsonObject::parse(logprobs).ok()?;
        let mut joined: [Vec<u8>; 4] = Default::default();
        for (index, key) in ARRAYS.iter().enumerate() {
            let own = decodes.last_value(key)?;
            let shifted;
            let own_inside = if index == TEXT_OFFSET {
                shifted = self.shifted_offsets(own)?;
                &shifted[..]
            } else {
                array_inside(own)?
            };
            let echoed = self.arrays.get(index)?;
            let array = joined.get_mut(index)?;
            array.reserve(echoed.len() + own_inside.len() + 3);
            array.push(b'[');
            array.extend_from_slice(echoed);
            if !echoed.is_empty() && !own_inside.is_empty() {
                array.push(b',');
            }
            array.extend_from_slice(own_inside);
            array.push(b']');
        }
        let edit = |key: &str| match ARRAYS.iter().position(|array| *array == key) {
            Some(index) => Edit::Value(index),
            None => Edit::Keep,
        };
        let values: Vec<&[u8]> = joined.iter().map(Vec::as_slice).collect();
        let echoed_logprobs = decodes.splice(edit, &[]).write_values(logprobs, &values);
        Some((echoed_text, echoed_logprobs))
    }

    /// Decode's `text_offset` numbers, which count from its own text's start, counted from
    /// the echoed prompt's start: the inside of the array, written anew.
    fn shifted_offsets(&self, offsets: &[u8]) -> Option<Vec<u8>> {
        let elements = array_elements(offsets)?;
        let mut written = Vec::with_capacity(offsets.len() + elements.len());
        for (index, offset) in elements.iter().enumerate() {
            if index > 0 {
                written.push(b',');
            }
            let shifted = read_offset(offset)?.checked_add(self.generated_offset)?;
            written.extend_from_slice(shifted.to_string().as_bytes());
        }
        Some(written)
    }
}

fn read_offset(number: &[u8]) -> Option<u64> {
    std::str::from_utf8(number).ok()?.parse().ok()
}

/// The inside of a JSON string literal, as written.
fn string_inside(literal: &[u8]) -> Option<&[u8]> {
    literal.strip_prefix(b"\"")?.strip_suffix(b"\"")
}

/// The inside of a JSON array, without the whitespace around its elements.
fn array_inside(array: &[u8]) -> Option<&[u8]> {
    let ranges = array_element_ranges(array)?;
    match (ranges.first(), ranges.last()) {
        (Some(first), Some(last)) => array.get(first.start..last.end),
        _ => Some(b""),
    }
}

/// How many characters Python counts in a JSON string's inside: Unicode code points, a
/// `\u` escape one each but a surrogate pair of them one together (as Python's `json`
/// decodes them). `None` when an escape is cut short.
fn python_len(inside: &[u8]) -> Option<usize> {
    let mut count = 0;
    let mut at = 0;
    while let Some(&byte) = inside.get(at) {
        count += 1;
        at += match byte {
            b'\\' if inside.get(at + 1) == Some(&b'u') => {
                let unit = hex_unit(inside.get(at + 2..at + 6)?)?;
                let low = inside
                    .get(at + 6..at + 12)
                    .and_then(|next| next.strip_prefix(b"\\u"))
                    .and_then(hex_unit);
                let pair = (0xD800..0xDC00).contains(&unit)
                    && low.is_some_and(|low| (0xDC00..0xE000).contains(&low));
                if pair {
                    12
                } else {
                    6
                }
            }
            b'\\' => 2,
            // A UTF-8 sequence is one code point: its lead byte says how long it is.
            0xF0..=0xFF => 4,
            0xE0..=0xEF => 3,
            0xC0..=0xDF => 2,
            _ => 1,
        };
    }
    Some(count)
}

fn hex_unit(digits: &[u8]) -> Option<u32> {
    u32::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// vLLM's `_create_completion_logprobs` offsets: each token starts where the previous
    /// one ended, lengths in code points.
    fn offsets(tokens: &[&str]) -> Vec<u64> {
        let mut at = 0;
        tokens
            .iter()
            .map(|token| {
                let offset = at;
                at += token.chars().count() as u64;
                offset
            })
            .collect()
    }

    fn logprobs(tokens: &[&str], first_scored: bool) -> Value {
        let scored = |i: usize| first_scored || i > 0;
        json!({
            "text_offset": offsets(tokens),
            "token_logprobs": (0..tokens.len())
                .map(|i| if scored(i) { json!(-0.5 - i as f64) } else { Value::Null })
                .collect::<Vec<_>>(),
            "tokens": tokens,
            "top_logprobs": tokens.iter().enumerate()
                .map(|(i, t)| if scored(i) { json!({ *t: -0.25 }) } else { Value::Null })
                .collect::<Vec<_>>(),
        })
    }

    #[test]
    fn decodes_choice_gets_the_prompt_before_its_own_text_and_tokens() {
        let prompt = ["Hé", "llo", " wörld", " 😀", "\"", "\n"];
        let generated = [" and", " 🦀", " so", " on"];
        let prefill = json!({"id": "p", "choices": [{"index": 0, "text": prompt.concat(),
            "logprobs": logprobs(&prompt, false), "finish_reason": "length",
            "prompt_logprobs": [null, {"1": {"logprob": -1.0}}]}]});
        let echoed = EchoedPrompt::from_prefill_answer(prefill.to_string().as_bytes()).unwrap();
        let decode_choice = json!({"index": 0, "text": generated.concat(),
            "logprobs": logprobs(&generated, true), "finish_reason": "length"});
        let (text, written) = echoed
            .before(
                decode_choice["text"].to_string().as_bytes(),
                decode_choice["logprobs"].to_string().as_bytes(),
            )
            .unwrap();

        // What one vLLM answers: the offsets run on over the prompt's tokens and decode's.
        let all: Vec<&str> = prompt.iter().chain(&generated).copied().collect();
        let mut expected = logprobs(&all, false);
        for (i, value) in expected["token_logprobs"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .enumerate()
            .skip(prompt.len())
        {
            *value = json!(-0.5 - (i - prompt.len()) as f64);
        }
        let text: Value = serde_json::from_slice(&text).unwrap();
        assert_eq!(text, json!(all.concat()));
        let written: Value = serde_json::from_slice(&written).unwrap();
        assert_eq!(written, expected);
    }

    #[test]
    fn escapes_count_as_python_counts_them() {
        assert_eq!(python_len(br"a\nb"), Some(3));
        assert_eq!(python_len(br#"\"\\\/"#), Some(3));
        assert_eq!(python_len(br"\u00e9"), Some(1));
        // A surrogate pair is one code point, a lone surrogate one too.
        assert_eq!(python_len(br"\ud83d\ude00x"), Some(2));
        assert_eq!(python_len(br"\ud83dx"), Some(2));
        assert_eq!(python_len(br"\ude00\ud83d"), Some(2));
        assert_eq!(python_len("é😀ab".as_bytes()), Some(4));
        assert_eq!(python_len(br"\u12"), None);
        assert_eq!(python_len(b""), Some(0));

        let tokens = ["\u{1F600}", "\u{e9}"];
        let escaped = r#"{"choices":[{"text":"\ud83d\ude00\u00e9","logprobs":{"text_offset":[0,1],"token_logprobs":[null,-1.0],"tokens":["\ud83d\ude00","\u00e9"],"top_logprobs":[null,{"\u00e9":-1.0}]}}]}"#;
        let echoed = EchoedPrompt::from_prefill_answer(escaped.as_bytes()).unwrap();
        assert_eq!(echoed.generated_offset, offsets(&tokens)[1] + 1);
    }

    #[test]
    fn whitespace_and_members_of_decodes_logprobs_are_kept_and_empty_lists_joined() {
        let prefill = r#"{"choices":[{"text":"","logprobs":{"text_offset":[],"token_logprobs":[],"tokens":[],"top_logprobs":[]}}]}"#;
        let echoed = EchoedPrompt::from_prefill_answer(prefill.as_bytes()).unwrap();
        let (text, logprobs) = echoed
            .before(
                br#""x""#,
                br#"{ "tokens" : ["x"], "extra": 1, "text_offset":[ 0 ],"token_logprobs":[-1],"top_logprobs":[{}]}"#,
            )
            .unwrap();
        assert_eq!(text, br#""x""#);
        assert_eq!(
            String::from_utf8(logprobs).unwrap(),
            r#"{ "tokens" : ["x"], "extra": 1, "text_offset":[0],"token_logprobs":[-1],"top_logprobs":[{}]}"#
        );
    }

    #[test]
    fn an_answer_without_the_echo_as_vllm_writes_it_gives_none() {
        for answer in [
            r#"{"choices":[]}"#,
            r#"{"choices":[{"text":"a","logprobs":null}]}"#,
            r#"{"choices":[{"text":7,"logprobs":{"text_offset":[],"token_logprobs":[],"tokens":[],"top_logprobs":[]}}]}"#,
            r#"{"choices":[{"text":"a","logprobs":{"text_offset":[0],"token_logprobs":[],"tokens":[],"top_logprobs":[]}}]}"#,
            r#"{"choices":[{"text":"a","logprobs":{"text_offset":[-1],"token_logprobs":[null],"tokens":["a"],"top_logprobs":[null]}}]}"#,
            r#"{"choices":[{"text":"a","logprobs":{"text_offset":[0],"tokens":["a"],"top_logprobs":[null]}}]}"#,
        ] {
            assert_eq!(
                EchoedPrompt::from_prefill_answer(answer.as_bytes()),
                None,
                "{answer}"
            );
        }
        let prefill = r#"{"choices":[{"text":"a","logprobs":{"text_offset":[0],"token_logprobs":[null],"tokens":["a"],"top_logprobs":[null]}}]}"#;
        let echoed = EchoedPrompt::from_prefill_answer(prefill.as_bytes()).unwrap();
        let complete =
            r#"{"text_offset":[0],"token_logprobs":[-1],"tokens":["b"],"top_logprobs":[{}]}"#;
        assert!(echoed.before(br#""b""#, complete.as_bytes()).is_some());
        assert_eq!(echoed.before(b"null", complete.as_bytes()), None);
        assert_eq!(echoed.before(br#""b""#, b"null"), None);
        let bad_offset = complete.replace("[0]", "[0.5]");
        assert_eq!(echoed.before(br#""b""#, bad_offset.as_bytes()), None);
    }
}
