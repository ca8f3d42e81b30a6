//! The filter's Envoy stats. Envoy shows them under `wasmcustom.pd_filter.*` on the admin
//! `/stats` endpoint (and as `pd_filter_*` in `/stats/prometheus`), summed over all workers.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

use crate::api::Api;
use crate::protocol::FailureKind;
use crate::session::Metric;

pub struct Stats {
    orchestrated: [Option<u32>; Api::ALL.len()],
    passed_through: Option<u32>,
    prefill_failures: [Option<u32>; FailureKind::ALL.len()],
    decode_only_fallbacks: Option<u32>,
    bad_requests: Option<u32>,
    prefill_latency_ms: Option<u32>,
    kv_released: Option<u32>,
    kv_release_failed: Option<u32>,
    kv_release_dropped: Option<u32>,
}

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
    pub fn define() -> Stats {
        Stats {
            orchestrated: Api::ALL
                .map(|api| counter(&format!("requests_orchestrated.{}", api.name()))),
            passed_through: counter("requests_passed_through"),
            prefill_failures: FailureKind::ALL
                .map(|kind| counter(&format!("prefill_failures.{}", kind.name()))),
            decode_only_fallbacks: counter("decode_only_fallbacks"),
            bad_requests: counter("bad_requests"),
            prefill_latency_ms: define(MetricType::Histogram, "pd_filter.prefill_latency_ms"),
            kv_released: counter("kv_releases.released"),
            kv_release_failed: counter("kv_releases.failed"),
            kv_release_dropped: counter("kv_releases.dropped"),
        }
    }

    pub fn record(&self, metric: Metric) {
        match metric {
            Metric::Orchestrated(api) => {
                let index = Api::ALL.iter().position(|a| *a == api);
                increment(index.and_then(|i| self.orchestrated.get(i).copied().flatten()));
            }
            Metric::PassedThrough => increment(self.passed_through),
            Metric::PrefillFailure(kind) => {
                let index = FailureKind::ALL.iter().position(|k| *k == kind);
                increment(index.and_then(|i| self.prefill_failures.get(i).copied().flatten()));
            }
            Metric::DecodeOnlyFallback => increment(self.decode_only_fallbacks),
            Metric::BadRequest => increment(self.bad_requests),
            Metric::KvReleased => increment(self.kv_released),
            Metric::KvReleaseFailed => increment(self.kv_release_failed),
            Metric::KvReleaseDropped => increment(self.kv_release_dropped),
            Metric::PrefillLatency(elapsed) => {
                if let Some(id) = self.prefill_latency_ms {
                    let millis = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
                    let _ = hostcalls::record_metric(id, millis);
                }
            }
        }
    }
}
