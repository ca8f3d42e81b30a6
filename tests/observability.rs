//! The filter's stats on Envoy's admin endpoint, its log lines, and the prefill-time header.
//! One test, run in order, so the counters move only by what it does.

mod common;

use common::{assert_recomputed, assert_refused, assert_served, harness, unique_id, Request};

const COMPLETIONS: &str = "/v1/completions";

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
    let happy = r#"{"prompt":"a","max_tokens":1}"#;
    let (reply, _) = assert_served("default", COMPLETIONS, &happy_id, happy).await;
    // Off by default.
    assert_eq!(reply.header("x-pd-prefill-ms"), None);
    let id = unique_id("stats-chat");
    let chat = r#"{"messages":[{"role":"user","content":"a"}]}"#;
    assert_served("default", "/v1/chat/completions", &id, chat).await;
    let id = unique_id("stats-responses");
    let input = r#"{"input":"a"}"#;
    let (reply, _) = assert_served("strict", "/v1/responses", &id, input).await;
    let millis: u64 = reply
        .header("x-pd-prefill-ms")
        .expect("prefill time header")
        .parse()
        .unwrap();
    assert!(millis < 5_000);

    Request::get("default", "/v1/models").send().await;

    // One request per kind of prefill failure, then a bad request.
    let mut failures = Vec::new();
    for (kind, listener, body) in [
        (
            "status",
            "default",
            r#"{"prompt":"mock:prefill_status=500"}"#,
        ),
        (
            "timeout",
            "strict",
            r#"{"prompt":"mock:prefill_delay_ms=3000"}"#,
        ),
        (
            "reset",
            "default",
            r#"{"prompt":"mock:prefill_reset_mid_answer"}"#,
        ),
        ("unreachable", "unreachable", r#"{"prompt":"a"}"#),
        (
            "no_kv_transfer_params",
            "default",
            r#"{"prompt":"mock:prefill_no_kv"}"#,
        ),
    ] {
        let id = unique_id(&format!("stats-{kind}"));
        if kind == "no_kv_transfer_params" {
            // Decode recomputes from the client's body.
            assert_recomputed(listener, COMPLETIONS, &id, body).await;
        } else {
            let request = Request::post(listener, COMPLETIONS).id(&id);
            request.body(body).send().await;
        }
        failures.push((id, kind));
    }
    let bad_id = unique_id("stats-bad");
    assert_refused(
        "default",
        COMPLETIONS,
        &bad_id,
        "[]",
        400,
        "not a JSON object",
    )
    .await;

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
    for (id, kind) in &failures {
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
