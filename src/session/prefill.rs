//! The prefill leg: the call, its answer, retries, and what decode gets from it.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use crate::api::Api;
use crate::config::{Config, MissingKvPolicy, PrefillFailurePolicy, UsagePolicy};
use crate::held_bytes::{HeldBytes, Reservation};
use crate::json::JsonObject;
use crate::protocol::echo::EchoedPrompt;
use crate::protocol::scheduling::{
    call_authority, check_model_for_header, with_reachable_remote_host,
};
use crate::protocol::usage::prompt_usage_for_decode;
use crate::protocol::{
    prepare_with, prompt_logprobs, read_prefill_answer, ClientError, DecodePlan, FailureKind,
    PrefillAnswer, PrefillFailure, PrefillKv, PreparedRequest,
};

use super::*;

/// How much earlier than the filter reckons Envoy's timeout of a call may fire. Envoy starts
/// the timer from its event loop's cached time, which under load is older than the clock the
/// filter reads after sending the call by a whole turn of the loop: tens of milliseconds
/// were seen with two busy cores. A call reset without headers this close to its deadline
/// is its timeout.
pub(super) const CLOCK_SLACK: Duration = Duration::from_millis(250);

/// The least time left for which a failed prefill is tried again. Less would be taken for
/// the deadline anyway ([`CLOCK_SLACK`]), and a call given under a millisecond goes to Envoy
/// with a timeout of 0, which Envoy reads as no timeout at all.
pub(super) const MIN_RETRY_BUDGET: Duration = CLOCK_SLACK;

/// Room left for the rest of decode's answer when prefill's prompt logprobs go into it; an
/// answer that still outgrows the limit goes on as decode wrote it.
pub(super) const REST_OF_ANSWER: usize = 64 * 1024;

/// What request headers told about an orchestrated request.
pub(super) struct Pending {
    pub(super) api: Api,
    pub(super) prefill_headers: Vec<(String, String)>,
    pub(super) scheduled_hosts: Vec<SocketAddr>,
    /// What the request keeps in the VM from its headers on ([`kept_for_prefill`]), counted
    /// while its body uploads: uploads that never end must not hold the VM past its budget.
    pub(super) headers_held: Reservation,
}

/// What a request keeps in the VM for its prefill call and KV release beyond one callback:
/// the prefill call's headers (the client's forwarded headers among them)
/// and its request id.
pub(super) fn kept_for_prefill(prefill_headers: &[(String, String)], request_id: &str) -> usize {
    prefill_headers
        .iter()
        .map(|(name, value)| name.len() + value.len())
        .sum::<usize>()
        + request_id.len()
}

/// The longest `model` a request keeps for its KV release.
pub(super) const MAX_KEPT_MODEL_LEN: usize = 1024;

/// What the filter keeps of the client's body while prefill works. Envoy holds the body
/// until the request resumes; the filter keeps its own copy only when decode's edit needs
/// more than its head, and reads the body again from Envoy for a retry. So a request in
/// prefill costs its body once, in Envoy's heap, where the overload manager sees it.
pub(super) enum HeldBody {
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

    /// The bytes kept: all of the body, or none where decode's edit needs none of them
    /// (only a head is written, and there is nothing to strip: a property test holds the
    /// plan to that).
    fn bytes(&self) -> &[u8] {
        match self {
            HeldBody::Whole { body, .. } => body,
            HeldBody::HeadOnly => &[],
        }
    }
}

/// Prefill's prompt logprobs and echo of the prompt, each where asked for, kept (and counted
/// against the VM's budget) until they go into decode's answer.
pub(super) struct HeldLogprobs {
    pub(super) api: Api,
    pub(super) prompt_logprobs: Option<Vec<u8>>,
    pub(super) echoed: Option<EchoedPrompt>,
    pub(super) _reservation: Reservation,
}

/// The prefill leg of one request, across its attempts.
pub(super) struct Prefill {
    pub(super) api: Api,
    pub(super) original: HeldBody,
    pub(super) model: Option<String>,
    pub(super) decode: DecodePlan,
    /// The VM's budget `decode` takes: a plan of the client's members, as many as a large
    /// body of small ones has, kept while prefill works.
    pub(super) _plan_held: Reservation,
    /// Prefill's 2xx answer goes to the client as it is ([`PreparedRequest::answered_by_prefill`]).
    pub(super) answered_by_prefill: bool,
    pub(super) cluster: Rc<str>,
    pub(super) prefill_headers: Rc<[(String, String)]>,
    /// The VM's budget the headers, model and request id take: a client's headers can be
    /// tens of KB, and a request keeps them until its KV is known to be read.
    pub(super) headers_held: Reservation,
    pub(super) scheduled_hosts: Vec<SocketAddr>,
    /// The scheduler-listed hosts that answered this request with a pause (a 503 with
    /// `retry-after`): none of its later attempts goes to them.
    pub(super) paused_hosts: Vec<SocketAddr>,
    /// Number of the attempt in flight, from 0.
    pub(super) attempt: u32,
    pub(super) started: SystemTime,
}

impl Prefill {
    /// What a release of `kv` needs of this prefill.
    pub(super) fn into_unread_kv(self, kv: &[u8]) -> UnreadKv {
        UnreadKv {
            model: self.model,
            kv_transfer_params: kv.to_vec(),
            headers: self.prefill_headers,
            _held: self.headers_held,
        }
    }

    /// Prefill's `kv_transfer_params` as decode must read them, for the request or for a
    /// release: a local `remote_host` replaced by the scheduler-chosen host prefill was
    /// reached at, where `replace_local_remote_host` asks for it.
    fn reachable_kv<'a>(&self, config: &Config, kv: &'a [u8]) -> Cow<'a, [u8]> {
        let reached = self.host().filter(|_| config.replace_local_remote_host);
        match reached.and_then(|host| with_reachable_remote_host(kv, host.ip())) {
            Some(rewritten) => Cow::Owned(rewritten),
            None => Cow::Borrowed(kv),
        }
    }

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

    /// Whether the next attempt goes to another scheduler-listed host than this one, and
    /// to none that asked this request for a pause.
    fn next_host_is_another(&self) -> bool {
        let count = self.scheduled_hosts.len();
        let next = (self.attempt as usize).wrapping_add(1).checked_rem(count);
        next.and_then(|next| self.scheduled_hosts.get(next))
            .is_some_and(|next| Some(*next) != self.host() && !self.paused_hosts.contains(next))
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
        let headers = match self.host() {
            Some(host) => {
                let mut headers = self.prefill_headers.to_vec();
                for (name, value) in headers.iter_mut() {
                    if name == ":authority" {
                        *value = call_authority(&self.cluster, Some(host));
                    }
                }
                headers.push((ORIGINAL_DST_HEADER.to_owned(), host.to_string()));
                Rc::from(headers)
            }
            None => self.prefill_headers.clone(),
        };
        HttpCall {
            cluster: self.cluster.clone(),
            headers,
            body,
            timeout,
        }
    }
}

/// Prefill's call headers with the `:authority` of the cluster they go to, after the other
/// pseudo-headers.
fn with_authority(mut headers: Vec<(String, String)>, cluster: &str) -> Rc<[(String, String)]> {
    let at = headers
        .iter()
        .position(|(name, _)| !name.starts_with(':'))
        .unwrap_or(headers.len());
    headers.insert(at, (":authority".to_owned(), call_authority(cluster, None)));
    Rc::from(headers)
}

/// The prefill stats of a request whose client left before prefill answered: its latency,
/// and a failure's kind as the request would have counted it (not a 4xx, the client's own).
fn abandoned_prefill_stats(
    prefill: &Prefill,
    status: Option<u16>,
    answer: &PrefillAnswer,
    config: &Config,
    now: SystemTime,
) -> Vec<Command> {
    let answered = prefill.answered_by_prefill && matches!(status, Some(200..=299));
    let (result, failure) = match answer {
        _ if answered => (PrefillResult::Answered, None),
        PrefillAnswer::KvTransferParams(_) => (PrefillResult::Kv, None),
        PrefillAnswer::NoKvTransferParams(_) => {
            (PrefillResult::NoKv, Some(FailureKind::NoKvTransferParams))
        }
        PrefillAnswer::Failed(failure) if failure.is_client_error() => {
            (PrefillResult::Failed, None)
        }
        PrefillAnswer::Failed(_) if status.is_none() && prefill.deadline_passed(config, now) => {
            (PrefillResult::Failed, Some(FailureKind::Timeout))
        }
        PrefillAnswer::Failed(failure) => (PrefillResult::Failed, Some(failure.kind)),
    };
    let mut commands = vec![Command::Record(Metric::PrefillLatency(
        result,
        prefill.elapsed(now),
    ))];
    commands.extend(failure.map(|kind| Command::Record(Metric::PrefillFailure(kind))));
    commands
}

impl Session {
    pub(super) fn start_prefill(
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
        if self.decode_outages.is_on() {
            // Followed by the decode cluster the operator named for the model (its KV
            // releases'), never by a name a client makes up.
            let key = config.decode_cluster_for(prepared.model.as_deref());
            if let Err(wait) = self.decode_outages.admit(key, now) {
                return Step::new(Flow::Pause, self.refuse_decode_unreachable(wait));
            }
            self.decode_outage_key = Some(key.to_owned());
        }
        if prepared.decode_alone {
            commands.extend(self.decode_alone(pending.api, &body, &prepared.decode, now));
            return Step::new(Flow::Continue, commands);
        }
        commands.push(Command::Record(Metric::Orchestrated(pending.api)));
        let cluster = match &config.prefill_host_cluster {
            Some(cluster) if !pending.scheduled_hosts.is_empty() => Rc::from(cluster.as_str()),
            _ => Rc::from(config.prefill_cluster_for(prepared.model.as_deref())),
        };
        // Kept for the KV release's model and cluster; a name longer than any model's
        // (which matched no configured pool) is not kept in the VM.
        let model = prepared
            .model
            .filter(|model| model.len() <= MAX_KEPT_MODEL_LEN);
        // The headers and request id are counted since the headers came; the model now.
        let mut headers_held = pending.headers_held;
        if !self
            .held
            .grow(&mut headers_held, model.as_ref().map_or(0, String::len))
        {
            return Step::new(Flow::Pause, self.refuse_overloaded());
        }
        let Some(original) = HeldBody::keep(body, &prepared.decode, &self.held) else {
            return Step::new(Flow::Pause, self.refuse_overloaded());
        };
        let Some(plan_held) = self.held.reserve(prepared.decode.heap_bytes()) else {
            return Step::new(Flow::Pause, self.refuse_overloaded());
        };
        let prefill = Prefill {
            api: pending.api,
            original,
            model,
            decode: prepared.decode,
            _plan_held: plan_held,
            answered_by_prefill: prepared.answered_by_prefill,
            prefill_headers: with_authority(pending.prefill_headers, &cluster),
            cluster,
            headers_held,
            scheduled_hosts: pending.scheduled_hosts,
            paused_hosts: Vec::new(),
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
    pub fn on_prefill_dispatched(
        &mut self,
        sent: Result<u32, CallRefused>,
        now: SystemTime,
    ) -> Vec<Command> {
        let prefill = match std::mem::replace(&mut self.state, State::PassThrough) {
            State::Dispatching(prefill) => prefill,
            State::Abandoned {
                prefill,
                token: None,
            } => {
                if let Ok(token) = sent {
                    self.state = State::Abandoned {
                        prefill,
                        token: Some(token),
                    };
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
        match sent {
            Ok(token) => {
                self.state = State::AwaitingPrefill { prefill, token };
                Vec::new()
            }
            Err(refused) => {
                log::debug!(
                    "[{}] prefill call to {:?} could not be dispatched",
                    self.request_id,
                    prefill.cluster
                );
                // Not retried: Envoy refused it at once (no such cluster, no healthy host, a
                // full pool), which the client is told at once (503).
                let failure = PrefillFailure::not_dispatched(&prefill.cluster, refused);
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
        let config = self.config.clone();
        let prefill = match std::mem::replace(&mut self.state, State::PassThrough) {
            State::AwaitingPrefill { prefill, token: t } if t == token => prefill,
            State::Abandoned {
                prefill,
                token: Some(t),
            } if t == token => {
                self.state = State::Finished;
                let answer = read(body);
                // The client left, but its prefill leg counts as any other in the prefill
                // stats: a prefill outage whose clients give up first shows there too.
                let mut commands = abandoned_prefill_stats(&prefill, status, &answer, &config, now);
                let PrefillAnswer::KvTransferParams(PrefillKv { kv, .. }) = answer else {
                    return commands;
                };
                log::debug!(
                    "[{}] the client left during prefill; releasing its KV",
                    self.request_id
                );
                let kv = prefill.reachable_kv(&config, kv);
                let unread = prefill.into_unread_kv(&kv);
                commands.extend(self.release(&config, unread));
                return commands;
            }
            other => {
                self.state = other;
                return Vec::new();
            }
        };
        if let (true, Some(status @ 200..=299)) = (prefill.answered_by_prefill, status) {
            // One that is not JSON goes the way of any prefill answer without KV, below (a
            // too large one is refused unread).
            let too_large = body.len() > config.max_request_body_bytes;
            if too_large || JsonObject::parse(body).is_ok() {
                return self.answer_from_prefill(prefill, status, body, now);
            }
        }
        match read(body) {
            PrefillAnswer::KvTransferParams(handed) => {
                self.resume_with_kv(prefill, handed, body, &config, now)
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

    /// Prefill's KV, for decode: the request goes on with them in its body, or is refused
    /// when decode's body or its answer would not fit (the KV then released).
    fn resume_with_kv(
        &mut self,
        mut prefill: Prefill,
        handed: PrefillKv,
        body: &[u8],
        config: &Config,
        now: SystemTime,
    ) -> Vec<Command> {
        let mut commands = self.prefill_time(&prefill, now, PrefillResult::Kv);
        let reachable = prefill.reachable_kv(config, handed.kv);
        let kv = reachable.as_ref();
        // Kept for a release until decode answers (a long prompt's KV lists thousands of
        // blocks): counted with the headers kept for it.
        if config.release_kv_on_abandon && !self.held.grow(&mut prefill.headers_held, kv.len()) {
            commands.extend(self.refuse_overloaded());
            commands.extend(self.release(config, prefill.into_unread_kv(kv)));
            return commands;
        }
        let held_logprobs = match self.check_decode_fits(&prefill, kv, body, config) {
            Ok(held_logprobs) => held_logprobs,
            Err(refused) => {
                commands.extend(refused);
                commands.extend(self.release(config, prefill.into_unread_kv(kv)));
                return commands;
            }
        };
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
            .then(|| prompt_usage_for_decode(prefill.api, handed.usage?, kv))
            .flatten()
            .map(|usage| (prefill.api, usage));
        let stream_usage = prefill.decode.stream_usage_asked || config.decode_forces_include_usage;
        let unread_kv = config
            .release_kv_on_abandon
            .then(|| prefill.into_unread_kv(kv));
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

    /// Prefill's answer as the client's whole answer: decode is not asked.
    fn answer_from_prefill(
        &mut self,
        prefill: Prefill,
        status: u16,
        body: &[u8],
        now: SystemTime,
    ) -> Vec<Command> {
        log::debug!(
            "[{}] prefill answered in {:?}: its answer is the whole answer",
            self.request_id,
            prefill.elapsed(now)
        );
        let mut commands = self.prefill_time(&prefill, now, PrefillResult::Answered);
        // Envoy writes a local answer at once, past its flow control: no larger than an
        // answer the filter would hold to rewrite.
        let limit = self.config.max_request_body_bytes;
        if body.len() > limit {
            commands.extend(self.reject(&ClientError::answer_too_large(body.len(), limit)));
            return commands;
        }
        commands.extend(self.outcome(Outcome::PrefillAnswered));
        commands.push(self.reply_with(status, body.to_vec()));
        commands
    }

    /// Whether decode's body with `kv` fits what Envoy buffers, and prefill's prompt
    /// logprobs (taken from its answer `body` when asked for) fit decode's answer and the
    /// VM's budget: the logprobs held for the answer, or the refusal. Envoy would refuse to
    /// buffer a larger body, answering on its own while the filter is still in its callback.
    fn check_decode_fits(
        &mut self,
        prefill: &Prefill,
        kv: &[u8],
        body: &[u8],
        config: &Config,
    ) -> Result<Option<HeldLogprobs>, Vec<Command>> {
        let limit = config.max_request_body_bytes;
        if prefill.decode.len_with_kv(kv.len()) > limit {
            return Err(self.reject(&ClientError::decode_body_too_large(limit)));
        }
        let plan = &prefill.decode;
        let prompt_logprobs = plan
            .prompt_logprobs_from_prefill
            .then(|| prompt_logprobs::from_prefill_answer(prefill.api, body))
            .flatten();
        let echoed = plan
            .echo_from_prefill
            .then(|| EchoedPrompt::from_prefill_answer(body))
            .flatten();
        if plan.echo_from_prefill && echoed.is_none() {
            log::warn!(
                "[{}] prefill's answer has no echo of the prompt with logprobs: decode's \
                 answer goes to the client without it",
                self.request_id
            );
        }
        if prompt_logprobs.is_none() && echoed.is_none() {
            return Ok(None);
        }
        let held = prompt_logprobs
            .as_ref()
            .map_or(0, Vec::len)
            .saturating_add(echoed.as_ref().map_or(0, EchoedPrompt::added_len));
        let size = held.saturating_mul(plan.prompt_logprobs_copies);
        if size.saturating_add(REST_OF_ANSWER) > limit {
            let error = ClientError::prompt_logprobs_too_large(size, limit, REST_OF_ANSWER);
            return Err(self.reject(&error));
        }
        // They wait in the VM until they go into decode's answer.
        match self.held.reserve(held) {
            Some(reservation) => Ok(Some(HeldLogprobs {
                api: prefill.api,
                prompt_logprobs,
                echoed,
                _reservation: reservation,
            })),
            None => Err(self.refuse_overloaded()),
        }
    }

    /// A failed attempt: retried while retries and time are left, then the policy decides.
    pub(super) fn prefill_failed(
        &mut self,
        mut prefill: Prefill,
        failure: PrefillFailure,
        now: SystemTime,
    ) -> Vec<Command> {
        let config = self.config.clone();
        let budget_left = config
            .prefill_timeout
            .checked_sub(prefill.elapsed(now))
            .filter(|left| *left >= MIN_RETRY_BUDGET);
        // A prefill that asked for a pause (a 503 with `retry-after`) is not asked again at
        // once: only another scheduler-listed host is tried, and the client gets the advice.
        // Nor is a host that asked for one earlier in the request, whatever the later hosts
        // answer: the list is tried in turn, and would come back to it.
        let asked_to_wait = failure.error.retry_after_seconds.is_some_and(|s| s > 0);
        if let Some(host) = prefill.host().filter(|_| asked_to_wait) {
            prefill.paused_hosts.push(host);
        }
        let another_host = prefill.next_host_is_another();
        let back_to_a_paused_host = !prefill.paused_hosts.is_empty() && !another_host;
        let retry =
            failure.is_retryable() && (!asked_to_wait || another_host) && !back_to_a_paused_host;
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
                let options = self.config.prefill_options;
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
    pub(super) fn retry(
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
    pub(super) fn give_up(
        &mut self,
        prefill: Prefill,
        failure: &PrefillFailure,
        now: SystemTime,
    ) -> Vec<Command> {
        let config = self.config.clone();
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
    pub(super) fn prefill_time(
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
    pub(super) fn decode_only(
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
        let prefill_time = Some(prefill.elapsed(now));
        commands.extend(self.decode_recomputes(
            &prefill.decode,
            prefill.original.bytes(),
            prefill_time,
            now,
        ));
        commands.push(Command::ResumeRequest);
        commands
    }

    /// Decode computes the prompt itself: it gets the client's body without any
    /// `kv_transfer_params` of the client's, and its answer goes to the client untouched.
    fn decode_recomputes(
        &mut self,
        decode: &DecodePlan,
        body: &[u8],
        prefill_time: Option<Duration>,
        now: SystemTime,
    ) -> Vec<Command> {
        let mut commands = Vec::new();
        if let Some(without_kv) = decode.body_without_kv(body) {
            commands.push(Command::ReplaceRequestBody {
                body: without_kv,
                replaced_len: body.len(),
            });
        }
        self.state = State::Decoding {
            prefill_time,
            resumed_at: now,
            unread_kv: None,
            prompt_usage: None,
            stream_usage: false,
            prompt_logprobs: None,
            answer: AnswerRewrite::Untouched,
        };
        commands
    }

    /// A request decode serves alone, as the operator chose for it: no prefill is called,
    /// and decode computes the prompt itself.
    fn decode_alone(
        &mut self,
        api: Api,
        body: &[u8],
        decode: &DecodePlan,
        now: SystemTime,
    ) -> Vec<Command> {
        log::debug!(
            "[{}] several prompts in one request: decode serves it alone",
            self.request_id
        );
        let mut commands = vec![Command::Record(Metric::Request(api, Outcome::DecodeOnly))];
        commands.extend(self.decode_recomputes(decode, body, None, now));
        commands
    }

    pub(super) fn fail(&mut self, failure: &PrefillFailure) -> Vec<Command> {
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
}
