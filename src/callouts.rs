//! The calls of one Envoy worker, host-free: a request hands its calls to the worker (they
//! must outlive it: prefill's answer still comes after its client left, and a KV release is
//! for a request already gone), the worker sends them on its next turn, and routes each
//! answer back by its token. Releases in flight are bounded.

use std::collections::{HashMap, VecDeque};

use crate::protocol::kv_release::ReleaseBudget;
use crate::session::HttpCall;

/// A call waiting for the worker's turn; `R` is the request it belongs to.
pub enum Job<R> {
    Prefill(R, HttpCall),
    Release(HttpCall),
}

/// Whose answer a token is.
pub enum Caller<R> {
    Prefill(R),
    Release,
}

pub struct Callouts<R> {
    jobs: VecDeque<Job<R>>,
    calls: HashMap<u32, Caller<R>>,
    releases: ReleaseBudget,
    wake_pending: bool,
}

impl<R> Default for Callouts<R> {
    fn default() -> Self {
        Callouts {
            jobs: VecDeque::new(),
            calls: HashMap::new(),
            releases: ReleaseBudget::new(0),
            wake_pending: false,
        }
    }
}

impl<R> Callouts<R> {
    pub fn set_release_bound(&mut self, max_in_flight: u32) {
        self.releases = ReleaseBudget::new(max_in_flight);
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

    /// Takes a slot for a release; `false` when the bound is reached and it is dropped.
    pub fn start_release(&mut self) -> bool {
        self.releases.try_start()
    }

    /// The release whose slot was taken went out with `token`, or (`None`) could not.
    pub fn release_sent(&mut self, token: Option<u32>) {
        match token {
            Some(token) => {
                self.calls.insert(token, Caller::Release);
            }
            None => self.releases.finish(),
        }
    }

    /// Whose answer `token` is; a release's slot is given back.
    pub fn answered(&mut self, token: u32) -> Option<Caller<R>> {
        let caller = self.calls.remove(&token);
        if let Some(Caller::Release) = caller {
            self.releases.finish();
        }
        caller
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn call() -> HttpCall {
        HttpCall {
            cluster: "decode".into(),
            headers: vec![],
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
    fn answers_go_back_to_their_caller_once() {
        let mut callouts: Callouts<&str> = Callouts::default();
        callouts.prefill_sent(7, "a");
        assert!(matches!(callouts.answered(7), Some(Caller::Prefill("a"))));
        assert!(callouts.answered(7).is_none());
    }

    #[test]
    fn releases_in_flight_are_bounded() {
        let mut callouts: Callouts<&str> = Callouts::default();
        callouts.set_release_bound(1);
        assert!(callouts.start_release());
        callouts.release_sent(Some(3));
        assert!(!callouts.start_release(), "the bound is reached");
        assert!(matches!(callouts.answered(3), Some(Caller::Release)));
        assert!(callouts.start_release(), "the slot came back");
        callouts.release_sent(None);
        assert!(
            callouts.start_release(),
            "a release that never went out frees its slot"
        );
    }
}
