//! The filter's Envoy stats, summed over all workers.
//!
//! The proxy-wasm ABI has no labels: a stat is one name. Each name carries its labels the way
//! Istio's own stats do, as `label=.=value;.;` parts between the `pd_filter.` prefix and the
//! stat, e.g. `pd_filter.api=.=chat_completions;.;outcome=.=decoded;.;requests`. Envoy shows
//! it as `wasmcustom.pd_filter.api=.=…;.;requests` on the admin `/stats`; with a
//! `stats_config.stats_tags` rule `(api=\.=(.*?);\.;)` per label (the shipped configurations,
//! or Istio's `extraStatTags`) `/stats/prometheus` shows
//! `pd_filter_requests{api="chat_completions",outcome="decoded"}`.

use crate::host::MetricType;

use crate::api::Api;
use crate::host;
use crate::protocol::FailureKind;
use crate::session::{Metric, Outcome, PrefillResult};

pub struct Stats {
    requests: [[Option<u32>; Outcome::ALL.len()]; Api::ALL.len()],
    orchestrated: [Option<u32>; Api::ALL.len()],
    passed_through: Option<u32>,
    prefill_failures: [Option<u32>; FailureKind::ALL.len()],
    decode_only_fallbacks: Option<u32>,
    bad_requests: Option<u32>,
    prefill_latency_ms: [Option<u32>; PrefillResult::ALL.len()],
    kv_released: Option<u32>,
    kv_release_failed: Option<u32>,
    kv_release_dropped: Option<u32>,
    prompt_mismatches: Option<u32>,
}

/// The full name of stat `name` with its labels.
fn stat_name(name: &str, labels: &[(&str, &str)]) -> String {
    let mut full = String::from("pd_filter.");
    for (label, value) in labels {
        full.push_str(label);
        full.push_str("=.=");
        full.push_str(value);
        full.push_str(";.;");
    }
    full.push_str(name);
    full
}

fn define(kind: MetricType, name: &str, labels: &[(&str, &str)]) -> Option<u32> {
    let name = stat_name(name, labels);
    match host::define_metric(kind, &name) {
        Ok(id) => Some(id),
        Err(status) => {
            log::warn!("could not define the metric {name}: {status:?}");
            None
        }
    }
}

fn counter(name: &str, labels: &[(&str, &str)]) -> Option<u32> {
    define(MetricType::Counter, name, labels)
}

fn increment(metric: Option<u32>) {
    if let Some(id) = metric {
        // A stat that cannot be written is not worth failing a request for.
        let _ = host::increment_metric(id, 1);
    }
}

/// The stat of `key` in a table defined in the order of `all`.
fn lookup<K: PartialEq, const N: usize>(
    all: &[K; N],
    table: &[Option<u32>; N],
    key: &K,
) -> Option<u32> {
    let index = all.iter().position(|k| k == key)?;
    table.get(index).copied().flatten()
}

impl Stats {
    pub fn define() -> Stats {
        Stats {
            requests: Api::ALL.map(|api| {
                Outcome::ALL.map(|outcome| {
                    let labels = [("api", api.name()), ("outcome", outcome.name())];
                    counter("requests", &labels)
                })
            }),
            orchestrated: Api::ALL
                .map(|api| counter("requests_orchestrated", &[("api", api.name())])),
            passed_through: counter("requests_passed_through", &[]),
            prefill_failures: FailureKind::ALL
                .map(|kind| counter("prefill_failures", &[("kind", kind.name())])),
            decode_only_fallbacks: counter("decode_only_fallbacks", &[]),
            bad_requests: counter("bad_requests", &[]),
            prefill_latency_ms: PrefillResult::ALL.map(|result| {
                let labels = [("outcome", result.name())];
                define(MetricType::Histogram, "prefill_latency_ms", &labels)
            }),
            kv_released: counter("kv_releases", &[("outcome", "released")]),
            kv_release_failed: counter("kv_releases", &[("outcome", "failed")]),
            kv_release_dropped: counter("kv_releases", &[("outcome", "dropped")]),
            prompt_mismatches: counter("prompt_mismatches", &[]),
        }
    }

    pub fn record(&self, metric: Metric) {
        match metric {
            Metric::Request(api, outcome) => {
                let index = Api::ALL.iter().position(|a| *a == api);
                let row = index.and_then(|i| self.requests.get(i));
                increment(row.and_then(|row| lookup(&Outcome::ALL, row, &outcome)));
            }
            Metric::Orchestrated(api) => increment(lookup(&Api::ALL, &self.orchestrated, &api)),
            Metric::PassedThrough => increment(self.passed_through),
            Metric::PrefillFailure(kind) => {
                increment(lookup(&FailureKind::ALL, &self.prefill_failures, &kind));
            }
            Metric::DecodeOnlyFallback => increment(self.decode_only_fallbacks),
            Metric::BadRequest => increment(self.bad_requests),
            Metric::KvReleased => increment(self.kv_released),
            Metric::KvReleaseFailed => increment(self.kv_release_failed),
            Metric::KvReleaseDropped => increment(self.kv_release_dropped),
            Metric::PromptMismatch => increment(self.prompt_mismatches),
            Metric::PrefillLatency(result, elapsed) => {
                let histogram = lookup(&PrefillResult::ALL, &self.prefill_latency_ms, &result);
                if let Some(id) = histogram {
                    let millis = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
                    let _ = host::record_metric(id, millis);
                }
            }
        }
    }
}
