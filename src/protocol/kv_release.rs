//! Releasing the KV a prefill worker holds for a request whose decode leg will never run:
//! vLLM frees prefill's blocks once a decode worker has read them, so a one-token request
//! carrying the same `kv_transfer_params` to decode frees them at once instead of when
//! prefill gives up on them.

/// Whether Envoy answered the decode leg itself with no decode worker that will read the
/// KV: a connection that never opened, no host, no cluster, no route, a full pool; or a
/// connection closed or reset before decode answered (a decode worker killed or crashed, or
/// a kept-alive connection it had closed as Envoy sent the request). In the last case decode
/// may have read the KV before it went; the release then costs a decode one token, and the
/// client, answered by Envoy, never sees the first decode's answer either way. Also Envoy's
/// 413 for a decode body written past its buffer limit (`request_payload_too_large`): the
/// filter holds the whole body until it writes decode's, so decode got none of it.
/// `code_details` is Envoy's `response.code_details` (`via_upstream` for a decode answer).
pub fn decode_will_not_read(code_details: &str) -> bool {
    const NOT_READ: [&str; 9] = [
        "connection_failure",
        "connection_timeout",
        // HTTP/2 REFUSED_STREAM: the server says it did not process the stream.
        "refused_stream",
        "no_healthy_upstream",
        "cluster_not_found",
        "route_not_found",
        "overflow",
        // Closed (`connection_termination`) or reset (`remote_reset`) before any answer.
        "upstream_reset_before_response_started",
        "request_payload_too_large",
    ];
    code_details != "via_upstream" && NOT_READ.iter().any(|what| code_details.contains(what))
}

/// Whether decode answered an error of its own (4xx or 5xx), after which the KV prefill made
/// may still wait. vLLM checks a request in its API server, before the engine that would read
/// prefill's KV ever sees it: a body that prefill served one capped token of can still fail
/// decode's checks (a limit past the context), and vLLM answers 503 when it is not serving.
/// A 500 (an engine that failed or died) may come before the read or after it. Releasing KV
/// decode already read costs a decode worker one token; KV left waiting holds prefill's
/// blocks until vLLM's abort timeout (`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, minutes).
pub fn decode_answered_an_error(status: Option<u16>, code_details: Option<&str>) -> bool {
    status.is_some_and(|status| (400..600).contains(&status))
        && code_details == Some("via_upstream")
}

/// Whether a release's answer says decode could not be reached at all, so that sending it
/// again later may succeed: Envoy's own 503 (no connection, no healthy host, a full pool) or
/// no answer (a reset). vLLM itself answers 503 only when it is not serving.
pub fn decode_unreached(status: Option<u16>) -> bool {
    matches!(status, None | Some(503))
}

/// Whether decode took the release (its answer is otherwise discarded).
pub fn release_succeeded(status: Option<u16>) -> bool {
    status.is_some_and(|status| (200..300).contains(&status))
}

/// Releases in flight on one worker, bounded: past the bound a release waits for a slot
/// (a bounded number of them, the rest dropped and counted), so that an abandoning crowd
/// cannot pile up callouts.
#[derive(Debug)]
pub struct ReleaseBudget {
    in_flight: u32,
    max: u32,
}

impl ReleaseBudget {
    pub fn new(max: u32) -> ReleaseBudget {
        ReleaseBudget { in_flight: 0, max }
    }

    /// Takes a slot for one release; `false` when the bound is reached.
    pub fn try_start(&mut self) -> bool {
        if self.in_flight >= self.max {
            return false;
        }
        self.in_flight += 1;
        true
    }

    pub fn finish(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// The bound.
    pub fn max(&self) -> u32 {
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_unreached_decode_is_worth_another_release() {
        assert!(decode_unreached(None));
        assert!(decode_unreached(Some(503)));
        for status in [200, 400, 404, 500, 502, 504] {
            assert!(!decode_unreached(Some(status)), "{status}");
        }
    }

    #[test]
    fn an_error_decode_wrote_itself_may_have_left_the_kv_unread() {
        assert!(decode_answered_an_error(Some(400), Some("via_upstream")));
        assert!(decode_answered_an_error(Some(415), Some("via_upstream")));
        assert!(decode_answered_an_error(Some(503), Some("via_upstream")));
        assert!(decode_answered_an_error(Some(500), Some("via_upstream")));
        assert!(decode_answered_an_error(Some(502), Some("via_upstream")));
        // Envoy's own 4xx or 503, an answer without details, a success or no status: not
        // an error decode answered.
        assert!(!decode_answered_an_error(
            Some(503),
            Some("no_healthy_upstream")
        ));
        assert!(!decode_answered_an_error(
            Some(413),
            Some("request_payload_too_large")
        ));
        assert!(!decode_answered_an_error(Some(400), None));
        assert!(!decode_answered_an_error(Some(200), Some("via_upstream")));
        assert!(!decode_answered_an_error(None, Some("via_upstream")));
    }

    #[test]
    fn only_answers_envoy_made_before_decode_answered_need_a_release() {
        for never in [
            "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}",
            "upstream_reset_before_response_started{connection_failure}",
            "no_healthy_upstream",
            "cluster_not_found",
            "route_not_found",
            "upstream_reset_before_response_started{overflow}",
            "upstream_reset_before_response_started{connection_timeout}",
            "upstream_reset_before_response_started{remote_refused_stream_reset}",
            "upstream_reset_before_response_started{connection_termination}",
            "upstream_reset_before_response_started{remote_reset}",
            "request_payload_too_large",
        ] {
            assert!(decode_will_not_read(never), "{never}");
        }
        // Decode has the request: its answer began, or it is still working on it.
        for read in [
            "via_upstream",
            "upstream_reset_after_response_started{remote_reset}",
            "response_timeout",
            "response_payload_too_large",
        ] {
            assert!(!decode_will_not_read(read), "{read}");
        }
    }

    #[test]
    fn the_budget_bounds_releases_in_flight() {
        let mut budget = ReleaseBudget::new(2);
        assert!(budget.try_start());
        assert!(budget.try_start());
        assert!(!budget.try_start());
        budget.finish();
        assert!(budget.try_start());
        let mut none = ReleaseBudget::new(0);
        assert!(!none.try_start());
        none.finish();
        assert!(release_succeeded(Some(200)));
        assert!(!release_succeeded(Some(503)));
        assert!(!release_succeeded(None));
    }
}
