//! The calls of one Envoy worker, host-free: a request hands its calls to the worker (they
//! must outlive it: prefill's answer still comes after its client left, and a KV release is
//! for a request already gone), the worker sends them on its next turn, and routes each
//! answer back by its token. Releases in flight are bounded, and those past the bound wait
//! for a slot; a release that failed because decode could not be reached is sent again a few
//! times, later.

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use crate::held_bytes::{HeldBytes, Reservation};
use crate::protocol::kv_release::ReleaseBudget;
use crate::session::HttpCall;

/// A call waiting for the worker's turn; `R` is the request it belongs to.
pub enum Job<R> {
    Prefill(R, HttpCall),
    Release(HttpCall),
}

/// What a worker had still to do, by kind.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Unfinished {
    /// KV releases not sent yet: queued for the worker's turn, waiting for a slot, or waiting
    /// to be sent again after decode could not be reached.
    pub releases_unsent: usize,
    /// KV releases sent and not answered.
    pub releases_in_flight: usize,
    /// Prefill calls queued or not answered.
    pub prefills: usize,
}

/// Whose answer a token is.
pub enum Caller<R> {
    Prefill(R),
    /// A release: the request it is for, and what it takes to send it again.
    Release {
        request_id: String,
        /// The decode cluster it went to.
        cluster: Rc<str>,
        retry: Option<Retry>,
    },
}

/// One attempt at a release: its number (from 1), and when the first went out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    pub number: u32,
    pub first_sent: SystemTime,
}

impl Attempt {
    pub fn first(now: SystemTime) -> Attempt {
        Attempt {
            number: 1,
            first_sent: now,
        }
    }

    fn next(self) -> Attempt {
        Attempt {
            number: self.number.saturating_add(1),
            ..self
        }
    }

    /// Whether an attempt made at `now` would come after vLLM 0.33's lease, when prefill
    /// has freed the blocks itself and a release costs decode a token for nothing.
    pub fn past_lease(&self, now: SystemTime) -> bool {
        now.duration_since(self.first_sent).unwrap_or_default() > RELEASE_LEASE
    }
}

/// Why a release was not kept to be sent again.
#[derive(Debug, PartialEq, Eq)]
pub enum NotKept {
    /// As many as may wait already do.
    TooMany,
    /// It would be due past the lease.
    PastLease,
}

/// What becomes of an attempt at a release the worker is handed.
#[derive(Debug, PartialEq, Eq)]
pub enum ReleaseStart {
    /// Its slot is taken: send it now.
    Send,
    /// No slot is free: it waits for one.
    Waits,
    /// A later attempt that would come after vLLM 0.33's lease.
    PastLease,
    /// No slot is free and too many wait already, or it is larger than the VM may keep.
    NoRoomToWait,
}

/// Why a release that failed will not be sent again.
#[derive(Debug, PartialEq, Eq)]
pub enum NoRetry {
    /// It was the last attempt.
    AttemptsUsed,
    /// It is larger than the VM's budget has room to keep.
    TooLargeToKeep,
}

impl NoRetry {
    pub fn reason(&self) -> &'static str {
        match self {
            NoRetry::AttemptsUsed => "no attempt left",
            NoRetry::TooLargeToKeep => "it is too large to keep within max_vm_held_bytes",
        }
    }
}

/// A release to send again if decode could not be reached.
pub struct Retry {
    call: HttpCall,
    /// The attempt made last.
    attempt: Attempt,
    _kept: Kept,
}

impl Retry {
    pub fn request_id(&self) -> &str {
        self.call.request_id()
    }
}

/// Attempts a release gets in all; the waits before the second and later ones, 24 s in all,
/// leave the attempts themselves room within vLLM 0.33's 30 s lease.
pub const RELEASE_ATTEMPTS: u32 = 5;
const RETRY_AFTER: [Duration; 4] = [
    Duration::from_secs(1),
    Duration::from_secs(3),
    Duration::from_secs(8),
    Duration::from_secs(12),
];
/// A release up to this size, headers and body, is kept to wait (for a slot, or to be sent
/// again) within the bound on their number: 2 x 16 x `max_kv_releases_in_flight` of them per
/// worker (16 MiB at the default). A larger one (the `kv_transfer_params` of a long prompt
/// list thousands of blocks; a client's large `baggage`) is kept only while it fits in the
/// VM's held-bytes budget, and counts against it.
const SMALL_RELEASE_BYTES: usize = 8192;
/// How long after its first attempt a release may still go out. After vLLM 0.33's 30 s lease
/// prefill has freed the blocks itself, and a release sent then costs decode a token for
/// nothing: a decode that took seconds per release left a queue that went out 60 to 90 s
/// late, in a burst.
const RELEASE_LEASE: Duration = Duration::from_secs(30);
/// Releases that may wait, per release that may be in flight, for a slot and (as many
/// again) to be sent again: a burst of clients leaving at once, or the requests of a decode
/// outage of seconds (a few hundred bytes each), waits rather than strands its KV.
const WAITING_PER_SLOT: usize = 16;

fn release_bytes(call: &HttpCall) -> usize {
    let headers: usize = call
        .headers
        .iter()
        .map(|(name, value)| name.len() + value.len())
        .sum();
    headers.saturating_add(call.body.len())
}

/// What a kept release holds of the VM's budget: nothing for a small one.
type Kept = Option<Reservation>;

pub struct Callouts<R> {
    jobs: VecDeque<Job<R>>,
    calls: HashMap<u32, Caller<R>>,
    releases: ReleaseBudget,
    /// Releases waiting to be sent again, each with when; at most [`WAITING_PER_SLOT`] per
    /// release that may be in flight.
    retries: VecDeque<(SystemTime, Retry)>,
    /// Releases waiting for a slot, each with its attempt.
    waiting: VecDeque<(HttpCall, Attempt, Kept)>,
    wake_pending: bool,
    /// The VM's budget, which large kept releases count against.
    held: HeldBytes,
}

impl<R> Default for Callouts<R> {
    fn default() -> Self {
        Callouts {
            jobs: VecDeque::new(),
            calls: HashMap::new(),
            releases: ReleaseBudget::new(0),
            retries: VecDeque::new(),
            waiting: VecDeque::new(),
            wake_pending: false,
            held: HeldBytes::new(0),
        }
    }
}

impl<R> Callouts<R> {
    /// How many releases may be in flight, and the VM's budget large kept releases count
    /// against.
    pub fn set_release_bound(&mut self, max_in_flight: u32, held: HeldBytes) {
        self.releases = ReleaseBudget::new(max_in_flight);
        self.held = held;
    }

    /// Room to keep `call` for later; `None` when it is too large for what the VM holds.
    fn keep(&self, call: &HttpCall) -> Option<Kept> {
        let bytes = release_bytes(call);
        if bytes <= SMALL_RELEASE_BYTES {
            return Some(None);
        }
        self.held.reserve(bytes).map(Some)
    }

    /// Queues a call for the worker's turn; `true` when the worker must be woken for it.
    pub fn queue(&mut self, job: Job<R>) -> bool {
        self.jobs.push_back(job);
        !std::mem::replace(&mut self.wake_pending, true)
    }

    /// The worker could not be woken: the call just queued, to be sent at once instead.
    pub fn wake_failed(&mut self) -> Option<Job<R>> {
        self.wake_pending = false;
        self.jobs.pop_back()
    }

    /// The worker's turn has come: calls queued from now on need another wake.
    pub fn woken(&mut self) {
        self.wake_pending = false;
    }

    pub fn next_job(&mut self) -> Option<Job<R>> {
        self.jobs.pop_front()
    }

    pub fn prefill_sent(&mut self, token: u32, request: R) {
        self.calls.insert(token, Caller::Prefill(request));
    }

    /// How many releases may wait for a slot, and how many to be sent again.
    fn waiting_bound(&self) -> usize {
        let slots = usize::try_from(self.releases.max()).unwrap_or(usize::MAX);
        slots.saturating_mul(WAITING_PER_SLOT)
    }

    /// An attempt at a release, made at `now`: sent, waiting, or dropped. Also the
    /// releases that waited past the lease and are dropped now, so that they never take the
    /// places of new ones.
    pub fn begin_release(
        &mut self,
        call: &HttpCall,
        attempt: Attempt,
        now: SystemTime,
    ) -> (ReleaseStart, Vec<HttpCall>) {
        // A first attempt is made now; a later one may come too late.
        if attempt.number > 1 && attempt.past_lease(now) {
            return (ReleaseStart::PastLease, Vec::new());
        }
        if self.start_release() {
            return (ReleaseStart::Send, Vec::new());
        }
        let expired = self.expire_waiting(now);
        let start = if self.wait_for_slot(call.clone(), attempt) {
            ReleaseStart::Waits
        } else {
            ReleaseStart::NoRoomToWait
        };
        (start, expired)
    }

    /// Takes a slot for a release; `false` when the bound is reached.
    fn start_release(&mut self) -> bool {
        self.releases.try_start()
    }

    /// Keeps an attempt at a release that found no slot until one frees; `false` when too
    /// many already wait (it is dropped).
    fn wait_for_slot(&mut self, call: HttpCall, attempt: Attempt) -> bool {
        if self.waiting.len() >= self.waiting_bound() {
            return false;
        }
        let Some(kept) = self.keep(&call) else {
            return false;
        };
        self.waiting.push_back((call, attempt, kept));
        true
    }

    /// The releases waiting for a slot whose first attempt is past the lease, taken out:
    /// to be dropped.
    pub fn expire_waiting(&mut self, now: SystemTime) -> Vec<HttpCall> {
        let past_lease = |attempt: &Attempt| attempt.past_lease(now);
        // A release sent again joins the queue behind newer ones: any of them may be stale.
        if !self
            .waiting
            .iter()
            .any(|(_, attempt, _)| past_lease(attempt))
        {
            return Vec::new();
        }
        let (expired, waiting): (VecDeque<_>, VecDeque<_>) = self
            .waiting
            .drain(..)
            .partition(|(_, attempt, _)| past_lease(attempt));
        self.waiting = waiting;
        expired.into_iter().map(|(call, ..)| call).collect()
    }

    /// The release that has waited longest, with the slot it now holds; `None` when none
    /// waits or no slot is free.
    pub fn next_waiting_release(&mut self) -> Option<(HttpCall, Attempt)> {
        if self.waiting.is_empty() || !self.releases.try_start() {
            return None;
        }
        self.waiting
            .pop_front()
            .map(|(call, attempt, _)| (call, attempt))
    }

    /// The release whose slot was taken went out with `token`, at `attempt`; kept to be sent
    /// again should decode not be reached, while attempts are left and it can be kept.
    pub fn release_went_out(&mut self, token: u32, call: &HttpCall, attempt: Attempt) {
        let request_id = call.request_id().to_owned();
        let retry = self.retry_for(call, attempt).ok();
        let cluster = call.cluster.clone();
        self.calls.insert(
            token,
            Caller::Release {
                request_id,
                cluster,
                retry,
            },
        );
    }

    /// The release whose slot was taken could not go out at `attempt` (Envoy refused it at
    /// once: a full decode pool, no healthy host): its slot is given back, and it is returned
    /// to be sent again, or why it cannot be.
    pub fn release_refused(&mut self, call: &HttpCall, attempt: Attempt) -> Result<Retry, NoRetry> {
        self.releases.finish();
        self.retry_for(call, attempt)
    }

    fn retry_for(&self, call: &HttpCall, attempt: Attempt) -> Result<Retry, NoRetry> {
        if attempt.number >= RELEASE_ATTEMPTS {
            return Err(NoRetry::AttemptsUsed);
        }
        let kept = self.keep(call).ok_or(NoRetry::TooLargeToKeep)?;
        Ok(Retry {
            call: call.clone(),
            attempt,
            _kept: kept,
        })
    }

    /// Whose answer `token` is; a release's slot is given back.
    pub fn answered(&mut self, token: u32) -> Option<Caller<R>> {
        let caller = self.calls.remove(&token);
        if let Some(Caller::Release { .. }) = caller {
            self.releases.finish();
        }
        caller
    }

    /// Keeps a release that could not reach decode to send again later, or says why not
    /// (it is dropped).
    pub fn retry_later(&mut self, retry: Retry, now: SystemTime) -> Result<(), NotKept> {
        if self.retries.len() >= self.waiting_bound() {
            return Err(NotKept::TooMany);
        }
        let index = usize::try_from(retry.attempt.number.saturating_sub(1)).unwrap_or(usize::MAX);
        let wait = RETRY_AFTER
            .get(index)
            .copied()
            .unwrap_or(Duration::from_secs(4));
        let due = now
            .checked_add(wait)
            .filter(|due| !retry.attempt.past_lease(*due))
            .ok_or(NotKept::PastLease)?;
        self.retries.push_back((due, retry));
        Ok(())
    }

    /// The releases due to be sent again by `now`, each with its next attempt.
    pub fn due_retries(&mut self, now: SystemTime) -> Vec<(HttpCall, Attempt)> {
        let mut due = Vec::new();
        let mut waiting = VecDeque::with_capacity(self.retries.len());
        for (when, retry) in self.retries.drain(..) {
            if when <= now {
                due.push((retry.call, retry.attempt.next()));
            } else {
                waiting.push_back((when, retry));
            }
        }
        self.retries = waiting;
        due
    }

    pub fn retries_waiting(&self) -> bool {
        !self.retries.is_empty()
    }

    /// What is left to do: what a worker loses when Envoy ends its VM.
    pub fn unfinished(&self) -> Unfinished {
        let mut unfinished = Unfinished {
            releases_unsent: self.waiting.len() + self.retries.len(),
            ..Unfinished::default()
        };
        for job in &self.jobs {
            match job {
                Job::Release(_) => unfinished.releases_unsent += 1,
                Job::Prefill(..) => unfinished.prefills += 1,
            }
        }
        for caller in self.calls.values() {
            match caller {
                Caller::Release { .. } => unfinished.releases_in_flight += 1,
                Caller::Prefill(_) => unfinished.prefills += 1,
            }
        }
        unfinished
    }

    /// Whether no call is queued, in flight, waiting for a slot or to be sent again.
    pub fn is_idle(&self) -> bool {
        self.jobs.is_empty()
            && self.calls.is_empty()
            && self.waiting.is_empty()
            && self.retries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const T0: SystemTime = SystemTime::UNIX_EPOCH;

    fn first() -> Attempt {
        Attempt::first(T0)
    }

    fn last() -> Attempt {
        Attempt {
            number: RELEASE_ATTEMPTS,
            first_sent: T0,
        }
    }

    fn call() -> HttpCall {
        HttpCall {
            cluster: "decode".into(),
            headers: vec![("x-request-id".into(), "req-9".into())].into(),
            body: vec![],
            timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn one_wake_serves_every_call_queued_before_the_turn() {
        let mut callouts: Callouts<&str> = Callouts::default();
        assert!(callouts.queue(Job::Prefill("a", call())));
        assert!(!callouts.queue(Job::Prefill("b", call())));
        callouts.woken();
        let order: Vec<&str> = std::iter::from_fn(|| callouts.next_job())
            .map(|job| match job {
                Job::Prefill(request, _) => request,
                Job::Release(_) => "release",
            })
            .collect();
        assert_eq!(order, ["a", "b"]);
        assert!(
            callouts.queue(Job::Release(call())),
            "a new turn needs a new wake"
        );
        assert!(matches!(callouts.wake_failed(), Some(Job::Release(_))));
        assert!(callouts.next_job().is_none());
    }

    #[test]
    fn what_is_left_to_do_is_told_by_kind() {
        let mut callouts: Callouts<&str> = Callouts::default();
        callouts.set_release_bound(1, HeldBytes::new(0));
        assert_eq!(callouts.unfinished(), Unfinished::default());
        callouts.queue(Job::Prefill("a", call()));
        callouts.queue(Job::Release(call()));
        callouts.prefill_sent(1, "b");
        // One release in flight, one waiting for its slot, one to be sent again.
        assert_eq!(
            callouts.begin_release(&call(), first(), T0).0,
            ReleaseStart::Send
        );
        callouts.release_went_out(2, &call(), first());
        assert_eq!(
            callouts.begin_release(&call(), first(), T0).0,
            ReleaseStart::Waits
        );
        let retry = callouts.retry_for(&call(), first()).ok().unwrap();
        assert!(callouts.retry_later(retry, T0).is_ok());
        assert_eq!(
            callouts.unfinished(),
            Unfinished {
                releases_unsent: 3,
                releases_in_flight: 1,
                prefills: 2,
            }
        );
    }

    #[test]
    fn answers_go_back_to_their_caller_once() {
        let mut callouts: Callouts<&str> = Callouts::default();
        callouts.prefill_sent(7, "a");
        assert!(matches!(callouts.answered(7), Some(Caller::Prefill("a"))));
        assert!(callouts.answered(7).is_none());
    }

    #[test]
    fn releases_in_flight_are_bounded() {
        let mut callouts: Callouts<&str> = Callouts::default();
        callouts.set_release_bound(1, HeldBytes::new(0));
        assert!(callouts.start_release());
        callouts.release_went_out(3, &call(), first());
        assert!(!callouts.start_release(), "the bound is reached");
        let Some(Caller::Release { request_id, .. }) = callouts.answered(3) else {
            panic!("a release's answer");
        };
        assert_eq!(request_id, "req-9", "the request its log lines name");
        assert!(callouts.start_release(), "the slot came back");
        assert!(
            callouts.release_refused(&call(), first()).is_ok(),
            "one Envoy refused at once is sent again"
        );
        assert!(
            callouts.start_release(),
            "a release that never went out frees its slot"
        );
        assert_eq!(
            callouts.release_refused(&call(), last()).err(),
            Some(NoRetry::AttemptsUsed)
        );
    }

    #[test]
    fn a_large_release_waits_only_within_the_vms_budget() {
        // The kv_transfer_params of a long prompt list thousands of blocks; a client's
        // headers may be large too.
        let heavy = HttpCall {
            headers: vec![("baggage".into(), "x".repeat(SMALL_RELEASE_BYTES))].into(),
            body: vec![b'1'; 30_000],
            ..call()
        };
        let size = release_bytes(&heavy);
        let held = HeldBytes::new(2 * size);
        let mut callouts: Callouts<&str> = Callouts::default();
        callouts.set_release_bound(1, held.clone());
        assert!(callouts.wait_for_slot(heavy.clone(), first()));
        let retry = callouts.release_refused(&heavy, first()).unwrap();
        assert_eq!(held.held(), 2 * size);
        assert!(
            !callouts.wait_for_slot(heavy.clone(), first()),
            "the budget is full"
        );
        assert_eq!(
            callouts.release_refused(&heavy, first()).err(),
            Some(NoRetry::TooLargeToKeep),
            "not the last attempt, but no room"
        );
        assert!(
            callouts.wait_for_slot(call(), first()),
            "a small one still waits"
        );
        drop(retry);
        let (sent, _) = callouts.next_waiting_release().unwrap();
        assert_eq!(sent.body.len(), 30_000, "in the order they came");
        assert_eq!(held.held(), 0, "what was sent holds nothing");
    }

    #[test]
    fn releases_past_the_bound_wait_for_a_slot_in_order() {
        let mut callouts: Callouts<&str> = Callouts::default();
        callouts.set_release_bound(1, HeldBytes::new(0));
        assert!(callouts.start_release());
        callouts.release_went_out(1, &call(), first());
        assert!(!callouts.start_release());
        let named = |cluster: &str| HttpCall {
            cluster: cluster.into(),
            ..call()
        };
        for n in 0..WAITING_PER_SLOT {
            assert!(callouts.wait_for_slot(named(&n.to_string()), first()));
        }
        assert!(
            !callouts.wait_for_slot(named("late"), first()),
            "the wait is bounded"
        );
        assert!(callouts.next_waiting_release().is_none(), "no slot yet");
        callouts.answered(1);
        let (first, attempt) = callouts.next_waiting_release().unwrap();
        assert_eq!((&*first.cluster, attempt.number), ("0", 1));
        assert!(
            callouts.next_waiting_release().is_none(),
            "its slot is taken"
        );
        callouts.release_went_out(2, &first, attempt);
        callouts.answered(2);
        assert_eq!(&*callouts.next_waiting_release().unwrap().0.cluster, "1");
    }

    #[test]
    fn an_attempt_is_sent_waits_or_is_dropped() {
        let mut callouts: Callouts<&str> = Callouts::default();
        callouts.set_release_bound(1, HeldBytes::new(0));
        let named = |cluster: &str| HttpCall {
            cluster: cluster.into(),
            ..call()
        };
        let late = T0 + RELEASE_LEASE + Duration::from_secs(1);
        let (start, expired) = callouts.begin_release(&call(), first(), T0);
        assert_eq!((start, expired.len()), (ReleaseStart::Send, 0));
        let (start, _) = callouts.begin_release(&named("stale"), first(), T0);
        assert_eq!(start, ReleaseStart::Waits, "the one slot is taken");
        let again = Attempt {
            number: 2,
            ..first()
        };
        let (start, _) = callouts.begin_release(&call(), again, late);
        assert_eq!(
            start,
            ReleaseStart::PastLease,
            "a later attempt past the lease"
        );
        let (start, expired) = callouts.begin_release(&named("new"), Attempt::first(late), late);
        assert_eq!(
            start,
            ReleaseStart::Waits,
            "a first attempt is never too late"
        );
        let expired: Vec<&str> = expired.iter().map(|call| &*call.cluster).collect();
        assert_eq!(
            expired,
            ["stale"],
            "dropped before it could take a new one's place"
        );
        for _ in 1..WAITING_PER_SLOT {
            let (start, _) = callouts.begin_release(&call(), Attempt::first(late), late);
            assert_eq!(start, ReleaseStart::Waits);
        }
        let (start, _) = callouts.begin_release(&call(), Attempt::first(late), late);
        assert_eq!(start, ReleaseStart::NoRoomToWait);
    }

    #[test]
    fn releases_that_waited_past_the_lease_are_dropped() {
        let mut callouts: Callouts<&str> = Callouts::default();
        let held = HeldBytes::new(1 << 20);
        callouts.set_release_bound(1, held.clone());
        assert!(callouts.start_release());
        let named = |cluster: &str| HttpCall {
            cluster: cluster.into(),
            ..call()
        };
        let heavy = HttpCall {
            body: vec![b'1'; 2 * SMALL_RELEASE_BYTES],
            ..named("old")
        };
        assert!(callouts.wait_for_slot(heavy, first()));
        let later = T0 + Duration::from_secs(20);
        assert!(callouts.wait_for_slot(named("recent"), Attempt::first(later)));
        assert!(callouts.expire_waiting(T0 + RELEASE_LEASE).is_empty());
        let expired = callouts.expire_waiting(later + Duration::from_secs(15));
        let clusters: Vec<&str> = expired.iter().map(|call| &*call.cluster).collect();
        assert_eq!(clusters, ["old"]);
        assert_eq!(held.held(), 0, "what it kept in the VM is given back");
        let _ = callouts.release_refused(&call(), last());
        let (next, _) = callouts.next_waiting_release().unwrap();
        assert_eq!(&*next.cluster, "recent");
    }

    #[test]
    fn idle_only_once_every_call_has_gone_and_answered() {
        let mut callouts: Callouts<&str> = Callouts::default();
        callouts.set_release_bound(1, HeldBytes::new(0));
        assert!(callouts.is_idle());
        callouts.queue(Job::Release(call()));
        assert!(!callouts.is_idle(), "queued for the worker's turn");
        let Some(Job::Release(release)) = callouts.next_job() else {
            panic!("the release");
        };
        assert!(callouts.start_release());
        callouts.release_went_out(4, &release, first());
        assert!(!callouts.is_idle(), "in flight");
        let Some(Caller::Release {
            retry: Some(retry), ..
        }) = callouts.answered(4)
        else {
            panic!("a retry");
        };
        assert_eq!(callouts.retry_later(retry, T0), Ok(()));
        assert!(!callouts.is_idle(), "to be sent again");
        let due = callouts.due_retries(T0 + Duration::from_secs(1));
        assert_eq!(due.len(), 1);
        assert!(callouts.start_release());
        assert!(callouts.wait_for_slot(due[0].0.clone(), due[0].1));
        assert!(!callouts.is_idle(), "waiting for a slot");
        assert_eq!(
            callouts.expire_waiting(T0 + Duration::from_secs(31)).len(),
            1
        );
        let _ = callouts.release_refused(&call(), last());
        assert!(callouts.is_idle());
    }

    #[test]
    fn the_lease_counts_from_a_releases_first_attempt() {
        let mut callouts: Callouts<&str> = Callouts::default();
        callouts.set_release_bound(1, HeldBytes::new(0));
        assert!(callouts.start_release());
        let named = |cluster: &str| HttpCall {
            cluster: cluster.into(),
            ..call()
        };
        let at = |secs: u64| T0 + Duration::from_secs(secs);
        // A new release queues first; one sent again, first tried at 0 s, queues behind it.
        assert!(callouts.wait_for_slot(named("new"), Attempt::first(at(20))));
        let retried = Attempt {
            number: 4,
            first_sent: T0,
        };
        assert!(callouts.wait_for_slot(named("retried"), retried));
        assert!(callouts.expire_waiting(at(30)).is_empty());
        let expired = callouts.expire_waiting(at(31));
        let clusters: Vec<&str> = expired.iter().map(|call| &*call.cluster).collect();
        assert_eq!(clusters, ["retried"], "though it waited 1 s only");
        let _ = callouts.release_refused(&call(), last());
        assert_eq!(&*callouts.next_waiting_release().unwrap().0.cluster, "new");
    }

    #[test]
    fn a_release_is_sent_again_later_a_bounded_number_of_times() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let at = |secs: u64| start + Duration::from_secs(secs);
        let mut callouts: Callouts<&str> = Callouts::default();
        callouts.set_release_bound(2, HeldBytes::new(0));
        let mut attempt = Attempt::first(start);
        let mut now = start;
        loop {
            assert!(callouts.start_release());
            callouts.release_went_out(9, &call(), attempt);
            let Some(Caller::Release { retry, .. }) = callouts.answered(9) else {
                panic!("a release");
            };
            let Some(retry) = retry else {
                break;
            };
            assert_eq!(callouts.retry_later(retry, now), Ok(()));
            assert!(callouts.due_retries(now).is_empty(), "not yet");
            now += RETRY_AFTER[attempt.number as usize - 1];
            let due = callouts.due_retries(now);
            assert_eq!(due.len(), 1);
            attempt = due[0].1;
            assert_eq!(
                attempt.first_sent, start,
                "the first attempt's time is kept"
            );
            assert!(!callouts.retries_waiting());
        }
        assert_eq!(
            attempt.number, RELEASE_ATTEMPTS,
            "every attempt made, then no more"
        );
        assert!(now <= start + RELEASE_LEASE, "all within the lease");

        // One whose attempts took long (each up to its timeout) is not sent past the lease.
        assert!(callouts.start_release());
        callouts.release_went_out(8, &call(), Attempt::first(start));
        let Some(Caller::Release {
            retry: Some(retry), ..
        }) = callouts.answered(8)
        else {
            panic!("a retry");
        };
        assert_eq!(callouts.retry_later(retry, at(30)), Err(NotKept::PastLease));

        // A large body is not kept past the VM's budget; too many waiting are dropped.
        let large = HttpCall {
            body: vec![b'x'; SMALL_RELEASE_BYTES + 1],
            ..call()
        };
        callouts.release_went_out(1, &large, first());
        assert!(matches!(
            callouts.answered(1),
            Some(Caller::Release { retry: None, .. })
        ));
        let bound = 2 * WAITING_PER_SLOT as u32;
        for n in 0..bound + 1 {
            callouts.release_went_out(n, &call(), Attempt::first(start));
            let Some(Caller::Release {
                retry: Some(retry), ..
            }) = callouts.answered(n)
            else {
                panic!("a retry");
            };
            let expected = if n < bound {
                Ok(())
            } else {
                Err(NotKept::TooMany)
            };
            assert_eq!(
                callouts.retry_later(retry, at(0)),
                expected,
                "bound {bound}"
            );
        }
    }
}
