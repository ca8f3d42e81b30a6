//! The adapter to the proxy-wasm host: it turns host callbacks ([`dispatch`]'s) into
//! [`Session`] events and the session's commands into host calls, and decides nothing
//! itself. Host calls go through [`host`], where a refusal is a value; a reset callout's
//! headers come as an empty list.
//!
//! Callouts belong to the worker's root context, not to the request: the dispatcher delivers
//! an answer only to the context that sent the call, and a request's context is gone once its
//! client is, while prefill's answer (and the KV it holds) still comes. A request hands its
//! calls to the root; the root sends them, reads their answers, and acts on the request (its
//! effective context) while the client is there.
//!
//! A prefill call is handed over without a turn of the event loop: the request calls the
//! dispatcher's `proxy_on_queue_ready` export for the root, which runs a callback of the root
//! (an answer goes to the context whose callback sent the call), and the root sends the call
//! at once; the KV-release tests (clients that leave during prefill) fail if answers stop
//! being routed that way. Where it cannot be done (inside a callback of the root, which the
//! dispatcher holds borrowed) the call waits in a per-worker shared queue for the root's next
//! turn, as KV releases do. A call is never sent in a request's own context: where the queue
//! cannot take it, the root runs it at once the same way.
//!
//! So a request may be resumed while one of its own request callbacks still runs: Envoy
//! refuses a prefill call at once (no healthy host, a full pool, no such cluster) and
//! `decode_only` sends the body to decode. The host's `continue_stream` would then resume the
//! stream before Envoy has taken the chunk in hand: a body that came in one frame with the
//! stream's end (HTTP/2) would go to decode as headers alone, or never. There the callback's
//! own answer resumes it instead ([`Request::resume_on_return`]).

use std::cell::{Cell, OnceCell, RefCell};
use std::collections::VecDeque;
use std::rc::{Rc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::dispatch::{self, Action, Root, Stream};
use crate::host::{BufferType, LogLevel, MapType};

use crate::abandoned::AbandonedPrefills;
use crate::callouts::{Attempt, Caller, Callouts, Job, NotKept, ReleaseStart, Retry};
use crate::config::Config;
use crate::decode_outage::DecodeOutages;
use crate::headers::HeaderLookup;
use crate::held_bytes::HeldBytes;
use crate::held_headers_check::{HeldHeadersCheck, NO_BODY_WARNING_AFTER};
use crate::host;
use crate::log_budget::announces_configuration;
use crate::logger;
use crate::protocol::kv_release::{decode_unreached, release_succeeded};
use crate::request_id::new_request_id;
use crate::session::{
    reply_without_configuration, reply_without_context, BodyStep, CallRefused, Command, Flow,
    HostFailure, HttpCall, LocalReply, Metric, PrefillHead, ResponseHead, Session, Step,
    FILTER_RAN_FILTER_STATE,
};
use crate::stats::Stats;
use crate::upload_slices::UploadSlices;
use crate::vm_roots::VmRoots;

thread_local! {
    /// This VM's configured roots (one VM per worker thread, so one count per VM).
    static VM_ROOTS: RefCell<VmRoots> = RefCell::new(VmRoots::default());
    /// The workers of this VM's roots that Envoy is done with and that finish their calls
    /// first: they go with the VM when its last root is done.
    static FINISHING: RefCell<Vec<Weak<Worker>>> = const { RefCell::new(Vec::new()) };
    /// What this VM's requests hold in it, whichever root they came through: each root's
    /// `max_vm_held_bytes` bounds the VM's total.
    static VM_HELD: HeldBytes = HeldBytes::new(0);
    /// The VM's prefill calls running on after their clients left, and the decode pools
    /// Envoy cannot connect to, whichever root they came through: per worker, as documented.
    static VM_ABANDONED: AbandonedPrefills = AbandonedPrefills::default();
    static VM_DECODE_OUTAGES: DecodeOutages = DecodeOutages::default();
}

/// The VM's start ([`dispatch`]'s `_initialize`): the logger, and how roots are made.
pub fn start() {
    logger::install(LogLevel::Info);
    dispatch::set_factories(
        |root_id| -> Box<dyn Root> {
            Box::new(PdRoot {
                config: None,
                counted: false,
                held: HeldBytes::new(0),
                abandoned: AbandonedPrefills::default(),
                worker: Rc::new(Worker::new(root_id)),
            })
        },
        || Box::new(Refusing(reply_without_context)),
    );
}

struct PdRoot {
    config: Option<Rc<Config>>,
    /// Counted among the VM's configured roots ([`VM_ROOTS`]).
    counted: bool,
    /// What this VM's requests hold in it, against `max_vm_held_bytes`.
    held: HeldBytes,
    /// This VM's prefill calls still running after their clients left, by client.
    abandoned: AbandonedPrefills,
    worker: Rc<Worker>,
}

/// How often the root looks for KV releases due to be sent again, while any wait.
const RETRY_TICK: Duration = Duration::from_millis(250);

/// The queue id the root's `on_queue_ready` gets for a call sent at once
/// ([`Worker::send_as_root`]); never one the host hands out.
const SEND_NOW: u32 = u32::MAX;

/// The queue id the root's `on_queue_ready` gets for a job run at once
/// ([`Worker::run_as_root`]); never one the host hands out.
const RUN_NOW: u32 = u32::MAX - 1;

/// What one worker's root context shares with its requests.
struct Worker {
    root_id: u32,
    /// A callback of the root is running: the dispatcher holds the root borrowed.
    in_root: Cell<bool>,
    /// The call the root is to send at once, and the token it went out with.
    send_now: RefCell<Option<HttpCall>>,
    sent_now: Cell<Option<Result<u32, CallRefused>>>,
    /// The job the root is to run at once.
    run_now: RefCell<Option<Job<Rc<Request>>>>,
    stats: OnceCell<Stats>,
    queue: Cell<Option<u32>>,
    /// The root's tick is on (KV releases wait to be sent again).
    ticking: Cell<bool>,
    callouts: RefCell<Callouts<Rc<Request>>>,
    held_headers: RefCell<HeldHeadersCheck>,
    /// The decode pools Envoy cannot connect to, shared with this worker's requests.
    decode_outages: RefCell<DecodeOutages>,
    /// Envoy is done with the plugin (a new configuration, a drained listener) and the
    /// root lives on until its calls have finished.
    finishing: Cell<bool>,
}

/// A request, shared by its own context and the root (which outlives it).
struct Request {
    context_id: u32,
    session: RefCell<Session>,
    alive: Cell<bool>,
    /// One of the request's own request callbacks (headers, body, trailers) is running.
    in_request_callback: Cell<bool>,
    /// The stream was resumed during that callback: its answer to Envoy is `Continue`.
    resume_on_return: Cell<bool>,
}

/// Which context a callback runs in: the root must make the request's stream the effective
/// context before acting on it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum In {
    Root,
    Request,
}

/// The host's clock, read at most once per callback and only when something needs it.
#[derive(Default)]
struct Clock(Cell<Option<SystemTime>>);

impl Clock {
    fn now(&self) -> SystemTime {
        if let Some(now) = self.0.get() {
            return now;
        }
        let now = host::now().unwrap_or(UNIX_EPOCH);
        self.0.set(Some(now));
        now
    }
}

/// The level for the ABI's number.
fn log_level(level: u32) -> Option<LogLevel> {
    Some(match level {
        0 => LogLevel::Trace,
        1 => LogLevel::Debug,
        2 => LogLevel::Info,
        3 => LogLevel::Warn,
        4 => LogLevel::Error,
        5 => LogLevel::Critical,
        _ => return None,
    })
}

/// Follows Envoy's level, so that debug lines cost nothing per request unless asked for.
fn follow_envoys_log_level() {
    if let Some(level) = host::log_level().ok().and_then(log_level) {
        logger::set_level(level);
    }
}

/// A release's first attempt, from now.
fn first_attempt() -> Attempt {
    Attempt::first(host::now().unwrap_or(UNIX_EPOCH))
}

/// The callback's answer to Envoy. A step may both reply and pause: Envoy carries out
/// `send_local_response` once the callback has returned, so the pause only stops Envoy from
/// going on by itself in between. A resume in a request callback is its answer instead
/// ([`PdRequest::request_callback`]); a resume in another (a response callback, the root's)
/// is the host's `continue_stream`.
fn action(flow: Flow) -> Action {
    match flow {
        Flow::Continue => Action::Continue,
        Flow::Pause => Action::Pause,
    }
}

impl Worker {
    fn new(root_id: u32) -> Worker {
        Worker {
            root_id,
            in_root: Cell::new(false),
            send_now: RefCell::new(None),
            sent_now: Cell::new(None),
            run_now: RefCell::new(None),
            stats: OnceCell::new(),
            queue: Cell::new(None),
            ticking: Cell::new(false),
            callouts: RefCell::new(Callouts::default()),
            held_headers: RefCell::new(HeldHeadersCheck::default()),
            decode_outages: RefCell::new(DecodeOutages::default()),
            finishing: Cell::new(false),
        }
    }

    /// Lets Envoy delete a root that outlived its plugin once nothing is left to send or
    /// answer (Envoy deletes it after the current callback).
    fn finish_if_idle(&self) {
        if !self.finishing.get() || !self.callouts.borrow().is_idle() {
            return;
        }
        self.finishing.set(false);
        if self.ticking.replace(false) {
            let _ = host::set_tick_period(Duration::ZERO);
        }
        if let Err(status) = host::done() {
            log::warn!("proxy_done: status {status}");
        }
    }

    /// Envoy ends this VM with calls left (README, "Releasing KV"): releases not sent are
    /// dropped, and the log says what went.
    fn lost_with_the_vm(&self) {
        if self.callouts.borrow().is_idle() {
            return;
        }
        let unfinished = self.callouts.borrow().unfinished();
        log::warn!(
            "Envoy is ending this VM (its listener was removed, or the new configuration \
             needs another VM: another vm_config or code): {} KV releases still to send are \
             lost, {} sent are cut before their answer, and {} prefill calls are cut; prefill \
             keeps the KV of the releases until its own timeout",
            unfinished.releases_unsent,
            unfinished.releases_in_flight,
            unfinished.prefills
        );
        for _ in 0..unfinished.releases_unsent {
            self.record(Metric::KvReleaseDropped);
        }
        if self.ticking.replace(false) {
            let _ = host::set_tick_period(Duration::ZERO);
        }
    }

    fn record(&self, metric: Metric) {
        if let Some(stats) = self.stats.get() {
            stats.record(metric);
        }
    }

    /// Runs `work` as a callback of the root, during which the dispatcher holds the root
    /// borrowed.
    fn as_root<T>(&self, work: impl FnOnce() -> T) -> T {
        let was_in_root = self.in_root.replace(true);
        let result = work();
        self.in_root.set(was_in_root);
        result
    }

    /// Sends `call` as the root from a request's callback. `Err` gives the call back when
    /// that cannot be done here; `Ok(Err(_))` when Envoy would not send it.
    fn send_as_root(&self, call: HttpCall) -> Result<Result<u32, CallRefused>, HttpCall> {
        if self.in_root.get() {
            return Err(call);
        }
        *self.send_now.borrow_mut() = Some(call);
        self.sent_now.set(None);
        // The dispatcher's export, called as the host would call it: the root's callback,
        // whose calls answer to the root.
        dispatch::proxy_on_queue_ready(self.root_id, SEND_NOW);
        self.send_now.borrow_mut().take();
        // The root's callback did not run: as a call Envoy refused.
        Ok(self.sent_now.take().unwrap_or(Err(CallRefused::AtOnce)))
    }

    /// Runs `job` as the root from a request's callback, at once: the dispatcher drops the
    /// answer to a call sent in a request's context once that context is gone, and with it
    /// the call's caller, which holds the request.
    fn run_as_root(&self, job: Job<Rc<Request>>) {
        if self.in_root.get() {
            self.run_job(job, In::Root, &Clock::default());
            return;
        }
        *self.run_now.borrow_mut() = Some(job);
        // As in `send_as_root`.
        dispatch::proxy_on_queue_ready(self.root_id, RUN_NOW);
        let lost = self.run_now.borrow_mut().take();
        if let Some(Job::Release(call)) = lost {
            log::warn!(
                "[{}] KV release dropped: the root context did not run it",
                call.request_id()
            );
            self.record(Metric::KvReleaseDropped);
        } else if lost.is_some() {
            log::warn!("the root context did not run a call handed to it: the call is lost");
        }
    }

    /// Hands a call to the root: a prefill call is sent at once where possible; others wait
    /// in the shared queue for the root's turn, or are run at once where there is no queue.
    fn hand_over(&self, job: Job<Rc<Request>>, clock: &Clock) {
        let job = match job {
            Job::Prefill(request, call) => match self.send_as_root(call) {
                Ok(sent) => {
                    self.prefill_dispatched(&request, sent, In::Request, clock);
                    return;
                }
                Err(call) => Job::Prefill(request, call),
            },
            job => job,
        };
        let Some(queue) = self.queue.get() else {
            self.run_as_root(job);
            return;
        };
        let wake = self.callouts.borrow_mut().queue(job);
        if wake {
            if let Err(status) = host::enqueue(queue, b"1") {
                log::warn!("could not wake the root context: {status:?}");
                let job = self.callouts.borrow_mut().wake_failed();
                if let Some(job) = job {
                    self.run_as_root(job);
                }
            }
        }
    }

    /// The root's turn: the call to send at once, or every call queued since the last turn.
    fn on_queue_ready(&self, queue: u32) {
        if queue == SEND_NOW {
            let sent = self
                .send_now
                .borrow()
                .as_ref()
                .map(|call| self.try_dispatch(call).map_err(refusal));
            self.sent_now.set(sent);
            return;
        }
        if queue == RUN_NOW {
            let job = self.run_now.borrow_mut().take();
            if let Some(job) = job {
                self.as_root(|| self.run_job(job, In::Root, &Clock::default()));
            }
            return;
        }
        self.as_root(|| {
            while let Ok(Some(_)) = host::dequeue(queue) {}
            self.callouts.borrow_mut().woken();
            loop {
                let job = self.callouts.borrow_mut().next_job();
                let Some(job) = job else { break };
                self.run_job(job, In::Root, &Clock::default());
            }
        });
    }

    fn run_job(&self, job: Job<Rc<Request>>, context: In, clock: &Clock) {
        match job {
            // Nothing to do for a client gone before its prefill went out.
            Job::Prefill(request, _) if !request.alive.get() => {}
            Job::Prefill(request, call) => self.dispatch_prefill(&request, &call, context, clock),
            Job::Release(call) => self.dispatch_release(&call, first_attempt()),
        }
    }

    /// Envoy answers `BadArgument` for a cluster it does not have, and `InternalFailure` for
    /// a call it refused at once (the cluster's pool full, no healthy host).
    fn try_dispatch(&self, call: &HttpCall) -> Result<u32, u32> {
        dispatch::http_call(&call.cluster, &call.headers, &call.body, call.timeout)
            .inspect_err(|status| log::debug!("http_call to {:?}: status {status}", call.cluster))
    }

    fn dispatch_prefill(&self, request: &Rc<Request>, call: &HttpCall, context: In, clock: &Clock) {
        let sent = self.try_dispatch(call).map_err(refusal);
        self.prefill_dispatched(request, sent, context, clock);
    }

    fn prefill_dispatched(
        &self,
        request: &Rc<Request>,
        sent: Result<u32, CallRefused>,
        context: In,
        clock: &Clock,
    ) {
        if let Ok(token) = sent {
            self.callouts
                .borrow_mut()
                .prefill_sent(token, request.clone());
        }
        let commands = request
            .session
            .borrow_mut()
            .on_prefill_dispatched(sent, clock.now());
        self.act_on(request, commands, context, clock);
    }

    /// Sends an attempt at a release, or keeps it until a release in flight has answered.
    fn dispatch_release(&self, call: &HttpCall, attempt: Attempt) {
        let now = host::now().unwrap_or(UNIX_EPOCH);
        let (start, expired) = self.callouts.borrow_mut().begin_release(call, attempt, now);
        for call in &expired {
            self.release_past_lease(call);
        }
        match start {
            ReleaseStart::Send => {
                let _ = self.send_release(call, attempt);
            }
            ReleaseStart::Waits => {}
            ReleaseStart::PastLease => self.release_past_lease(call),
            ReleaseStart::NoRoomToWait => {
                log::warn!(
                    "[{}] KV release dropped: too many wait for a slot \
                     (max_kv_releases_in_flight), or it is larger than the VM may keep",
                    call.request_id()
                );
                self.record(Metric::KvReleaseDropped);
            }
        }
    }

    /// Sends the releases that waited for the slots now free. One Envoy refuses at once
    /// stops the round once retries wait: the next would be refused alike, and the root's
    /// tick sends them later.
    fn send_waiting_releases(&self) {
        self.drop_expired_releases(host::now().unwrap_or(UNIX_EPOCH));
        loop {
            let next = self.callouts.borrow_mut().next_waiting_release();
            let Some((call, attempt)) = next else { break };
            if !self.send_release(&call, attempt) && self.ticking.get() {
                break;
            }
        }
    }

    /// Drops the waiting releases whose first attempt is older than vLLM 0.33's lease.
    fn drop_expired_releases(&self, now: SystemTime) {
        let expired = self.callouts.borrow_mut().expire_waiting(now);
        for call in expired {
            self.release_past_lease(&call);
        }
    }

    fn release_past_lease(&self, call: &HttpCall) {
        log::warn!(
            "[{}] KV release dropped: 30 s after its first attempt it had not gone out \
             (decode unreachable, or slow to answer releases: max_kv_releases_in_flight), and \
             vLLM 0.33 holds KV nobody reads that long",
            call.request_id()
        );
        self.record(Metric::KvReleaseDropped);
    }

    /// Sends a release whose slot is taken; whether it went out.
    fn send_release(&self, call: &HttpCall, attempt: Attempt) -> bool {
        let status = match self.try_dispatch(call) {
            Ok(token) => {
                self.callouts
                    .borrow_mut()
                    .release_went_out(token, call, attempt);
                return true;
            }
            Err(status) => status,
        };
        // Sent again later either way: a cluster Envoy does not have may be one a dynamic
        // configuration is replacing for a few seconds.
        let why = match refusal(status) {
            CallRefused::NoSuchCluster => {
                "Envoy has no such cluster (decode_cluster, model_decode_clusters)"
            }
            // Decode's pool full or without a healthy host, for the release as for the
            // request it follows.
            CallRefused::AtOnce => "its pool is full or has no healthy host",
        };
        log::warn!(
            "[{}] KV release to cluster {:?} refused by Envoy at once (attempt {}): {why}",
            call.request_id(),
            call.cluster,
            attempt.number
        );
        let retry = self.callouts.borrow_mut().release_refused(call, attempt);
        match retry {
            Ok(retry) => self.release_unreached(retry),
            Err(no_retry) => {
                log::warn!(
                    "[{}] KV release failed: {}; prefill keeps the KV until its own timeout",
                    call.request_id(),
                    no_retry.reason()
                );
                self.record(Metric::KvReleaseFailed);
            }
        }
        false
    }

    /// A release decode could not be reached for waits to be sent again: the root ticks
    /// while any wait.
    fn release_unreached(&self, retry: Retry) {
        let now = host::now().unwrap_or(UNIX_EPOCH);
        let request_id = retry.request_id().to_owned();
        let kept = self.callouts.borrow_mut().retry_later(retry, now);
        if let Err(not_kept) = kept {
            let why = match not_kept {
                NotKept::TooMany => "too many releases wait to be sent again",
                NotKept::PastLease => "the next attempt would come after vLLM 0.33's 30 s lease",
            };
            log::warn!(
                "[{request_id}] KV release dropped: decode could not take it (unreachable, or \
                 its pool full), and {why}"
            );
            self.record(Metric::KvReleaseDropped);
            return;
        }
        if !self.ticking.replace(true) {
            if let Err(status) = host::set_tick_period(RETRY_TICK) {
                self.ticking.set(false);
                log::warn!("no tick for KV release retries: status {status}");
            }
        }
    }

    /// The root's tick: the releases due to be sent again.
    fn on_tick(&self) {
        let now = host::now().unwrap_or(UNIX_EPOCH);
        let due = self.callouts.borrow_mut().due_retries(now);
        for (call, attempt) in due {
            self.dispatch_release(&call, attempt);
        }
        // Those that stopped waiting for a slot when Envoy refused one at once.
        self.send_waiting_releases();
        if !self.callouts.borrow().retries_waiting() && self.ticking.replace(false) {
            let _ = host::set_tick_period(Duration::ZERO);
        }
    }

    /// The answer to a call, read in the context that receives it.
    fn on_answer(&self, token: u32, body_size: usize, context: In) {
        let caller = self.callouts.borrow_mut().answered(token);
        // A reset callout has no headers at all: read them as a list, never `:status` by name.
        let headers = host::header_map(MapType::HttpCallResponseHeaders).unwrap_or_default();
        let status = headers
            .text(":status")
            .and_then(|status| status.parse::<u16>().ok());
        match caller {
            Some(Caller::Prefill(request)) => {
                let body = host::buffer(BufferType::HttpCallResponseBody, 0, body_size)
                    .unwrap_or_default();
                let clock = Clock::default();
                let head = PrefillHead {
                    status,
                    retry_after: headers.text("retry-after"),
                };
                let commands = request.session.borrow_mut().on_prefill_response(
                    token,
                    head,
                    &body,
                    clock.now(),
                );
                self.act_on(&request, commands, context, &clock);
            }
            Some(Caller::Release {
                request_id,
                cluster,
                retry,
            }) => {
                log::debug!("[{request_id}] KV release answered {status:?}");
                // Decode's own answer (Envoy's for a call that failed is a 5xx, or none): its
                // pool can be reached again, whatever the probes were.
                if status.is_some_and(|status| status < 500) {
                    self.decode_outages.borrow().reached(&cluster);
                }
                if release_succeeded(status) {
                    self.record(Metric::KvReleased);
                } else if let (true, Some(retry)) = (decode_unreached(status), retry) {
                    self.release_unreached(retry);
                } else {
                    log::warn!(
                        "[{request_id}] KV release failed: decode answered {}; prefill keeps \
                         the KV until its own timeout",
                        status.map_or("nothing".to_owned(), |status| status.to_string())
                    );
                    self.record(Metric::KvReleaseFailed);
                }
                self.send_waiting_releases();
            }
            None => {}
        }
    }

    /// Carries out a request's commands. Only calls that outlive it run for a gone client.
    fn act_on(&self, request: &Rc<Request>, commands: Vec<Command>, context: In, clock: &Clock) {
        if commands.is_empty() {
            return;
        }
        let alive = request.alive.get();
        if alive && context == In::Root {
            if let Err(status) = host::set_effective_context(request.context_id) {
                log::debug!("set_effective_context: {status:?}");
                return;
            }
        }
        let mut queue = VecDeque::from(commands);
        while let Some(command) = queue.pop_front() {
            let follow_up = match command {
                Command::DispatchPrefill(call) => {
                    self.prefill_call(request, call, context, clock);
                    Vec::new()
                }
                Command::ReleaseKv(call) => {
                    self.release_call(call, context, clock);
                    Vec::new()
                }
                Command::Record(metric) => {
                    self.record(metric);
                    Vec::new()
                }
                // Envoy may have ended the stream inside one of these host calls (a body grown
                // past its buffer): none after that.
                command if request.alive.get() => perform(request, command),
                // A gone request's stream is not there to act on.
                _ => Vec::new(),
            };
            for command in follow_up.into_iter().rev() {
                queue.push_front(command);
            }
        }
    }

    fn prefill_call(&self, request: &Rc<Request>, call: HttpCall, context: In, clock: &Clock) {
        match context {
            // Already the root's turn (a retry): send it now.
            In::Root => self.dispatch_prefill(request, &call, In::Root, clock),
            In::Request => self.hand_over(Job::Prefill(request.clone(), call), clock),
        }
    }

    fn release_call(&self, call: HttpCall, context: In, clock: &Clock) {
        match context {
            In::Root => self.dispatch_release(&call, first_attempt()),
            In::Request => self.hand_over(Job::Release(call), clock),
        }
    }
}

/// Carries out one command on the request's stream; a command whose result the session
/// needs returns the session's next commands.
fn perform(request: &Request, command: Command) -> Vec<Command> {
    let session = &request.session;
    let request_id = || session.borrow().request_id().to_owned();
    match command {
        Command::SetRequestHeader { name, value } => {
            if let Err(status) = host::set_header(MapType::HttpRequestHeaders, &name, Some(&value))
            {
                log::warn!(
                    "[{}] could not set request header {name}: {status:?}",
                    request_id()
                );
            }
        }
        Command::RemoveRequestHeader(name) => {
            if let Err(status) = host::set_header(MapType::HttpRequestHeaders, &name, None) {
                log::warn!(
                    "[{}] could not remove request header {name}: {status:?}",
                    request_id()
                );
            }
        }
        Command::ClearRouteCache => {
            let _ = host::call_foreign_function("clear_route_cache");
        }
        Command::ReplaceRequestBody { body, replaced_len } => {
            if let Err(status) =
                host::set_buffer(BufferType::HttpRequestBody, 0, replaced_len, &body)
            {
                log::debug!("[{}] set_buffer(HttpRequestBody): {status:?}", request_id());
                return session
                    .borrow_mut()
                    .on_host_failure(HostFailure::ReplaceRequestBody);
            }
        }
        Command::ReadRequestBody => {
            let body = host::buffer(BufferType::HttpRequestBody, 0, usize::MAX)
                .map_err(|status| {
                    log::debug!("[{}] get_buffer(HttpRequestBody): {status:?}", request_id())
                })
                .ok();
            let now = host::now().unwrap_or(UNIX_EPOCH);
            return session.borrow_mut().on_request_body_reread(body, now);
        }
        // Envoy would resume the stream before it has buffered the chunk its callback holds:
        // the callback answers `Continue` instead, with the body as the commands left it.
        Command::ResumeRequest if request.in_request_callback.get() => {
            request.resume_on_return.set(true);
        }
        Command::ResumeRequest => {
            if let Err(status) = host::resume_request() {
                log::error!(
                    "[{}] could not resume the request: {status:?}",
                    request_id()
                );
            }
        }
        Command::DiscardRequestBody(len) => {
            if let Err(status) = host::set_buffer(BufferType::HttpRequestBody, 0, len, &[]) {
                log::debug!("[{}] could not drop the upload: {status:?}", request_id());
                return session.borrow_mut().on_discard_failed();
            }
        }
        Command::SendReply(reply) => {
            if let Err(status) = host::send_reply(reply.status, &reply.headers, &reply.body) {
                log::error!(
                    "[{}] could not send the error reply: {status:?}",
                    request_id()
                );
            }
        }
        Command::SetFilterState { key, value } => {
            if let Err(status) = host::set_property(key, value.as_bytes()) {
                log::debug!("[{}] could not set {key}: status {status}", request_id());
            }
        }
        Command::RemoveResponseHeader(name) => {
            if let Err(status) = host::set_header(MapType::HttpResponseHeaders, &name, None) {
                log::warn!(
                    "[{}] could not remove response header {name}: {status:?}",
                    request_id()
                );
            }
        }
        Command::ReplaceResponseBody {
            body,
            replaced_len,
            announce_length,
        } => {
            let replaced = host::set_buffer(BufferType::HttpResponseBody, 0, replaced_len, &body);
            let announced = match replaced {
                Ok(()) if announce_length => {
                    let length = body.len().to_string();
                    host::set_header(
                        MapType::HttpResponseHeaders,
                        "content-length",
                        Some(&length),
                    )
                }
                other => other,
            };
            if let Err(status) = announced {
                log::warn!(
                    "[{}] could not write the answer (its length announced: {announce_length}): \
                     {status:?}",
                    request_id()
                );
            }
        }
        Command::AddResponseHeader { name, value } => {
            if let Err(status) = host::add_header(MapType::HttpResponseHeaders, &name, &value) {
                log::warn!("[{}] could not add {name}: {status:?}", request_id());
            }
        }
        // Handled by the worker.
        Command::DispatchPrefill(_) | Command::ReleaseKv(_) | Command::Record(_) => {}
    }
    Vec::new()
}

/// Whether this VM is the first of this push to load this configuration, told through the
/// data the VMs of one plugin share (when it was last announced). Two workers starting at
/// the same instant may both say yes.
fn first_to_announce(configuration: &[u8]) -> bool {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    configuration.hash(&mut hasher);
    let key = format!("pd-filter.configured.{:016x}", hasher.finish());
    let now = host::now()
        .ok()
        .and_then(|now| now.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |since| since.as_secs());
    announces_configuration(host::shared_data(&key).as_deref(), now)
        && host::set_shared_data(&key, now.to_string().as_bytes()).is_ok()
}

impl Root for PdRoot {
    fn on_http_call_response(&mut self, token_id: u32, body_size: usize) {
        self.worker
            .as_root(|| self.worker.on_answer(token_id, body_size, In::Root));
        self.worker.finish_if_idle();
    }

    /// Envoy drops the plugin's root when its configuration goes (a new one pushed, the
    /// listener drained), and with it every KV release still waiting: the root stays until
    /// they have gone out or passed the lease, about 30 s at most, plus their timeouts.
    /// Where it is the VM's last root, Envoy ends the VM with it at once, and what it still
    /// had to send is lost: said in the log and counted.
    fn on_done(&mut self) -> bool {
        let last_in_vm =
            std::mem::take(&mut self.counted) && VM_ROOTS.with(|roots| roots.borrow_mut().done());
        if last_in_vm {
            let finishing =
                FINISHING.with(|finishing| std::mem::take(&mut *finishing.borrow_mut()));
            for worker in finishing.iter().filter_map(Weak::upgrade) {
                worker.lost_with_the_vm();
            }
            self.worker.lost_with_the_vm();
            return true;
        }
        if self.worker.callouts.borrow().is_idle() {
            return true;
        }
        FINISHING.with(|finishing| {
            let mut finishing = finishing.borrow_mut();
            finishing.retain(|worker| worker.strong_count() > 0);
            finishing.push(Rc::downgrade(&self.worker));
        });
        log::info!("pd-filter configuration replaced: finishing its KV releases first");
        self.worker.finishing.set(true);
        false
    }

    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let bytes =
            host::buffer(BufferType::PluginConfiguration, 0, usize::MAX).unwrap_or_default();
        follow_envoys_log_level();
        let _ = self.worker.stats.get_or_init(Stats::define);
        if self.worker.queue.get().is_none() {
            // One queue per worker: a name shared by workers would hand calls across threads.
            let name = format!("pd-filter-{}", new_request_id());
            match host::register_shared_queue(&name) {
                Ok(queue) => self.worker.queue.set(Some(queue)),
                Err(status) => log::warn!(
                    "no shared queue ({status:?}): KV releases are sent at once, not at the \
                     root's next turn"
                ),
            }
        }
        match Config::from_json(&bytes) {
            Ok(config) => {
                logger::set_lines_per_second(config.max_log_lines_per_second);
                let summary = format!(
                    "pd-filter configured: prefill cluster {:?}, {} paths, prefill timeout {:?}, \
                     bodies up to {} bytes (max_request_body_bytes: Envoy's buffer limit must be \
                     above it by a connection's read)",
                    config.prefill_cluster,
                    config.orchestrated_paths.len(),
                    config.prefill_timeout,
                    config.max_request_body_bytes
                );
                // Every worker has its own VM: the lines once for the process, not per worker.
                if first_to_announce(&bytes) {
                    log::info!("{summary}");
                    for warning in config.warnings() {
                        log::warn!("pd-filter configuration: {warning}");
                    }
                } else {
                    log::debug!("{summary}");
                }
                self.held = VM_HELD.with(|vm| {
                    HeldBytes::with_room_for_small(
                        config.max_vm_held_bytes,
                        config.max_request_body_bytes,
                    )
                    .counting_with(vm)
                });
                self.worker
                    .callouts
                    .borrow_mut()
                    .set_release_bound(config.max_kv_releases_in_flight, self.held.clone());
                self.abandoned = VM_ABANDONED.with(|vm| {
                    AbandonedPrefills::new(config.max_abandoned_prefills_per_client)
                        .counting_with(vm)
                });
                *self.worker.decode_outages.borrow_mut() = VM_DECODE_OUTAGES
                    .with(|vm| DecodeOutages::new(config.decode_outage_retry).counting_with(vm));
                self.config = Some(Rc::new(config));
                if !std::mem::replace(&mut self.counted, true) {
                    VM_ROOTS.with(|roots| roots.borrow_mut().configured());
                }
                true
            }
            Err(error) => {
                log::error!("{error}");
                false
            }
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        self.worker.on_queue_ready(queue_id);
        // Not inside a call being sent (its token is not counted yet).
        if queue_id != SEND_NOW && queue_id != RUN_NOW {
            self.worker.finish_if_idle();
        }
    }

    fn on_tick(&mut self) {
        self.worker.as_root(|| self.worker.on_tick());
        self.worker.finish_if_idle();
    }

    fn create_http_context(&self, context_id: u32) -> Box<dyn Stream> {
        // Read again for each request: an operator who turns on `wasm:debug` at run time
        // (Envoy's /logging, `istioctl proxy-config log`) gets the next request's lines.
        follow_envoys_log_level();
        let Some(config) = self.config.clone() else {
            return Box::new(Refusing(reply_without_configuration));
        };
        Box::new(PdRequest {
            request: Rc::new(Request {
                context_id,
                session: RefCell::new(
                    Session::new(config, self.held.clone())
                        .with_abandoned_prefills(self.abandoned.clone())
                        .with_decode_outages(self.worker.decode_outages.borrow().clone()),
                ),
                alive: Cell::new(true),
                in_request_callback: Cell::new(false),
                resume_on_return: Cell::new(false),
            }),
            worker: self.worker.clone(),
            upload: UploadSlices::default(),
        })
    }
}

/// Whether the stream ever had a connection to decode: Envoy names the upstream host as soon
/// as it picks one, but the connection's local address only once it has a connection.
/// Only the host's "no such value" says there was none: any other refusal is taken as
/// connected, so that no release goes out for a request decode may have.
fn decode_was_connected() -> bool {
    match host::property(&["upstream", "local_address"]) {
        Ok(address) => !address.is_empty(),
        Err(host::NOT_FOUND) => false,
        Err(status) => {
            log::debug!("upstream.local_address: status {status}");
            true
        }
    }
}

struct PdRequest {
    request: Rc<Request>,
    worker: Rc<Worker>,
    upload: UploadSlices,
}

/// A request the filter cannot serve (its plugin's configuration was refused, or its root
/// could not make its context): answered with this reply, never passed on.
struct Refusing(fn() -> LocalReply);

impl Stream for Refusing {
    fn on_request_headers(&mut self, _end_of_stream: bool) -> Action {
        let reply = (self.0)();
        if let Err(status) = host::send_reply(reply.status, &reply.headers, &reply.body) {
            log::error!("could not send the error reply: {status:?}");
        }
        Action::Pause
    }
}

impl Stream for PdRequest {
    /// Every call goes out as the root's, so none should answer here; one that does is
    /// taken as the root would take it.
    fn on_http_call_response(&mut self, token_id: u32, body_size: usize) {
        self.worker.on_answer(token_id, body_size, In::Request);
    }

    fn on_done(&mut self) {
        if self.request.session.borrow().wants_address_on_leaving() {
            let address = host::property(&["source", "address"]).ok();
            self.request
                .session
                .borrow_mut()
                .on_leaving_client_address(address.as_deref());
        }
        let awaits_decode = self.request.session.borrow().awaits_decode_answer();
        let clock = Clock::default();
        let mut commands = if awaits_decode {
            self.request
                .session
                .borrow_mut()
                .on_client_left_before_decode_answered(clock.now(), decode_was_connected)
        } else {
            Vec::new()
        };
        self.request.alive.set(false);
        commands.extend(self.request.session.borrow_mut().on_stream_done());
        self.worker
            .act_on(&self.request, commands, In::Request, &clock);
    }

    fn on_request_headers(&mut self, end_of_stream: bool) -> Action {
        self.request_callback(|this| this.request_headers(end_of_stream))
    }

    fn on_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.request_callback(|this| this.request_body(body_size, end_of_stream))
    }

    fn on_request_trailers(&mut self) -> Action {
        self.request_callback(|this| {
            let step = this.request.session.borrow_mut().on_request_trailers();
            this.run_body_step(step)
        })
    }

    fn on_response_headers(&mut self, end_of_stream: bool) -> Action {
        if !self.request.session.borrow().watches_response() {
            return Action::Continue;
        }
        let headers = host::header_map(MapType::HttpResponseHeaders).unwrap_or_default();
        let status = headers
            .text(":status")
            .and_then(|status| status.parse().ok());
        let wanted = self.request.session.borrow().wants_response_details(status);
        let details = wanted
            .then(|| host::property(&["response", "code_details"]).ok())
            .flatten()
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned());
        // An answer Envoy made itself (a timeout in decode's pool, say) may come before any
        // connection to decode: then decode never had the request.
        let envoys_own = details
            .as_deref()
            .is_some_and(|details| details != "via_upstream");
        let head = ResponseHead {
            status,
            content_type: headers.text("content-type"),
            has_request_id: headers.value("x-request-id").is_some(),
            content_length: headers.value("content-length"),
            content_encoding: headers.value("content-encoding"),
            end_of_stream,
            code_details: details.as_deref(),
            decode_connected: envoys_own.then(decode_was_connected),
            envoys_own_at: envoys_own.then(|| host::now().unwrap_or(UNIX_EPOCH)),
        };
        let step = self.request.session.borrow_mut().on_response_headers(&head);
        self.run(step)
    }

    fn on_response_trailers(&mut self) -> Action {
        let step = self.request.session.borrow_mut().on_response_trailers();
        // The answer Envoy holds, whole: no body callback says its size here.
        self.read_response_body(step, usize::MAX, true)
    }

    fn on_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let step = self
            .request
            .session
            .borrow_mut()
            .on_response_body(body_size, end_of_stream);
        self.read_response_body(step, body_size, end_of_stream)
    }
}

/// What a status from `proxy_http_call` says of why Envoy would not send the call.
fn refusal(status: u32) -> CallRefused {
    if status == host::BAD_ARGUMENT {
        CallRefused::NoSuchCluster
    } else {
        CallRefused::AtOnce
    }
}

/// Has Envoy hold the request body it buffers in one piece: the same bytes, read and put
/// back ([`crate::upload_slices`]). The length is unchanged, so Envoy's buffer limit is not
/// crossed (crossing it from here makes Envoy answer 413 from inside the callback).
fn hold_body_in_one_piece(size: usize) {
    let rewritten = host::buffer(BufferType::HttpRequestBody, 0, size)
        .and_then(|body| host::set_buffer(BufferType::HttpRequestBody, 0, body.len(), &body));
    match rewritten {
        Ok(()) => log::debug!("request body of {size} bytes held in one piece"),
        Err(status) => log::debug!("request body not held in one piece: {status:?}"),
    }
}

impl PdRequest {
    /// Carries out a response step, reading the answer's first `size` bytes for the session
    /// first when it asks for them.
    fn read_response_body(&mut self, step: BodyStep, size: usize, end_of_stream: bool) -> Action {
        let step = match step {
            BodyStep::Step(step) => step,
            BodyStep::ReadBody => {
                let body = host::buffer(BufferType::HttpResponseBody, 0, size).unwrap_or_default();
                self.request
                    .session
                    .borrow_mut()
                    .on_response_body_read(&body, end_of_stream)
            }
        };
        self.run(step)
    }

    /// Runs one of the request's own request callbacks. A resume asked for while it runs
    /// (prefill refused at once, and decode gets the body without it) is its answer to
    /// Envoy, `Continue`: the host's `continue_stream` there would resume the stream before
    /// Envoy has buffered the chunk in hand, which then never reaches decode.
    fn request_callback(&mut self, callback: impl FnOnce(&mut Self) -> Action) -> Action {
        let was_in_callback = self.request.in_request_callback.replace(true);
        let action = callback(self);
        self.request.in_request_callback.set(was_in_callback);
        if !was_in_callback && self.request.resume_on_return.take() {
            return Action::Continue;
        }
        action
    }

    fn request_headers(&mut self, end_of_stream: bool) -> Action {
        if let Err(status) = host::set_property(FILTER_RAN_FILTER_STATE, b"yes") {
            log::warn!("could not mark the request as seen by pd-filter: status {status}");
        }
        // One host call for all headers rather than one per header.
        let headers = match host::header_map(MapType::HttpRequestHeaders) {
            Ok(headers) => headers,
            // Read as none, they would let an orchestrated path through as any other.
            Err(status) => {
                log::debug!("get_header_map_pairs(HttpRequestHeaders): {status:?}");
                let step = self.host_failed(HostFailure::ReadRequestHeaders);
                return self.run(step);
            }
        };
        let step = {
            let mut session = self.request.session.borrow_mut();
            let step = session.on_request_headers(&headers, end_of_stream);
            if session.wants_client_address() {
                let address = host::property(&["source", "address"]).ok();
                session
                    .on_client_address(address.as_deref())
                    .unwrap_or(step)
            } else {
                step
            }
        };
        let holds_for_body = self.request.session.borrow().headers_held_for_body();
        if holds_for_body && self.worker.held_headers.borrow().watching() {
            let now = host::now().unwrap_or(UNIX_EPOCH);
            if self.worker.held_headers.borrow_mut().headers_held(now) {
                log::error!(
                    "requests whose headers pd-filter held have come for {} s and none has had \
                     its body. If every orchestrated request hangs: Envoy gives a held request \
                     its body only when the wasm filter sets \
                     allow_on_headers_stop_iteration: true, which hold_request_headers and \
                     model_header need (Istio's WasmPlugin cannot set it: leave both off \
                     there); until then such requests wait for their timeouts. Clients that \
                     hold back their bodies look the same until one body comes",
                    NO_BODY_WARNING_AFTER.as_secs()
                );
            }
        }
        self.run(step)
    }

    fn request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // Only a held request's body says that holding works: others get theirs regardless.
        if self.worker.held_headers.borrow().watching()
            && self.request.session.borrow().headers_held_for_body()
        {
            self.worker.held_headers.borrow_mut().body_arrived();
        }
        let step = self
            .request
            .session
            .borrow_mut()
            .on_request_body(body_size, end_of_stream);
        // Only a body the session goes on holding: not one it answers (a 413 past the limit).
        let held = matches!(&step, BodyStep::Step(step)
            if step.flow == Flow::Pause && step.commands.is_empty());
        if held && !end_of_stream && self.upload.grown_to(body_size) {
            hold_body_in_one_piece(body_size);
        }
        self.run_body_step(step)
    }

    fn run_body_step(&mut self, step: BodyStep) -> Action {
        let clock = Clock::default();
        match step {
            BodyStep::Step(step) => self.run_with(step, &clock),
            BodyStep::ReadBody => {
                // No body at all (trailers right after the headers) is an empty one.
                let body = match host::buffer(BufferType::HttpRequestBody, 0, usize::MAX) {
                    Err(host::NOT_FOUND) => Ok(Vec::new()),
                    body => body,
                };
                let step = match body {
                    Ok(body) => self
                        .request
                        .session
                        .borrow_mut()
                        .on_request_complete(body, clock.now()),
                    Err(status) => {
                        log::debug!("get_buffer(HttpRequestBody): {status:?}");
                        self.host_failed(HostFailure::ReadRequestBody)
                    }
                };
                self.run_with(step, &clock)
            }
        }
    }

    /// The step for a host call that failed on the request's behalf: the client's answer.
    fn host_failed(&self, failure: HostFailure) -> Step {
        Step {
            flow: Flow::Pause,
            commands: self.request.session.borrow_mut().on_host_failure(failure),
        }
    }

    fn run(&mut self, step: Step) -> Action {
        self.run_with(step, &Clock::default())
    }

    /// Carries out a step's commands; `clock` is the one the session was given its time by.
    fn run_with(&mut self, step: Step, clock: &Clock) -> Action {
        self.worker
            .act_on(&self.request, step.commands, In::Request, clock);
        action(step.flow)
    }
}
