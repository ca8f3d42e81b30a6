//! The filter's Envoy stats. Envoy shows them under `wasmcustom.pd_filter.*` on the admin
//! `/stats` endpoint (and `/stats/prometheus`), summed over all workers.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

use crate::protocol::{Endpoint, FailureKind};

pub struct Stats {
    orchestrated: [Option<u32>; 3],
    passed_through: Option<u32>,
    prefill_failures: [Option<u32>; FailureKind::ALL.len()],
    decode_only_fallbacks: Option<u32>,
    bad_requests: Option<u32>,
    prefill_latency_ms: Option<u32>,
}

const ENDPOINTS: [Endpoint; 3] = [
    Endpoint::Completions,
    Endpoint::ChatCompletions,
    Endpoint::Responses,
];

fn define(kind: MetricType, name: &str) -> Option<u32> {
    match hostcalls::define_metric(kind, name) {
        Ok(id) => Some(id),
        Err(status) => {
            log::warn!("could not define the metric {name}: {status:?}");
            None
        }
    }
}

fn counter(name: &str) -> Option<u32> {
    define(MetricType::Counter, &format!("pd_filter.{name}"))
}

fn increment(metric: Option<u32>) {
    if let Some(id) = metric {
        // A stat that cannot be written is not worth failing a request for.
        let _ = hostcalls::increment_metric(id, 1);
    }
}

impl Stats {
    /// Stats that record nothing, for a request whose plugin never finished configuring.
    pub fn disabled() -> Stats {
        Stats {
            orchestrated: [None; 3],
            passed_through: None,
            prefill_failures: [None; FailureKind::ALL.len()],
            decode_only_fallbacks: None,
            bad_requests: None,
            prefill_latency_ms: None,
        }
    }

    pub fn define() -> Stats {
        Stats {
            orchestrated: ENDPOINTS
                .map(|endpoint| counter(&format!("requests_orchestrated.{}", endpoint.name()))),
            passed_through: counter("requests_passed_through"),
            prefill_failures: FailureKind::ALL
                .map(|kind| counter(&format!("prefill_failures.{}", kind.name()))),
            decode_only_fallbacks: counter("decode_only_fallbacks"),
            bad_requests: counter("bad_requests"),
            prefill_latency_ms: define(MetricType::Histogram, "pd_filter.prefill_latency_ms"),
        }
    }

    pub fn orchestrated(&self, endpoint: Endpoint) {
        let index = ENDPOINTS.iter().position(|e| *e == endpoint);
        increment(index.and_then(|i| self.orchestrated.get(i).copied().flatten()));
    }

    pub fn passed_through(&self) {
        increment(self.passed_through);
    }

    pub fn prefill_failure(&self, kind: FailureKind) {
        let index = FailureKind::ALL.iter().position(|k| *k == kind);
        increment(index.and_then(|i| self.prefill_failures.get(i).copied().flatten()));
    }

    pub fn decode_only_fallback(&self) {
        increment(self.decode_only_fallbacks);
    }

    pub fn bad_request(&self) {
        increment(self.bad_requests);
    }

    pub fn prefill_latency(&self, millis: u64) {
        if let Some(id) = self.prefill_latency_ms {
            let _ = hostcalls::record_metric(id, millis);
        }
    }
}
