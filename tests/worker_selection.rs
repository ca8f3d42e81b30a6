//! Picking the workers: per-model prefill pools, a model header for decode routing, prefill
//! hosts chosen by a scheduler, an endpoint picker's decode host, retries and the decode-only
//! fallback. Real Envoy, built filter, mocks.

mod common;

use common::{harness, post, unique_id};
use serde_json::json;

async fn post_with(
    listener: &str,
    id: &str,
    headers: &[(&str, String)],
    body: serde_json::Value,
) -> common::Reply {
    let mut request = common::client()
        .post(harness().url(listener, "/v1/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", id);
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    common::send(request.body(body.to_string())).await
}

#[tokio::test]
async fn each_model_reaches_its_own_prefill_and_decode_pair() {
    let h = harness();
    for (model, prefill, decode) in [
        ("model-a", &h.prefill, &h.decode),
        ("model-b", &h.prefill_b, &h.decode_b),
    ] {
        let id = unique_id(model);
        let reply = post(
            "models",
            "/v1/completions",
            &id,
            json!({"model": model, "prompt": "route me", "max_tokens": 2}).to_string(),
        )
        .await;
        assert_eq!(reply.status, 200, "{model}: {}", reply.body);
        assert_eq!(reply.header("x-mock-kv"), Some("reused"), "{model}");
        assert_eq!(prefill.requests_with_id(&id).len(), 1, "{model} prefill");
        let decoded = decode.requests_with_id(&id);
        assert_eq!(decoded.len(), 1, "{model} decode");
        assert_eq!(decoded[0].header("x-pd-model"), Some(model));
        // And nothing reached the other pair.
        let total = h.prefill.requests_with_id(&id).len() + h.prefill_b.requests_with_id(&id).len();
        let decodes = h.decode.requests_with_id(&id).len() + h.decode_b.requests_with_id(&id).len();
        assert_eq!((total, decodes), (1, 1), "{model}");
    }
}

#[tokio::test]
async fn a_scheduler_chosen_prefill_host_gets_the_callout_and_decode_does_not_see_the_header() {
    let h = harness();
    let id = unique_id("scheduled");
    let host = format!("127.0.0.2:{}", h.prefill_b.port());
    let reply = post_with(
        "scheduled",
        &id,
        &[("x-prefiller-host-port", host)],
        json!({"prompt": "pick a host", "max_tokens": 2}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));
    assert_eq!(h.prefill_b.requests_with_id(&id).len(), 1);
    assert!(h.prefill.requests_with_id(&id).is_empty());
    let decode = h.only_decode(&id);
    assert_eq!(decode.header("x-prefiller-host-port"), None);
    // Prefill reported its side channel on 127.0.0.1; decode is told the host it really was.
    assert_eq!(
        decode.json()["kv_transfer_params"]["remote_host"],
        "127.0.0.2"
    );
}

#[tokio::test]
async fn without_a_scheduler_header_the_prefill_cluster_balances() {
    let h = harness();
    let id = unique_id("unscheduled");
    let reply = post_with(
        "scheduled",
        &id,
        &[],
        json!({"prompt": "x", "max_tokens": 2}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    h.only_prefill(&id);
    assert_eq!(
        h.only_decode(&id).json()["kv_transfer_params"]["remote_host"],
        "127.0.0.1"
    );
}

#[tokio::test]
async fn a_failed_scheduled_host_is_retried_on_the_next_one() {
    let h = harness();
    let id = unique_id("scheduled-retry");
    let hosts = format!(
        "127.0.0.2:{},127.0.0.2:{}",
        h.closed_port,
        h.prefill_b.port()
    );
    let reply = post_with(
        "scheduled",
        &id,
        &[("x-prefiller-host-port", hosts)],
        json!({"prompt": "second time lucky", "max_tokens": 2}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));
    assert_eq!(h.prefill_b.requests_with_id(&id).len(), 1);
    h.only_decode(&id);
}

#[tokio::test]
async fn client_errors_are_not_retried() {
    let h = harness();
    let id = unique_id("no-retry-4xx");
    let host = format!("127.0.0.2:{}", h.prefill_b.port());
    let reply = post_with(
        "scheduled",
        &id,
        &[("x-prefiller-host-port", format!("{host},{host}"))],
        json!({"prompt": "mock:prefill_status=400", "max_tokens": 2}),
    )
    .await;
    reply.assert_error(400, "prefill rejected the request (400)");
    assert_eq!(h.prefill_b.requests_with_id(&id).len(), 1);
}

#[tokio::test]
async fn a_bad_scheduler_header_is_400_and_reaches_no_backend() {
    let h = harness();
    for value in [
        "prefill.example.com:8000",
        "10.0.0.1",
        "127.0.0.1:80,;rm",
        "",
    ] {
        let id = unique_id("bad-host");
        let reply = post_with(
            "scheduled",
            &id,
            &[("x-prefiller-host-port", value.to_owned())],
            json!({"prompt": "x"}),
        )
        .await;
        reply.assert_error(400, "x-prefiller-host-port");
        assert!(h.prefill.requests_with_id(&id).is_empty(), "{value}");
        assert!(h.prefill_b.requests_with_id(&id).is_empty(), "{value}");
        assert!(h.decode.requests_with_id(&id).is_empty(), "{value}");
    }
}

#[tokio::test]
async fn an_endpoint_pickers_decode_host_gets_the_request() {
    let h = harness();
    let id = unique_id("picker");
    let reply = post_with(
        "scheduled",
        &id,
        &[(
            "x-gateway-destination-endpoint",
            format!("127.0.0.1:{}", h.decode_b.port()),
        )],
        json!({"prompt": "decode there", "max_tokens": 2}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));
    assert_eq!(h.decode_b.requests_with_id(&id).len(), 1);
    assert!(h.decode.requests_with_id(&id).is_empty());
}

#[tokio::test]
async fn after_the_retries_decode_only_still_serves_the_client() {
    let h = harness();
    let before = h.counter("decode_only_fallbacks");
    let id = unique_id("decode-only");
    let original = json!({"prompt": "serve me anyway", "max_tokens": 3}).to_string();
    let reply = post("decode_only", "/v1/completions", &id, original.clone()).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("recomputed"));
    assert_eq!(h.only_decode(&id).body, original.as_bytes());
    assert!(h.counter("decode_only_fallbacks") > before);
    let log = h.envoy_log_text();
    let retries = log
        .lines()
        .filter(|line| line.contains(id.as_str()) && line.contains("retrying"))
        .count();
    assert_eq!(retries, 2, "prefill_retries is 2 on this listener");
}
