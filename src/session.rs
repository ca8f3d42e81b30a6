//! One request's life in the filter, free of any host calls: events in (request headers,
//! body, trailers, prefill answer, response headers, client gone), steps out (continue,
//! pause, call prefill, replace the body and resume, answer the client). Every decision the
//! filter makes lives here; the proxy-wasm adapter only carries events in and commands out.

use std::rc::Rc;
use std::time::{Duration, SystemTime};

use crate::abandoned::{AbandonedMark, AbandonedPrefills};
use crate::api::Api;
use crate::config::Config;
use crate::decode_outage::DecodeOutages;
use crate::held_bytes::HeldBytes;
use crate::protocol::usage::PromptUsage;
use crate::protocol::{ClientError, FailureKind, PrefillFailure};

/// The filter state key of the prefill time in milliseconds: Envoy's access log reads it as
/// `%FILTER_STATE(wasm.pd_prefill_ms:PLAIN)%`.
pub const PREFILL_TIME_FILTER_STATE: &str = "pd_prefill_ms";

/// Set on every request the filter sees, as `wasm.pd_filter_ran` = `yes`. Envoy leaves a
/// wasm filter out, whatever its failure policy, on a worker where the plugin has no handle
/// (a VM not set up there yet, or one that failed to start); the shipped configurations
/// refuse, in an RBAC filter after this one, any request that lacks the mark, so that none
/// reaches decode without its prefill.
pub const FILTER_RAN_FILTER_STATE: &str = "pd_filter_ran";

mod answer;
mod intake;
mod outcome;
mod prefill;
mod release;

pub use crate::protocol::prefill_answer::CallRefused;
use answer::AnswerRewrite;
pub use answer::ResponseHead;
pub use outcome::{Outcome, PrefillResult};
use prefill::{kept_for_prefill, HeldLogprobs, Pending, Prefill};
use release::UnreadKv;

/// Marks the filter's KV release calls to decode, for decode's logs.
pub const KV_RELEASE_HEADER: &str = "x-pd-kv-release";

/// Header an ORIGINAL_DST cluster (`use_http_header: true`) reads the destination from.
pub const ORIGINAL_DST_HEADER: &str = "x-envoy-original-dst-host";

/// Whether the host goes on with the request after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Pause,
}

/// What the host is asked to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Sets a request header (only while the request headers are held or being read).
    SetRequestHeader {
        name: String,
        value: String,
    },
    RemoveRequestHeader(String),
    /// Makes Envoy pick the route again, with the headers as they are now.
    ClearRouteCache,
    /// Sends the prefill call; the host reports back with [`Session::on_prefill_dispatched`].
    DispatchPrefill(HttpCall),
    /// Replaces the first `replaced_len` bytes of the buffered request body with `body` (the
    /// whole of it when `replaced_len` is its length). The new body always fits in the
    /// configured limit.
    ReplaceRequestBody {
        body: Vec<u8>,
        replaced_len: usize,
    },
    /// Reads the whole request body Envoy holds and hands it to
    /// [`Session::on_request_body_reread`].
    ReadRequestBody,
    /// Lets a paused request go on to decode.
    ResumeRequest,
    /// Sends a call to decode that frees prefill's KV for a request whose decode leg will
    /// never run; it must outlive the request, and its answer only counts in the stats.
    ReleaseKv(HttpCall),
    /// Answers the client; the request goes no further.
    SendReply(LocalReply),
    /// Drops the first `len` bytes of the request body Envoy holds: the upload of a request
    /// already refused, read to its end before the answer ([`Session::on_discard_failed`]
    /// when the host refuses).
    DiscardRequestBody(usize),
    AddResponseHeader {
        name: String,
        value: String,
    },
    /// Sets a value in Envoy's filter state for the request, where access logs read it
    /// (`%FILTER_STATE(wasm.KEY:PLAIN)%`).
    SetFilterState {
        key: &'static str,
        value: String,
    },
    /// Removes a response header (only while the response headers are being read).
    RemoveResponseHeader(String),
    /// Replaces the first `replaced_len` bytes of the response body Envoy holds (the body
    /// seen so far, or the latest chunk of a stream) with `body`, never longer than the
    /// configured limit; with `replaced_len` 0, puts `body` before it. `announce_length`:
    /// the response headers, held for this body, then get its `content-length` (only once
    /// the body is in place, so that the two always agree).
    ReplaceResponseBody {
        body: Vec<u8>,
        replaced_len: usize,
        announce_length: bool,
    },
    Record(Metric),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpCall {
    pub cluster: Rc<str>,
    /// Shared with the request, which keeps them for another attempt and for a KV release.
    pub headers: Rc<[(String, String)]>,
    pub body: Vec<u8>,
    pub timeout: Duration,
}

impl HttpCall {
    /// The `x-request-id` the call carries: the request it is made for.
    pub fn request_id(&self) -> &str {
        self.headers
            .iter()
            .find(|(name, _)| name == "x-request-id")
            .map_or("", |(_, value)| value.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// What the stats count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// A request whose prefill begins.
    Orchestrated(Api),
    /// How an orchestrated request ended: once per request that ends with the filter.
    Request(Api, Outcome),
    PassedThrough,
    /// A prefill leg that failed for a reason other than the client's request.
    PrefillFailure(FailureKind),
    DecodeOnlyFallback,
    BadRequest,
    PrefillLatency(PrefillResult, Duration),
    KvReleased,
    KvReleaseFailed,
    KvReleaseDropped,
    /// Decode counted another prompt than prefill (see [`PromptUsage::decode_counted_another`]).
    PromptMismatch,
}

/// The answer to a request callback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub flow: Flow,
    pub commands: Vec<Command>,
}

impl Step {
    fn new(flow: Flow, commands: Vec<Command>) -> Step {
        Step { flow, commands }
    }
}

/// The answer to a body or trailers callback: the session may need the whole body first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyStep {
    /// The body is complete: read all of it and hand it to [`Session::on_request_complete`].
    ReadBody,
    Step(Step),
}

/// A host call that failed, reported back to the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostFailure {
    ReadRequestHeaders,
    ReadRequestBody,
    ReplaceRequestBody,
}

/// The headers of prefill's answer that matter.
#[derive(Debug, Clone, Copy)]
pub struct PrefillHead<'a> {
    /// `None` when the answer has no headers: the call was reset.
    pub status: Option<u16>,
    pub retry_after: Option<&'a str>,
}

/// The answer to every request of a plugin whose configuration was refused (Envoy logged
/// why when it was loaded).
pub fn reply_without_configuration() -> LocalReply {
    internal_error_reply("pd-filter has no valid configuration")
}

/// The answer to a request whose context the plugin's root could not make (Envoy started
/// the stream while the root was in a callback of its own).
pub fn reply_without_context() -> LocalReply {
    internal_error_reply("pd-filter could not take this request; try again")
}

fn internal_error_reply(message: &str) -> LocalReply {
    let error = ClientError::internal(message);
    LocalReply {
        status: error.status,
        headers: vec![("content-type".to_owned(), "application/json".to_owned())],
        body: error.body_for(None, ""),
    }
}

/// One request.
pub struct Session {
    config: Rc<Config>,
    /// What this VM's requests hold in it, shared by them.
    held: HeldBytes,
    request_id: String,
    state: State,
    /// The API of an orchestrated request, for its outcome in the stats.
    api: Option<Api>,
    /// This VM's running prefill calls whose clients left, by client.
    abandoned: AbandonedPrefills,
    /// The client's address, when running prefills are counted by client.
    client: Option<String>,
    /// This request's place in `abandoned` once its client has left during prefill: given
    /// back when the session goes, after prefill's answer.
    _abandoned_mark: Option<AbandonedMark>,
    /// This VM's decode pools that Envoy cannot connect to.
    decode_outages: DecodeOutages,
    /// The decode cluster of this request's model ([`Config::decode_cluster_for`]), while
    /// decode outages are followed.
    decode_outage_key: Option<String>,
    upload: Upload,
    /// The request's headers were held for a body still to come.
    headers_held_for_body: bool,
    /// Decode's usage showed it counted another prompt than prefill, and that was said.
    prompt_mismatch_noted: bool,
}

/// The client's request body, as far as the filter has seen it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Upload {
    /// Whole, or there is none.
    Ended,
    /// Still arriving; `declared` is its content-length.
    Arriving { declared: Option<usize> },
}

enum State {
    /// Before the request headers.
    Started,
    /// Not the filter's, or handed on: nothing more to do.
    PassThrough,
    /// An orchestrated request whose body is still arriving.
    Buffering(Pending),
    /// A generation request that is not orchestrated, whose body is still arriving: its
    /// `kv_transfer_params` are removed before it goes on.
    StrippingKv,
    /// A prefill call was handed to the host, which has not said whether it went out.
    Dispatching(Prefill),
    AwaitingPrefill {
        prefill: Prefill,
        token: u32,
    },
    /// A failed attempt is to be retried: the client's body is being read again from
    /// Envoy's buffer to write the prefill call anew.
    RereadingForRetry {
        prefill: Prefill,
        failure: PrefillFailure,
        budget_left: Duration,
    },
    /// The client left while prefill was working: the KV it makes is released.
    Abandoned {
        prefill: Prefill,
        token: Option<u32>,
    },
    /// Resumed to decode; until decode answers, what is needed to release the KV if decode
    /// turns out never to have taken the request.
    Decoding {
        prefill_time: Option<Duration>,
        /// When the request went on to decode.
        resumed_at: SystemTime,
        unread_kv: Option<UnreadKv>,
        /// Prefill's prompt counts, to put into decode's usage.
        prompt_usage: Option<(Api, PromptUsage)>,
        /// A streamed answer carries usage: read its chunks for it.
        stream_usage: bool,
        /// Prefill's prompt logprobs as it wrote them, to put into decode's answer.
        prompt_logprobs: Option<HeldLogprobs>,
        answer: AnswerRewrite,
    },
    /// The filter refused the request while its body was still arriving: the rest of the
    /// body is dropped as it comes, and `reply` goes out at its end.
    Refusing {
        reply: LocalReply,
        received: usize,
    },
    /// The filter answered the client.
    Answered,
    /// The client is gone.
    Finished,
}

impl Session {
    pub fn new(config: Rc<Config>, held: HeldBytes) -> Session {
        Session {
            config,
            held,
            request_id: String::new(),
            state: State::Started,
            api: None,
            abandoned: AbandonedPrefills::default(),
            client: None,
            _abandoned_mark: None,
            decode_outages: DecodeOutages::default(),
            decode_outage_key: None,
            upload: Upload::Ended,
            headers_held_for_body: false,
            prompt_mismatch_noted: false,
        }
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The outcome of an orchestrated request, for the stats; nothing for other requests.
    fn outcome(&self, outcome: Outcome) -> Vec<Command> {
        self.api
            .map(|api| Command::Record(Metric::Request(api, outcome)))
            .into_iter()
            .collect()
    }

    /// A host call failed; the request cannot go on as planned.
    pub fn on_host_failure(&mut self, failure: HostFailure) -> Vec<Command> {
        let message = match failure {
            HostFailure::ReadRequestHeaders => "pd-filter could not read the request headers",
            HostFailure::ReadRequestBody => "pd-filter could not read the request body",
            HostFailure::ReplaceRequestBody => "pd-filter could not write the decode request body",
        };
        log::error!("[{}] {message}", self.request_id);
        let unread = match std::mem::replace(&mut self.state, State::PassThrough) {
            State::Decoding { unread_kv, .. } => unread_kv,
            _ => None,
        };
        let mut commands = vec![self.reply(&ClientError::internal(message))];
        if let Some(unread) = unread {
            commands.extend(self.release(&self.config, unread));
        }
        commands
    }

    /// Counts this request's prefill, should its client leave while it runs, among `abandoned`
    /// (one per VM), and refuses clients with too many there.
    pub fn with_abandoned_prefills(mut self, abandoned: AbandonedPrefills) -> Session {
        self.abandoned = abandoned;
        self
    }

    /// Follows, with the rest of this VM's requests, which decode pools Envoy cannot connect
    /// to, and refuses requests for them before prefill.
    pub fn with_decode_outages(mut self, outages: DecodeOutages) -> Session {
        self.decode_outages = outages;
        self
    }

    /// Envoy cannot connect to the decode pool of this request's model: a 503 before prefill.
    fn refuse_decode_unreachable(&mut self, wait: Duration) -> Vec<Command> {
        log::debug!(
            "[{}] refused with 503: its decode pool could not be reached (next probe in \
             {} ms)",
            self.request_id,
            wait.as_millis()
        );
        let mut commands = self.outcome(Outcome::DecodeUnreachable);
        commands.push(self.reply(&ClientError::decode_unreachable()));
        commands
    }

    fn hold_or_continue(&self) -> Step {
        match self.state {
            State::PassThrough | State::Decoding { .. } | State::Started => {
                Step::new(Flow::Continue, Vec::new())
            }
            _ => Step::new(Flow::Pause, Vec::new()),
        }
    }

    /// Answers a request the filter will not orchestrate because of its own content.
    fn reject(&mut self, error: &ClientError) -> Vec<Command> {
        log::debug!(
            "[{}] rejected with {}: {}",
            self.request_id,
            error.status,
            error.message
        );
        let mut commands = vec![Command::Record(Metric::BadRequest)];
        commands.extend(self.outcome(Outcome::ClientError));
        commands.push(self.reply(error));
        commands
    }

    /// The VM holds as much as `max_vm_held_bytes` lets it: a 503, which is not the
    /// client's mistake.
    fn refuse_overloaded(&mut self) -> Vec<Command> {
        log::info!(
            "[{}] refused with 503: the VM holds {} of max_vm_held_bytes {}",
            self.request_id,
            self.held.held(),
            self.held.limit()
        );
        let mut commands = self.outcome(Outcome::Overloaded);
        commands.push(self.reply(&ClientError::vm_budget_full(self.held.limit())));
        commands
    }

    /// An answer of the filter's own that is not an error: `body` is JSON.
    fn reply_with(&mut self, status: u16, body: Vec<u8>) -> Command {
        self.state = State::Answered;
        Command::SendReply(LocalReply {
            status,
            headers: self.reply_headers(),
            body,
        })
    }

    fn reply_headers(&self) -> Vec<(String, String)> {
        let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
        if !self.request_id.is_empty() {
            headers.push(("x-request-id".to_owned(), self.request_id.clone()));
        }
        headers
    }

    fn reply(&mut self, error: &ClientError) -> Command {
        self.state = State::Answered;
        let mut headers = self.reply_headers();
        // A 503 is worth trying again shortly (prefill's pool full or unreachable, the VM's
        // budget spent): clients that read retry-after wait a second rather than their own
        // backoff, unless prefill said how long.
        let retry_after = error
            .retry_after_seconds
            .or((error.status == 503).then_some(1));
        if let Some(seconds) = retry_after {
            headers.push(("retry-after".to_owned(), seconds.to_string()));
        }
        Command::SendReply(LocalReply {
            status: error.status,
            headers,
            body: error.body_for(self.api, &self.request_id),
        })
    }
}

#[cfg(test)]
mod sequences;
#[cfg(test)]
mod tests;
