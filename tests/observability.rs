//! The filter's stats on Envoy's admin endpoint, its log lines, and the prefill-time header.
//! One test, run in order, so the counters move only by what it does.

mod common;

use common::{harness, post, unique_id};

#[tokio::test]
async fn stats_logs_and_prefill_time_header() {
    let h = harness();
    let counters = [
        "requests_orchestrated.completions",
        "requests_orchestrated.chat_completions",
        "requests_orchestrated.responses",
        "requests_passed_through",
        "prefill_failures.status",
        "prefill_failures.timeout",
        "prefill_failures.reset",
        "prefill_failures.unreachable",
        "prefill_failures.no_kv_transfer_params",
        "decode_only_fallbacks",
        "bad_requests",
    ];
    let before: Vec<u64> = counters.iter().map(|name| h.counter(name)).collect();

    let happy_id = unique_id("stats-happy");
    let reply = post(
        "default",
        "/v1/completions",
        &happy_id,
        r#"{"prompt":"a","max_tokens":1}"#,
    )
    .await;
    assert_eq!(reply.status, 200);
    // Off by default.
    assert_eq!(reply.header("x-pd-prefill-ms"), None);
    let id = unique_id("stats-chat");
    post(
        "default",
        "/v1/chat/completions",
        &id,
        r#"{"messages":[{"role":"user","content":"a"}]}"#,
    )
    .await;
    let id = unique_id("stats-responses");
    let reply = post("strict", "/v1/responses", &id, r#"{"input":"a"}"#).await;
    assert_eq!(reply.status, 200);
    let millis: u64 = reply
        .header("x-pd-prefill-ms")
        .expect("prefill time header")
        .parse()
        .unwrap();
    assert!(millis < 5_000);

    common::send(common::client().get(h.url("default", "/v1/models"))).await;

    let status_id = unique_id("stats-status");
    post(
        "default",
        "/v1/completions",
        &status_id,
        r#"{"prompt":"mock:prefill_status=500"}"#,
    )
    .await;
    let timeout_id = unique_id("stats-timeout");
    post(
        "strict",
        "/v1/completions",
        &timeout_id,
        r#"{"prompt":"mock:prefill_delay_ms=3000"}"#,
    )
    .await;
    let reset_id = unique_id("stats-reset");
    post(
        "default",
        "/v1/completions",
        &reset_id,
        r#"{"prompt":"mock:prefill_reset_mid_answer"}"#,
    )
    .await;
    let unreachable_id = unique_id("stats-unreachable");
    post(
        "unreachable",
        "/v1/completions",
        &unreachable_id,
        r#"{"prompt":"a"}"#,
    )
    .await;
    let no_kv_id = unique_id("stats-no-kv");
    post(
        "default",
        "/v1/completions",
        &no_kv_id,
        r#"{"prompt":"mock:prefill_no_kv"}"#,
    )
    .await;
    let bad_id = unique_id("stats-bad");
    post("default", "/v1/completions", &bad_id, "[]").await;

    let deltas: Vec<(&str, u64)> = counters
        .iter()
        .zip(&before)
        .map(|(name, before)| (*name, h.counter(name) - before))
        .collect();
    assert_eq!(
        deltas,
        vec![
            ("requests_orchestrated.completions", 6),
            ("requests_orchestrated.chat_completions", 1),
            ("requests_orchestrated.responses", 1),
            ("requests_passed_through", 1),
            ("prefill_failures.status", 1),
            ("prefill_failures.timeout", 1),
            ("prefill_failures.reset", 1),
            ("prefill_failures.unreachable", 1),
            ("prefill_failures.no_kv_transfer_params", 1),
            ("decode_only_fallbacks", 1),
            ("bad_requests", 1),
        ]
    );
    let stats = h.stats();
    let histogram = stats
        .get("pd_filter.prefill_latency_ms")
        .expect("latency histogram");
    assert!(histogram.contains("P50"), "{histogram}");

    // One warning line per failure, naming the request and the kind; nothing about the
    // request that went well.
    let log = h.envoy_log_text();
    for (id, kind) in [
        (&status_id, "status"),
        (&timeout_id, "timeout"),
        (&reset_id, "reset"),
        (&unreachable_id, "unreachable"),
        (&no_kv_id, "no_kv_transfer_params"),
    ] {
        let lines: Vec<&str> = log
            .lines()
            .filter(|line| line.contains(id.as_str()) && line.contains("prefill failure"))
            .collect();
        assert_eq!(lines.len(), 1, "{id}: {lines:#?}");
        assert!(
            lines[0].contains(&format!("prefill failure ({kind})")),
            "{}",
            lines[0]
        );
    }
    assert!(!log.contains(&happy_id), "happy path logged at info level");
}
