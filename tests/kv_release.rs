//! A client that leaves must not strand prefill's KV: when a request's decode leg will never
//! run, the filter sends decode a one-token request carrying prefill's `kv_transfer_params`,
//! which is what frees them on a vLLM prefill worker. The mock prefill keeps a ledger of the
//! KV it issued and the KV a decode read.

mod common;
#[path = "common/raw_http.rs"]
mod raw_http;

use std::time::{Duration, Instant};

use common::{
    assert_envoy_log_clean, assert_filter_healthy, harness, unique_id, Connections, Request,
};
use serde_json::{json, Value};

const COMPLETIONS: &str = "/v1/completions";
const KV_RELEASED: &str = r#"pd_filter_kv_releases{outcome="released"}"#;
const KV_DROPPED: &str = r#"pd_filter_kv_releases{outcome="dropped"}"#;
const ABANDONED: &str = r#"pd_filter_requests{api="completions",outcome="abandoned"}"#;

/// The ledger is the mock's, shared by every test here: one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A completion request on `listener` with `id` for `prompt`.
fn post(listener: &str, id: &str, prompt: &str) -> Request {
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 5}).to_string();
    Request::post(listener, COMPLETIONS).id(id).body(body)
}

/// Waits until prefill holds no stranded KV, or says how many are left.
async fn wait_until_nothing_is_stranded(within: Duration) -> Result<(), u64> {
    let deadline = Instant::now() + within;
    loop {
        let stranded = harness().prefill.kv_ledger().stranded;
        if stranded == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(stranded);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `count` clients that each send `prompt` to `listener` and leave 300 ms later, before
/// any answer; their request ids.
async fn clients_that_leave(
    count: usize,
    listener: &'static str,
    prompt: &'static str,
) -> Vec<String> {
    let ids: Vec<String> = (0..count).map(|_| unique_id("leaves")).collect();
    let mut clients = Vec::new();
    for id in &ids {
        let id = id.clone();
        clients.push(tokio::spawn(async move {
            post(listener, &id, prompt)
                .leave_after(Duration::from_millis(300))
                .await
        }));
    }
    for client in clients {
        assert!(!client.await.unwrap(), "{listener}: answered within 300 ms");
    }
    ids
}

/// Waits for a ledger with nothing stranded; the releases counted so far.
async fn releases_from_a_clean_ledger() -> u64 {
    wait_until_nothing_is_stranded(Duration::from_secs(5))
        .await
        .expect("a clean ledger to start from");
    harness().counter(KV_RELEASED)
}

/// Waits until decode got a release for `id`, or the time is up.
async fn wait_for_a_release(id: &str, within: Duration) {
    let deadline = Instant::now() + within;
    while releases(id).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until prefill got a request for `id`, or the time is up.
async fn wait_for_prefill(id: &str, within: Duration) {
    let deadline = Instant::now() + within;
    while harness().prefill_requests(id).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `id` had one prefill and one release, and prefill holds nothing stranded.
async fn assert_released_once(id: &str) {
    assert_eq!(harness().prefill_requests(id).len(), 1);
    wait_for_a_release(id, Duration::from_secs(5)).await;
    assert_eq!(releases(id).len(), 1);
    assert_eq!(
        wait_until_nothing_is_stranded(Duration::from_secs(5)).await,
        Ok(())
    );
    assert_filter_healthy();
}

/// The KV releases of `id`: one token, not streamed, on prefill's KV.
fn releases(id: &str) -> Vec<Value> {
    let releases: Vec<Value> = harness()
        .kv_releases(id)
        .iter()
        .map(|request| request.json())
        .collect();
    for release in &releases {
        assert_eq!(release["max_tokens"], 1, "{release}");
        assert_eq!(release["stream"], false, "{release}");
    }
    releases
}

#[tokio::test]
async fn clients_that_leave_during_a_slow_prefill_strand_no_kv() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let released_before = releases_from_a_clean_ledger().await;
    let abandoned_before = h.counter(ABANDONED);
    // The clients leave while prefill works.
    let ids = clients_that_leave(100, "default", "left early mock:prefill_delay_ms=1500").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let left = wait_until_nothing_is_stranded(Duration::from_secs(5)).await;
    assert_eq!(
        left,
        Ok(()),
        "KV stranded on prefill after its clients left"
    );
    for id in &ids {
        assert_eq!(h.prefill_requests(id).len(), 1, "{id}");
        let releases = releases(id);
        assert!(h.decode_requests(id).is_empty(), "{id}: decode served it");
        assert_eq!(releases.len(), 1, "{id}");
        // The filter keeps no copy of the body while prefill works, and the client's is gone
        // with it: the release is one token of prompt on the same KV.
        assert_eq!(releases[0]["prompt"], json!([0]), "{id}");
        assert_eq!(releases[0]["kv_transfer_params"]["do_remote_prefill"], true);
    }
    assert_eq!(h.counter(KV_RELEASED), released_before + 100);
    assert_eq!(h.counter(KV_DROPPED), 0);
    // Each counted once, by how it ended.
    assert_eq!(h.counter(ABANDONED), abandoned_before + 100);
    assert_filter_healthy();
    assert_envoy_log_clean();
}

/// HTTP/2 clients leave by resetting their stream, on a connection that stays open: the
/// same release as for a client that closes its connection.
#[tokio::test]
async fn http2_clients_that_reset_their_stream_during_prefill_strand_no_kv() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let released_before = releases_from_a_clean_ledger().await;
    let sender = raw_http::h2_connect(h.port("default"))
        .await
        .expect("h2c connection");
    let ids: Vec<String> = (0..10).map(|_| unique_id("h2-reset")).collect();
    let resets = ids.iter().map(|id| {
        let body = json!({"model": "m", "prompt": format!("{id} mock:prefill_delay_ms=1500"),
            "max_tokens": 5})
        .to_string();
        let sender = sender.clone();
        async move {
            let headers = [
                ("content-type", "application/json"),
                ("x-request-id", id.as_str()),
            ];
            raw_http::h2_post_then_reset(
                &sender,
                COMPLETIONS,
                &headers,
                body.as_bytes(),
                Duration::from_millis(300),
            )
            .await
        }
    });
    for reset in futures_util::future::join_all(resets).await {
        assert_eq!(reset, Ok(()));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for id in &ids {
        assert_released_once(id).await;
        assert!(h.decode_requests(id).is_empty(), "{id}: decode served it");
    }
    assert_eq!(h.counter(KV_RELEASED), released_before + 10);
    // The connection goes on serving.
    let id = unique_id("h2-after-resets");
    let request = raw_http::H2Request {
        method: "POST".to_owned(),
        path: COMPLETIONS.to_owned(),
        headers: vec![
            ("content-type".to_owned(), "application/json".to_owned()),
            ("x-request-id".to_owned(), id.clone()),
        ],
        data: vec![json!({"model": "m", "prompt": "after", "max_tokens": 2})
            .to_string()
            .into_bytes()],
        trailers: vec![],
        reset_after: None,
    };
    match raw_http::h2_exchange(&sender, request, Duration::from_secs(10)).await {
        raw_http::H2Outcome::Response(answer) => assert_eq!(answer.status, 200, "{answer:?}"),
        other => panic!("the connection no longer serves: {other:?}"),
    }
    assert_filter_healthy();
    assert_envoy_log_clean();
}

#[tokio::test]
async fn a_release_never_asks_decode_for_what_decode_on_remote_kv_cannot_do() {
    // Bodies the filter keeps whole while prefill works: one asking for prompt logprobs
    // (decode on prefill's KV refuses those, as vLLM 0.11 does), one with the client's
    // own kv_transfer_params. Their releases are the smallest request all the same.
    let _serial = SERIAL.lock().await;
    let h = harness();
    let released_before = releases_from_a_clean_ledger().await;
    let prompt = "left early mock:prefill_delay_ms=800";
    let bodies = [
        json!({"model": "m", "prompt": prompt, "max_tokens": 5, "prompt_logprobs": 2}),
        json!({"model": "m", "prompt": prompt, "max_tokens": 5,
            "kv_transfer_params": {"remote_host": "6.6.6.6"}}),
    ];
    let mut ids = Vec::new();
    for body in &bodies {
        let id = unique_id("leaves-whole");
        let answered = Request::post("default", COMPLETIONS)
            .id(&id)
            .body(body.to_string())
            .leave_after(Duration::from_millis(300))
            .await;
        assert!(!answered, "{body}");
        ids.push(id);
    }
    for (id, body) in ids.iter().zip(&bodies) {
        assert_released_once(id).await;
        let release = &releases(id)[0];
        assert_eq!(release["prompt"], json!([0]), "{body}");
        assert!(release.get("prompt_logprobs").is_none(), "{body}");
        assert_eq!(release["kv_transfer_params"]["do_remote_prefill"], true);
    }
    assert_eq!(
        h.counter(KV_RELEASED),
        released_before + 2,
        "both answered 200"
    );
    assert_filter_healthy();
}

#[tokio::test]
async fn a_burst_of_releases_past_the_bound_waits_rather_than_strands_kv() {
    // Twelve clients leave during the same slow prefill; each worker sends one release at
    // a time, and the rest wait for it to answer (up to 16 per worker, whichever of the two
    // workers took which client).
    let _serial = SERIAL.lock().await;
    let h = harness();
    let released_before = releases_from_a_clean_ledger().await;
    let dropped_before = h.counter(KV_DROPPED);
    let ids = clients_that_leave(12, "one_release", "a burst mock:prefill_delay_ms=800").await;
    for id in &ids {
        assert_released_once(id).await;
    }
    assert_eq!(h.counter(KV_RELEASED), released_before + 12);
    assert_eq!(h.counter(KV_DROPPED), dropped_before, "none dropped");
    assert_filter_healthy();
}

#[tokio::test]
async fn decode_that_was_never_reached_strands_no_kv() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let id = unique_id("decode-down");
    let reply = post("decode_unreachable", &id, "nobody decodes this")
        .send()
        .await;
    assert_eq!(reply.status, 503, "{}", reply.body);
    // Envoy's router connects to decode as soon as the headers pass, so the client may get
    // its 503 while prefill is still working; prefill's KV is released when it answers.
    wait_for_prefill(&id, Duration::from_secs(5)).await;
    assert_eq!(h.prefill_requests(&id).len(), 1);
    wait_for_a_release(&id, Duration::from_secs(5)).await;
    assert_eq!(releases(&id).len(), 1);
    assert_eq!(
        wait_until_nothing_is_stranded(Duration::from_secs(5)).await,
        Ok(())
    );
}

#[tokio::test]
async fn decode_that_times_out_after_prefill_answered_strands_no_kv() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let id = unique_id("decode-timeout");
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "nobody connects"}],
                      "max_tokens": 5})
    .to_string();
    let reply = Request::post("decode_blackholed", "/v1/chat/completions")
        .id(&id)
        .body(body)
        .send()
        .await;
    // Prefill answers at once; Envoy gives up on decode's connection a second later.
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_eq!(h.prefill_requests(&id).len(), 1);
    wait_for_a_release(&id, Duration::from_secs(5)).await;
    // The filter no longer holds the client's body: the release is one token of prompt on
    // the same KV.
    let released = h.kv_releases(&id);
    assert_eq!(released.len(), 1, "{released:?}");
    assert_eq!(released[0].path, COMPLETIONS);
    let release = released[0].json();
    assert_eq!(release["prompt"], json!([0]), "{release}");
    assert_eq!(release["model"], "m");
    assert_eq!(
        wait_until_nothing_is_stranded(Duration::from_secs(5)).await,
        Ok(())
    );
}

#[tokio::test]
async fn a_client_that_leaves_while_decode_is_being_connected_strands_no_kv() {
    let _serial = SERIAL.lock().await;
    let id = unique_id("leaves-before-decode");
    // Prefill answers at once; decode's connection never completes (Envoy would give up
    // after a second), and the client leaves before that.
    let left = post("decode_blackholed", &id, "gone before decode connects")
        .leave_after(Duration::from_millis(400))
        .await;
    assert!(!left, "answered within 400 ms");
    assert_released_once(&id).await;
}

#[tokio::test]
async fn a_release_decode_could_not_take_is_sent_again_once_decode_is_back() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let id = unique_id("release-retry");
    // A long prompt's kv_transfer_params list thousands of blocks: its release is larger
    // than the small ones every worker keeps, and waits within the VM's budget.
    let long_id = unique_id("release-retry-long");
    let words: Vec<String> = (0..30_000).map(|i| format!("w{i}")).collect();
    for (id, prompt) in [
        (&id, "decode comes back later".to_owned()),
        (&long_id, words.join(" ")),
    ] {
        let reply = post("release_retry", id, &prompt).send().await;
        assert_eq!(reply.status, 503, "{}", reply.body);
        wait_for_prefill(id, Duration::from_secs(5)).await;
        assert_eq!(h.prefill_requests(id).len(), 1);
    }
    // The first release, right after prefill's answer, finds no decode. Decode comes back
    // before the next attempt (1 s).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let address = format!("127.0.0.1:{}", h.late_decode_port);
    let late = mock_vllm::MockServer::start(mock_vllm::Role::Decode, &address)
        .await
        .expect("decode on the late port");
    for id in [&id, &long_id] {
        let deadline = Instant::now() + Duration::from_secs(6);
        while late.requests_with_id(id).is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let released = late.requests_with_id(id);
        assert_eq!(
            released.len(),
            1,
            "{id}: one release reached the decode that came back"
        );
        assert!(released[0].header(common::KV_RELEASE_HEADER).is_some());
    }
    assert_eq!(
        wait_until_nothing_is_stranded(Duration::from_secs(5)).await,
        Ok(())
    );
    assert_filter_healthy();
}

/// A decode worker killed with requests on its connections: Envoy answers them 503
/// (`upstream_reset_before_response_started{connection_termination}`), and no decode reads
/// their KV. A fault soak that killed decode seven times left such KV for vLLM's timeout.
#[tokio::test]
async fn decode_that_closes_its_connection_before_answering_strands_no_kv() {
    let _serial = SERIAL.lock().await;
    let id = unique_id("decode-closes");
    let reply = post("default", &id, "decode goes mock:decode_reset")
        .send()
        .await;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_released_once(&id).await;
}

#[tokio::test]
async fn decode_that_refuses_a_request_prefill_served_strands_no_kv() {
    let _serial = SERIAL.lock().await;
    // Prefill gets one capped token (min_tokens 1) and serves it; decode gets the
    // client's own limits and refuses them, as vLLM's API server does, before any KV is read:
    // a minimum above the context left after the prompt (which only decode knows: a chat
    // request without a limit may take the rest of it). A limit past the model's context,
    // on a stream with several choices, decode refuses at once rather than generating for
    // minutes.
    let cases = [
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": [{"role": "user", "content": "refused by decode"}],
                   "min_tokens": 200_000}),
            "min_tokens",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": [{"role": "user", "content": "too long"}],
                   "max_tokens": 1_000_000, "n": 2, "stream": true}),
            "maximum context length",
        ),
    ];
    for (path, body, decodes_reason) in cases {
        let id = unique_id("decode-refuses");
        let reply = Request::post("default", path)
            .id(&id)
            .body(body.to_string())
            .send()
            .await;
        assert_eq!(reply.status, 400, "{}", reply.body);
        assert!(
            reply.body.contains(decodes_reason),
            "decode's own error: {}",
            reply.body
        );
        assert_released_once(&id).await;
    }
}

#[tokio::test]
async fn decode_that_is_not_serving_strands_no_kv() {
    let _serial = SERIAL.lock().await;
    let id = unique_id("decode-503");
    // vLLM answers 503 only when it is not serving (scaling, shutting down), before its
    // engine reads any KV.
    let reply = post("default", &id, "not serving mock:decode_status=503")
        .send()
        .await;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_released_once(&id).await;
}

#[tokio::test]
async fn decode_that_fails_with_a_5xx_strands_no_kv() {
    let _serial = SERIAL.lock().await;
    // An engine that failed may have failed before it read the KV: the client gets decode's
    // error as it was written, and the KV is released.
    for status in [500, 502] {
        let id = unique_id(&format!("decode-{status}"));
        let reply = post(
            "default",
            &id,
            &format!("failing mock:decode_status={status}"),
        )
        .send()
        .await;
        assert_eq!(reply.status, status, "{}", reply.body);
        assert_released_once(&id).await;
    }
}

/// The filter's own calls name the cluster they go to, never the client's host: a hop in
/// front of the workers that routes by host would otherwise send them wherever a client
/// names (an audit's `internal-admin.svc:9901` reached prefill as its host).
#[tokio::test]
async fn the_filters_calls_carry_the_clusters_host_not_the_clients() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let id = unique_id("client-host");
    let reply = post("default", &id, "failing mock:decode_status=500")
        .header("host", "internal-admin.svc:9901")
        .send()
        .await;
    assert_eq!(reply.status, 500, "{}", reply.body);
    assert_released_once(&id).await;
    assert_eq!(h.only_prefill(&id).header("host"), Some("prefill"));
    let release = h.kv_releases(&id);
    assert_eq!(release.len(), 1);
    assert_eq!(release[0].header("host"), Some("decode"));
    // Decode's own request goes where Envoy's route sends it, with the client's host, as
    // Envoy forwards any request.
    let decoded: Vec<_> = h
        .decode_requests(&id)
        .into_iter()
        .filter(|request| request.header("x-pd-kv-release").is_none())
        .collect();
    assert_eq!(decoded.len(), 1);
    assert_eq!(decoded[0].header("host"), Some("internal-admin.svc:9901"));
}

#[tokio::test]
async fn served_requests_and_clients_leaving_mid_stream_send_no_release() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let released_before = h.counter(KV_RELEASED);
    let served = unique_id("served");
    let reply = post("default", &served, "a normal request").send().await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));

    // A stream that the client drops after its first events, as vLLM answers a stream: its
    // headers at once, then a token at a time. Decode has the KV already.
    let streamed = unique_id("mid-stream");
    let body = json!({"model": "m", "prompt": "stream then leave", "max_tokens": 200,
                      "stream": true, "mock:decode_token_delay_ms=50": true})
    .to_string();
    let request = Request::post("default", COMPLETIONS)
        .id(&streamed)
        .body(body)
        .try_send();
    let _ = tokio::time::timeout(Duration::from_millis(300), request).await;
    tokio::time::sleep(Duration::from_millis(600)).await;

    for id in [&served, &streamed] {
        assert_eq!(h.decode_requests(id).len(), 1, "{id}: the decode leg only");
        assert!(releases(id).is_empty(), "{id}: a release was sent");
    }
    assert_eq!(
        wait_until_nothing_is_stranded(Duration::from_secs(5)).await,
        Ok(())
    );
    assert_eq!(h.counter(KV_RELEASED), released_before);

    // A client that leaves while decode has not answered, within moments of the request
    // going on: whether decode read it cannot be told, so a release goes out. Here decode
    // had it: the release is the one-token duplicate, and nothing is stranded either way.
    let unanswered = unique_id("unanswered");
    let body = json!({"model": "m", "prompt": "leave before the headers", "max_tokens": 5,
                      "mock:decode_delay_ms=600": true})
    .to_string();
    let request = Request::post("default", COMPLETIONS)
        .id(&unanswered)
        .body(body)
        .try_send();
    let _ = tokio::time::timeout(Duration::from_millis(150), request).await;
    assert_released_once(&unanswered).await;
}

/// Envoy was connected to decode, but decode had not read the request when the client left:
/// Envoy closes the connection, the request goes with it, and only a release frees the KV.
/// Found by a fault soak (a decode slow to read its requests); before, the connection alone
/// counted as "decode has it".
#[tokio::test]
async fn a_client_that_leaves_before_decode_read_its_request_strands_no_kv() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let released_before = releases_from_a_clean_ledger().await;
    let ids = clients_that_leave(10, "decode_deaf", "decode never reads this").await;
    for id in &ids {
        assert_released_once(id).await;
    }
    assert_eq!(h.counter(KV_RELEASED), released_before + 10);
}

#[tokio::test]
async fn a_client_that_leaves_many_prefills_running_is_refused_until_they_end() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    releases_from_a_clean_ledger().await;
    // Twelve requests left during a slow prefill: two per worker may run on for one client
    // (every test client is 127.0.0.1), so each worker has more than its share.
    let left = clients_that_leave(12, "abandon_limit", "left mock:prefill_delay_ms=2500").await;
    let probe = |label: &'static str| async move {
        let id = unique_id(label);
        let reply = post("abandon_limit", &id, "a new request").send().await;
        (id, reply)
    };
    let mut refused = 0;
    for _ in 0..10 {
        let (id, reply) = probe("while-running").await;
        match reply.status {
            429 => {
                refused += 1;
                let body: Value = serde_json::from_str(&reply.body).expect("JSON");
                assert_eq!(body["error"]["type"], "RateLimitError", "{body}");
                assert_eq!(reply.header("retry-after"), Some("1"));
                assert!(
                    h.prefill_requests(&id).is_empty(),
                    "{id}: refused before prefill"
                );
            }
            200 => {}
            other => panic!("{other}: {}", reply.body),
        }
    }
    assert!(
        refused > 0,
        "no request refused while 12 abandoned prefills ran"
    );
    // Once prefill has answered them (and their KV is released), the client is served.
    for id in &left {
        wait_for_a_release(id, Duration::from_secs(8)).await;
        assert_eq!(releases(id).len(), 1, "{id}");
    }
    assert_eq!(
        wait_until_nothing_is_stranded(Duration::from_secs(5)).await,
        Ok(())
    );
    for _ in 0..6 {
        let (_, reply) = probe("after").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    assert_filter_healthy();
}

/// Sends a completion request to `listener` every `gap`, `count` times, each answered 503:
/// whether the filter refused each before prefill.
/// Up to `count` requests, `gap` apart, over `connections`; stops early once the last
/// `stop_after_refused` were refused (never, for 0). Whether each was refused before prefill.
async fn requests_in_a_row(
    listener: &str,
    connections: &Connections,
    count: usize,
    gap: Duration,
    stop_after_refused: usize,
) -> Vec<bool> {
    let mut refused: Vec<bool> = Vec::new();
    for _ in 0..count {
        let id = unique_id("outage");
        let reply = post(listener, &id, "decode is down")
            .over(connections)
            .send()
            .await;
        assert_eq!(reply.status, 503, "{listener}: {}", reply.body);
        // Otherwise Envoy's own 503 (text, in this test Envoy) came from decode's route.
        let ours = serde_json::from_str::<Value>(&reply.body)
            .is_ok_and(|error| error["error"]["type"] == "ServiceUnavailableError");
        if ours {
            assert_eq!(reply.header("retry-after"), Some("1"));
            assert_eq!(reply.header("x-request-id"), Some(id.as_str()));
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert!(harness().prefill_requests(&id).is_empty(), "{listener}");
        }
        refused.push(ours);
        let streak = refused.iter().rev().take_while(|refused| **refused).count();
        if stop_after_refused > 0 && streak >= stop_after_refused {
            break;
        }
        tokio::time::sleep(gap).await;
    }
    refused
}

#[tokio::test]
async fn while_decode_cannot_be_reached_requests_are_refused_before_prefill() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let refused = r#"pd_filter_requests{api="completions",outcome="decode_unreachable"}"#;
    let refused_before = h.counter(refused);
    for listener in ["decode_outage", "decode_outage_passed"] {
        // Each Envoy worker learns on its own (at least three failures over 100 ms), so the
        // requests share one connection, and so one worker. Once two were refused, the
        // rest follow at once: the next probe of `decode_outage_passed` is a second away.
        let connections = Connections::new();
        let gap = Duration::from_millis(60);
        let first = requests_in_a_row(listener, &connections, 12, gap, 2).await;
        let prefilled = first.iter().filter(|refused| !**refused).count();
        assert!(prefilled >= 3, "{listener}: {first:?}");
        assert!(first.ends_with(&[true, true]), "{listener}: {first:?}");
        // Then none goes to prefill until the next probe (a second, or a minute).
        let then = requests_in_a_row(listener, &connections, 8, Duration::ZERO, 0).await;
        assert_eq!(then, vec![true; 8], "{listener}");
    }
    assert!(h.counter(refused) >= refused_before + 16);

    // Decode comes back. No probe is due for a minute: the KV releases of the requests that
    // failed, sent again 1 and 3 s after their first attempt, find decode, and requests go
    // on again.
    let address = format!("127.0.0.1:{}", h.outage_decode_port);
    let _decode = mock_vllm::MockServer::start(mock_vllm::Role::Decode, &address)
        .await
        .expect("decode on the outage port");
    let deadline = Instant::now() + Duration::from_secs(8);
    let mut served_in_a_row = 0;
    while served_in_a_row < 6 {
        assert!(
            Instant::now() < deadline,
            "decode is back but requests are refused"
        );
        let id = unique_id("outage-over");
        let reply = post("decode_outage", &id, "decode is back").send().await;
        served_in_a_row = if reply.status == 200 {
            served_in_a_row + 1
        } else {
            0
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        wait_until_nothing_is_stranded(Duration::from_secs(5)).await,
        Ok(())
    );
    assert_filter_healthy();
}
