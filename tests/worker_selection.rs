//! Picking the workers: per-model prefill pools, a model header for decode routing, prefill
//! hosts chosen by a scheduler, an endpoint picker's decode host, retries and the decode-only
//! fallback. Real Envoy, built filter, mocks.

mod common;

use common::{
    assert_decode_got, assert_prefill_got, assert_recomputed, assert_served, harness, unique_id,
    Request,
};
use mock_vllm::{MockServer, RecordedRequest};
use serde_json::json;

const COMPLETIONS: &str = "/v1/completions";

/// The prefill and decode mocks a request must reach, and nothing else.
struct Pair<'a> {
    prefill: &'a MockServer,
    decode: &'a MockServer,
}

impl Pair<'_> {
    fn of<'a>(prefill: &'a MockServer, decode: &'a MockServer) -> Pair<'a> {
        Pair { prefill, decode }
    }
}

/// POSTs a completions `body` to `listener` with `x-request-id: id` and `headers`; asserts it
/// was served on the KV its own prefill made, that the pair's prefill and decode each got it
/// once as they must, and that no other mock got it. Returns what decode got.
async fn assert_served_by(
    pair: Pair<'_>,
    listener: &str,
    id: &str,
    headers: &[(&str, String)],
    body: &str,
) -> RecordedRequest {
    let mut request = Request::post(listener, COMPLETIONS).id(id);
    for (name, value) in headers {
        request = request.header(name, value.as_str());
    }
    let reply = request.body(body).send().await;
    assert_eq!(reply.status, 200, "{listener} {headers:?}: {}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"), "{headers:?}");
    let prefilled = pair.prefill.requests_with_id(id);
    assert_eq!(prefilled.len(), 1, "{headers:?} prefill");
    assert_prefill_got(COMPLETIONS, body, &prefilled[0]);
    let mut decoded = pair.decode.requests_with_id(id);
    assert_eq!(decoded.len(), 1, "{headers:?} decode");
    assert_decode_got(COMPLETIONS, body, &decoded[0]);
    // And nothing reached the other mocks.
    let [prefill, prefill_b, decode, decode_b] = recorded(id);
    let total = (prefill + prefill_b, decode + decode_b);
    assert_eq!(total, (1, 1), "{headers:?}");
    decoded.remove(0)
}

/// How many requests with `id` each mock recorded: prefill, prefill_b, decode, decode_b.
fn recorded(id: &str) -> [usize; 4] {
    let h = harness();
    [&h.prefill, &h.prefill_b, &h.decode, &h.decode_b].map(|mock| mock.requests_with_id(id).len())
}

#[tokio::test]
async fn each_model_reaches_its_own_prefill_and_decode_pair() {
    let h = harness();
    for (model, prefill, decode) in [
        ("model-a", &h.prefill, &h.decode),
        ("model-b", &h.prefill_b, &h.decode_b),
    ] {
        let id = unique_id(model);
        let body = json!({"model": model, "prompt": "route me", "max_tokens": 2}).to_string();
        let pair = Pair::of(prefill, decode);
        let decoded = assert_served_by(pair, "models", &id, &[], &body).await;
        assert_eq!(decoded.header("x-pd-model"), Some(model));
    }
}

#[tokio::test]
async fn a_scheduler_chosen_prefill_host_gets_the_callout_and_decode_does_not_see_the_header() {
    let h = harness();
    let id = unique_id("scheduled");
    let host = format!("127.0.0.2:{}", h.prefill_b.port());
    let body = json!({"prompt": "pick a host", "max_tokens": 2}).to_string();
    let pair = Pair::of(&h.prefill_b, &h.decode);
    let headers = [("x-prefiller-host-port", host)];
    let decode = assert_served_by(pair, "scheduled", &id, &headers, &body).await;
    assert_eq!(decode.header("x-prefiller-host-port"), None);
    // Prefill reported its side channel on 127.0.0.1; decode is told the host it really was.
    assert_eq!(
        decode.json()["kv_transfer_params"]["remote_host"],
        "127.0.0.2"
    );
}

#[tokio::test]
async fn without_a_scheduler_header_the_prefill_cluster_balances() {
    let id = unique_id("unscheduled");
    let body = json!({"prompt": "x", "max_tokens": 2}).to_string();
    let (_, kv) = assert_served("scheduled", COMPLETIONS, &id, &body).await;
    assert_eq!(kv["remote_host"], "127.0.0.1");
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
    let body = json!({"prompt": "second time lucky", "max_tokens": 2}).to_string();
    let pair = Pair::of(&h.prefill_b, &h.decode);
    let headers = [("x-prefiller-host-port", hosts.clone())];
    assert_served_by(pair, "scheduled", &id, &headers, &body).await;

    // The filter keeps no copy of the body while prefill works: the retry reads it again
    // from Envoy's buffer, whole, however large.
    let id = unique_id("scheduled-retry-large");
    let prompt = format!("second time lucky {}", "many words ".repeat(300_000));
    let body = json!({"prompt": prompt, "max_tokens": 2, "min_tokens": 1}).to_string();
    assert!(body.len() > 3_000_000);
    let headers = [("x-prefiller-host-port", hosts)];
    let pair = Pair::of(&h.prefill_b, &h.decode);
    assert_served_by(pair, "scheduled", &id, &headers, &body).await;
}

#[tokio::test]
async fn client_errors_are_not_retried() {
    let h = harness();
    let id = unique_id("no-retry-4xx");
    let host = format!("127.0.0.2:{}", h.prefill_b.port());
    let reply = Request::post("scheduled", COMPLETIONS)
        .id(&id)
        .header("x-prefiller-host-port", format!("{host},{host}"))
        .body(json!({"prompt": "mock:prefill_status=400", "max_tokens": 2}).to_string())
        .send()
        .await;
    reply.assert_error(400, "mock prefill failure 400");
    assert_eq!(h.prefill_b.requests_with_id(&id).len(), 1);
}

#[tokio::test]
async fn a_bad_scheduler_header_is_400_and_reaches_no_backend() {
    for value in [
        "prefill.example.com:8000",
        "10.0.0.1",
        "127.0.0.1:80,;rm",
        "",
    ] {
        let id = unique_id("bad-host");
        let reply = Request::post("scheduled", COMPLETIONS)
            .id(&id)
            .header("x-prefiller-host-port", value)
            .body(r#"{"prompt":"x"}"#)
            .send()
            .await;
        reply.assert_error(400, "x-prefiller-host-port");
        assert_eq!(recorded(&id), [0; 4], "{value}");
    }
}

#[tokio::test]
async fn an_endpoint_pickers_decode_host_gets_the_request() {
    let h = harness();
    let id = unique_id("picker");
    let body = json!({"prompt": "decode there", "max_tokens": 2}).to_string();
    let pair = Pair::of(&h.prefill, &h.decode_b);
    let picked = format!("127.0.0.1:{}", h.decode_b.port());
    let headers = [("x-gateway-destination-endpoint", picked)];
    assert_served_by(pair, "scheduled", &id, &headers, &body).await;
}

#[tokio::test]
async fn after_the_retries_decode_only_still_serves_the_client() {
    let h = harness();
    let before = h.counter("pd_filter_decode_only_fallbacks");
    let id = unique_id("decode-only");
    let original = json!({"prompt": "serve me anyway", "max_tokens": 3}).to_string();
    assert_recomputed("decode_only", COMPLETIONS, &id, &original).await;
    assert!(h.counter("pd_filter_decode_only_fallbacks") > before);
    let log = h.envoy_log_text();
    let retries = log
        .lines()
        .filter(|line| line.contains(id.as_str()) && line.contains("retrying"))
        .count();
    assert_eq!(retries, 2, "prefill_retries is 2 on this listener");
}
