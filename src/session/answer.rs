//! Decode's answer on its way to the client: what only prefill knows (the prompt's usage,
//! prompt logprobs) written into it.

use std::time::SystemTime;

use crate::config::Config;
use crate::decode_outage::is_connect_failure;
use crate::protocol::kv_release::{decode_answered_an_error, decode_will_not_read};
use crate::protocol::usage::{merge_answer, EventStream, Rewritten};
use crate::protocol::{media_type, prompt_logprobs};

use super::*;

/// How decode's answer is changed on its way to the client.
pub(super) enum AnswerRewrite {
    /// Not at all.
    Untouched,
    /// A JSON answer, held whole and written again with merged usage. Its length, when
    /// decode announced it, tells when it is whole before Envoy says the stream ended; where
    /// headers may wait for a body ([`Config::headers_may_wait_for_body`]), an announced
    /// length also holds the answer's headers for its body ([`AnswerRewrite::holds_headers`]).
    Whole { length: Option<usize> },
    /// Server-sent events, passed on as they come but for the usage event.
    Events(EventStream),
}

impl AnswerRewrite {
    /// Whether the answer's headers wait for its body, so that the client gets the rewritten
    /// answer's own `content-length`, as from vLLM; otherwise Envoy frames it. Only where
    /// Envoy gives a filter that holds headers the body all the same
    /// ([`Config::headers_may_wait_for_body`]): otherwise the answer would never come.
    fn holds_headers(&self, config: &Config) -> bool {
        matches!(self, AnswerRewrite::Whole { length: Some(_) })
            && config.headers_may_wait_for_body()
    }
}

/// What the response headers tell the session.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseHead<'a> {
    pub status: Option<u16>,
    pub content_type: Option<&'a str>,
    pub has_request_id: bool,
    /// Decode's `content-length` header, as sent.
    pub content_length: Option<&'a [u8]>,
    /// Decode's `content-encoding` header, as sent.
    pub content_encoding: Option<&'a [u8]>,
    /// The answer has no body.
    pub end_of_stream: bool,
    /// Envoy's `response.code_details` (`via_upstream` for decode's own answer), when asked
    /// for ([`Session::wants_response_details`]).
    pub code_details: Option<&'a str>,
    /// For an answer Envoy made itself: whether the stream ever had a connection to decode.
    pub decode_connected: Option<bool>,
    /// For an answer Envoy made itself: when it came.
    pub envoys_own_at: Option<SystemTime>,
}

impl ResponseHead<'_> {
    /// Whether the answer's bytes are compressed (or otherwise encoded): the filter cannot
    /// read them. Decode is not asked to compress, but a proxy on the way may.
    fn is_encoded(&self) -> bool {
        self.content_encoding.is_some_and(|coding| {
            let coding = coding.trim_ascii();
            !coding.is_empty() && !coding.eq_ignore_ascii_case(b"identity")
        })
    }

    /// The answer's length in bytes, when decode announced one that is a number.
    fn announced_length(&self) -> Option<usize> {
        let text = std::str::from_utf8(self.content_length?).ok()?;
        text.trim().parse().ok()
    }
}

pub(super) fn note_answer_too_large(request_id: &str, limit: usize) {
    // Info, not a warning: the client's own request (many or long choices) makes such an
    // answer, and info lines have a budget apart from the warnings an operator looks for.
    log::info!(
        "[{request_id}] decode's answer is larger than {limit} bytes (max_request_body_bytes): \
         passed on as decode wrote it, without prefill's usage or prompt logprobs"
    );
}

impl Session {
    /// Whether the response concerns the session at all: only a request sent on to decode
    /// by the filter. Every other answer goes by without its headers being read.
    pub fn watches_response(&self) -> bool {
        matches!(self.state, State::Decoding { .. }) || self.decode_outage_key.is_some()
    }

    /// Whether [`Session::on_response_headers`] needs Envoy's `response.code_details` for an
    /// answer with this status: only while decode may not have taken the KV prefill made,
    /// and only for an error: a 5xx Envoy answers with when decode could not be reached, or
    /// a 4xx that decode (or Envoy) answered.
    pub fn wants_response_details(&self, status: Option<u16>) -> bool {
        let unread = matches!(
            self.state,
            State::Decoding {
                unread_kv: Some(_),
                ..
            }
        );
        (unread || self.decode_outage_key.is_some()) && status.is_none_or(|status| status >= 400)
    }

    /// The response to the client begins. Its headers wait only for a JSON answer whose
    /// usage is merged, when its length is announced and headers may be held.
    pub fn on_response_headers(&mut self, head: &ResponseHead) -> Step {
        self.note_whether_decode_was_reached(head);
        let config = self.config.clone();
        let State::Decoding {
            prefill_time,
            unread_kv,
            prompt_usage,
            stream_usage,
            prompt_logprobs,
            answer,
            ..
        } = &mut self.state
        else {
            return Step::new(Flow::Continue, vec![]);
        };
        let mut commands = Vec::new();
        let mut flow = Flow::Continue;
        if let (Some(name), Some(elapsed)) = (&config.prefill_time_header, prefill_time) {
            commands.push(Command::AddResponseHeader {
                name: name.clone(),
                value: elapsed.as_millis().to_string(),
            });
        }
        if !head.has_request_id && !self.request_id.is_empty() {
            commands.push(Command::AddResponseHeader {
                name: "x-request-id".to_owned(),
                value: self.request_id.clone(),
            });
        }
        let rewrites = (prompt_usage.is_some() || prompt_logprobs.is_some())
            && head.status == Some(200)
            && !head.end_of_stream
            && !head.is_encoded();
        let essence = head.content_type.map(media_type).unwrap_or_default().trim();
        let mut rewrite = None;
        if rewrites && essence.eq_ignore_ascii_case("text/event-stream") {
            // Read even where prefill reported no details: vLLM 0.11 reports them only for
            // a prompt with cache hits, so prefill without hits writes none whatever its
            // flags, while decode (with `--enable-prompt-tokens-details`) reports the KV it
            // pulled.
            rewrite = (prompt_usage.is_some() && *stream_usage).then(|| {
                let events = EventStream::new(self.held.clone(), config.max_request_body_bytes);
                AnswerRewrite::Events(events)
            });
        } else if rewrites && essence.eq_ignore_ascii_case("application/json") {
            rewrite = match head.announced_length() {
                // Empty, or larger than any answer worth holding: as decode wrote it.
                Some(0) => None,
                Some(length) if length > config.max_request_body_bytes => {
                    note_answer_too_large(&self.request_id, config.max_request_body_bytes);
                    None
                }
                length => Some(AnswerRewrite::Whole { length }),
            };
        }
        if rewrite
            .as_ref()
            .is_some_and(|rewrite| rewrite.holds_headers(&config))
        {
            flow = Flow::Pause;
        }
        if !matches!(rewrite, Some(AnswerRewrite::Whole { .. })) {
            // Only a whole JSON answer gets them: they no longer hold the VM's memory.
            *prompt_logprobs = None;
        }
        if let Some(rewrite) = rewrite {
            // Headers that go on before the answer is rewritten cannot tell its length:
            // Envoy frames it.
            if flow == Flow::Continue && head.content_length.is_some() {
                commands.push(Command::RemoveResponseHeader("content-length".to_owned()));
            }
            *answer = rewrite;
        }
        // Decode has the request from here on, or never will.
        let unread = unread_kv.take();
        if let Some(unread) = unread {
            let not_read = head.code_details.is_some_and(decode_will_not_read)
                || head.decode_connected == Some(false);
            let reason = if not_read {
                Some("decode was not reached, or went before it answered")
            } else if decode_answered_an_error(head.status, head.code_details) {
                Some("decode answered an error")
            } else {
                None
            };
            if let Some(reason) = reason {
                log::debug!(
                    "[{}] {reason} ({:?}, {}); releasing the KV",
                    self.request_id,
                    head.status,
                    head.code_details.unwrap_or_default()
                );
                commands.extend(self.release(&config, unread));
            }
        }
        Step::new(flow, commands)
    }

    /// Tells the VM's [`crate::decode_outage::DecodeOutages`] whether decode could be reached
    /// for this request: from the answer to a request sent on to decode, or from Envoy's own answer while
    /// prefill runs, where request headers go on before the body (Envoy connects to decode
    /// for them at once).
    fn note_whether_decode_was_reached(&mut self, head: &ResponseHead) {
        let to_decode = matches!(
            self.state,
            State::Decoding { .. } | State::RereadingForRetry { .. }
        ) || self.prefill_running();
        if !to_decode {
            return;
        }
        let Some(key) = self.decode_outage_key.take() else {
            return;
        };
        match (head.code_details, head.envoys_own_at) {
            (Some(details), Some(now)) if is_connect_failure(details) => {
                self.decode_outages.connect_failed(&key, now);
            }
            // Another answer of Envoy's own (a timeout, a full pool) says nothing of whether
            // decode can be reached; an answer under 400 is decode's.
            (Some(details), _) if details != "via_upstream" => {}
            _ => self.decode_outages.reached(&key),
        }
    }

    /// `size` bytes of the answer arrived (all of it held so far, for a whole answer).
    pub fn on_response_body(&mut self, size: usize, end_of_stream: bool) -> BodyStep {
        let limit = self.config.max_request_body_bytes;
        match &mut self.state {
            State::Decoding {
                answer,
                prompt_logprobs,
                ..
            } => match answer {
                AnswerRewrite::Untouched => BodyStep::Step(Step::new(Flow::Continue, vec![])),
                // An empty chunk (often the stream's end) with nothing held changes nothing.
                AnswerRewrite::Events(events) if size == 0 && !events.holds_bytes() => {
                    BodyStep::Step(Step::new(Flow::Continue, vec![]))
                }
                AnswerRewrite::Events(_) => BodyStep::ReadBody,
                // Larger than any answer worth holding: it goes on as it is.
                AnswerRewrite::Whole { .. } if size > limit => {
                    *answer = AnswerRewrite::Untouched;
                    *prompt_logprobs = None;
                    note_answer_too_large(&self.request_id, limit);
                    BodyStep::Step(Step::new(Flow::Continue, vec![]))
                }
                // Envoy gives decode's body, then the stream's end in a call of its own: an
                // answer of the length announced is whole already, and is not held for it.
                AnswerRewrite::Whole { length } if end_of_stream || *length == Some(size) => {
                    BodyStep::ReadBody
                }
                AnswerRewrite::Whole { .. } => BodyStep::Step(Step::new(Flow::Pause, vec![])),
            },
            _ => BodyStep::Step(Step::new(Flow::Continue, vec![])),
        }
    }

    /// The answer ended with trailers. Envoy then gives no body callback at its end: a JSON
    /// answer held whole is read here, from Envoy's buffer, and rewritten there. Part of an
    /// event still waiting for its end is lost: the filter cannot add body bytes from a
    /// trailers callback. vLLM sends no trailers; a proxy between it and Envoy, or an HTTP/2
    /// decode cluster, might.
    pub fn on_response_trailers(&mut self) -> BodyStep {
        let continuing = BodyStep::Step(Step::new(Flow::Continue, vec![]));
        let State::Decoding { answer, .. } = &self.state else {
            return continuing;
        };
        match answer {
            AnswerRewrite::Whole { .. } => BodyStep::ReadBody,
            AnswerRewrite::Events(events) if events.holds_bytes() => {
                log::warn!(
                    "[{}] decode's answer ended with trailers while {} bytes of an event \
                     waited for its end: the client does not get them",
                    self.request_id,
                    events.held_len()
                );
                continuing
            }
            _ => continuing,
        }
    }

    /// The answer's bytes asked for by [`Session::on_response_body`] or
    /// [`Session::on_response_trailers`]: the latest chunk of an event stream, or the whole
    /// of a JSON answer.
    pub fn on_response_body_read(&mut self, body: &[u8], end_of_stream: bool) -> Step {
        let State::Decoding {
            prompt_usage,
            prompt_logprobs,
            answer,
            ..
        } = &mut self.state
        else {
            return Step::new(Flow::Continue, vec![]);
        };
        let headers_held = answer.holds_headers(&self.config);
        let limit = self.config.max_request_body_bytes;
        let request_id = &self.request_id;
        // Bytes an event stream held back from earlier chunks, to go before this one as it
        // is: the stream is given up.
        let mut given_up = None;
        let rewritten = match answer {
            AnswerRewrite::Untouched => None,
            AnswerRewrite::Whole { .. } => {
                // Read once, whole: what comes after (the stream's end) goes on as it is.
                *answer = AnswerRewrite::Untouched;
                let merged = prompt_usage
                    .as_ref()
                    .and_then(|(api, prompt)| merge_answer(*api, body, prompt));
                let current = merged.as_deref().unwrap_or(body);
                // Used once: the VM's memory they held is given back with them.
                let with_logprobs = prompt_logprobs.take().map(|held| {
                    let written = prompt_logprobs::into_answer(
                        held.api,
                        current,
                        held.prompt_logprobs.as_deref(),
                        held.echoed.as_ref(),
                        limit,
                    );
                    if written.is_none() {
                        log::info!(
                            "[{request_id}] prefill's prompt logprobs (or echo of the prompt) \
                             were not written into decode's answer: it has no choices to hold \
                             them, or would be larger than {limit} bytes with them \
                             (max_request_body_bytes)"
                        );
                    }
                    written
                });
                with_logprobs.flatten().or(merged)
            }
            AnswerRewrite::Events(events) => {
                let rewritten = prompt_usage
                    .as_ref()
                    .map(|(api, prompt)| events.on_chunk(*api, prompt, body, end_of_stream));
                match rewritten {
                    None | Some(Rewritten::AsIs) => None,
                    Some(Rewritten::Replaced(bytes)) => Some(bytes),
                    Some(Rewritten::GaveUp { held }) => {
                        // Once: from here on the stream is neither read nor held.
                        *answer = AnswerRewrite::Untouched;
                        given_up = Some(held);
                        None
                    }
                }
            }
        };
        let mut commands = Vec::new();
        let counts = prompt_usage
            .as_ref()
            .and_then(|(_, prompt)| prompt.decode_counted_another());
        if let (Some((prefill, decode)), false) = (counts, self.prompt_mismatch_noted) {
            self.prompt_mismatch_noted = true;
            log::warn!(
                "[{}] prefill counted {prefill} prompt tokens and decode {decode}: the two \
                 workers rendered different prompts, so decode answered from KV computed for \
                 another prompt (run both pools with the same model, chat template and \
                 max-model-len)",
                self.request_id
            );
            commands.push(Command::Record(Metric::PromptMismatch));
        }
        // Envoy's buffer holds at least `max_request_body_bytes` (documented); a larger
        // answer would make Envoy answer on its own from inside this callback. Such an answer
        // goes on as decode wrote it. An event stream's rewrite is never larger: where it
        // would be, the stream is given up, and what it held back goes before this chunk,
        // written on its own (never more than the limit, which bounds what it holds) while
        // decode's chunk stays in Envoy's buffer as it is.
        if let Some(held) = given_up {
            log::info!(
                "[{}] a chunk of decode's stream with prefill's usage would be larger than \
                 {limit} bytes (max_request_body_bytes): the rest of the stream goes on as \
                 decode wrote it, without prefill's usage",
                self.request_id
            );
            if !held.is_empty() {
                // Envoy drains nothing and puts these bytes before the chunk.
                commands.push(Command::ReplaceResponseBody {
                    body: held,
                    replaced_len: 0,
                    announce_length: false,
                });
            }
        }
        // A rewrite is never decode's answer again: the merges give `None` for an answer
        // whose usage already has prefill's counts. (Comparing the two here would cost a
        // byte-by-byte pass over the answer in wasm, whose `memcmp` is a plain loop.)
        let rewritten = rewritten.filter(|rewritten| {
            let fits = rewritten.len() <= limit;
            if !fits {
                log::info!(
                    "[{}] the answer with prefill's usage and prompt logprobs would be larger \
                     than {limit} bytes; passed on as decode wrote it",
                    self.request_id
                );
            }
            fits
        });
        commands.extend(rewritten.map(|rewritten| Command::ReplaceResponseBody {
            body: rewritten,
            replaced_len: body.len(),
            announce_length: headers_held,
        }));
        Step::new(Flow::Continue, commands)
    }
}
