//! Decode that Envoy cannot connect to, per decode pool, as one VM (one Envoy worker) has
//! seen it. While decode is down every request would still cost a prefill whose KV nobody
//! reads, and clients that retry at once on a quick 503 multiply that: new requests for the
//! pool are answered 503 before prefill until decode answers again, to a probe (one request
//! per `retry` period) or to a KV release.
//!
//! A pool is named as the operator named it for a request's model: the decode cluster its
//! KV releases go to (`decode_cluster`, `model_decode_clusters`), never a name a client
//! chooses, so that no client can fill the table or keep another's pool apart.
//!
//! Only failures a client cannot cause count: Envoy could not connect (refused, timed out)
//! or had no healthy host. And only a run of them with no answer from decode in between,
//! long enough that one dead host among live ones does not stop a pool: at least
//! [`FAILURES_TO_REFUSE`] requests over at least [`SPAN_TO_REFUSE`].

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

/// Failed requests in a row, at least, before a pool's requests are refused.
pub const FAILURES_TO_REFUSE: u32 = 3;
/// How long the run of failures lasts, at least, before a pool's requests are refused.
pub const SPAN_TO_REFUSE: Duration = Duration::from_millis(100);
/// A run of failures with no other failure for this long is over: one failure now and two
/// an hour ago are no outage.
const RUN_ENDS_AFTER: Duration = Duration::from_secs(10);
/// Pools followed at once (there are as many as the configuration names); past this a new
/// one is not followed.
const MOST_POOLS: usize = 256;

/// Answers Envoy gave instead of decode's that say decode could not be reached at all, in
/// Envoy's `response.code_details`.
pub fn is_connect_failure(code_details: &str) -> bool {
    code_details != "via_upstream"
        && [
            "connection_failure",
            "connection_timeout",
            "no_healthy_upstream",
        ]
        .iter()
        .any(|what| code_details.contains(what))
}

#[derive(Debug, Clone, Copy)]
struct Run {
    failures: u32,
    first: SystemTime,
    last: SystemTime,
    /// New requests are refused until then; the first one after goes on, as a probe.
    refusing_until: Option<SystemTime>,
}

#[derive(Clone, Debug, Default)]
pub struct DecodeOutages {
    runs: Rc<RefCell<HashMap<String, Run>>>,
    /// How long requests are refused before one goes on to try decode; zero: never refused.
    retry: Duration,
}

impl DecodeOutages {
    pub fn new(retry: Duration) -> DecodeOutages {
        DecodeOutages {
            runs: Rc::default(),
            retry,
        }
    }

    /// This period over the outages `other` has seen: the VM's other roots (listeners with
    /// another configuration, a configuration being replaced) send to the same pools.
    pub fn counting_with(self, other: &DecodeOutages) -> DecodeOutages {
        DecodeOutages {
            runs: Rc::clone(&other.runs),
            ..self
        }
    }

    pub fn is_on(&self) -> bool {
        !self.retry.is_zero()
    }

    /// Whether a request for `pool` may go to prefill now; if not, how long until one may.
    /// Past a refusal period the first request goes on (a probe) and the next period begins.
    pub fn admit(&self, pool: &str, now: SystemTime) -> Result<(), Duration> {
        if !self.is_on() {
            return Ok(());
        }
        let mut runs = self.runs.borrow_mut();
        // Every request asks: with no pool down, not even the key is hashed.
        if runs.is_empty() {
            return Ok(());
        }
        let Some(until) = runs
            .get_mut(pool)
            .and_then(|run| run.refusing_until.as_mut())
        else {
            return Ok(());
        };
        match until.duration_since(now) {
            Ok(wait) if !wait.is_zero() => Err(wait),
            _ => {
                *until = self.end_of_period(now);
                Ok(())
            }
        }
    }

    /// Envoy could not connect to decode for a request for `pool`.
    pub fn connect_failed(&self, pool: &str, now: SystemTime) {
        if !self.is_on() {
            return;
        }
        let mut runs = self.runs.borrow_mut();
        if !runs.contains_key(pool) && runs.len() >= MOST_POOLS {
            return;
        }
        let fresh = Run {
            failures: 0,
            first: now,
            last: now,
            refusing_until: None,
        };
        let run = runs.entry(pool.to_owned()).or_insert(fresh);
        if now.duration_since(run.last).unwrap_or_default() > RUN_ENDS_AFTER {
            *run = fresh;
        }
        run.failures = run.failures.saturating_add(1);
        run.last = now;
        let span = now.duration_since(run.first).unwrap_or_default();
        if run.refusing_until.is_some()
            || (run.failures >= FAILURES_TO_REFUSE && span >= SPAN_TO_REFUSE)
        {
            if run.refusing_until.is_none() {
                log::warn!(
                    target: crate::log_budget::EVENT_TARGET,
                    "decode pool {pool:?} could not be reached {} times in a row over \
                     {} ms: its new requests are answered 503 before prefill, one let through \
                     every {} ms to see whether decode is back (decode_outage_retry_ms)",
                    run.failures,
                    span.as_millis(),
                    self.retry.as_millis()
                );
            }
            run.refusing_until = Some(self.end_of_period(now));
        }
    }

    fn end_of_period(&self, now: SystemTime) -> SystemTime {
        now.checked_add(self.retry).unwrap_or(now)
    }

    /// Decode answered a request for `pool` (whatever it answered): the run is over.
    pub fn reached(&self, pool: &str) {
        let mut runs = self.runs.borrow_mut();
        if runs.is_empty() {
            return;
        }
        if let Some(run) = runs.remove(pool) {
            if run.refusing_until.is_some() {
                log::warn!(
                    target: crate::log_budget::EVENT_TARGET,
                    "decode pool {pool:?} answers again: its requests go on"
                );
            }
        }
    }

    #[cfg(test)]
    fn followed(&self) -> usize {
        self.runs.borrow().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RETRY: Duration = Duration::from_millis(1000);

    fn at(ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
    }

    #[test]
    fn a_run_of_failures_long_enough_refuses_the_pool_until_a_probe() {
        let outages = DecodeOutages::new(RETRY);
        outages.connect_failed("m", at(0));
        outages.connect_failed("m", at(40));
        outages.connect_failed("m", at(80));
        assert_eq!(
            outages.admit("m", at(90)),
            Ok(()),
            "three, but within 100 ms"
        );
        outages.connect_failed("m", at(250));
        assert_eq!(outages.admit("m", at(300)), Err(Duration::from_millis(950)));
        assert_eq!(outages.admit("other", at(300)), Ok(()), "other pools go on");
        assert_eq!(outages.admit("m", at(1250)), Ok(()), "the probe");
        assert_eq!(
            outages.admit("m", at(1260)),
            Err(Duration::from_millis(990)),
            "refused while the probe is out"
        );
        outages.connect_failed("m", at(1300));
        assert_eq!(outages.admit("m", at(2250)), Err(Duration::from_millis(50)));
        outages.reached("m");
        assert_eq!(outages.admit("m", at(2250)), Ok(()));
        assert_eq!(outages.admit("m", at(2251)), Ok(()));
        assert_eq!(outages.followed(), 0);
    }

    #[test]
    fn roots_of_one_vm_see_each_others_outages() {
        let vm = DecodeOutages::default();
        let old = DecodeOutages::new(RETRY).counting_with(&vm);
        let new = DecodeOutages::new(RETRY).counting_with(&vm);
        for ms in [0, 60, 120] {
            old.connect_failed("m", at(ms));
        }
        assert!(
            new.admit("m", at(130)).is_err(),
            "the pool is down for the worker"
        );
        new.reached("m");
        assert_eq!(old.admit("m", at(140)), Ok(()));
    }

    #[test]
    fn an_answer_from_decode_ends_the_run() {
        let outages = DecodeOutages::new(RETRY);
        outages.connect_failed("m", at(0));
        outages.connect_failed("m", at(300));
        outages.reached("m");
        outages.connect_failed("m", at(400));
        outages.connect_failed("m", at(700));
        assert_eq!(outages.admit("m", at(800)), Ok(()));
    }

    #[test]
    fn failures_far_apart_are_no_run() {
        let outages = DecodeOutages::new(RETRY);
        outages.connect_failed("m", at(0));
        outages.connect_failed("m", at(5_000));
        outages.connect_failed("m", at(16_000));
        outages.connect_failed("m", at(16_050));
        assert_eq!(outages.admit("m", at(16_200)), Ok(()));
        outages.connect_failed("m", at(16_300));
        assert!(outages.admit("m", at(16_400)).is_err());
    }

    #[test]
    fn off_with_a_zero_retry() {
        let outages = DecodeOutages::new(Duration::ZERO);
        for ms in 0..10 {
            outages.connect_failed("m", at(ms * 100));
        }
        assert_eq!(outages.admit("m", at(2_000)), Ok(()));
        assert_eq!(outages.followed(), 0);
    }

    #[test]
    fn the_pools_followed_are_bounded() {
        let outages = DecodeOutages::new(RETRY);
        for n in 0..(MOST_POOLS + 10) {
            outages.connect_failed(&format!("m{n}"), at(0));
        }
        assert_eq!(outages.followed(), MOST_POOLS);
    }

    #[test]
    fn only_connect_failures_count() {
        for details in [
            "upstream_reset_before_response_started{connection_failure}",
            "upstream_reset_before_response_started{connection_timeout}",
            "no_healthy_upstream",
        ] {
            assert!(is_connect_failure(details), "{details}");
        }
        for details in [
            "via_upstream",
            "upstream_reset_before_response_started{remote_reset}",
            "upstream_reset_before_response_started{overflow}",
            "upstream_response_timeout",
            "cluster_not_found",
            "route_not_found",
        ] {
            assert!(!is_connect_failure(details), "{details}");
        }
    }
}
