//! What the client gets when its request or the prefill leg goes wrong, through a real Envoy
//! running the built filter. Decode is never called with a body it cannot use.

mod common;

use common::{harness, post, unique_id};
use serde_json::json;

fn assert_no_backend_called(id: &str) {
    let h = harness();
    assert!(h.prefill_requests(id).is_empty(), "prefill was called");
    assert!(h.decode_requests(id).is_empty(), "decode was called");
}

#[tokio::test]
async fn bodies_that_are_not_json_objects_are_400_and_reach_no_backend() {
    let cases: &[(&str, &[u8], &str)] = &[
        ("not-json", b"hello", "not a JSON object"),
        ("array", b"[1,2,3]", "not a JSON object"),
        ("string", b"\"prompt\"", "not a JSON object"),
        ("bad-utf8", b"{\"prompt\":\"\xff\xfe\"}", "not valid UTF-8"),
        ("trailing", b"{\"prompt\":\"x\"} {}", "not a JSON object"),
    ];
    for (label, body, reason) in cases {
        let id = unique_id(label);
        let reply = post("default", "/v1/completions", &id, body.to_vec()).await;
        reply.assert_error(400, reason);
        assert_eq!(reply.header("x-request-id"), Some(id.as_str()));
        assert_no_backend_called(&id);
    }
}

#[tokio::test]
async fn an_empty_body_is_400() {
    let id = unique_id("empty");
    let reply = post("default", "/v1/chat/completions", &id, "").await;
    reply.assert_error(400, "empty");
    assert_no_backend_called(&id);
}

#[tokio::test]
async fn a_non_json_content_type_is_415() {
    let h = harness();
    let id = unique_id("form");
    let reply = common::send(
        common::client()
            .post(h.url("default", "/v1/completions"))
            .header("content-type", "application/x-www-form-urlencoded")
            .header("x-request-id", &id)
            .body(r#"{"prompt":"x"}"#),
    )
    .await;
    reply.assert_error(415, "application/json");
    assert_no_backend_called(&id);
}

#[tokio::test]
async fn a_missing_content_type_is_treated_as_json() {
    let h = harness();
    let id = unique_id("no-content-type");
    let reply = common::send(
        common::client()
            .post(h.url("default", "/v1/completions"))
            .header("x-request-id", &id)
            .body(r#"{"prompt":"x","max_tokens":2}"#),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        h.only_prefill(&id).header("content-type"),
        Some("application/json")
    );
}

#[tokio::test]
async fn a_body_over_the_limit_is_413() {
    // The strict listener allows 64 KiB.
    let padding = "x".repeat(70_000);
    let id = unique_id("too-large");
    let body = json!({"prompt": padding}).to_string();
    let reply = post("strict", "/v1/completions", &id, body).await;
    reply.assert_error(413, "65536");
    assert_no_backend_called(&id);

    // Chunked, so the limit is found while buffering rather than from content-length.
    let id = unique_id("too-large-chunked");
    let chunks: Vec<Result<String, std::io::Error>> = vec![
        Ok(r#"{"prompt":""#.to_owned()),
        Ok("y".repeat(40_000)),
        Ok("y".repeat(40_000)),
        Ok(r#""}"#.to_owned()),
    ];
    let stream = futures_util::stream::iter(chunks);
    let reply = post(
        "strict",
        "/v1/completions",
        &id,
        reqwest::Body::wrap_stream(stream),
    )
    .await;
    reply.assert_error(413, "65536");
    assert_no_backend_called(&id);

    // Just under the limit is served.
    let id = unique_id("under-limit");
    let body = json!({"prompt": "z".repeat(65_000), "max_tokens": 1}).to_string();
    assert!(body.len() <= 65_536);
    let reply = post("strict", "/v1/completions", &id, body).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
}

#[tokio::test]
async fn prefill_client_errors_pass_on_their_status_and_message() {
    let id = unique_id("prefill-429");
    let body = r#"{"prompt":"x mock:prefill_status=429","max_tokens":2}"#;
    let reply = post("default", "/v1/completions", &id, body).await;
    reply.assert_error(429, "mock prefill failure 429");
    assert!(reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("prefill rejected the request (429)"));
    assert!(harness().decode_requests(&id).is_empty());
}

#[tokio::test]
async fn prefill_server_errors_are_502_and_unavailability_503() {
    for (directive, status, text) in [
        (
            "mock:prefill_status=500",
            502,
            "prefill failed (500): mock prefill failure 500",
        ),
        (
            "mock:prefill_status=503",
            503,
            "prefill is unavailable (503)",
        ),
        // Envoy reports a connection closed before any answer as its own 503.
        ("mock:prefill_reset", 503, "reset"),
        ("mock:prefill_reset_mid_answer", 502, "reset"),
    ] {
        let id = unique_id("prefill-5xx");
        let body = json!({"prompt": format!("x {directive}"), "max_tokens": 2}).to_string();
        let reply = post("default", "/v1/completions", &id, body).await;
        reply.assert_error(status, text);
        assert!(harness().decode_requests(&id).is_empty(), "{directive}");
    }
}

#[tokio::test]
async fn a_prefill_slower_than_the_timeout_is_504() {
    // The strict listener gives prefill 1.5 s.
    let id = unique_id("prefill-timeout");
    let body = r#"{"prompt":"x mock:prefill_delay_ms=4000","max_tokens":2}"#;
    let started = std::time::Instant::now();
    let reply = post("strict", "/v1/completions", &id, body).await;
    reply.assert_error(504, "prefill timed out");
    assert!(started.elapsed() < std::time::Duration::from_secs(4));
    assert!(harness().decode_requests(&id).is_empty());
}

#[tokio::test]
async fn a_slow_prefill_within_the_timeout_is_served() {
    let id = unique_id("prefill-slow");
    let body = r#"{"prompt":"x mock:prefill_delay_ms=500","max_tokens":2}"#;
    let reply = post("strict", "/v1/completions", &id, body).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));
}

#[tokio::test]
async fn an_unreachable_prefill_is_503() {
    let id = unique_id("unreachable");
    let reply = post("unreachable", "/v1/completions", &id, r#"{"prompt":"x"}"#).await;
    reply.assert_error(503, "prefill is unavailable");
    assert!(harness().decode_requests(&id).is_empty());
}

#[tokio::test]
async fn an_unknown_prefill_cluster_is_503_naming_it() {
    let id = unique_id("unknown-cluster");
    let reply = post(
        "unknown_cluster",
        "/v1/completions",
        &id,
        r#"{"prompt":"x"}"#,
    )
    .await;
    reply.assert_error(503, "no_such_cluster");
    assert_no_backend_called(&id);
}

#[tokio::test]
async fn prefill_without_kv_transfer_params_lets_decode_recompute_by_default() {
    let h = harness();
    for directive in [
        "mock:prefill_no_kv",
        "mock:prefill_null_kv",
        "mock:prefill_kv_not_object",
        "mock:prefill_non_json",
    ] {
        let id = unique_id("no-kv");
        let original = json!({"prompt": format!("x {directive}"), "max_tokens": 2}).to_string();
        let reply = post("default", "/v1/completions", &id, original.clone()).await;
        assert_eq!(reply.status, 200, "{directive}: {}", reply.body);
        assert_eq!(reply.header("x-mock-kv"), Some("recomputed"), "{directive}");
        // Decode gets the client's body exactly as sent.
        assert_eq!(h.only_decode(&id).body, original.as_bytes(), "{directive}");
    }
}

#[tokio::test]
async fn prefill_without_kv_transfer_params_is_502_when_configured_to_fail() {
    let id = unique_id("no-kv-strict");
    let body = r#"{"prompt":"x mock:prefill_no_kv","max_tokens":2}"#;
    let reply = post("strict", "/v1/completions", &id, body).await;
    reply.assert_error(502, "no kv_transfer_params");
    assert!(harness().decode_requests(&id).is_empty());
}
