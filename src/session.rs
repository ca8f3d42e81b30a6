//! One request's life in the filter, free of any host calls: events in (request headers,
//! body, trailers, prefill answer, response headers, client gone), steps out (continue,
//! pause, call prefill, replace the body and resume, answer the client). Every decision the
//! filter makes lives here; the proxy-wasm adapter only carries events in and commands out.

use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use crate::abandoned::{client_key, AbandonedMark, AbandonedPrefills};
use crate::api::Api;
use crate::config::{Config, MissingKvPolicy, PrefillFailurePolicy, UsagePolicy};
use crate::headers::HeaderLookup;
use crate::held_bytes::{HeldBytes, Reservation};
use crate::protocol::kv_release::{decode_never_read, decode_refused};
use crate::protocol::paths::PathVerdict;
use crate::protocol::prompt_logprobs;
use crate::protocol::rewrite::{
    minimal_kv_release_body, strip_kv_transfer_params, MINIMAL_RELEASE_PATH,
};
use crate::protocol::scheduling::{
    check_model_for_header, parse_prefill_hosts, with_reachable_remote_host,
};
use crate::protocol::usage::{merge_answer, prompt_usage_for_decode, EventStream, PromptUsage};
use crate::protocol::{
    check_content_type, is_vllm_json, media_type, prepare_with, read_prefill_answer, ClientError,
    DecodePlan, FailureKind, PrefillAnswer, PrefillFailure, PreparedRequest,
};
use crate::request_id::new_request_id;

/// How long after a request went on to decode the filter cannot tell whether decode has
/// read it. Envoy may hold a connection to decode while the request is still in its own
/// buffers, or unread in decode's socket: a client that leaves then takes the request with
/// it, and prefill's KV with it. vLLM reads a request within milliseconds unless its server
/// is stalled, and answers a stream's headers as soon as it has read it; a client that
/// leaves later left a request decode had. Kept short: a release for a request decode did
/// read makes vLLM's prefill log an error for the unknown notification.
const DELIVERY_WINDOW: Duration = Duration::from_secs(2);

/// How much earlier than the filter reckons Envoy's timeout of a call may fire. Envoy starts
/// the timer from its event loop's cached time, which under load is older than the clock the
/// filter reads after sending the call by a whole turn of the loop: tens of milliseconds
/// were seen with two busy cores. A call reset without headers this close to its deadline
/// is its timeout.
const CLOCK_SLACK: Duration = Duration::from_millis(250);

/// The least time left for which a failed prefill is tried again. Less would be taken for
/// the deadline anyway ([`CLOCK_SLACK`]), and a call given under a millisecond goes to Envoy
/// with a timeout of 0, which Envoy reads as no timeout at all.
const MIN_RETRY_BUDGET: Duration = CLOCK_SLACK;

/// Room left for the rest of decode's answer when prefill's prompt logprobs go into it; an
/// answer that still outgrows the limit goes on as decode wrote it.
const REST_OF_ANSWER: usize = 64 * 1024;

/// The upload of a request refused before its body ended is read and dropped, up to this many
/// times `max_request_body_bytes`, before the answer goes out; a larger one is answered at
/// once, and Envoy closes an HTTP/1.1 connection under it.
const REFUSED_UPLOAD_READ_FACTOR: usize = 4;

/// The filter state key of the prefill time in milliseconds: Envoy's access log reads it as
/// `%FILTER_STATE(wasm.pd_prefill_ms:PLAIN)%`.
pub const PREFILL_TIME_FILTER_STATE: &str = "pd_prefill_ms";

/// Set on every request the filter sees, as `wasm.pd_filter_ran` = `yes`. Envoy leaves a
/// wasm filter out, whatever its failure policy, on a worker where the plugin has no handle
/// (a VM not set up there yet, or one that failed to start); the shipped configurations
/// refuse, in an RBAC filter after this one, any request that lacks the mark, so that none
/// reaches decode without its prefill.
pub const FILTER_RAN_FILTER_STATE: &str = "pd_filter_ran";

mod outcome;
pub use outcome::{Outcome, PrefillResult};

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
    /// Replaces the response body seen so far, `replaced_len` bytes long. `announce_length`:
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
    pub cluster: String,
    pub headers: Vec<(String, String)>,
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

/// One request.
pub struct Session {
    config: Option<Rc<Config>>,
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
    upload: Upload,
    /// The request's headers were held for a body still to come.
    headers_held_for_body: bool,
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

/// How decode's answer is changed on its way to the client.
enum AnswerRewrite {
    /// Not at all.
    Untouched,
    /// A JSON answer, held whole and written again with merged usage. Its length, when
    /// decode announced it, tells when it is whole before Envoy says the stream ended; with
    /// `hold_request_headers`, an announced length also holds the answer's headers for its
    /// body ([`AnswerRewrite::holds_headers`]).
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

/// KV that prefill made and decode has not read yet.
struct UnreadKv {
    model: Option<String>,
    kv_transfer_params: Vec<u8>,
    headers: Vec<(String, String)>,
    /// The VM's budget these take.
    _held: Reservation,
}

/// What request headers told about an orchestrated request.
struct Pending {
    api: Api,
    prefill_headers: Vec<(String, String)>,
    scheduled_hosts: Vec<SocketAddr>,
}

/// The longest `model` a request keeps for its KV release.
const MAX_KEPT_MODEL_LEN: usize = 1024;

/// What the filter keeps of the client's body while prefill works. Envoy holds the body
/// until the request resumes; the filter keeps its own copy only when decode's edit needs
/// more than its head, and reads the body again from Envoy for a retry. So a request in
/// prefill costs its body once, in Envoy's heap, where the overload manager sees it.
enum HeldBody {
    /// All of it, counted against the VM's budget.
    Whole {
        body: Vec<u8>,
        _reservation: Reservation,
    },
    /// None of it: prefill's `kv_transfer_params` go in as the first member, in place of
    /// the body's first bytes up to its opening brace ([`DecodePlan::head_len`]).
    HeadOnly,
}

impl HeldBody {
    /// What decode's edit needs of `body`; `None` when that is the whole body and the VM's
    /// budget has no room for it.
    fn keep(body: Vec<u8>, plan: &DecodePlan, held: &HeldBytes) -> Option<HeldBody> {
        match plan.head_len() {
            Some(len) if len < body.len() => Some(HeldBody::HeadOnly),
            _ => {
                let reservation = held.reserve(body.len())?;
                Some(HeldBody::Whole {
                    body,
                    _reservation: reservation,
                })
            }
        }
    }

    /// The bytes kept: all of the body, or none.
    fn bytes(&self) -> &[u8] {
        match self {
            HeldBody::Whole { body, .. } => body,
            HeldBody::HeadOnly => &[],
        }
    }
}

/// Prefill's prompt logprobs, kept (and counted against the VM's budget) until they go into
/// decode's answer.
struct HeldLogprobs {
    api: Api,
    logprobs: Vec<u8>,
    _reservation: Reservation,
}

/// The prefill leg of one request, across its attempts.
struct Prefill {
    api: Api,
    original: HeldBody,
    model: Option<String>,
    decode: DecodePlan,
    cluster: String,
    prefill_headers: Vec<(String, String)>,
    /// The VM's budget the headers, model and request id take: a client's headers can be
    /// tens of KB, and a request keeps them until its KV is known to be read.
    headers_held: Reservation,
    scheduled_hosts: Vec<SocketAddr>,
    /// Number of the attempt in flight, from 0.
    attempt: u32,
    started: SystemTime,
}

impl Prefill {
    /// The scheduler-chosen host an attempt goes to, if any: the list is tried in turn.
    fn host(&self) -> Option<SocketAddr> {
        let count = self.scheduled_hosts.len();
        if count == 0 {
            return None;
        }
        self.scheduled_hosts
            .get(self.attempt as usize % count)
            .copied()
    }

    fn elapsed(&self, now: SystemTime) -> Duration {
        now.duration_since(self.started).unwrap_or_default()
    }

    /// Whether `prefill_timeout_ms` from the first attempt has passed (every attempt's call
    /// ends by then), give or take the host's clock.
    fn deadline_passed(&self, config: &Config, now: SystemTime) -> bool {
        self.elapsed(now).saturating_add(CLOCK_SLACK) >= config.prefill_timeout
    }

    fn call(&self, body: Vec<u8>, timeout: Duration) -> HttpCall {
        let mut headers = self.prefill_headers.clone();
        if let Some(host) = self.host() {
            headers.push((ORIGINAL_DST_HEADER.to_owned(), host.to_string()));
        }
        HttpCall {
            cluster: self.cluster.clone(),
            headers,
            body,
            timeout,
        }
    }
}

impl Session {
    pub fn new(config: Option<Rc<Config>>, held: HeldBytes) -> Session {
        Session {
            config,
            held,
            request_id: String::new(),
            state: State::Started,
            api: None,
            abandoned: AbandonedPrefills::default(),
            client: None,
            _abandoned_mark: None,
            upload: Upload::Ended,
            headers_held_for_body: false,
        }
    }

    /// Whether the request's headers were held for its body: without Envoy's
    /// `allow_on_headers_stop_iteration` such a body never comes.
    pub fn headers_held_for_body(&self) -> bool {
        self.headers_held_for_body
    }

    /// Notes whether `step`, the answer to the request's headers, holds them for a body
    /// still to come (a pause with no reply).
    fn headers_step(&mut self, step: Step) -> Step {
        self.headers_held_for_body = step.flow == Flow::Pause
            && matches!(self.upload, Upload::Arriving { .. })
            && !step
                .commands
                .iter()
                .any(|command| matches!(command, Command::SendReply(_)));
        step
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
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

    fn request_headers_step<H: HeaderLookup + ?Sized>(
        &mut self,
        headers: &H,
        end_of_stream: bool,
    ) -> Step {
        let Some(config) = self.config.clone() else {
            let reply = self.reply(&ClientError::internal(
                "pd-filter has no valid configuration",
            ));
            return Step::new(Flow::Pause, vec![reply]);
        };
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
        let api = match config.classify_path(&path) {
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
                // never ends takes no decode stream. The body's end continues both.
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
        if let Err(error) = check_content_type(headers.text("content-type")) {
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
        // The decode body differs from the client's: let Envoy frame it.
        commands.push(Command::RemoveRequestHeader("content-length".to_owned()));
        // Decode's answer may get prefill's usage and prompt logprobs, which a compressed
        // answer could not: decode answers plain, as vLLM does unless set up to compress.
        if headers.value("accept-encoding").is_some() {
            commands.push(Command::RemoveRequestHeader("accept-encoding".to_owned()));
        }
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

        let authority = headers
            .text(":authority")
            .unwrap_or(&config.prefill_cluster);
        let mut prefill_headers = vec![
            (":method".to_owned(), "POST".to_owned()),
            (":path".to_owned(), path),
            (":authority".to_owned(), authority.to_owned()),
            ("content-type".to_owned(), "application/json".to_owned()),
            ("x-request-id".to_owned(), self.request_id.clone()),
        ];
        for name in &config.forward_headers {
            if let Some(value) = headers.text(name) {
                prefill_headers.push((name.clone(), value.to_owned()));
            }
        }
        self.state = State::Buffering(Pending {
            api,
            prefill_headers,
            scheduled_hosts,
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
                if self.config_limit().is_some_and(|limit| buffered > limit) {
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
        let Some(config) = self.config.clone() else {
            return self.hold_or_continue();
        };
        if body.len() > config.max_request_body_bytes {
            return Step::new(Flow::Pause, self.reject_too_large());
        }
        match std::mem::replace(&mut self.state, State::PassThrough) {
            State::Buffering(pending) => self.start_prefill(&config, pending, body, now),
            State::StrippingKv => match strip_kv_transfer_params(&body) {
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

    fn start_prefill(
        &mut self,
        config: &Config,
        pending: Pending,
        body: Vec<u8>,
        now: SystemTime,
    ) -> Step {
        let prepared = match prepare_with(pending.api, &body, config.prefill_options) {
            Ok(prepared) => prepared,
            Err(error) => return Step::new(Flow::Pause, self.reject(&error)),
        };
        let mut commands = Vec::new();
        if let Some(name) = &config.model_header {
            // An empty model is no model: the default pools serve it.
            if let Some(model) = prepared.model.as_ref().filter(|model| !model.is_empty()) {
                if let Err(error) = check_model_for_header(model) {
                    return Step::new(Flow::Pause, self.reject(&error));
                }
                commands.push(Command::SetRequestHeader {
                    name: name.clone(),
                    value: model.clone(),
                });
                commands.push(Command::ClearRouteCache);
            }
        }
        commands.push(Command::Record(Metric::Orchestrated(pending.api)));
        let cluster = match &config.prefill_host_cluster {
            Some(cluster) if !pending.scheduled_hosts.is_empty() => cluster.clone(),
            _ => config
                .prefill_cluster_for(prepared.model.as_deref())
                .to_owned(),
        };
        // Kept for the KV release's model and cluster; a name longer than any model's
        // (which matched no configured pool) is not kept in the VM.
        let model = prepared
            .model
            .filter(|model| model.len() <= MAX_KEPT_MODEL_LEN);
        let kept = pending
            .prefill_headers
            .iter()
            .map(|(name, value)| name.len() + value.len())
            .sum::<usize>()
            + model.as_ref().map_or(0, String::len)
            + self.request_id.len();
        let Some(headers_held) = self.held.reserve(kept) else {
            return Step::new(Flow::Pause, self.refuse_overloaded());
        };
        let Some(original) = HeldBody::keep(body, &prepared.decode, &self.held) else {
            return Step::new(Flow::Pause, self.refuse_overloaded());
        };
        let prefill = Prefill {
            api: pending.api,
            original,
            model,
            decode: prepared.decode,
            cluster,
            prefill_headers: pending.prefill_headers,
            headers_held,
            scheduled_hosts: pending.scheduled_hosts,
            attempt: 0,
            started: now,
        };
        commands.push(Command::DispatchPrefill(
            prefill.call(prepared.prefill_body, config.prefill_timeout),
        ));
        self.state = State::Dispatching(prefill);
        Step::new(Flow::Pause, commands)
    }

    /// Whether the last [`Command::DispatchPrefill`] went out, with its token.
    pub fn on_prefill_dispatched(&mut self, token: Option<u32>, now: SystemTime) -> Vec<Command> {
        let prefill = match std::mem::replace(&mut self.state, State::PassThrough) {
            State::Dispatching(prefill) => prefill,
            State::Abandoned {
                prefill,
                token: None,
            } => {
                if token.is_some() {
                    self.state = State::Abandoned { prefill, token };
                } else {
                    self.state = State::Finished;
                }
                return Vec::new();
            }
            other => {
                self.state = other;
                return Vec::new();
            }
        };
        match token {
            Some(token) => {
                self.state = State::AwaitingPrefill { prefill, token };
                Vec::new()
            }
            None => {
                log::debug!(
                    "[{}] prefill call to {:?} could not be dispatched",
                    self.request_id,
                    prefill.cluster
                );
                // Not retried: the cluster is missing, another attempt would fail the same way.
                let failure = PrefillFailure::not_dispatched(&prefill.cluster);
                self.give_up(prefill, &failure, now)
            }
        }
    }

    /// The answer to a prefill call: `head.status` is `None` when it has no headers (a
    /// reset).
    pub fn on_prefill_response(
        &mut self,
        token: u32,
        head: PrefillHead<'_>,
        body: &[u8],
        now: SystemTime,
    ) -> Vec<Command> {
        let status = head.status;
        let read = |body| read_prefill_answer(status, body).with_retry_after(head.retry_after);
        let Some(config) = self.config.clone() else {
            return Vec::new();
        };
        let prefill = match std::mem::replace(&mut self.state, State::PassThrough) {
            State::AwaitingPrefill { prefill, token: t } if t == token => prefill,
            State::Abandoned {
                prefill,
                token: Some(t),
            } if t == token => {
                self.state = State::Finished;
                let PrefillAnswer::KvTransferParams(kv) = read(body) else {
                    return Vec::new();
                };
                log::debug!(
                    "[{}] the client left during prefill; releasing its KV",
                    self.request_id
                );
                let unread = UnreadKv {
                    model: prefill.model,
                    kv_transfer_params: kv.to_vec(),
                    headers: prefill.prefill_headers,
                    _held: prefill.headers_held,
                };
                return self.release(&config, unread).into_iter().collect();
            }
            other => {
                self.state = other;
                return Vec::new();
            }
        };
        match read(body) {
            PrefillAnswer::KvTransferParams(kv) => {
                let mut commands = self.prefill_time(&prefill, now, PrefillResult::Kv);
                let reached = prefill.host().filter(|_| config.replace_local_remote_host);
                let with_host = reached.and_then(|host| with_reachable_remote_host(kv, host.ip()));
                let kv = with_host.as_deref().unwrap_or(kv);
                let prompt_logprobs = prefill
                    .decode
                    .prompt_logprobs_from_prefill
                    .then(|| prompt_logprobs::from_prefill_answer(prefill.api, body))
                    .flatten();
                let limit = config.max_request_body_bytes;
                // Envoy would refuse to buffer a larger body, answering on its own while the
                // filter is still in this callback; prompt logprobs larger than the answers
                // the filter holds could not go into decode's answer.
                let refusal = if prefill.decode.len_with_kv(kv.len()) > limit {
                    Some(ClientError::decode_body_too_large(limit))
                } else {
                    let copies = prefill.decode.prompt_logprobs_copies;
                    prompt_logprobs
                        .as_ref()
                        .map(|logprobs| logprobs.len().saturating_mul(copies))
                        .filter(|size| size.saturating_add(REST_OF_ANSWER) > limit)
                        .map(|size| {
                            ClientError::prompt_logprobs_too_large(size, limit, REST_OF_ANSWER)
                        })
                };
                // Prompt logprobs wait in the VM until they go into decode's answer.
                let mut held_logprobs = None;
                let refused = match (refusal, prompt_logprobs) {
                    (Some(refusal), _) => Some(self.reject(&refusal)),
                    (None, Some(logprobs)) => match self.held.reserve(logprobs.len()) {
                        Some(reservation) => {
                            held_logprobs = Some(HeldLogprobs {
                                api: prefill.api,
                                logprobs,
                                _reservation: reservation,
                            });
                            None
                        }
                        None => Some(self.refuse_overloaded()),
                    },
                    (None, None) => None,
                };
                if let Some(refused) = refused {
                    commands.extend(refused);
                    let unread = UnreadKv {
                        model: prefill.model,
                        kv_transfer_params: kv.to_vec(),
                        headers: prefill.prefill_headers,
                        _held: prefill.headers_held,
                    };
                    commands.extend(self.release(&config, unread));
                    return commands;
                }
                log::debug!(
                    "[{}] prefill answered in {:?}; resuming to decode",
                    self.request_id,
                    prefill.elapsed(now)
                );
                let decoded = Metric::Request(prefill.api, Outcome::Decoded);
                commands.push(Command::Record(decoded));
                // Usually only the head of the body Envoy holds changes.
                let edit = prefill.decode.edit_with_kv(prefill.original.bytes(), kv);
                commands.push(Command::ReplaceRequestBody {
                    body: edit.head,
                    replaced_len: edit.replaced_len,
                });
                commands.push(Command::ResumeRequest);
                let prefill_time = Some(prefill.elapsed(now));
                let prompt_usage = (config.usage == UsagePolicy::Merge)
                    .then(|| prompt_usage_for_decode(prefill.api, body, kv))
                    .flatten()
                    .map(|usage| (prefill.api, usage));
                let unread_kv = config.release_kv_on_abandon.then(|| UnreadKv {
                    kv_transfer_params: kv.to_vec(),
                    model: prefill.model,
                    headers: prefill.prefill_headers,
                    _held: prefill.headers_held,
                });
                let stream_usage =
                    prefill.decode.stream_usage_asked || config.decode_forces_include_usage;
                self.state = State::Decoding {
                    prefill_time,
                    resumed_at: now,
                    unread_kv,
                    prompt_usage,
                    stream_usage,
                    prompt_logprobs: held_logprobs,
                    answer: AnswerRewrite::Untouched,
                };
                commands
            }
            PrefillAnswer::NoKvTransferParams(reason) => {
                let mut commands = self.prefill_time(&prefill, now, PrefillResult::NoKv);
                commands.extend(match config.on_missing_kv_transfer_params {
                    MissingKvPolicy::DecodeOnly => {
                        self.decode_only(prefill, FailureKind::NoKvTransferParams, &reason, now)
                    }
                    MissingKvPolicy::Fail => {
                        self.fail(&PrefillFailure::no_kv_transfer_params(&reason))
                    }
                });
                commands
            }
            PrefillAnswer::Failed(_)
                if status.is_none() && prefill.deadline_passed(&config, now) =>
            {
                let failure = PrefillFailure::timed_out_mid_answer(config.prefill_timeout);
                self.prefill_failed(prefill, failure, now)
            }
            PrefillAnswer::Failed(failure) => self.prefill_failed(prefill, failure, now),
        }
    }

    /// A failed attempt: retried while retries and time are left, then the policy decides.
    fn prefill_failed(
        &mut self,
        prefill: Prefill,
        failure: PrefillFailure,
        now: SystemTime,
    ) -> Vec<Command> {
        let Some(config) = self.config.clone() else {
            return Vec::new();
        };
        let budget_left = config
            .prefill_timeout
            .checked_sub(prefill.elapsed(now))
            .filter(|left| *left >= MIN_RETRY_BUDGET);
        let retry = failure.is_retryable();
        let Some(budget_left) =
            budget_left.filter(|_| retry && prefill.attempt < config.prefill_retries)
        else {
            return self.give_up(prefill, &failure, now);
        };
        // The prefill body is rebuilt rather than kept: retries are rare, memory is not.
        match &prefill.original {
            HeldBody::Whole { body: original, .. } => {
                let prepared = prepare_with(prefill.api, original, config.prefill_options);
                self.retry(prefill, prepared, failure, budget_left, now)
            }
            HeldBody::HeadOnly => {
                self.state = State::RereadingForRetry {
                    prefill,
                    failure,
                    budget_left,
                };
                vec![Command::ReadRequestBody]
            }
        }
    }

    /// The client's body as Envoy holds it, read again for a retry (`None`: it could not
    /// be read).
    pub fn on_request_body_reread(
        &mut self,
        body: Option<Vec<u8>>,
        now: SystemTime,
    ) -> Vec<Command> {
        let (prefill, failure, budget_left) =
            match std::mem::replace(&mut self.state, State::PassThrough) {
                State::RereadingForRetry {
                    prefill,
                    failure,
                    budget_left,
                } => (prefill, failure, budget_left),
                other => {
                    self.state = other;
                    return Vec::new();
                }
            };
        match body {
            Some(body) => {
                let options = self
                    .config
                    .as_ref()
                    .map(|config| config.prefill_options)
                    .unwrap_or_default();
                let prepared = prepare_with(prefill.api, &body, options);
                self.retry(prefill, prepared, failure, budget_left, now)
            }
            None => {
                log::debug!(
                    "[{}] the body could not be read again for a retry",
                    self.request_id
                );
                self.give_up(prefill, &failure, now)
            }
        }
    }

    /// The next attempt, with the prefill body written anew.
    fn retry(
        &mut self,
        mut prefill: Prefill,
        prepared: Result<PreparedRequest, ClientError>,
        failure: PrefillFailure,
        budget_left: Duration,
        now: SystemTime,
    ) -> Vec<Command> {
        let Ok(prepared) = prepared else {
            return self.give_up(prefill, &failure, now);
        };
        prefill.attempt += 1;
        log::info!(
            "[{}] prefill attempt {} failed ({}): {}; retrying",
            self.request_id,
            prefill.attempt,
            failure.kind.name(),
            failure.error.message
        );
        let call = prefill.call(prepared.prefill_body, budget_left);
        self.state = State::Dispatching(prefill);
        vec![Command::DispatchPrefill(call)]
    }

    /// No more attempts: the client gets the error, or decode recomputes if so configured.
    fn give_up(
        &mut self,
        prefill: Prefill,
        failure: &PrefillFailure,
        now: SystemTime,
    ) -> Vec<Command> {
        let Some(config) = self.config.clone() else {
            return Vec::new();
        };
        let mut commands = self.prefill_time(&prefill, now, PrefillResult::Failed);
        let decode_only = config.on_prefill_failure == PrefillFailurePolicy::DecodeOnly
            && !failure.is_client_error();
        commands.extend(if decode_only {
            self.decode_only(prefill, failure.kind, &failure.error.message, now)
        } else {
            self.fail(failure)
        });
        commands
    }

    /// How long the prefill leg took and what it came to, for the stats and for Envoy's
    /// access log.
    fn prefill_time(
        &self,
        prefill: &Prefill,
        now: SystemTime,
        result: PrefillResult,
    ) -> Vec<Command> {
        let elapsed = prefill.elapsed(now);
        vec![
            Command::Record(Metric::PrefillLatency(result, elapsed)),
            Command::SetFilterState {
                key: PREFILL_TIME_FILTER_STATE,
                value: elapsed.as_millis().to_string(),
            },
        ]
    }

    /// Sends the client's body to decode without any `kv_transfer_params`: decode
    /// recomputes the prompt.
    fn decode_only(
        &mut self,
        prefill: Prefill,
        kind: FailureKind,
        reason: &str,
        now: SystemTime,
    ) -> Vec<Command> {
        log::warn!(
            "[{}] prefill failure ({}): {reason}; decode will recompute the prompt",
            self.request_id,
            kind.name()
        );
        let mut commands = vec![
            Command::Record(Metric::PrefillFailure(kind)),
            Command::Record(Metric::DecodeOnlyFallback),
            Command::Record(Metric::Request(prefill.api, Outcome::DecodeOnly)),
        ];
        // Only a client body with `kv_transfer_params` changes, and that one is kept whole.
        if let Some(body) = prefill.decode.body_without_kv(prefill.original.bytes()) {
            commands.push(Command::ReplaceRequestBody {
                body,
                replaced_len: prefill.original.bytes().len(),
            });
        }
        commands.push(Command::ResumeRequest);
        self.state = State::Decoding {
            prefill_time: Some(prefill.elapsed(now)),
            resumed_at: now,
            unread_kv: None,
            prompt_usage: None,
            stream_usage: false,
            prompt_logprobs: None,
            answer: AnswerRewrite::Untouched,
        };
        commands
    }

    fn fail(&mut self, failure: &PrefillFailure) -> Vec<Command> {
        let mut commands = Vec::new();
        // A request prefill refused is the client's mistake, not a prefill failure: no
        // warning for what any client can send.
        if failure.is_client_error() {
            log::info!(
                "[{}] prefill refused the request: answering {}: {}",
                self.request_id,
                failure.error.status,
                failure.error.message
            );
            commands.extend(self.outcome(Outcome::ClientError));
        } else {
            log::warn!(
                "[{}] prefill failure ({}): answering {}: {}",
                self.request_id,
                failure.kind.name(),
                failure.error.status,
                failure.error.message
            );
            commands.push(Command::Record(Metric::PrefillFailure(failure.kind)));
            commands.extend(self.outcome(Outcome::PrefillFailed));
        }
        commands.push(self.reply(&failure.error));
        commands
    }

    /// The outcome of an orchestrated request, for the stats; nothing for other requests.
    fn outcome(&self, outcome: Outcome) -> Vec<Command> {
        self.api
            .map(|api| Command::Record(Metric::Request(api, outcome)))
            .into_iter()
            .collect()
    }

    /// Whether the response concerns the session at all: only a request sent on to decode
    /// by the filter. Every other answer goes by without its headers being read.
    pub fn watches_response(&self) -> bool {
        matches!(self.state, State::Decoding { .. })
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
        unread && status.is_none_or(|status| status >= 400)
    }

    /// The response to the client begins. Its headers wait only for a JSON answer whose
    /// usage is merged, when its length is announced and headers may be held.
    pub fn on_response_headers(&mut self, head: &ResponseHead) -> Step {
        let Some(config) = self.config.clone() else {
            return Step::new(Flow::Continue, vec![]);
        };
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
            rewrite = (prompt_usage.is_some() && *stream_usage)
                .then(|| AnswerRewrite::Events(EventStream::new(self.held.clone())));
        } else if rewrites && essence.eq_ignore_ascii_case("application/json") {
            rewrite = match head.announced_length() {
                // Empty, or larger than any answer worth holding: as decode wrote it.
                Some(0) => None,
                Some(length) if length > config.max_request_body_bytes => {
                    warn_answer_too_large(&self.request_id, config.max_request_body_bytes);
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
            let never_reached = head.code_details.is_some_and(decode_never_read)
                || head.decode_connected == Some(false);
            let reason = if never_reached {
                Some("decode was never reached")
            } else if decode_refused(head.status, head.code_details) {
                Some("decode refused the request")
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

    /// `size` bytes of the answer arrived (all of it held so far, for a whole answer).
    pub fn on_response_body(&mut self, size: usize, end_of_stream: bool) -> BodyStep {
        let limit = self.config_limit().unwrap_or_default();
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
                    warn_answer_too_large(&self.request_id, limit);
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

    /// The answer ended with trailers. Envoy then gives no body callback at its end, and the
    /// filter cannot add body bytes from a trailers callback: part of an event still waiting
    /// for its end is not sent on. vLLM sends no trailers; a proxy between it and Envoy might.
    pub fn on_response_trailers(&mut self) {
        if let State::Decoding {
            answer: AnswerRewrite::Events(events),
            ..
        } = &self.state
        {
            if events.holds_bytes() {
                log::warn!(
                    "[{}] decode's answer ended with trailers while {} bytes of an event \
                     waited for its end: the client does not get them",
                    self.request_id,
                    events.held_len()
                );
            }
        }
    }

    /// The answer's bytes asked for by [`Session::on_response_body`]: the latest chunk of an
    /// event stream, or the whole of a JSON answer.
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
        let headers_held = self
            .config
            .as_ref()
            .is_some_and(|config| answer.holds_headers(config));
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
                prompt_logprobs
                    .take()
                    .and_then(|held| {
                        prompt_logprobs::into_answer(held.api, current, &held.logprobs)
                    })
                    .or(merged)
            }
            AnswerRewrite::Events(events) => prompt_usage
                .as_ref()
                .and_then(|(api, prompt)| events.on_chunk(*api, prompt, body, end_of_stream)),
        };
        // Envoy's buffer holds at least `max_request_body_bytes` (documented); a larger
        // answer would make Envoy answer on its own from inside this callback. Such an answer
        // goes on as decode wrote it.
        let limit = self.config_limit().unwrap_or_default();
        // Often nothing changed (vLLM by default reports no cached_tokens on either leg, and
        // both count the same prompt): the answer is not written back.
        let rewritten = rewritten.filter(|rewritten| rewritten.as_slice() != body);
        let rewritten = rewritten.filter(|rewritten| {
            let fits = rewritten.len() <= limit;
            if !fits {
                log::warn!(
                    "[{}] the answer with prefill's usage and prompt logprobs would be larger \
                     than {limit} bytes; passed on as decode wrote it",
                    self.request_id
                );
            }
            fits
        });
        let commands = rewritten
            .map(|rewritten| Command::ReplaceResponseBody {
                body: rewritten,
                replaced_len: body.len(),
                announce_length: headers_held,
            })
            .into_iter()
            .collect();
        Step::new(Flow::Continue, commands)
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
        if let (Some(config), Some(unread)) = (self.config.clone(), unread) {
            commands.extend(self.release(&config, unread));
        }
        commands
    }

    /// The client went away, or the stream ended: prefill work still under way is released
    /// when it answers. A request already with decode needs nothing: decode has its KV.
    pub fn on_client_gone(&mut self) {
        if self.prefill_running() {
            self._abandoned_mark = self
                .client
                .as_deref()
                .map(|client| self.abandoned.mark(client));
        }
        self.state = match std::mem::replace(&mut self.state, State::Finished) {
            State::Dispatching(prefill) => State::Abandoned {
                prefill,
                token: None,
            },
            State::AwaitingPrefill { prefill, token } => State::Abandoned {
                prefill,
                token: Some(token),
            },
            abandoned @ State::Abandoned { .. } => abandoned,
            _ => State::Finished,
        };
    }

    /// Counts this request's prefill, should its client leave while it runs, among `abandoned`
    /// (one per VM), and refuses clients with too many there.
    pub fn with_abandoned_prefills(mut self, abandoned: AbandonedPrefills) -> Session {
        self.abandoned = abandoned;
        self
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

    /// Whether the client's address is wanted now that the client is leaving, before
    /// [`Session::on_client_gone`]: its prefill runs on, counted against it.
    pub fn wants_address_on_leaving(&self) -> bool {
        self.abandoned.is_limited() && self.client.is_none() && self.prefill_running()
    }

    /// A prefill call is out (or being handed to the host) for this request.
    fn prefill_running(&self) -> bool {
        matches!(
            self.state,
            State::Dispatching(_) | State::AwaitingPrefill { .. }
        )
    }

    /// The client's address (Envoy's `source.address`), read as the client leaves.
    pub fn on_leaving_client_address(&mut self, source_address: Option<&[u8]>) {
        self.client = source_address.and_then(client_key);
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

    /// Whether the request went on to decode and decode has not answered: when the client
    /// leaves now, [`Session::on_client_left_before_decode_answered`] says whether decode can
    /// have it.
    pub fn awaits_decode_answer(&self) -> bool {
        matches!(
            self.state,
            State::Decoding {
                unread_kv: Some(_),
                ..
            }
        )
    }

    /// The client left while decode had not answered. The KV prefill made is released when
    /// decode may not have read the request: Envoy never had a connection to decode for it
    /// (`decode_connected`, asked only when needed), or the client left within
    /// [`DELIVERY_WINDOW`] of the request going on. Later, a stream with a connection has
    /// delivered the request, whose cancellation vLLM's own abort path reports to prefill. A
    /// release for a request decode did read costs one token on one block of KV, and prefill
    /// logs a notification it does not know.
    pub fn on_client_left_before_decode_answered(
        &mut self,
        now: SystemTime,
        decode_connected: impl FnOnce() -> bool,
    ) -> Vec<Command> {
        let Some(config) = self.config.clone() else {
            return Vec::new();
        };
        let State::Decoding {
            unread_kv,
            resumed_at,
            ..
        } = &mut self.state
        else {
            return Vec::new();
        };
        if unread_kv.is_none() {
            return Vec::new();
        }
        let since_resumed = now.duration_since(*resumed_at).unwrap_or_default();
        let reason = if since_resumed < DELIVERY_WINDOW {
            "before decode can be known to have read the request"
        } else if !decode_connected() {
            "before decode was connected"
        } else {
            return Vec::new();
        };
        let Some(unread) = unread_kv.take() else {
            return Vec::new();
        };
        log::debug!(
            "[{}] the client left {reason}; releasing the KV",
            self.request_id
        );
        self.release(&config, unread).into_iter().collect()
    }

    /// The call that frees prefill's KV for a request decode will not run, if so configured.
    fn release(&self, config: &Config, unread: UnreadKv) -> Option<Command> {
        if !config.release_kv_on_abandon {
            return None;
        }
        // Never the client's body: the smallest request takes the KV as well, and carries
        // nothing (prompt logprobs, tools, a long prompt) that would make decode compute more.
        let mut headers = unread.headers;
        for (name, value) in headers.iter_mut() {
            if name == ":path" {
                *value = MINIMAL_RELEASE_PATH.to_owned();
            }
        }
        let body = minimal_kv_release_body(unread.model.as_deref(), &unread.kv_transfer_params);
        headers.push((KV_RELEASE_HEADER.to_owned(), "1".to_owned()));
        Some(Command::ReleaseKv(HttpCall {
            cluster: config
                .decode_cluster_for(unread.model.as_deref())
                .to_owned(),
            headers,
            body,
            timeout: config.kv_release_timeout,
        }))
    }

    fn hold_or_continue(&self) -> Step {
        match self.state {
            State::PassThrough | State::Decoding { .. } | State::Started => {
                Step::new(Flow::Continue, Vec::new())
            }
            _ => Step::new(Flow::Pause, Vec::new()),
        }
    }

    fn config_limit(&self) -> Option<usize> {
        self.config
            .as_ref()
            .map(|config| config.max_request_body_bytes)
    }

    /// A refusal decided while the client is still sending its body waits for the body's
    /// end, the body dropped as it comes: a client that writes its whole body before it reads
    /// (httpx's async client, so the async OpenAI and Anthropic SDKs) otherwise meets an
    /// HTTP/1.1 connection Envoy closes under its upload, and never sees the answer. At the
    /// request headers only where they may wait for the body
    /// ([`Config::headers_may_wait_for_body`]); never for more than
    /// [`REFUSED_UPLOAD_READ_FACTOR`] times the body limit. `buffered`: the body Envoy holds
    /// now.
    fn answer_after_upload(&mut self, mut step: Step, buffered: usize, at_headers: bool) -> Step {
        let Upload::Arriving { declared } = self.upload else {
            return step;
        };
        let headers_held = self
            .config
            .as_ref()
            .is_some_and(|config| config.headers_may_wait_for_body());
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

    fn readable_refused_upload(&self) -> usize {
        self.config_limit()
            .unwrap_or_default()
            .saturating_mul(REFUSED_UPLOAD_READ_FACTOR)
    }

    /// The answer a refused request's upload waited for.
    fn send_refusal(&mut self) -> Vec<Command> {
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

    fn reject_too_large(&mut self) -> Vec<Command> {
        let limit = self.config_limit().unwrap_or_default();
        self.reject(&ClientError::payload_too_large(limit))
    }

    /// The request id both legs carry: the client's (or Envoy's), else a new one. A client's
    /// id goes into every log line about its request, here and on both vLLM workers: one
    /// that is long or has anything but visible ASCII (a line separator, an escape sequence)
    /// is replaced, so that no client writes lines of its own into those logs.
    fn take_request_id<H: HeaderLookup + ?Sized>(
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

    fn reply(&mut self, error: &ClientError) -> Command {
        self.state = State::Answered;
        let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
        if !self.request_id.is_empty() {
            headers.push(("x-request-id".to_owned(), self.request_id.clone()));
        }
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
            body: error.body_for(self.api),
        })
    }
}

/// The longest client request id kept: ids are UUIDs (36) or trace ids (32) in practice.
const LONGEST_REQUEST_ID: usize = 128;

fn is_loggable_id(id: &str) -> bool {
    (1..=LONGEST_REQUEST_ID).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic())
}

fn discard(buffered: usize) -> Vec<Command> {
    (buffered > 0)
        .then_some(Command::DiscardRequestBody(buffered))
        .into_iter()
        .collect()
}

fn warn_answer_too_large(request_id: &str, limit: usize) {
    log::warn!(
        "[{request_id}] decode's answer is larger than {limit} bytes (max_request_body_bytes): \
         passed on as decode wrote it, without prefill's usage or prompt logprobs"
    );
}

#[cfg(test)]
mod tests;
