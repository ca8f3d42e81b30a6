//! Tells an operator why every request hangs when the filter holds request headers
//! (`hold_request_headers`, `model_header`) in an Envoy that was not told to allow it: without
//! `allow_on_headers_stop_iteration` Envoy turns the pause into one that also holds the body
//! from the filter, so no held request ever gets its body, and nothing else says why.

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

/// How long held requests, none of which got its body, must have been arriving before the
/// warning is due.
pub const NO_BODY_WARNING_AFTER: Duration = Duration::from_secs(10);

/// How long a held request has to get its body before its missing body counts. A client
/// that sends its body with its headers has it in the filter within milliseconds; a slow
/// client's late body is told apart by the requests after it, whose bodies come.
const BODY_GRACE: Duration = Duration::from_secs(1);

/// How many held requests must have had [`BODY_GRACE`] without their bodies: a few slow
/// clients spread over the first seconds of a worker are no reason.
const MIN_SETTLED: u32 = 5;

/// The most arrivals kept while they are younger than [`BODY_GRACE`]; past it the oldest
/// counts as settled early, which only brings the warning forward under a flood of requests
/// that all hang.
const MAX_RECENT: usize = 1024;

/// One worker's watch: from its first request held at the headers until any held request's
/// body arrives. After that, or after the one warning, it costs a flag read per request.
#[derive(Debug, Default)]
pub struct HeldHeadersCheck {
    first_held: Option<SystemTime>,
    /// Arrivals of held requests younger than [`BODY_GRACE`], oldest first.
    recent: VecDeque<SystemTime>,
    /// The latest arrival of a held request that had [`BODY_GRACE`] to get its body.
    latest_settled: Option<SystemTime>,
    /// How many held requests had [`BODY_GRACE`] to get their bodies.
    settled: u32,
    body_seen: bool,
    warned: bool,
}

impl HeldHeadersCheck {
    /// Whether the check still needs the time of a request whose headers are held.
    pub fn watching(&self) -> bool {
        !self.body_seen && !self.warned
    }

    /// A request's headers were held at `now`, its body still to come: `true` once, when held
    /// requests that each had time to get their bodies, and none did, have been arriving for
    /// [`NO_BODY_WARNING_AFTER`], at least [`MIN_SETTLED`] of them. Slow clients that all
    /// arrived at once, or a few spread out, do not make it so.
    pub fn headers_held(&mut self, now: SystemTime) -> bool {
        if !self.watching() {
            return false;
        }
        let first = *self.first_held.get_or_insert(now);
        self.recent.push_back(now);
        while let Some(&arrived) = self.recent.front() {
            let had_grace = now.duration_since(arrived).unwrap_or_default() >= BODY_GRACE;
            if !had_grace && self.recent.len() <= MAX_RECENT {
                break;
            }
            self.latest_settled = Some(arrived);
            self.settled = self.settled.saturating_add(1);
            self.recent.pop_front();
        }
        let waited = self
            .latest_settled
            .and_then(|settled| settled.duration_since(first).ok())
            .unwrap_or_default();
        if waited < NO_BODY_WARNING_AFTER || self.settled < MIN_SETTLED {
            return false;
        }
        self.warned = true;
        self.recent = VecDeque::new();
        true
    }

    /// A held request's body reached the filter: holding works.
    pub fn body_arrived(&mut self) {
        self.body_seen = true;
        self.recent = VecDeque::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(millis: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1000) + Duration::from_millis(millis)
    }

    #[test]
    fn warns_once_when_held_requests_keep_coming_without_their_bodies() {
        let mut check = HeldHeadersCheck::default();
        for millis in [0, 1, 2, 3, 9_000] {
            assert!(!check.headers_held(at(millis)));
        }
        // The one at 10.2 s has not had its second yet.
        assert!(!check.headers_held(at(10_200)));
        assert!(check.headers_held(at(11_300)));
        assert!(!check.headers_held(at(12_000)), "once");
        assert!(!check.watching());
    }

    #[test]
    fn a_few_slow_clients_spread_out_are_no_reason() {
        let mut check = HeldHeadersCheck::default();
        assert!(!check.headers_held(at(0)));
        assert!(!check.headers_held(at(10_500)));
        // A request whose body comes at once, after two slow ones 10.5 s apart.
        assert!(!check.headers_held(at(11_600)));
        check.body_arrived();
        assert!(!check.watching());
    }

    #[test]
    fn slow_clients_that_came_together_are_no_reason() {
        let mut check = HeldHeadersCheck::default();
        for _ in 0..6 {
            assert!(!check.headers_held(at(0)));
        }
        // Requests 11 s later: the slow ones had their grace, but they span no time at all.
        assert!(!check.headers_held(at(11_000)));
        assert!(!check.headers_held(at(11_001)));
        // And the new requests' bodies come.
        check.body_arrived();
        assert!(!check.watching());
        assert!(!check.headers_held(at(30_000)));
    }

    #[test]
    fn a_body_ends_the_watch() {
        let mut check = HeldHeadersCheck::default();
        assert!(!check.headers_held(at(0)));
        check.body_arrived();
        assert!(!check.watching());
        assert!(!check.headers_held(at(60_000)));
    }

    #[test]
    fn a_flood_of_hanging_requests_is_bounded_and_still_told() {
        let mut check = HeldHeadersCheck::default();
        let mut warned = false;
        for millis in 0..12_000 {
            warned |= check.headers_held(at(millis));
            assert!(check.recent.len() <= MAX_RECENT);
        }
        assert!(warned);
    }
}
