//! Issue #9: no client can crash Envoy, skip prefill, or steer traffic. Hostile requests go
//! through a real Envoy running the built filter; after each one Envoy is alive, no VM
//! crashed, decode never received the client's own `kv_transfer_params`, and a normal request
//! on the same listener is served.
//!
//! The hostile client marks its own `kv_transfer_params` ([`CLIENT_KV`]) so that they are
//! recognised wherever they end up.
//!
//! The tests share one Envoy: one that crashes it fails the others too. To see each on its
//! own, run them one at a time (`cargo test --test security -- --exact NAME`).

mod common;
#[path = "common/raw_http.rs"]
mod raw_http;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{
    assert_filter_healthy, harness, http_get, members_of, mock_fingerprint, unique_id, Reply,
    Request,
};
use mock_vllm::RecordedRequest;
use raw_http::{h2_connect, h2_exchange, post_raw, H2Outcome, H2Request, RawResponse};
use serde_json::{json, Value};

/// A client's forged `kv_transfer_params`: pull KV blocks from a host of its choosing.
const CLIENT_KV: &str = r#"{"remote_host":"6.6.6.6","do_remote_prefill":true,"remote_engine_id":"client-forged-engine"}"#;
/// Text that only the client's `kv_transfer_params` contain.
const CLIENT_MARKERS: &[&str] = &["6.6.6.6", "client-forged-engine"];

// ----------------------------------------------------------------------------------------
// Helpers

/// The raw values of every top-level `name` member of a JSON object body.
fn values_of(body: &[u8], name: &str) -> Vec<String> {
    let text = String::from_utf8_lossy(body);
    members_of(body)
        .unwrap_or_else(|| panic!("not a JSON object: {}", preview(&text)))
        .into_iter()
        .filter(|(key, _)| key == name)
        .map(|(_, value)| value)
        .collect()
}

fn preview(text: &str) -> String {
    if text.len() <= 400 {
        return text.to_owned();
    }
    let mut end = 400;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &text[..end], text.len())
}

fn has_client_marker(text: &str) -> bool {
    CLIENT_MARKERS.iter().any(|marker| text.contains(marker))
}

/// A completions body with this prompt and `max_tokens`, carrying the client's
/// kv_transfer_params.
fn client_kv_body(prompt: &str, max_tokens: u32) -> String {
    format!(
        r#"{{"prompt":{},"max_tokens":{max_tokens},"kv_transfer_params":{CLIENT_KV}}}"#,
        json!(prompt)
    )
}

/// `{"prompt":<prompt>,` then `head`, `member` `count` times, and `tail` (which closes the
/// object).
fn repeated_member_body(
    prompt: &str,
    head: &str,
    member: &str,
    count: usize,
    tail: &str,
) -> String {
    let mut body = format!(r#"{{"prompt":{},{head}"#, json!(prompt));
    body.push_str(&member.repeat(count));
    body.push_str(tail);
    body
}

/// Every request either decode pool received for `id`.
fn decoded(id: &str) -> Vec<RecordedRequest> {
    let h = harness();
    let mut all = h.decode_requests(id);
    all.extend(h.decode_b.requests_with_id(id));
    all
}

/// Every request either prefill received for `id`.
fn prefilled(id: &str) -> Vec<RecordedRequest> {
    let h = harness();
    let mut all = h.prefill_requests(id);
    all.extend(h.prefill_b.requests_with_id(id));
    all
}

/// Neither decode pool ever received the client's `kv_transfer_params` for `id`.
fn assert_decode_never_got_client_kv(id: &str) {
    for request in decoded(id) {
        let text = String::from_utf8_lossy(&request.body);
        match members_of(&request.body) {
            Some(members) => {
                for (key, value) in members {
                    assert!(
                        !(key == "kv_transfer_params" && has_client_marker(&value)),
                        "{id}: decode received the client's kv_transfer_params {value}: {}",
                        preview(&text)
                    );
                }
            }
            None => assert!(
                !has_client_marker(&text),
                "{id}: decode received a body with the client's marker: {}",
                preview(&text)
            ),
        }
    }
}

/// The one decode request for `id`, which carries exactly one `kv_transfer_params`: the one
/// prefill issued for `prompt`.
fn assert_decode_got_prefills_kv(id: &str, prompt: &str) -> RecordedRequest {
    let mut requests = decoded(id);
    assert_eq!(requests.len(), 1, "{id}: decode requests {requests:?}");
    let request = requests.remove(0);
    let kv = values_of(&request.body, "kv_transfer_params");
    assert_eq!(
        kv.len(),
        1,
        "{id}: decode got {} kv_transfer_params members",
        kv.len()
    );
    let kv: Value = serde_json::from_str(&kv[0]).expect("kv_transfer_params JSON");
    assert_eq!(
        kv["mock_prompt_fingerprint"],
        mock_fingerprint(prompt),
        "{id}: decode's kv_transfer_params are not prefill's: {kv}"
    );
    assert_decode_never_got_client_kv(id);
    request
}

/// A leg's body is at most 1 KiB longer than the client's `client_len` bytes.
fn assert_not_grown(leg: &str, request: &RecordedRequest, client_len: usize) {
    assert!(
        request.body.len() <= client_len + 1024,
        "{leg} body {} bytes, the client's {client_len}",
        request.body.len()
    );
}

fn assert_envoy_alive() {
    let ready = http_get(harness().admin_port, "/ready");
    assert!(
        ready.as_deref().is_some_and(|text| text.contains("LIVE")),
        "Envoy's admin does not answer (Envoy crashed?): {ready:?}\n{}",
        tail_of_envoy_log()
    );
}

fn tail_of_envoy_log() -> String {
    let text = harness().envoy_log_text();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Envoy alive, no VM reloaded, no panic or trap in the log.
fn assert_healthy() {
    assert_envoy_alive();
    assert_filter_healthy();
}

/// Sends `request` (60 s at most) and reads the whole reply; a failure says whether Envoy is
/// still there.
async fn send(request: Request) -> Reply {
    match request.timeout(Duration::from_secs(60)).try_send().await {
        Ok(reply) => reply,
        Err(error) => {
            let alive = http_get(harness().admin_port, "/ready").is_some();
            panic!(
                "request failed: {error}; Envoy alive: {alive}\n{}",
                tail_of_envoy_log()
            )
        }
    }
}

/// POSTs `body` as JSON to `path` on `listener` with `x-request-id: id` ([`send`]).
async fn post_json(listener: &str, path: &str, id: &str, body: impl AsRef<[u8]>) -> Reply {
    send(Request::post(listener, path).id(id).body(body)).await
}

/// A normal request on `listener` is served with prefill's KV (decode recomputes on the
/// decode-only listener, whose prefill is unreachable); then everything is healthy.
async fn assert_still_serves(listener: &str) {
    let id = unique_id("still-serves");
    let prompt = format!("{id} normal request");
    // The stripping listener orchestrates chat only.
    let (path, body) = if listener == "stripping" {
        let messages = json!([{"role": "user", "content": prompt}]);
        (
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 4}),
        )
    } else {
        (
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 4}),
        )
    };
    let reply = post_json(listener, path, &id, body.to_string()).await;
    assert_eq!(reply.status, 200, "{listener}: {}", reply.body);
    if listener == "decode_only" {
        assert_eq!(reply.header("x-mock-kv"), Some("recomputed"), "{listener}");
    } else {
        assert_eq!(reply.header("x-mock-kv"), Some("reused"), "{listener}");
        assert_decode_got_prefills_kv(&id, &prompt);
    }
    assert_healthy();
}

fn assert_filter_error(reply: &Reply, status: u16, context: &str) {
    assert_eq!(reply.status, status, "{context}: {}", reply.body);
    let body: Value = serde_json::from_str(&reply.body)
        .unwrap_or_else(|e| panic!("{context}: not JSON ({e}): {}", reply.body));
    assert!(body["error"]["message"].is_string(), "{context}: {body}");
    assert!(body["error"]["type"].is_string(), "{context}: {body}");
    assert_eq!(body["error"]["code"], status, "{context}: {body}");
    assert!(
        reply.header("x-envoy-upstream-service-time").is_none(),
        "{context}: the answer came from an upstream, not the filter"
    );
}

/// A completions body of exactly `size` bytes carrying the client's kv_transfer_params.
fn sized_body(prompt_head: &str, size: usize) -> (String, String) {
    let build = |padding: &str| {
        let prompt = format!("{prompt_head} {padding}");
        (client_kv_body(&prompt, 3), prompt)
    };
    let frame = build("").0.len();
    let (body, prompt) = build(&"z".repeat(size - frame));
    assert_eq!(body.len(), size);
    (body, prompt)
}

type Case = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs every case, one after the other, each to its end even when an earlier one failed;
/// then a normal request on `listener` ([`assert_still_serves`]); then fails with the message
/// of each that panicked.
async fn run_cases_then_still_serves(mut cases: Vec<(String, Case)>, listener: &'static str) {
    cases.push(case("then a normal request", assert_still_serves(listener)));
    let total = cases.len();
    let mut failures = Vec::new();
    for (name, case) in cases {
        if let Err(error) = tokio::spawn(case).await {
            let message = error
                .try_into_panic()
                .ok()
                .and_then(|payload| {
                    payload
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                })
                .unwrap_or_else(|| "cancelled".to_owned());
            failures.push(format!("[{name}] {message}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {total} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn case(
    name: impl Into<String>,
    future: impl Future<Output = ()> + Send + 'static,
) -> (String, Case) {
    (name.into(), Box::pin(future))
}

// ----------------------------------------------------------------------------------------
// 1. A decode body that outgrows Envoy's buffer

#[tokio::test]
async fn a_body_that_grows_past_envoys_buffer_on_decode_is_413_or_served() {
    // tight_buffer: Envoy buffers at most 65536 bytes, the filter accepts up to 65536. With
    // prefill's kv_transfer_params in it, decode's body no longer fits in Envoy's buffer.
    body_growing_past_envoys_buffer("tight_buffer", &[65_456, 65_536]).await;
}

#[tokio::test]
async fn at_envoys_default_buffer_limit_the_filters_default_keeps_decode_bodies_within_it() {
    // envoy_defaults: Envoy's 1 MiB and no max_request_body_bytes in the plugin's
    // configuration, as on Istio's gateway. With a default above Envoy's limit, a body just
    // under 1 MiB whose decode version is over it crashed Envoy once prefill answered.
    let limit = common::ENVOY_DEFAULT_BUFFER_LIMIT_BYTES as usize;
    body_growing_past_envoys_buffer("envoy_defaults", &[limit - 276, limit - 80, limit]).await;
}

#[tokio::test]
async fn an_envoy_buffer_below_the_body_limit_gives_envoys_413_and_envoy_lives() {
    // undersized_buffer: Envoy buffers at most 65536 bytes, the filter's default limit is
    // 1 MiB, so the filter writes decode's body past Envoy's buffer once prefill answered.
    // Envoy answers the client itself from inside that host call, and calls the filter's
    // callbacks for the request (response headers, log, done, delete) before the call
    // returns: with the SDK's dispatcher the nested call panicked and Envoy crashed.
    let listener = "undersized_buffer";
    let mut cases = Vec::new();
    for size in [65_456, 65_536] {
        for framing in ["content-length", "chunked"] {
            cases.push(case(format!("{size} bytes, {framing}"), async move {
                let context = format!("{listener}: {size} bytes, {framing}");
                let id = unique_id("undersized");
                let (reply, _prompt) = sized_upload(listener, &id, size, framing).await;
                eprintln!("{context}: {} {}", reply.status, reply.body);
                assert_envoy_alive();
                assert_eq!(reply.status, 413, "{context}: {}", reply.body);
                // Envoy's own answer, not the filter's (which is JSON).
                assert!(
                    serde_json::from_str::<Value>(&reply.body).is_err(),
                    "{context}: {}",
                    reply.body
                );
                assert_eq!(prefilled(&id).len(), 1, "{context}");
                assert!(decoded(&id).is_empty(), "{context}: decode was called");
                // The request still saw its end: prefill's KV is released.
                let deadline = std::time::Instant::now() + Duration::from_secs(5);
                while harness().kv_releases(&id).is_empty() && std::time::Instant::now() < deadline
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let log = harness().envoy_log_text();
                let lines: Vec<&str> = log.lines().filter(|line| line.contains(&id)).collect();
                assert_eq!(
                    harness().kv_releases(&id).len(),
                    1,
                    "{context}: the filter's lines:\n{}",
                    lines.join("\n")
                );
                assert_healthy();
            }));
        }
    }
    run_cases_then_still_serves(cases, listener).await;
}

#[tokio::test]
async fn an_answer_rewritten_past_envoys_buffer_leaves_envoy_running() {
    // undersized_answer: Envoy buffers at most 65536 bytes, the filter rewrites answers up to
    // its default 1 MiB. Decode's answer ends with trailers, so the filter rewrites it in
    // Envoy's buffer, and prefill's prompt logprobs (about 55 bytes a word, 3,000 words) take
    // it past the buffer: Envoy answers 500 or resets the stream from inside the filter's
    // set_buffer, and calls the filter back (the end of its stream included) while its
    // callback still runs, which crashed Envoy with the published proxy-wasm dispatcher.
    let listener = "undersized_answer";
    let id = unique_id("undersized-answer");
    let prompt = format!("{id} {}", "a ".repeat(3000));
    let body = json!({
        "model": "m", "prompt": prompt, "max_tokens": 3, "prompt_logprobs": 1
    })
    .to_string();
    assert!(body.len() < 65536);
    let outcome = Request::post(listener, "/v1/completions")
        .id(&id)
        .body(body)
        .timeout(Duration::from_secs(60))
        .try_send()
        .await;
    match &outcome {
        Ok(reply) => {
            eprintln!("{listener}: {} {}", reply.status, preview(&reply.body));
            assert_eq!(reply.status, 500, "{}", preview(&reply.body));
        }
        // The answer's headers had gone: Envoy resets the stream.
        Err(error) => eprintln!("{listener}: {error}"),
    }
    assert_envoy_alive();
    assert_healthy();
    // Its decode is no mock: a small answer on it, then a request served by the mocks.
    let small = json!({"model": "m", "prompt": format!("{id} again"), "max_tokens": 3});
    let reply = post_json(
        listener,
        "/v1/completions",
        &unique_id("small"),
        small.to_string(),
    )
    .await;
    assert_eq!(reply.status, 200, "{listener}: {}", reply.body);
    assert_still_serves("undersized_buffer").await;
}

/// A completions body of exactly `size` bytes ([`sized_body`]), sent with a content-length
/// or chunked; the reply and the body's prompt.
async fn sized_upload(listener: &str, id: &str, size: usize, framing: &str) -> (Reply, String) {
    let (body, prompt) = sized_body(id, size);
    let request = Request::post(listener, "/v1/completions").id(id);
    let request = match framing {
        "chunked" => request.chunked(body, 8192),
        _ => request.body(body),
    };
    (send(request).await, prompt)
}

async fn body_growing_past_envoys_buffer(listener: &'static str, sizes: &[usize]) {
    let mut cases = Vec::new();
    for &size in sizes {
        for framing in ["content-length", "chunked"] {
            cases.push(case(format!("{size} bytes, {framing}"), async move {
                let context = format!("{listener}: {size} bytes, {framing}");
                let id = unique_id("tight");
                let (reply, prompt) = sized_upload(listener, &id, size, framing).await;
                eprintln!("{context}: {} {}", reply.status, reply.body);
                assert_envoy_alive();
                match reply.status {
                    413 => {
                        assert_filter_error(&reply, 413, &context);
                        assert_eq!(
                            reply.json()["error"]["type"],
                            "RequestTooLargeError",
                            "{context}"
                        );
                        assert!(decoded(&id).is_empty(), "{context}: decode was called");
                    }
                    200 => {
                        assert_eq!(reply.header("x-mock-kv"), Some("reused"), "{context}");
                        assert_decode_got_prefills_kv(&id, &prompt);
                    }
                    other => panic!("{context}: neither 413 nor served: {other} {}", reply.body),
                }
                assert_decode_never_got_client_kv(&id);
                assert_healthy();
            }));
        }
    }
    run_cases_then_still_serves(cases, listener).await;
}

#[tokio::test]
async fn eighty_thousand_duplicate_kv_transfer_params_do_not_crash_envoy() {
    // A 16 MiB buffer, 8 MiB body limit (the default listener), as envoy/envoy.yaml buffers.
    // 2.1 MB of `"kv_transfer_params":null,`: replacing each one by prefill's object makes a
    // decode body far above the buffer.
    let id = unique_id("dup-kv-80000");
    let prompt = format!("{id} duplicates");
    let body = repeated_member_body(
        &prompt,
        r#""max_tokens":3,"#,
        r#""kv_transfer_params":null,"#,
        80_000,
        r#""stream":false}"#,
    );
    assert!(body.len() > 1_750_000);
    let client_len = body.len();
    let reply = post_json("default", "/v1/completions", &id, body).await;
    eprintln!(
        "80,000 duplicates: {} {}",
        reply.status,
        preview(&reply.body)
    );
    assert_envoy_alive();
    match reply.status {
        200 => {
            let decode = assert_decode_got_prefills_kv(&id, &prompt);
            assert_not_grown("decode", &decode, client_len);
        }
        400..=499 => {
            assert_filter_error(&reply, reply.status, "80,000 duplicates");
            assert!(decoded(&id).is_empty(), "decode was called");
        }
        other => panic!("neither served nor a 4xx: {other} {}", reply.body),
    }
    assert_healthy();
    assert_still_serves("default").await;
}

// ----------------------------------------------------------------------------------------
// 2. Duplicate members

/// POSTs `body` to `default` and asserts it was served on prefill's KV for `prompt`, prefill
/// got exactly one kv_transfer_params and not the client's, and neither leg's body is more
/// than 1 KiB over the client's. Returns prefill's request and its kv_transfer_params.
async fn assert_served_as_one(id: &str, prompt: &str, body: String) -> (RecordedRequest, String) {
    let client_len = body.len();
    let reply = post_json("default", "/v1/completions", id, body).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));

    let prefill = harness().only_prefill(id);
    assert_not_grown("prefill", &prefill, client_len);
    let mut kv = values_of(&prefill.body, "kv_transfer_params");
    assert_eq!(kv.len(), 1, "prefill got {} kv_transfer_params", kv.len());
    assert!(
        !has_client_marker(&kv[0]),
        "prefill got the client's: {}",
        kv[0]
    );
    let decode = assert_decode_got_prefills_kv(id, prompt);
    assert_not_grown("decode", &decode, client_len);
    (prefill, kv.remove(0))
}

#[tokio::test]
async fn five_thousand_client_kv_transfer_params_reach_each_leg_as_one() {
    let id = unique_id("dup-kv-5000");
    let prompt = format!("{id} many kv");
    let forged = format!(r#""kv_transfer_params":{CLIENT_KV},"#);
    let (head, tail) = (r#""max_tokens":4,"#, r#""temperature":0}"#);
    let body = repeated_member_body(&prompt, head, &forged, 5_000, tail);
    let (_, kv) = assert_served_as_one(&id, &prompt, body).await;
    assert_eq!(
        serde_json::from_str::<Value>(&kv).unwrap()["do_remote_decode"],
        true
    );
    assert_healthy();
    assert_still_serves("default").await;
}

#[tokio::test]
async fn ten_thousand_duplicate_limits_do_not_grow_the_prefill_body() {
    let mut cases = Vec::new();
    for (member, key) in [
        (r#""stream":0"#, "stream"),
        (r#""max_tokens":5"#, "max_tokens"),
    ] {
        cases.push(case(member, async move {
            let id = unique_id("dup-limits");
            let prompt = format!("{id} limits");
            let tail = format!(r#""kv_transfer_params":{CLIENT_KV}}}"#);
            let body = repeated_member_body(&prompt, "", &format!("{member},"), 10_000, &tail);
            let (prefill, _) = assert_served_as_one(&id, &prompt, body).await;
            // Whichever duplicate a parser reads, prefill generates one token, unstreamed.
            let expected = if key == "stream" { "false" } else { "1" };
            let values = values_of(&prefill.body, key);
            assert!(!values.is_empty(), "no {key} on prefill");
            assert!(
                values.iter().all(|value| value == expected),
                "prefill {key} values other than {expected}: {:?}",
                values
                    .iter()
                    .filter(|v| *v != expected)
                    .take(3)
                    .collect::<Vec<_>>()
            );
            assert_healthy();
        }));
    }
    run_cases_then_still_serves(cases, "default").await;
}

// ----------------------------------------------------------------------------------------
// 3. HTTP/2 request trailers

/// POSTs over a new h2c connection to `default`: JSON with `x-request-id: id`, the body in
/// these DATA frames, then `trailers` if any. What became of it within 30 s.
async fn h2_post(path: &str, id: &str, data: Vec<Vec<u8>>, trailers: &[(&str, &str)]) -> H2Outcome {
    let port = harness().port("default");
    let sender = h2_connect(port).await.expect("h2c connection");
    let owned = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    };
    let request = H2Request {
        method: "POST".to_owned(),
        path: path.to_owned(),
        headers: owned(&[("content-type", "application/json"), ("x-request-id", id)]),
        data,
        trailers: owned(trailers),
        reset_after: None,
    };
    h2_exchange(&sender, request, Duration::from_secs(30)).await
}

/// Envoy's HTTP/2 codec takes a `:method` of `post`; a server that read it as POST would
/// serve the client's kv_transfer_params without prefill. Refused on orchestrated and
/// stripped paths alike, before either leg.
#[tokio::test]
async fn an_h2_post_spelled_in_lowercase_is_405_and_reaches_no_worker() {
    let port = harness().port("stripping");
    let sender = h2_connect(port).await.expect("h2c connection");
    for (method, path) in [
        ("post", "/v1/chat/completions"),
        ("Post", "/v1/chat/completions"),
        ("pOST", "/v1/completions"),
    ] {
        let id = unique_id("h2-lowercase-post");
        let request = H2Request {
            method: method.to_owned(),
            path: path.to_owned(),
            headers: vec![
                ("content-type".to_owned(), "application/json".to_owned()),
                ("x-request-id".to_owned(), id.clone()),
            ],
            data: vec![client_kv_body(&format!("{id} {method}"), 4).into_bytes()],
            trailers: vec![],
            reset_after: None,
        };
        let outcome = h2_exchange(&sender, request, Duration::from_secs(30)).await;
        outcome.response(method).assert_json_error(405, method);
        assert!(prefilled(&id).is_empty(), "{method} {path}");
        assert!(decoded(&id).is_empty(), "{method} {path}");
    }
    assert_healthy();
}

fn split_in(body: &[u8], parts: usize) -> Vec<Vec<u8>> {
    let size = body.len().div_ceil(parts);
    body.chunks(size).map(<[u8]>::to_vec).collect()
}

/// A 200 built on prefill's KV: prefill was called once for `id` and decode got the
/// kv_transfer_params prefill issued for `prompt`; then everything is healthy.
fn assert_raw_served(response: &RawResponse, id: &str, prompt: &str) {
    assert_eq!(response.status, 200, "{}", response.text());
    assert_eq!(response.header("x-mock-kv"), Some("reused"));
    harness().only_prefill(id);
    assert_decode_got_prefills_kv(id, prompt);
    assert_healthy();
}

#[tokio::test]
async fn an_h2c_request_without_trailers_is_orchestrated() {
    // The harness's listeners speak h2c (codec AUTO): the trailer tests below rely on it.
    let id = unique_id("h2c-plain");
    let prompt = format!("{id} over h2c");
    let body = client_kv_body(&prompt, 4);
    let outcome = h2_post("/v1/completions", &id, split_in(body.as_bytes(), 3), &[]).await;
    assert_raw_served(&outcome.response("h2c"), &id, &prompt);
}

#[tokio::test]
async fn h2_trailers_after_the_body_do_not_skip_prefill() {
    let mut cases = Vec::new();
    for frames in [1, 3] {
        cases.push(case(
            format!("{frames} DATA frames, then trailers"),
            async move {
                let id = unique_id("h2-trailers");
                let prompt = format!("{id} with trailers");
                let data = split_in(client_kv_body(&prompt, 4).as_bytes(), frames);
                let trailers = [("x-trailer", "end")];
                let outcome = h2_post("/v1/completions", &id, data, &trailers).await;
                assert_envoy_alive();
                let prefills = prefilled(&id).len();
                assert_decode_never_got_client_kv(&id);
                assert_eq!(prefills, 1, "prefill was not called once");
                assert_raw_served(&outcome.response("h2 trailers"), &id, &prompt);
            },
        ));
    }
    run_cases_then_still_serves(cases, "default").await;
}

#[tokio::test]
async fn h2_trailers_without_a_body_are_400() {
    let id = unique_id("h2-trailers-only");
    let trailers = [("x-trailer", "1")];
    let outcome = h2_post("/v1/chat/completions", &id, Vec::new(), &trailers).await;
    assert_envoy_alive();
    assert!(prefilled(&id).is_empty(), "prefill was called");
    assert!(
        decoded(&id).is_empty(),
        "decode was called ({outcome:?}): {:?}",
        decoded(&id)
    );
    let response = outcome.response("h2 trailers only");
    response.assert_json_error(400, "trailers without a body");
    assert!(!response.came_from_upstream(), "answered by an upstream");
    assert_healthy();
    assert_still_serves("default").await;
}

// ----------------------------------------------------------------------------------------
// 4. Paths decode would route to an orchestrated endpoint, spelled another way

/// Each spelling, with what makes it one.
const NON_CANONICAL_PATHS: &[(&str, &str)] = &[
    ("/v1/%63ompletions", "an encoded letter"),
    ("/v1/re%73ponses", "an encoded letter in /v1/responses"),
    ("/%76%31/chat/completions", "an encoded segment"),
    ("/v1%2Fcompletions", "an encoded slash"),
    ("/v1/chat%2fcompletions", "a lowercase encoded slash"),
    ("//v1/completions", "an empty segment"),
    ("/v1/./completions", "a dot segment"),
    ("/v1/x/../completions", "a dot-dot segment"),
];

fn marked_body(prompt: &str) -> String {
    // Fields for all three endpoints, so that any of them would accept it.
    format!(
        r#"{{"prompt":{p},"messages":[{{"role":"user","content":{p}}}],"input":{p},"max_tokens":3,"kv_transfer_params":{CLIENT_KV}}}"#,
        p = json!(prompt)
    )
}

/// Envoy is alive, nothing reached decode for `id`, and the answer (`response` panics if
/// there is none) is the filter's 400.
fn assert_refused_before_decode(id: &str, path: &str, response: impl FnOnce() -> RawResponse) {
    assert_envoy_alive();
    assert!(decoded(id).is_empty(), "decode recorded it");
    let response = response();
    assert!(
        !response.came_from_upstream(),
        "{path}: the answer came from decode, not the filter: {} {}",
        response.status,
        response.text()
    );
    response.assert_json_error(400, path);
}

#[tokio::test]
async fn non_canonical_orchestrated_paths_are_400_and_never_reach_decode() {
    let mut cases = Vec::new();
    for (path, spelling) in NON_CANONICAL_PATHS {
        cases.push(case(format!("HTTP/1.1 {path} ({spelling})"), async move {
            let id = unique_id("odd-path");
            let body = marked_body(&format!("{id} odd path"));
            let port = harness().port("default");
            let outcome = post_raw(port, path, &id, &[], body.as_bytes()).await;
            assert_refused_before_decode(&id, path, || outcome.response(path));
        }));
        cases.push(case(format!("h2 {path} ({spelling})"), async move {
            let id = unique_id("odd-path-h2");
            let body = marked_body(&format!("{id} odd path"));
            let outcome = h2_post(path, &id, vec![body.into_bytes()], &[]).await;
            assert_refused_before_decode(&id, path, || outcome.response(path));
        }));
    }
    run_cases_then_still_serves(cases, "default").await;
}

#[tokio::test]
async fn an_orchestrated_path_with_a_query_string_is_still_orchestrated() {
    let id = unique_id("query");
    let prompt = format!("{id} with a query");
    let body = client_kv_body(&prompt, 3);
    let port = harness().port("default");
    let outcome = post_raw(port, "/v1/completions?x=1", &id, &[], body.as_bytes()).await;
    assert_raw_served(&outcome.response("query"), &id, &prompt);
}

// ----------------------------------------------------------------------------------------
// 5. Decode-only fallbacks

/// A 200 from decode recomputing: decode got the client's body with no `kv_transfer_params`
/// member and nothing else changed; then everything is healthy.
fn assert_recomputed_without_kv(reply: &Reply, id: &str, client_body: &str) {
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_decode_never_got_client_kv(id);
    let mut requests = decoded(id);
    assert_eq!(requests.len(), 1, "decode requests {requests:?}");
    let request = requests.remove(0);
    let got = members_of(&request.body).expect("decode body is a JSON object");
    assert!(
        got.iter().all(|(key, _)| key != "kv_transfer_params"),
        "decode got kv_transfer_params: {}",
        String::from_utf8_lossy(&request.body)
    );
    let expected: Vec<(String, String)> = members_of(client_body.as_bytes())
        .unwrap()
        .into_iter()
        .filter(|(key, _)| key != "kv_transfer_params")
        .collect();
    assert_eq!(got, expected, "the other members changed");
    assert_eq!(reply.header("x-mock-kv"), Some("recomputed"));
    assert_healthy();
}

#[tokio::test]
async fn without_prefills_kv_decode_gets_the_body_without_any_kv_transfer_params() {
    let mut cases = Vec::new();
    for directive in [
        "mock:prefill_no_kv",
        "mock:prefill_null_kv",
        "mock:prefill_kv_not_object",
        "mock:prefill_non_json",
    ] {
        cases.push(case(directive, async move {
            let id = unique_id("fallback");
            let body = format!(
                r#"{{"prompt":{},"kv_transfer_params":{CLIENT_KV},"max_tokens":3,"kv_transfer_params":{CLIENT_KV}}}"#,
                json!(format!("{id} {directive}"))
            );
            let reply = post_json("default", "/v1/completions", &id, &body).await;
            assert_recomputed_without_kv(&reply, &id, &body);
        }));
    }
    run_cases_then_still_serves(cases, "default").await;
}

#[tokio::test]
async fn the_decode_only_fallback_drops_the_clients_kv_transfer_params() {
    // decode_only: prefill unreachable, on_prefill_failure decode_only.
    let id = unique_id("decode-only");
    let body = client_kv_body(&format!("{id} fallback"), 3);
    let reply = post_json("decode_only", "/v1/completions", &id, &body).await;
    assert_recomputed_without_kv(&reply, &id, &body);
    assert_still_serves("decode_only").await;
}

// ----------------------------------------------------------------------------------------
// 6. Scheduler header pointing outside the allowlist (127.0.0.2/32 on `scheduled`)

/// A TCP port that counts the connections made to it and drops each at once.
#[derive(Clone)]
struct Canary {
    port: u16,
    connections: Arc<AtomicUsize>,
}

impl Canary {
    async fn start() -> Canary {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let connections = Arc::new(AtomicUsize::new(0));
        let counter = connections.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                drop(stream);
            }
        });
        Canary { port, connections }
    }

    /// What `exchange` gives, and how many connections the canary got from its start until
    /// 300 ms after its end.
    async fn connections_during<T>(&self, exchange: impl Future<Output = T>) -> (T, usize) {
        let before = self.connections.load(Ordering::SeqCst);
        let output = exchange.await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        (output, self.connections.load(Ordering::SeqCst) - before)
    }
}

async fn post_scheduled(id: &str, hosts: &str) -> Reply {
    let body = json!({"prompt": format!("{id} steer"), "max_tokens": 3}).to_string();
    let request = Request::post("scheduled", "/v1/completions").id(id);
    send(request.header("x-prefiller-host-port", hosts).body(body)).await
}

/// The filter's 400, whose message names the scheduler's header.
fn assert_refuses_the_header(reply: &Reply, context: &str) {
    assert_filter_error(reply, 400, context);
    assert!(
        reply.body.contains("x-prefiller-host-port"),
        "the error does not name the header: {}",
        reply.body
    );
}

#[tokio::test]
async fn a_scheduler_host_outside_the_allowlist_is_400_and_nothing_is_sent_there() {
    let h = harness();
    // The canary's accept loop runs on this test's runtime, like the cases.
    let canary = Canary::start().await;
    let canary_port = canary.port;
    let mut cases = Vec::new();

    // Envoy's own admin endpoint: its text must never come back to the client.
    cases.push(case("Envoy's admin", async move {
        let id = unique_id("ssrf-admin");
        let reply = post_scheduled(&id, &format!("127.0.0.1:{}", h.admin_port)).await;
        assert_envoy_alive();
        assert!(
            !reply.body.contains("admin commands") && !reply.body.contains("/stats"),
            "the admin's answer reached the client: {} {}",
            reply.status,
            preview(&reply.body)
        );
        assert_refuses_the_header(&reply, "admin host");
        assert!(prefilled(&id).is_empty() && decoded(&id).is_empty());
    }));

    for hosts in [
        format!("127.0.0.1:{canary_port}"),
        format!("[::ffff:127.0.0.1]:{canary_port}"),
    ] {
        let canary = canary.clone();
        cases.push(case(hosts.clone(), async move {
            let id = unique_id("ssrf-canary");
            let (reply, made) = canary.connections_during(post_scheduled(&id, &hosts)).await;
            assert_eq!(
                made, 0,
                "the filter connected to a host outside the allowlist; the client got {} {}",
                reply.status, reply.body
            );
            assert_refuses_the_header(&reply, &hosts);
            assert!(prefilled(&id).is_empty() && decoded(&id).is_empty());
        }));
    }

    // A list with a forbidden host first: rejected, or served by the allowed one, but the
    // forbidden one is never contacted.
    cases.push(case("a list starting outside the allowlist", async move {
        let id = unique_id("ssrf-list");
        let hosts = format!("127.0.0.1:{canary_port},127.0.0.2:{}", h.prefill_b.port());
        let (reply, made) = canary.connections_during(post_scheduled(&id, &hosts)).await;
        assert_eq!(
            made, 0,
            "{hosts}: the filter connected to a host outside the allowlist ({} {})",
            reply.status, reply.body
        );
        match reply.status {
            400 => assert_refuses_the_header(&reply, &hosts),
            200 => assert_eq!(h.prefill_b.requests_with_id(&id).len(), 1),
            other => panic!("{hosts}: {other} {}", reply.body),
        }
    }));

    // A host inside the allowlist still gets the callout.
    cases.push(case("inside the allowlist", async move {
        let id = unique_id("allowed-host");
        let prompt = format!("{id} steer");
        let reply = post_scheduled(&id, &format!("127.0.0.2:{}", h.prefill_b.port())).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(h.prefill_b.requests_with_id(&id).len(), 1);
        assert_decode_got_prefills_kv(&id, &prompt);
        assert_healthy();
    }));
    run_cases_then_still_serves(cases, "scheduled").await;
}

// ----------------------------------------------------------------------------------------
// 8. The model header (`models`: x-pd-model: model-b routes to decode pool b)

#[tokio::test]
async fn a_clients_own_model_header_does_not_pick_the_decode_pool() {
    let mut cases = Vec::new();
    for body_model in [None, Some("model-a"), Some("")] {
        cases.push(case(format!("body model {body_model:?}"), async move {
            let h = harness();
            let id = unique_id("model-header");
            let prompt = format!("{id} which pool");
            let mut body = json!({"prompt": prompt, "max_tokens": 3});
            if let Some(model) = body_model {
                body["model"] = json!(model);
            }
            let request = Request::post("models", "/v1/completions").id(&id);
            let reply = send(
                request
                    .header("x-pd-model", "model-b")
                    .body(body.to_string()),
            )
            .await;
            assert_envoy_alive();
            assert!(
                h.decode_b.requests_with_id(&id).is_empty(),
                "the client's x-pd-model chose decode pool b"
            );
            assert!(
                h.prefill_b.requests_with_id(&id).is_empty(),
                "prefill pool b was called"
            );
            assert_eq!(reply.status, 200, "{}", reply.body);
            assert_eq!(h.decode.requests_with_id(&id).len(), 1);
            assert_healthy();
        }));
    }
    run_cases_then_still_serves(cases, "models").await;
}

/// The filter marks its KV releases to decode with `x-pd-kv-release`; a client's copy would
/// pass its request off as one in decode's logs.
#[tokio::test]
async fn a_clients_kv_release_mark_never_reaches_decode() {
    let h = harness();
    let id = unique_id("release-mark");
    let prompt = format!("{id} not a release");
    let request = Request::post("default", "/v1/completions")
        .id(&id)
        .header(common::KV_RELEASE_HEADER, "1")
        .body(json!({"prompt": prompt, "max_tokens": 3}).to_string());
    let reply = send(request).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(
        h.kv_releases(&id).is_empty(),
        "decode got the client's mark"
    );
    assert_decode_got_prefills_kv(&id, &prompt);
}

#[tokio::test]
async fn a_model_with_control_characters_is_400_before_any_prefill() {
    let mut cases = Vec::new();
    for model in [
        r"a\r\nb",
        r"model-b\r\nx-evil: 1",
        r"a\nb",
        r"a\rb",
        r"a\u0000b",
        r"a\u007fb",
    ] {
        cases.push(case(model, async move {
            let id = unique_id("model-ctl");
            // `model` is written with JSON escapes: the decoded value holds the control byte.
            let body = format!(r#"{{"model":"{model}","prompt":"x","max_tokens":3}}"#);
            let reply = post_json("models", "/v1/completions", &id, body).await;
            assert_envoy_alive();
            let (prefills, decodes) = (prefilled(&id).len(), decoded(&id).len());
            assert!(
                prefills == 0 && decodes == 0,
                "prefill called {prefills}, decode {decodes} times; the client got {} {}",
                reply.status,
                reply.body
            );
            assert_filter_error(&reply, 400, model);
            assert_healthy();
        }));
    }
    run_cases_then_still_serves(cases, "models").await;
}

// ----------------------------------------------------------------------------------------
// 10. A UTF-8 byte order mark

#[tokio::test]
async fn a_utf8_bom_before_the_body_is_served_and_both_legs_get_valid_json() {
    let mut cases = Vec::new();
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/responses"] {
        cases.push(case(path, async move {
            let id = unique_id("bom");
            let prompt = format!("{id} bom");
            let json_body = match path {
                "/v1/completions" => json!({"prompt": prompt, "max_tokens": 3}),
                "/v1/chat/completions" => {
                    json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 3})
                }
                _ => json!({"input": prompt, "max_output_tokens": 3}),
            };
            let mut body = b"\xEF\xBB\xBF".to_vec();
            body.extend_from_slice(json_body.to_string().as_bytes());
            let reply = post_json("default", path, &id, body).await;
            assert_envoy_alive();
            assert_eq!(reply.status, 200, "{}", reply.body);
            assert_eq!(reply.header("x-mock-kv"), Some("reused"));
            let prefill = harness().only_prefill(&id);
            assert!(
                serde_json::from_slice::<Value>(&prefill.body).is_ok(),
                "prefill body is not JSON: {:?}",
                String::from_utf8_lossy(&prefill.body)
            );
            let decode = assert_decode_got_prefills_kv(&id, &prompt);
            assert!(serde_json::from_slice::<Value>(&decode.body).is_ok());
            assert_healthy();
        }));
    }
    run_cases_then_still_serves(cases, "default").await;
}

// ----------------------------------------------------------------------------------------
// 11. Stripped paths (`stripping`: only chat is orchestrated; vLLM's other generation
// paths have their kv_transfer_params removed)

/// A configuration that orchestrates fewer APIs still keeps clients' kv_transfer_params from
/// the others: a review saw /v1/completions and /v1/responses reach decode with them.
#[tokio::test]
async fn vllms_generation_paths_left_out_of_paths_never_pass_on_client_kv() {
    let mut cases = Vec::new();
    for (path, body) in [
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 3})),
        (
            "/v1/completions?x=1",
            json!({"prompt": "hi", "max_tokens": 3}),
        ),
        (
            "/v1/responses",
            json!({"input": "hi", "max_output_tokens": 3}),
        ),
        (
            "/v1/messages",
            json!({"model": "m", "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/inference/v1/generate",
            json!({"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}}),
        ),
    ] {
        cases.push(case(path, async move {
            let id = unique_id("strip-unorchestrated");
            let mut body = body;
            body["kv_transfer_params"] = serde_json::from_str(CLIENT_KV).unwrap();
            let reply = post_json("stripping", path, &id, body.to_string()).await;
            assert_envoy_alive();
            assert_eq!(
                decoded(&id).len(),
                1,
                "{path}: {} {}",
                reply.status,
                reply.body
            );
            assert_decode_never_got_client_kv(&id);
            assert!(prefilled(&id).is_empty(), "{path}");
        }));
    }
    run_cases_then_still_serves(cases, "stripping").await;
}

/// vLLM's parser keeps the last copy of a member, but a parser between the gateway and vLLM
/// may keep the first: a client's kv_transfer_params in any copy of `vllm_xargs`,
/// `sampling_params` or its `extra_args` are refused, on orchestrated and stripped paths.
#[tokio::test]
async fn client_kv_in_a_dropped_copy_of_a_nested_member_reaches_no_worker() {
    let mut cases = Vec::new();
    for (listener, path, body) in [
        (
            "default",
            "/v1/completions",
            format!(
                r#"{{"prompt":"hi","vllm_xargs":{{"kv_transfer_params":{CLIENT_KV}}},"vllm_xargs":{{}}}}"#
            ),
        ),
        (
            "default",
            "/inference/v1/generate",
            format!(
                r#"{{"token_ids":[1],"sampling_params":{{"extra_args":{{"kv_transfer_params":{CLIENT_KV}}},"extra_args":{{}}}}}}"#
            ),
        ),
        (
            "stripping",
            "/v1/messages",
            format!(
                r#"{{"max_tokens":3,"messages":[],"vllm_xargs":{{"kv_transfer_params":{CLIENT_KV}}},"vllm_xargs":{{}}}}"#
            ),
        ),
    ] {
        cases.push(case(path, async move {
            let id = unique_id("dropped-copy");
            let reply = post_json(listener, path, &id, body).await;
            assert_envoy_alive();
            reply.assert_error(400, "kv_transfer_params are set by the gateway");
            assert!(prefilled(&id).is_empty(), "{path}");
            assert!(decoded(&id).is_empty(), "{path}");
        }));
    }
    run_cases_then_still_serves(cases, "default").await;
}

/// vLLM's encoder-cache connector fetches from the host a request's `ec_transfer_params`
/// name: a client's never reach a worker, at the top level or nested, orchestrated or not.
#[tokio::test]
async fn client_ec_transfer_params_reach_no_worker() {
    let ec = r#"{"peer_host":"10.0.0.9","peer_port":5555}"#;
    let mut cases = Vec::new();
    for (listener, path, body) in [
        (
            "default",
            "/v1/chat/completions",
            format!(
                r#"{{"max_tokens":3,"messages":[{{"role":"user","content":"hi"}}],"ec_transfer_params":{ec}}}"#
            ),
        ),
        (
            "default",
            "/v1/completions",
            format!(r#"{{"prompt":"hi","vllm_xargs":{{"ec_transfer_params":{ec}}}}}"#),
        ),
        (
            "default",
            "/inference/v1/generate",
            format!(
                r#"{{"token_ids":[1],"sampling_params":{{"extra_args":{{"ec_transfer_params":{ec}}}}}}}"#
            ),
        ),
        (
            "stripping",
            "/v1/messages",
            format!(r#"{{"max_tokens":3,"messages":[],"ec_transfer_params":{ec}}}"#),
        ),
    ] {
        cases.push(case(path, async move {
            let id = unique_id("client-ec");
            let reply = post_json(listener, path, &id, body).await;
            assert_envoy_alive();
            reply.assert_error(400, "ec_transfer_params are set by the gateway");
            assert!(prefilled(&id).is_empty(), "{path}");
            assert!(decoded(&id).is_empty(), "{path}");
        }));
    }
    run_cases_then_still_serves(cases, "default").await;
}

/// vLLM up to 0.33 cuts a prompt under `truncate_prompt_tokens: -1` (or Responses'
/// `truncation: "auto"`) to the context less the output limit: prefill's one-token copy would
/// keep more of a long prompt than decode, whose answer would come from another prompt's KV.
#[tokio::test]
async fn truncation_to_the_context_is_refused_before_prefill() {
    let mut cases = Vec::new();
    for (path, body) in [
        (
            "/v1/completions",
            r#"{"prompt":"hi","max_tokens":500,"truncate_prompt_tokens":-1}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":500,"truncate_prompt_tokens":-1}"#,
        ),
        (
            "/v1/responses",
            r#"{"input":"hi","max_output_tokens":500,"truncation":"auto"}"#,
        ),
        // -1 to Python's json (the nearest double), so to vLLM; the wasm build's JSON
        // reader once rounded it to -1.0000000000000002 and served it.
        (
            "/v1/completions",
            r#"{"prompt":"hi","max_tokens":500,"truncate_prompt_tokens":-1.00000000000000011}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":500,"truncate_prompt_tokens":-1.00000000000000011}"#,
        ),
    ] {
        cases.push(case(path, async move {
            let id = unique_id("truncation");
            let reply = post_json("default", path, &id, body).await;
            assert_envoy_alive();
            reply.assert_error(400, "cannot be served through prefill/decode");
            assert!(prefilled(&id).is_empty(), "{path}");
            assert!(decoded(&id).is_empty(), "{path}");
        }));
    }
    run_cases_then_still_serves(cases, "default").await;
}

/// Without held headers (Istio's WasmPlugin) decode's stream opens with them, while the filter
/// still holds the body: a retry of the route would send decode what Envoy buffers then, the
/// client's own body (its kv_transfer_params too) before prefill answered. A review saw it on
/// every retried request; the filter turns the route's retries off for such requests.
#[tokio::test]
async fn without_held_headers_a_retrying_route_never_sends_decode_the_clients_body() {
    let mut cases = Vec::new();
    for i in 0..8 {
        cases.push(case("/v1/completions", async move {
            let id = unique_id("half-dead");
            let prompt = format!("half dead {i} mock:prefill_delay_ms=200");
            let body = format!(
                r#"{{"model":"m","prompt":"{prompt}","max_tokens":3,"kv_transfer_params":{CLIENT_KV}}}"#
            );
            let reply = post_json("retrying_half_dead", "/v1/completions", &id, body).await;
            assert_envoy_alive();
            assert!(
                reply.status == 200 || reply.status == 503,
                "{} {}",
                reply.status,
                reply.body
            );
            for request in decoded(&id) {
                let text = String::from_utf8_lossy(&request.body).into_owned();
                assert!(!has_client_marker(&text), "decode got the client's kv: {text}");
                let parsed: Result<serde_json::Value, _> = serde_json::from_str(&text);
                assert!(parsed.is_ok(), "decode got more than one body: {text}");
            }
        }));
    }
    run_cases_then_still_serves(cases, "default").await;
}

#[tokio::test]
async fn a_stripped_path_never_passes_on_a_body_the_filter_cannot_read() {
    let mut cases = Vec::new();
    // A body the filter reads: decode gets it without the client's kv_transfer_params.
    cases.push(case("plain JSON", async move {
        let id = unique_id("strip-plain");
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":3,"kv_transfer_params":{CLIENT_KV}}}"#
        );
        let reply = post_json("stripping", "/v1/messages", &id, body).await;
        assert_envoy_alive();
        assert_eq!(decoded(&id).len(), 1, "{} {}", reply.status, reply.body);
        assert_decode_never_got_client_kv(&id);
        assert!(prefilled(&id).is_empty());
    }));
    let text = |extra: &str| {
        format!(
            r#"{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":3{extra},"kv_transfer_params":{CLIENT_KV}}}"#
        )
    };
    // Python's json.loads (vLLM's parser) reads NaN and the infinities, and so does the
    // filter: their kv_transfer_params are found and removed.
    for (name, extra) in [
        ("NaN", r#","x":NaN"#),
        ("-Infinity", r#","x":[-Infinity,Infinity]"#),
    ] {
        let body = text(extra);
        cases.push(case(name, async move {
            let id = unique_id("strip-nan");
            let reply = post_json("stripping", "/v1/messages", &id, body).await;
            assert_envoy_alive();
            assert_eq!(
                decoded(&id).len(),
                1,
                "{name}: {} {}",
                reply.status,
                reply.body
            );
            assert_decode_never_got_client_kv(&id);
            assert!(
                String::from_utf8_lossy(&decoded(&id)[0].body).contains(&extra[1..]),
                "{name}: the rest of the body as sent"
            );
        }));
    }
    // Bodies Python's json.loads reads as an object carrying the client's
    // kv_transfer_params, but which are not JSON to the filter: refused, never passed on.
    let utf16: Vec<u8> = text("").encode_utf16().flat_map(u16::to_le_bytes).collect();
    {
        let (name, body) = ("UTF-16", utf16);
        cases.push(case(name, async move {
            let id = unique_id("strip-unreadable");
            let reply = post_json("stripping", "/v1/messages", &id, body).await;
            assert_envoy_alive();
            let decodes = decoded(&id);
            assert!(
                decodes.is_empty(),
                "{name}: decode got {:?}",
                decodes
                    .iter()
                    .map(|r| preview(&String::from_utf8_lossy(&r.body)))
                    .collect::<Vec<_>>()
            );
            assert_filter_error(&reply, 400, name);
            assert_healthy();
        }));
    }
    run_cases_then_still_serves(cases, "stripping").await;
}

// ----------------------------------------------------------------------------------------
// 12. What decode is told the body is (vLLM takes exactly `application/json`)

#[tokio::test]
async fn decode_gets_application_json_whatever_json_type_the_client_named() {
    let mut cases = Vec::new();
    for content_type in [
        None,
        Some("application/vnd.api+json"),
        Some("application/json ; charset=utf-8"),
    ] {
        cases.push(case(format!("{content_type:?}"), async move {
            let id = unique_id("decode-content-type");
            let prompt = format!("{id} labelled");
            let body = json!({"prompt": prompt, "max_tokens": 3}).to_string();
            let mut request = Request::post("default", "/v1/completions")
                .id(&id)
                .without_content_type();
            if let Some(value) = content_type {
                request = request.header("content-type", value);
            }
            let reply = send(request.body(body)).await;
            assert_eq!(reply.status, 200, "{}", reply.body);
            let decode = assert_decode_got_prefills_kv(&id, &prompt);
            let labels: Vec<&str> = decode
                .headers
                .iter()
                .filter(|(name, _)| name == "content-type")
                .map(|(_, value)| value.as_str())
                .collect();
            assert_eq!(
                labels,
                ["application/json"],
                "{content_type:?}: decode would refuse the body prefill served"
            );
            assert_healthy();
        }));
    }
    run_cases_then_still_serves(cases, "default").await;
}

/// Envoy's count of `cluster`'s decode streams now open.
fn decode_streams_open(cluster: &str) -> u64 {
    let name = format!("cluster.{cluster}.upstream_rq_active");
    common::envoy_stats(&name)
        .into_iter()
        .find(|(stat, _)| *stat == name)
        .map_or(0, |(_, value)| value)
}

/// Clients that send the headers and part of a body, then nothing, on orchestrated and
/// stripped paths: with the headers held (as shipped) they take no decode stream, so they cannot fill decode's pool or its
/// circuit breaker; passed at once (as under Istio) each holds one while it waits.
#[tokio::test]
async fn uploads_that_never_finish_take_no_decode_stream_when_headers_are_held() {
    use tokio::io::AsyncWriteExt;
    const CLIENTS: u64 = 20;
    for (listener, cluster, held) in [
        ("held", "decode_held", true),
        ("passed", "decode_passed", false),
    ] {
        let mut stalled = Vec::new();
        for n in 0..CLIENTS {
            // Orchestrated and stripped paths alike (a stripped path's body is held whole).
            let path = if n % 2 == 0 {
                "/v1/completions"
            } else {
                "/v1/messages"
            };
            let mut stream =
                tokio::net::TcpStream::connect(("127.0.0.1", harness().port(listener)))
                    .await
                    .expect("connect");
            let head = format!(
                "POST {path} HTTP/1.1\r\nhost: x\r\n\
                 content-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"prompt\":"
            );
            stream.write_all(head.as_bytes()).await.expect("send");
            stalled.push(stream);
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut open = decode_streams_open(cluster);
        while !held && open < CLIENTS && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            open = decode_streams_open(cluster);
        }
        if held {
            tokio::time::sleep(Duration::from_millis(500)).await;
            open = decode_streams_open(cluster);
            assert_eq!(
                open, 0,
                "{listener}: decode streams opened for unfinished uploads"
            );
        } else {
            assert_eq!(open, CLIENTS, "{listener}: the contrast the test relies on");
        }
        assert_still_serves(listener).await;
        drop(stalled);
    }
}

/// Envoy honours `x-envoy-retry-on` and `x-envoy-max-retries` from requests it takes for
/// internal ones. A client that got its decode request retried would have decode pull
/// prefill's KV again after the first decode had it, and multiply decode's work: whatever
/// address it claims, decode gets the request once.
#[tokio::test]
async fn a_clients_envoy_retry_headers_never_send_decode_the_request_twice() {
    for forwarded_for in [None, Some("10.0.0.1"), Some("127.0.0.1")] {
        let id = unique_id("client-retry");
        let mut request = Request::post("default", "/v1/completions")
            .id(&id)
            .header(
                "x-envoy-retry-on",
                "5xx,reset,connect-failure,retriable-4xx",
            )
            .header("x-envoy-max-retries", "5")
            .header("x-envoy-retriable-status-codes", "500")
            .body(
                json!({"model": "m", "prompt": "retry me mock:decode_status=500", "max_tokens": 4})
                    .to_string(),
            );
        if let Some(address) = forwarded_for {
            request = request.header("x-forwarded-for", address);
        }
        let reply = request.send().await;
        assert_eq!(reply.status, 500, "{forwarded_for:?}: {}", reply.body);
        assert_eq!(
            decoded(&id).len(),
            1,
            "{forwarded_for:?}: decode got it again"
        );
        assert_eq!(prefilled(&id).len(), 1, "{forwarded_for:?}");
    }
    assert_still_serves("default").await;
}

/// The tests that fill `small_vm_budget`'s VMs, one at a time.
static SMALL_VM_BUDGET: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Prompt logprobs wait in the VM until decode answers, and whole bodies while prefill
/// works: Envoy's heap monitor cannot see that memory, and an allocation the VM cannot make
/// kills it for every request on its worker (an audit did so with 180 streams of 280 KB
/// asking for 8 MB of prompt logprobs each). Past the VM's budget a request is refused
/// with a 503 and its KV released; the VM lives, and serves again once the others finish.
#[tokio::test]
async fn requests_that_hold_memory_in_the_vm_are_refused_past_its_budget() {
    let _alone = SMALL_VM_BUDGET.lock().await;
    const CLIENTS: usize = 6;
    let words: Vec<String> = (0..14_000).map(|i| format!("w{i}")).collect();
    let prompt = format!("{} mock:decode_delay_ms=3000", words.join(" "));
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 3, "prompt_logprobs": 1});
    let ids: Vec<String> = (0..CLIENTS).map(|_| unique_id("vm-budget")).collect();
    // Every worker has its own VM and budget: the requests share one HTTP/2 connection, so
    // one worker and one budget. With a connection each, Envoy's workers took them as the
    // kernel spread the connections, and each worker that got any served one (2 of 6, or 1
    // of 6 when all six landed on one worker: one CI run).
    let sender = h2_connect(harness().port("small_vm_budget"))
        .await
        .expect("h2c connection");
    let replies = futures_util::future::join_all(ids.iter().map(|id| {
        let request = H2Request {
            method: "POST".to_owned(),
            path: "/v1/completions".to_owned(),
            headers: vec![
                ("content-type".to_owned(), "application/json".to_owned()),
                ("x-request-id".to_owned(), id.clone()),
            ],
            data: vec![body.to_string().into_bytes()],
            trailers: vec![],
            reset_after: None,
        };
        h2_exchange(&sender, request, Duration::from_secs(60))
    }))
    .await;
    let mut served = 0;
    for (id, outcome) in ids.iter().zip(replies) {
        let reply = outcome.response(id);
        match reply.status {
            200 => {
                served += 1;
                let logprobs = &reply.json()["choices"][0]["prompt_logprobs"];
                assert!(
                    logprobs.as_array().is_some_and(|l| l.len() > 10_000),
                    "{id}"
                );
            }
            503 => {
                reply.assert_json_error(503, id);
                assert!(!reply.came_from_upstream(), "{id}");
                assert!(
                    reply.text().contains("max_vm_held_bytes"),
                    "{}",
                    reply.text()
                );
                assert!(decoded(id)
                    .iter()
                    .all(|r| r.header("x-pd-kv-release") == Some("1")));
            }
            status => panic!("{id}: {status} {}", preview(&reply.text())),
        }
    }
    // The budget (2 MiB, large holdings up to three quarters of it) holds one request's
    // prompt logprobs (about 865 KB) beside the bodies still waiting for prefill, not two:
    // one served while its decode takes 3 s, the other five refused.
    eprintln!("vm budget: {served} of {CLIENTS} served");
    assert_eq!(served, 1, "{served} of {CLIENTS} served");
    assert_healthy();
    let again = Request::post("small_vm_budget", "/v1/completions")
        .id(&unique_id("vm-budget-after"))
        .body(
            json!({"model": "m", "prompt": words[..50].join(" "), "prompt_logprobs": 1})
                .to_string(),
        )
        .send()
        .await;
    assert_eq!(again.status, 200, "{}", preview(&again.body));
}

/// One client that fills the VM's budget with prompt logprobs its decodes keep waiting
/// (a review held 69 such requests on one HTTP/2 connection) must not get every other
/// request on the worker refused: large holdings (above 16 KiB) stop at three quarters of
/// the budget, and an ordinary request keeps a few hundred bytes.
#[tokio::test]
async fn prompt_logprobs_leave_room_in_the_vm_for_other_requests() {
    let _alone = SMALL_VM_BUDGET.lock().await;
    let words: Vec<String> = (0..14_000).map(|i| format!("w{i}")).collect();
    let holder = |count: usize| {
        let prompt = format!("{} mock:decode_delay_ms=3000", words[..count].join(" "));
        json!({"model": "m", "prompt": prompt, "max_tokens": 3, "prompt_logprobs": 1})
    };
    // Large, then smaller and smaller (the smallest 21 KB), so that together they would
    // fill the budget to within 21 KB.
    let holders: Vec<(String, Value)> = [(4, 14_000), (10, 2_000), (150, 350)]
        .into_iter()
        .flat_map(|(count, words)| std::iter::repeat_n(words, count))
        .map(|words| (unique_id("vm-holder"), holder(words)))
        .collect();
    let holding = futures_util::future::join_all(holders.iter().map(|(id, body)| {
        Request::post("small_vm_budget", "/v1/completions")
            .id(id)
            .body(body.to_string())
            .send()
    }));
    let others = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        // Small holdings (prompt logprobs of 200 tokens, 12 KB): 24 of them fit in the
        // quarter the large ones leave, wherever they land; in what was left of a budget the
        // large ones could fill, a few did.
        let small = json!({"model": "m", "prompt": format!("{} mock:decode_delay_ms=1000",
            words[..200].join(" ")), "max_tokens": 3, "prompt_logprobs": 1});
        let ids: Vec<String> = (0..24).map(|_| unique_id("vm-other")).collect();
        let replies = futures_util::future::join_all(ids.iter().map(|id| {
            Request::post("small_vm_budget", "/v1/completions")
                .id(id)
                .body(small.to_string())
                .send()
        }))
        .await;
        (ids, replies)
    };
    let (held, (ids, replies)) = tokio::join!(holding, others);
    // The filter's refusals for the budget; an Envoy 503 (decode unreachable) is not one.
    let refused = held
        .iter()
        .filter(|reply| reply.status == 503 && reply.body.contains("max_vm_held_bytes"))
        .count();
    assert!(refused > 0, "the holders did not reach the budget");
    for (id, reply) in ids.iter().zip(&replies) {
        assert_eq!(reply.status, 200, "{id}: {}", preview(&reply.body));
    }
    assert_healthy();
}

/// What an orchestrated request keeps for its prefill call (the headers `forward_headers`
/// names, `authorization` by default: up to Envoy's 60 KiB of headers) is kept in the VM from its headers on, while the body uploads. Counted only once
/// the body was whole, it let a client's uploads that never end hold the VM past its budget
/// (an audit held 232 MB in one worker's VM with 4,000 such HTTP/2 streams, 58 KB each,
/// never given back) where Envoy's heap monitor cannot see it. Counted from the headers on,
/// such requests are refused past the budget like any other holding.
#[tokio::test]
async fn unfinished_uploads_count_what_they_keep_for_prefill_against_the_vm_budget() {
    let _alone = SMALL_VM_BUDGET.lock().await;
    // 60 uploads of 40 KB of headers each: past the budget (2 MiB, large holdings up to
    // three quarters of it), on one HTTP/2 connection, so one worker and one VM.
    const STALLED: usize = 60;
    let credential = format!("Bearer {}", "k".repeat(40_000));
    let sender = h2_connect(harness().port("small_vm_budget"))
        .await
        .expect("h2c connection");
    let mut stalled = Vec::new();
    for _ in 0..STALLED {
        let request = http::Request::builder()
            .method("POST")
            .uri("http://localhost/v1/completions")
            .header("content-type", "application/json")
            .header("x-request-id", unique_id("vm-stalled"))
            .header("authorization", credential.as_str())
            .body(())
            .expect("request");
        let mut ready = sender.clone().ready().await.expect("h2 ready");
        let (response, mut stream) = ready.send_request(request, false).expect("send_request");
        stream
            .send_data(
                bytes::Bytes::from_static(b"{\"model\":\"m\",\"prompt\":"),
                false,
            )
            .expect("send_data");
        stalled.push((response, stream));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let body = json!({"model": "m", "prompt": "after the stalled uploads", "max_tokens": 3});
    let post = |id: String, credential: Option<String>| {
        let mut headers = vec![
            ("content-type".to_owned(), "application/json".to_owned()),
            ("x-request-id".to_owned(), id),
        ];
        headers.extend(credential.map(|value| ("authorization".to_owned(), value)));
        let request = H2Request {
            method: "POST".to_owned(),
            path: "/v1/completions".to_owned(),
            headers,
            data: vec![body.to_string().into_bytes()],
            trailers: vec![],
            reset_after: None,
        };
        h2_exchange(&sender, request, Duration::from_secs(30))
    };
    // Another large holding: refused, as the budget is full.
    let id = unique_id("vm-stalled-large");
    let reply = post(id.clone(), Some(credential.clone()))
        .await
        .response(&id);
    assert_eq!(reply.status, 503, "{id}: {}", preview(&reply.text()));
    reply.assert_json_error(503, &id);
    assert!(
        reply.text().contains("max_vm_held_bytes"),
        "{}",
        reply.text()
    );
    assert!(prefilled(&id).is_empty() && decoded(&id).is_empty(), "{id}");
    // An ordinary request still fits in the quarter large holdings leave.
    let id = unique_id("vm-stalled-small");
    let reply = post(id.clone(), None).await.response(&id);
    assert_eq!(reply.status, 200, "{id}: {}", preview(&reply.text()));
    // The uploads reset: what they held is given back.
    drop(stalled);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let id = unique_id("vm-stalled-after");
    let reply = post(id.clone(), Some(credential.clone()))
        .await
        .response(&id);
    assert_eq!(reply.status, 200, "{id}: {}", preview(&reply.text()));
    assert_healthy();
}

/// Completions put prefill's prompt logprobs into each of decode's choices. However the
/// client spells `n`, as pydantic reads it, the copies are counted before decode runs: a
/// spelling the filter once read as one (`"+40"`) let the answer grow to n copies in the VM,
/// and an `n` in the thousands made an allocation the VM could not make, killing it.
#[tokio::test]
async fn every_spelling_of_n_counts_the_prompt_logprobs_copies() {
    let _alone = SMALL_VM_BUDGET.lock().await;
    let words: Vec<String> = (0..4_000).map(|i| format!("w{i}")).collect();
    for n in [
        r#""+40""#,
        r#""040""#,
        r#""4_0""#,
        r#"" 40 ""#,
        r#""40.0""#,
        "40.0",
    ] {
        let id = unique_id("n-spelling");
        let body = format!(
            r#"{{"model":"m","prompt":"{}","max_tokens":3,"prompt_logprobs":1,"n":{n}}}"#,
            words.join(" ")
        );
        let reply = Request::post("small_vm_budget", "/v1/completions")
            .id(&id)
            .body(body)
            .send()
            .await;
        assert_filter_error(&reply, 400, &id);
        assert!(
            reply.body.contains("prompt logprobs"),
            "{n}: {}",
            reply.body
        );
        assert!(
            decoded(&id)
                .iter()
                .all(|r| r.header("x-pd-kv-release") == Some("1")),
            "{n}: decode served it"
        );
    }
    assert_healthy();
    assert_still_serves("small_vm_budget").await;
}

// ----------------------------------------------------------------------------------------
// 13. A refused request whose body is still arriving

/// A client that writes its whole body before it reads (httpx's async client, so the async
/// OpenAI and Anthropic SDKs) sees the filter's refusal only if the answer waits for the end
/// of the upload: answered early, Envoy closes the HTTP/1.1 connection under the upload, and
/// such a client sees a broken connection. Each upload here stops for a while before its
/// last bytes: the answer must come after them. Up to four times the body limit (8 MiB on
/// `default`) is read and dropped; a larger declared body is answered at once.
#[tokio::test]
async fn a_refused_upload_is_read_to_its_end_before_the_answer() {
    use raw_http::{exchange, http1_request, Outcome, Writing};
    use std::time::Instant;
    const MIB: usize = 1024 * 1024;
    let port = harness().port("default");
    let pause = Duration::from_millis(700);
    let head = |content_type: &str, framing: &str| {
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: {content_type}\r\n\
             {framing}\r\n\r\n"
        )
        .into_bytes()
    };
    let mut chunked = head("application/json", "transfer-encoding: chunked");
    for _ in 0..10 {
        chunked.extend_from_slice(format!("{MIB:x}\r\n").as_bytes());
        chunked.extend_from_slice(&vec![b' '; MIB]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let cases = [
        (
            "wrong content-type",
            http1_request(
                "POST",
                "/v1/completions",
                &[("content-type", "text/plain")],
                &[b' '; 2 * MIB],
            ),
            400,
        ),
        (
            "declared over the limit",
            http1_request(
                "POST",
                "/v1/completions",
                &[("content-type", "application/json")],
                &vec![b' '; 10 * MIB],
            ),
            413,
        ),
        ("grown over the limit", chunked, 413),
    ];
    for (case, request, status) in cases {
        // All but the last 5 bytes, then the pause: past the limit where the body outgrows it.
        let writing = Writing {
            pieces: vec![request.len() - 5],
            pause,
            shutdown_after: false,
        };
        let started = Instant::now();
        let outcome = exchange(port, request, "POST", writing, Duration::from_secs(30)).await;
        let elapsed = started.elapsed();
        let Outcome::Response(response) = outcome else {
            panic!("{case}: {}", outcome.describe());
        };
        response.assert_json_error(status, case);
        assert!(
            elapsed >= pause,
            "{case}: answered {elapsed:?} in, before the upload ended"
        );
    }

    // Declared larger than four times the limit: answered without waiting for any of it.
    let mut request = head("application/json", &format!("content-length: {}", 40 * MIB));
    request.extend_from_slice(&[b' '; MIB]);
    let writing = Writing::default();
    let started = Instant::now();
    let outcome = exchange(port, request, "POST", writing, Duration::from_secs(30)).await;
    let Outcome::Response(response) = outcome else {
        panic!("40 MiB: {}", outcome.describe());
    };
    response.assert_json_error(413, "40 MiB");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_healthy();
}

// §14. The request id, which goes into every log line about the request.

/// A client's `x-request-id` with a line separator would write a line of its own into the
/// filter's log, and into both workers': it is replaced on both legs and in the answer.
#[tokio::test]
async fn a_request_id_that_could_forge_log_lines_is_replaced_on_both_legs() {
    let h = harness();
    let forged = format!("{}\u{2028}[critical][main] forged line", unique_id("forge"));
    let reply = Request::post("default", "/v1/completions")
        .header("x-request-id", forged.clone())
        .body(r#"{"prompt":"an id of my own mock:prefill_status=500","max_tokens":2}"#)
        .send()
        .await;
    // Prefill's 500 makes the filter log a line about the request.
    assert_eq!(reply.status, 502, "{}", reply.body);
    let id = reply
        .header("x-request-id")
        .expect("the answer's request id");
    assert_eq!(id.len(), 36, "{id:?}");
    assert_eq!(h.prefill_requests(id).len(), 1, "prefill, by the new id");
    assert!(!h.envoy_log_text().contains("forged line"));
    assert!(h.envoy_log_text().contains(id));
}

/// vLLM quotes a client's own words in its error messages (a model name, a tool name), and
/// the filter's line about a refused request quotes prefill's message: a line separator
/// there would let a client write lines of its own into the log, such as a failure under
/// another client's request id. Every line that names the other id is the client's own.
#[tokio::test]
async fn an_error_message_quoting_the_client_cannot_forge_log_lines() {
    let h = harness();
    let id = unique_id("forge-quoted");
    let victim = unique_id("forge-victim");
    let forged = format!(
        "x\n[2026-01-01 00:00:00.000][1][warning][wasm] wasm log pd-filter pd-filter: [{victim}] \
         prefill failure (status): answering 500: forged\r\u{2028}[{victim}] forged again"
    );
    let body = json!({
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "real", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": forged},
    });
    let reply = Request::post("default", "/v1/messages")
        .id(&id)
        .body(body.to_string())
        .send()
        .await;
    // Prefill refuses a tool choice no tool has, quoting its name; the filter logs that.
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert!(reply.body.contains("forged again"), "{}", reply.body);
    let log = h.envoy_log_text();
    assert!(log.contains(&id), "the refusal is logged");
    for line in log.lines().filter(|line| line.contains(&victim)) {
        assert!(line.contains(&id), "a forged line: {line}");
    }
    assert!(!log.contains('\u{2028}'));
}

/// Istio's gateway lets WebSocket upgrades through on every route, and its `WasmPlugin`
/// passes request headers on at once: a `POST` to a generation path asking for an upgrade
/// reached decode as headers alone (decode's 101 to the client), its body held for a
/// prefill that never started. The filter now refuses an upgrade on every path it
/// orchestrates or strips, before anything goes on. (The test listeners that pass headers
/// on at once allow WebSocket upgrades, as Istio does.)
#[tokio::test]
async fn a_protocol_upgrade_on_a_generation_path_is_400_before_decode() {
    let mut cases = Vec::new();
    for (listener, path) in [
        ("passed", "/v1/completions"),
        ("passed", "/v1/chat/completions"),
        ("stripping", "/v1/completions"),
    ] {
        cases.push(case(format!("{listener} {path}"), async move {
            let id = unique_id("upgrade");
            let body = marked_body(&format!("{id} upgrade"));
            let upgrade = [
                ("upgrade", "websocket"),
                ("connection", "upgrade"),
                ("sec-websocket-version", "13"),
                ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
            ];
            let port = harness().port(listener);
            let outcome = post_raw(port, path, &id, &upgrade, body.as_bytes()).await;
            assert_refused_before_decode(&id, path, || outcome.response(path));
            assert!(prefilled(&id).is_empty(), "{path}: prefill was called");
        }));
    }
    run_cases_then_still_serves(cases, "passed").await;
}

/// A `content-encoding` whose value is not UTF-8 (HTTP/1.1 carries any byte above 0x7f) was
/// read as no header at all: `content-encoding: gzip\xff` passed the filter's check on what
/// the client declared, and decode got the header as the client sent it. Such a coding is
/// refused like any other the filter does not take, before prefill.
#[tokio::test]
async fn a_content_coding_that_is_not_utf8_is_400_before_prefill() {
    use raw_http::{exchange, Writing};
    let mut cases = Vec::new();
    for (name, value) in [
        ("content-encoding", &b"gzip\xff"[..]),
        ("content-encoding", b"\xff"),
    ] {
        cases.push(case(format!("{name}: {value:?}"), async move {
            let id = unique_id("non-utf8-header");
            let body = marked_body(&format!("{id} odd header"));
            let mut request = format!(
                "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\nx-request-id: {id}\r\n"
            )
            .into_bytes();
            request.extend_from_slice(b"content-type: application/json\r\n");
            request.extend_from_slice(name.as_bytes());
            request.extend_from_slice(b": ");
            request.extend_from_slice(value);
            request.extend_from_slice(
                format!("\r\ncontent-length: {}\r\n\r\n{body}", body.len()).as_bytes(),
            );
            let port = harness().port("default");
            let outcome = exchange(
                port,
                request,
                "POST",
                Writing::default(),
                Duration::from_secs(30),
            )
            .await;
            let context = format!("{name}: {value:?}");
            assert_refused_before_decode(&id, &context, || outcome.response(&context));
            assert!(prefilled(&id).is_empty(), "{context}: prefill was called");
        }));
    }
    run_cases_then_still_serves(cases, "default").await;
}
