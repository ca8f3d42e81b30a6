//! Tells an operator why every request hangs when the filter holds request headers
//! (`hold_request_headers`, `model_header`) in an Envoy that was not told to allow it: without
//! `allow_on_headers_stop_iteration` Envoy turns the pause into one that also holds the body
//! from the filter, so no held request ever gets its body, and nothing else says why.

use std::time::{Duration, SystemTime};

/// How long after the first held request, with no body seen, the warning is due.
pub const NO_BODY_WARNING_AFTER: Duration = Duration::from_secs(10);

/// One worker's watch: from its first request held at the headers until any held request's
/// body arrives. After that, or after the one warning, it costs a flag read per request.
#[derive(Debug, Default)]
pub struct HeldHeadersCheck {
    first_held: Option<SystemTime>,
    body_seen: bool,
    warned: bool,
}

impl HeldHeadersCheck {
    /// Whether the check still needs the time of a request whose headers are held.
    pub fn watching(&self) -> bool {
        !self.body_seen && !self.warned
    }

    /// A request's headers were held at `now`, its body still to come: `true` once, when no
    /// held request has had its body for [`NO_BODY_WARNING_AFTER`].
    pub fn headers_held(&mut self, now: SystemTime) -> bool {
        if !self.watching() {
            return false;
        }
        let first = *self.first_held.get_or_insert(now);
        let waited = now.duration_since(first).unwrap_or_default();
        if waited < NO_BODY_WARNING_AFTER {
            return false;
        }
        self.warned = true;
        true
    }

    /// A request's body reached the filter: holding works.
    pub fn body_arrived(&mut self) {
        self.body_seen = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1000 + secs)
    }

    #[test]
    fn warns_once_when_no_held_request_gets_its_body() {
        let mut check = HeldHeadersCheck::default();
        assert!(!check.headers_held(at(0)));
        assert!(!check.headers_held(at(9)));
        assert!(check.headers_held(at(10)));
        assert!(!check.headers_held(at(11)), "once");
        assert!(!check.watching());
    }

    #[test]
    fn a_body_ends_the_watch() {
        let mut check = HeldHeadersCheck::default();
        assert!(!check.headers_held(at(0)));
        check.body_arrived();
        assert!(!check.watching());
        assert!(!check.headers_held(at(60)));
    }
}
