//! A request arriving: its headers (which path, which API, whether it is refused at once),
//! its body (held whole, or dropped for a refusal), and the client's address when it counts.

use std::time::SystemTime;

use crate::abandoned::client_key;
use crate::headers::HeaderLookup;
use crate::protocol::paths::PathVerdict;
use crate::protocol::rewrite::strip_kv_transfer_params;
use crate::protocol::scheduling::parse_prefill_hosts;
use crate::protocol::{check_content_encoding, check_content_type, is_vllm_json, ClientError};
use crate::request_id::new_request_id;

use super::*;

/// The upload of a request refused before its body ended is read and dropped, up to this many
/// times `max_request_body_bytes`, before the answer goes out; a larger one is answered at
/// once, and Envoy closes an HTTP/1.1 connection under it.
pub(super) const REFUSED_UPLOAD_READ_FACTOR: usize = 4;

/// The longest client request id kept: ids are UUIDs (36) or trace ids (32) in practice.
pub(super) const LONGEST_REQUEST_ID: usize = 128;

pub(super) fn is_loggable_id(id: &str) -> bool {
    (1..=LONGEST_REQUEST_ID).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic())
}

pub(super) fn discard(buffered: usize) -> Vec<Command> {
    (buffered > 0)
        .then_some(Command::DiscardRequestBody(buffered))
        .into_iter()
        .collect()
}

impl Session {
    /// Whether the request's headers were held for its body: without Envoy's
    /// `allow_on_headers_stop_iteration` such a body never comes.
    pub fn headers_held_for_body(&self) -> bool {
        self.headers_held_for_body
    }

    /// Notes whether `step`, the answer to the request's headers, holds them for a body
    /// still to come (a pause with no reply).
    pub(super) fn headers_step(&mut self, mut step: Step) -> Step {
        self.headers_held_for_body = step.flow == Flow::Pause
            && matches!(self.upload, Upload::Arriving { .. })
            && !step
                .commands
                .iter()
                .any(|command| matches!(command, Command::SendReply(_)));
        if step.flow == Flow::Continue
            && matches!(self.state, State::Buffering(_) | State::StrippingKv)
        {
            // The headers go on while the filter still holds the body (a WasmPlugin cannot
            // hold headers): a retry of Envoy's router would send decode what Envoy buffers
            // at that moment, the client's body before prefill's answer or the stripping.
            // The route's own retry policy is the operator's; this overrides it per request.
            step.commands.push(Command::SetRequestHeader {
                name: "x-envoy-max-retries".to_owned(),
                value: "0".to_owned(),
            });
        }
        step
    }

    pub fn on_request_headers<H: HeaderLookup + ?Sized>(
        &mut self,
        headers: &H,
        end_of_stream: bool,
    ) -> Step {
        self.upload = if end_of_stream {
            Upload::Ended
        } else {
            Upload::Arriving {
                // As u64: on wasm32 a usize stops at 4 GiB.
                declared: headers
                    .text("content-length")
                    .and_then(|value| value.trim().parse::<u64>().ok())
                    .map(|length| usize::try_from(length).unwrap_or(usize::MAX)),
            }
        };
        let step = self.request_headers_step(headers, end_of_stream);
        let step = self.answer_after_upload(step, 0, true);
        self.headers_step(step)
    }

    pub(super) fn request_headers_step<H: HeaderLookup + ?Sized>(
        &mut self,
        headers: &H,
        end_of_stream: bool,
    ) -> Step {
        let config = self.config.clone();
        let mut commands = Vec::new();
        // Routing headers only ever come from the filter or the operator's scheduler.
        if let Some(name) = &config.model_header {
            if headers.value(name).is_some() {
                commands.push(Command::RemoveRequestHeader(name.clone()));
                commands.push(Command::ClearRouteCache);
            }
        }
        // The filter's mark of its own KV releases: a client's would pass its requests off as
        // releases in decode's logs and in anything that counts them.
        if headers.value(KV_RELEASE_HEADER).is_some() {
            commands.push(Command::RemoveRequestHeader(KV_RELEASE_HEADER.to_owned()));
        }
        let path = headers
            .value(":path")
            .map(|value| String::from_utf8_lossy(value).into_owned())
            .unwrap_or_default();
        let method = headers.text(":method").unwrap_or_default();
        let is_post = method == "POST";
        let verdict = config.classify_path(&path);
        let filtered = matches!(
            verdict,
            PathVerdict::Orchestrate(_) | PathVerdict::StripKvTransferParams
        );
        if let Some(protocol) = headers.value("upgrade").filter(|_| filtered) {
            let protocol = String::from_utf8_lossy(protocol).into_owned();
            self.take_request_id(headers, &mut commands);
            commands.extend(self.reject(&ClientError::upgrade_refused(&protocol)));
            return Step::new(Flow::Pause, commands);
        }
        let api = match verdict {
            PathVerdict::Orchestrate(api) if is_post => api,
            // Envoy's HTTP/2 codec takes `post`, its HTTP/1 codec does not. Methods are
            // case-sensitive, but a server that read it as POST would serve the client's
            // body, its kv_transfer_params included, without prefill.
            PathVerdict::Orchestrate(_) | PathVerdict::StripKvTransferParams
                if !is_post && method.eq_ignore_ascii_case("POST") =>
            {
                self.take_request_id(headers, &mut commands);
                commands.extend(self.reject(&ClientError::method_not_post(method)));
                return Step::new(Flow::Pause, commands);
            }
            PathVerdict::StripKvTransferParams if is_post && !end_of_stream => {
                self.state = State::StrippingKv;
                commands.push(Command::RemoveRequestHeader("content-length".to_owned()));
                commands.push(Command::Record(Metric::PassedThrough));
                // Its body is held whole anyway: with the headers held too, an upload that
                // never ends takes no decode stream. The body's end continues both. The
                // operator's choice (`hold_request_headers`), not merely what Envoy allows:
                // a `model_header` alone is for orchestrated requests' routes.
                let flow = if config.hold_request_headers {
                    Flow::Pause
                } else {
                    Flow::Continue
                };
                return Step::new(flow, commands);
            }
            PathVerdict::Refuse(error) => {
                self.take_request_id(headers, &mut commands);
                commands.extend(self.reject(&error));
                return Step::new(Flow::Pause, commands);
            }
            _ => {
                self.state = State::PassThrough;
                commands.push(Command::Record(Metric::PassedThrough));
                return Step::new(Flow::Continue, commands);
            }
        };
        self.api = Some(api);

        self.take_request_id(headers, &mut commands);
        // A content-type that is not UTF-8 reads as none: decode gets application/json. A
        // coding that is not UTF-8 must not: read as none, `gzip\xff` would reach decode.
        let checked = check_content_type(headers.text("content-type")).and_then(|()| {
            headers
                .text_or_lossy("content-encoding")
                .map_err(|value| ClientError::body_encoded(&value))
                .and_then(check_content_encoding)
        });
        if let Err(error) = checked {
            commands.extend(self.reject(&error));
            return Step::new(Flow::Pause, commands);
        }
        if end_of_stream {
            commands.extend(self.reject(&ClientError::bad_request("request body is empty")));
            return Step::new(Flow::Pause, commands);
        }
        let declared_length = match self.upload {
            Upload::Arriving { declared } => declared,
            Upload::Ended => None,
        };
        if declared_length.is_some_and(|length| length > config.max_request_body_bytes) {
            commands.extend(self.reject(&ClientError::payload_too_large(
                config.max_request_body_bytes,
            )));
            return Step::new(Flow::Pause, commands);
        }
        let mut scheduled_hosts = Vec::new();
        if config.prefill_host_cluster.is_some() {
            if let Some(value) = headers.text(&config.prefill_host_header) {
                // The scheduler's choice is for the prefill leg only.
                commands.push(Command::RemoveRequestHeader(
                    config.prefill_host_header.clone(),
                ));
                match parse_prefill_hosts(
                    &config.prefill_host_header,
                    value,
                    &config.prefill_hosts_allowed,
                ) {
                    Ok(hosts) => scheduled_hosts = hosts,
                    Err(error) => {
                        commands.extend(self.reject(&error));
                        return Step::new(Flow::Pause, commands);
                    }
                }
            }
        }
        let prefill_headers = self.prefill_headers(headers, path);
        // Kept while the body uploads, which may take until Envoy's request_timeout: counted
        // now, so that uploads that never end cannot hold the VM past its budget.
        let kept = kept_for_prefill(&prefill_headers, &self.request_id);
        let Some(headers_held) = self.held.reserve(kept) else {
            commands.extend(self.refuse_overloaded());
            return Step::new(Flow::Pause, commands);
        };
        commands.extend(decode_header_rewrites(headers));
        self.state = State::Buffering(Pending {
            api,
            prefill_headers,
            scheduled_hosts,
            headers_held,
        });
        // Hold the headers until prefill has answered (or, with a model header, until the
        // model is known, so that Envoy picks the route with it): Envoy's router would
        // otherwise open decode's stream at once and hold it, and a connection of decode's
        // pool, while the body uploads and prefill works. Needs
        // `allow_on_headers_stop_iteration: true`, or Envoy holds the body too.
        let flow = if config.headers_may_wait_for_body() {
            Flow::Pause
        } else {
            Flow::Continue
        };
        Step::new(flow, commands)
    }

    /// `buffered` is the size of the body Envoy holds (all of it received so far, but for
    /// what a refused request's upload dropped).
    pub fn on_request_body(&mut self, buffered: usize, end_of_stream: bool) -> BodyStep {
        if end_of_stream {
            self.upload = Upload::Ended;
        }
        let readable = self.readable_refused_upload();
        match &mut self.state {
            State::Refusing { received, .. } => {
                *received = received.saturating_add(buffered);
                let step = if end_of_stream || *received > readable {
                    Step::new(Flow::Pause, self.send_refusal())
                } else {
                    Step::new(Flow::Pause, discard(buffered))
                };
                BodyStep::Step(step)
            }
            State::Buffering(_) | State::StrippingKv => {
                if buffered > self.config.max_request_body_bytes {
                    let step = Step::new(Flow::Pause, self.reject_too_large());
                    return BodyStep::Step(self.answer_after_upload(step, buffered, false));
                }
                if end_of_stream {
                    BodyStep::ReadBody
                } else {
                    BodyStep::Step(Step::new(Flow::Pause, Vec::new()))
                }
            }
            _ => BodyStep::Step(self.hold_or_continue()),
        }
    }

    /// Trailers end the request: whatever body arrived is all there is.
    pub fn on_request_trailers(&mut self) -> BodyStep {
        self.upload = Upload::Ended;
        match &self.state {
            State::Refusing { .. } => BodyStep::Step(Step::new(Flow::Pause, self.send_refusal())),
            State::Buffering(_) | State::StrippingKv => BodyStep::ReadBody,
            _ => BodyStep::Step(self.hold_or_continue()),
        }
    }

    /// The whole request body, once it is complete.
    pub fn on_request_complete(&mut self, body: Vec<u8>, now: SystemTime) -> Step {
        let config = self.config.clone();
        if body.len() > config.max_request_body_bytes {
            return Step::new(Flow::Pause, self.reject_too_large());
        }
        match std::mem::replace(&mut self.state, State::PassThrough) {
            State::Buffering(pending) => self.start_prefill(&config, pending, body, now),
            State::StrippingKv => match strip_kv_transfer_params(
                &body,
                config.prefill_options.client_ec_transfer_params,
            ) {
                Ok(stripped) => {
                    let commands = stripped
                        .map(|stripped| Command::ReplaceRequestBody {
                            body: stripped,
                            replaced_len: body.len(),
                        })
                        .into_iter()
                        .collect();
                    Step::new(Flow::Continue, commands)
                }
                Err(error) => Step::new(Flow::Pause, self.reject(&error)),
            },
            other => {
                self.state = other;
                self.hold_or_continue()
            }
        }
    }

    /// A refusal decided while the client is still sending its body waits for the body's
    /// end, the body dropped as it comes: a client that writes its whole body before it reads
    /// (httpx's async client, so the async OpenAI and Anthropic SDKs) otherwise meets an
    /// HTTP/1.1 connection Envoy closes under its upload, and never sees the answer. At the
    /// request headers only where they may wait for the body
    /// ([`Config::headers_may_wait_for_body`]); never for more than
    /// [`REFUSED_UPLOAD_READ_FACTOR`] times the body limit. `buffered`: the body Envoy holds
    /// now.
    pub(super) fn answer_after_upload(
        &mut self,
        mut step: Step,
        buffered: usize,
        at_headers: bool,
    ) -> Step {
        let Upload::Arriving { declared } = self.upload else {
            return step;
        };
        let headers_held = self.config.headers_may_wait_for_body();
        let readable = self.readable_refused_upload();
        if (at_headers && !headers_held) || buffered.max(declared.unwrap_or(0)) > readable {
            return step;
        }
        let Some(index) = step
            .commands
            .iter()
            .position(|command| matches!(command, Command::SendReply(_)))
        else {
            return step;
        };
        if let Command::SendReply(reply) = step.commands.remove(index) {
            self.state = State::Refusing {
                reply,
                received: buffered,
            };
        }
        step.commands.extend(discard(buffered));
        step.flow = Flow::Pause;
        step
    }

    pub(super) fn readable_refused_upload(&self) -> usize {
        self.config
            .max_request_body_bytes
            .saturating_mul(REFUSED_UPLOAD_READ_FACTOR)
    }

    /// The answer a refused request's upload waited for.
    pub(super) fn send_refusal(&mut self) -> Vec<Command> {
        match std::mem::replace(&mut self.state, State::Answered) {
            State::Refusing { reply, .. } => vec![Command::SendReply(reply)],
            other => {
                self.state = other;
                Vec::new()
            }
        }
    }

    /// Envoy would not drop a refused request's upload: the answer goes out now.
    pub fn on_discard_failed(&mut self) -> Vec<Command> {
        self.send_refusal()
    }

    pub(super) fn reject_too_large(&mut self) -> Vec<Command> {
        let limit = self.config.max_request_body_bytes;
        self.reject(&ClientError::payload_too_large(limit))
    }

    /// The request id both legs carry: the client's (or Envoy's), else a new one. A client's
    /// id goes into every log line about its request, here and on both vLLM workers: one
    /// that is long or has anything but visible ASCII (a line separator, an escape sequence)
    /// is replaced, so that no client writes lines of its own into those logs.
    pub(super) fn take_request_id<H: HeaderLookup + ?Sized>(
        &mut self,
        headers: &H,
        commands: &mut Vec<Command>,
    ) {
        self.request_id = match headers.text("x-request-id").filter(|id| is_loggable_id(id)) {
            Some(id) => id.to_owned(),
            None => {
                let id = new_request_id();
                commands.push(Command::SetRequestHeader {
                    name: "x-request-id".to_owned(),
                    value: id.clone(),
                });
                id
            }
        };
    }

    /// Whether the client's address is wanted before prefill, to see whether the client may
    /// have one: [`Session::on_client_address`] next. Only while some client of this VM has
    /// prefills running after it left; until then the address is read only if this client
    /// leaves during prefill ([`Session::wants_address_on_leaving`]).
    pub fn wants_client_address(&self) -> bool {
        self.abandoned.is_limited()
            && self.abandoned.any_running()
            && matches!(self.state, State::Buffering(_))
    }

    /// The client's address (Envoy's `source.address`) for an orchestrated request: a
    /// refusal when the client has as many prefills running after it left as it may.
    pub fn on_client_address(&mut self, source_address: Option<&[u8]>) -> Option<Step> {
        let client = source_address.and_then(client_key)?;
        if self.abandoned.admits(&client) {
            self.client = Some(client);
            return None;
        }
        log::info!(
            "[{}] refused with 429: client {client} left {} requests whose prefill is still \
             running (max_abandoned_prefills_per_client)",
            self.request_id,
            self.abandoned.running_for(&client)
        );
        let error = ClientError::too_many_abandoned_prefills(self.abandoned.limit());
        let step = Step::new(Flow::Pause, self.reject(&error));
        let step = self.answer_after_upload(step, 0, true);
        Some(self.headers_step(step))
    }

    /// The headers of prefill's call: the filter's own, and those of the client's that
    /// `forward_headers` names.
    fn prefill_headers<H: HeaderLookup + ?Sized>(
        &self,
        headers: &H,
        path: String,
    ) -> Vec<(String, String)> {
        // `:authority` is the cluster's, added once the cluster is known.
        let mut prefill_headers = vec![
            (":method".to_owned(), "POST".to_owned()),
            (":path".to_owned(), path),
            ("content-type".to_owned(), "application/json".to_owned()),
            // Without it any coding is acceptable (RFC 9110), and a proxy in front of
            // prefill may compress an answer the filter must read.
            ("accept-encoding".to_owned(), "identity".to_owned()),
            ("x-request-id".to_owned(), self.request_id.clone()),
        ];
        // Every copy of a forwarded header, as decode gets them: a client's `baggage` or
        // `tracestate` may come on several lines, each a part of the one list.
        for name in &self.config.forward_headers {
            for value in headers.values(name) {
                if let Ok(value) = std::str::from_utf8(value) {
                    prefill_headers.push((name.clone(), value.to_owned()));
                }
            }
        }
        prefill_headers
    }
}

/// What decode's copy of an orchestrated request's headers needs changed.
fn decode_header_rewrites<H: HeaderLookup + ?Sized>(headers: &H) -> Vec<Command> {
    let mut commands = vec![
        // The decode body differs from the client's: let Envoy frame it.
        Command::RemoveRequestHeader("content-length".to_owned()),
        // Decode's answer may get prefill's usage and prompt logprobs, which a compressed
        // answer could not: decode is asked for a plain one (without the header any coding
        // is acceptable, RFC 9110, and a proxy in front of decode may compress).
        Command::SetRequestHeader {
            name: "accept-encoding".to_owned(),
            value: "identity".to_owned(),
        },
    ];
    // vLLM refuses any media type but exactly `application/json` (a missing one too),
    // where the filter also takes `+json` types and no content-type at all: decode would
    // refuse, after prefill's work, a request prefill (called with `application/json`)
    // served. Decode gets the body the filter read as JSON, labelled as prefill's is.
    if !is_vllm_json(headers.text("content-type")) {
        commands.push(Command::SetRequestHeader {
            name: "content-type".to_owned(),
            value: "application/json".to_owned(),
        });
    }
    commands
}
