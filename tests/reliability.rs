//! Faults on either leg, client disconnects and bad client input, through a real Envoy running
//! the built filter: what the client gets, and that decode is never called with a body it
//! cannot use. Each test ends with a normal request that must be served (the filter's VM is
//! never lost) and checks that the Envoy log shows no panic, wasm trap or failed proxy-wasm
//! callback, and that no VM was reloaded.

mod common;
#[path = "common/raw_http.rs"]
mod raw_http;

use std::time::{Duration, Instant};

use common::{
    answer_text, assert_error_without_decode, assert_filter_healthy, assert_legs,
    assert_prefill_got, assert_recomputed, assert_refused, assert_served, expected_decode_text,
    harness, members_of, unique_id, Request,
};
use raw_http::{h2_connect, h2_exchange, H2Outcome, H2Request};
use serde_json::json;

const COMPLETIONS: &str = "/v1/completions";

/// A normal request on `listener` that must be served with the prefill's KV, with its own
/// answer; then the filter must still be healthy.
async fn assert_still_serves(listener: &str) {
    let id = unique_id("after");
    let prompt = format!("{id} must still be served");
    let body = json!({"prompt": prompt, "max_tokens": 6}).to_string();
    let (reply, _) = assert_served(listener, COMPLETIONS, &id, &body).await;
    assert_eq!(answer_text(&reply.body).0, expected_decode_text(&prompt, 6));
    assert_filter_healthy();
}

/// After its prefill failed, the filter on `listener` still answers by itself: its own 400
/// for `bad_body`, and a pass-through GET; and the default listener still serves.
async fn assert_listener_still_answers(listener: &str, bad_body: &str) {
    let id = unique_id("bad-after-failures");
    assert_refused(
        listener,
        COMPLETIONS,
        &id,
        bad_body,
        400,
        "not a JSON object",
    )
    .await;
    let reply = Request::get(listener, "/v1/models").send().await;
    assert_eq!(reply.status, 200, "{listener}: {}", reply.body);
    assert_still_serves("default").await;
}

fn completion(prompt: &str) -> String {
    json!({"prompt": prompt, "max_tokens": 5}).to_string()
}

// ----------------------------------------------------------------------------------------
// Prefill faults

#[tokio::test]
async fn prefill_error_statuses_map_to_the_documented_client_statuses() {
    for (sent, expected, text) in [
        // A prefill 4xx reaches the client as vLLM wrote it (tests/one_vllm.rs).
        (400, 400, "mock prefill failure 400"),
        (404, 404, "mock prefill failure 404"),
        (429, 429, "mock prefill failure 429"),
        (500, 502, "prefill failed (500): mock prefill failure 500"),
        (502, 502, "prefill failed (502)"),
        (503, 503, "prefill is unavailable (503)"),
        (504, 504, "prefill timed out (504)"),
    ] {
        let id = unique_id("prefill-status");
        let body = completion(&format!("x mock:prefill_status={sent}"));
        let reply = assert_refused("default", COMPLETIONS, &id, body, expected, text).await;
        let message = reply.json()["error"]["message"].clone();
        assert!(message.as_str().unwrap().starts_with(text), "{message}");
        // A 503 is retried once (prefill_retries defaults to 1); nothing else is.
        let attempts = if sent == 503 { 2 } else { 1 };
        assert_eq!(harness().prefill_requests(&id).len(), attempts, "{sent}");
    }
    assert_still_serves("default").await;
}

#[tokio::test]
async fn a_slow_prefill_within_the_timeout_is_served() {
    // The strict listener gives prefill 1.5 s.
    let id = unique_id("prefill-slow");
    let prompt = "slowword mock:prefill_delay_ms=800";
    let started = Instant::now();
    let body = completion(prompt);
    let (reply, _) = assert_served("strict", COMPLETIONS, &id, &body).await;
    assert!(started.elapsed() >= Duration::from_millis(800));
    assert_eq!(answer_text(&reply.body).0, expected_decode_text(prompt, 5));
    assert_still_serves("strict").await;
}

/// Sends `prompt` on `strict` (prefill timeout 1.5 s): a 504 whose message has `message`,
/// answered at the timeout (before `latest`), with decode never called.
async fn assert_prefill_timed_out(id: &str, prompt: &str, message: &str, latest: Duration) {
    let started = Instant::now();
    let reply = Request::post("strict", COMPLETIONS)
        .id(id)
        .body(completion(prompt))
        .send()
        .await;
    let elapsed = started.elapsed();
    assert_error_without_decode(&reply, id, 504, message);
    assert!(
        elapsed >= Duration::from_millis(1400) && elapsed < latest,
        "answered after {elapsed:?}, the timeout is 1.5 s"
    );
}

#[tokio::test]
async fn a_prefill_hanging_past_the_timeout_is_504_and_its_late_answer_never_reaches_decode() {
    let h = harness();
    let id = unique_id("prefill-hang");
    let started = Instant::now();
    let prompt = "x mock:prefill_delay_ms=3000";
    assert_prefill_timed_out(
        &id,
        prompt,
        "prefill timed out",
        Duration::from_millis(2900),
    )
    .await;
    // The filter serves others while the abandoned prefill still sleeps.
    assert_still_serves("strict").await;
    // Once the mock has answered the abandoned callout, decode still has nothing.
    tokio::time::sleep(Duration::from_millis(3400).saturating_sub(started.elapsed())).await;
    h.only_prefill(&id);
    assert!(h.decode_requests(&id).is_empty());
    assert_still_serves("strict").await;
}

/// Envoy resets, rather than answers 504, a timed-out call whose answer had begun: the
/// client still gets the timeout, not a reset.
#[tokio::test]
async fn a_prefill_stalling_mid_answer_past_the_timeout_is_504() {
    let id = unique_id("prefill-stall");
    let prompt = "x mock:prefill_stall_mid_answer_ms=2500";
    let message = "within prefill_timeout_ms (1500 ms)";
    assert_prefill_timed_out(&id, prompt, message, Duration::from_millis(2400)).await;
    assert_still_serves("strict").await;
}

#[tokio::test]
async fn a_prefill_reset_before_answering_is_503() {
    let h = harness();
    // As shipped (headers held) and as under Istio (headers passed): the retry reads the
    // body again from Envoy's buffer and sends prefill the same one-token request.
    for listener in ["default", "passed"] {
        let id = unique_id("prefill-reset");
        let body = completion("x mock:prefill_reset");
        assert_refused(listener, COMPLETIONS, &id, &body, 503, "reset").await;
        let attempts = h.prefill_requests(&id);
        assert_eq!(attempts.len(), 2, "{listener}: one attempt and one retry");
        for attempt in &attempts {
            assert_prefill_got(COMPLETIONS, &body, attempt);
        }
        assert_still_serves(listener).await;
    }
}

#[tokio::test]
async fn a_prefill_reset_mid_answer_is_502_and_not_sent_again() {
    // vLLM starts a non-streamed answer once the prompt is computed: another attempt would
    // compute it again beside the KV the first one holds.
    let h = harness();
    for listener in ["default", "strict"] {
        let id = unique_id("prefill-reset-mid");
        let body = completion("x mock:prefill_reset_mid_answer");
        assert_refused(listener, COMPLETIONS, &id, body, 502, "reset").await;
        h.only_prefill(&id);
        assert_still_serves(listener).await;
    }
}

/// A 2xx prefill answer without usable `kv_transfer_params`: decode recomputes from the
/// client's exact body on the default listener, 502 on the strict one.
async fn assert_unusable_prefill_answer(directive: &str, strict_text: &str) {
    let h = harness();
    let id = unique_id("unusable-kv");
    let prompt = format!("recompute {directive}");
    let original = completion(&prompt);
    let reply = assert_recomputed("default", COMPLETIONS, &id, &original).await;
    assert_eq!(answer_text(&reply.body).0, expected_decode_text(&prompt, 5));
    assert_prefill_got(COMPLETIONS, &original, &h.only_prefill(&id));
    assert_still_serves("default").await;

    let id = unique_id("unusable-kv-strict");
    assert_refused("strict", COMPLETIONS, &id, original, 502, strict_text).await;
    assert_still_serves("strict").await;
}

#[tokio::test]
async fn a_non_json_prefill_answer_is_recomputed_or_502() {
    assert_unusable_prefill_answer("mock:prefill_non_json", "not a JSON object").await;
}

#[tokio::test]
async fn a_prefill_answer_without_kv_transfer_params_is_recomputed_or_502() {
    assert_unusable_prefill_answer("mock:prefill_no_kv", "no kv_transfer_params").await;
    assert_unusable_prefill_answer("mock:prefill_null_kv", "kv_transfer_params null").await;
}

#[tokio::test]
async fn kv_transfer_params_that_are_not_an_object_are_recomputed_or_502() {
    assert_unusable_prefill_answer("mock:prefill_kv_not_object", "not an object").await;
}

#[tokio::test]
async fn a_huge_prefill_answer_is_handled() {
    let h = harness();
    let id = unique_id("prefill-huge");
    // A 5 MB padding field in the prefill answer, next to the kv_transfer_params.
    let prompt = "hugeanswer mock:prefill_huge=5000000";
    let body = completion(prompt);
    let (reply, _) = assert_served("default", COMPLETIONS, &id, &body).await;
    assert_eq!(answer_text(&reply.body).0, expected_decode_text(prompt, 5));
    let decode = h.only_decode(&id);
    assert!(decode.body.len() < 10_000, "the padding reached decode");
    assert_still_serves("default").await;
}

#[tokio::test]
async fn an_unreachable_prefill_is_503_and_the_listener_keeps_working() {
    for _ in 0..3 {
        let id = unique_id("unreachable");
        assert_refused(
            "unreachable",
            COMPLETIONS,
            &id,
            completion("x"),
            503,
            "prefill is unavailable",
        )
        .await;
    }
    assert_listener_still_answers("unreachable", "nope").await;
}

#[tokio::test]
async fn a_prefill_that_answers_no_http_is_tried_again_then_503() {
    use std::sync::atomic::Ordering;
    let _serial = NOT_HTTP.lock().await;
    let before = common::NOT_HTTP_CONNECTIONS.load(Ordering::SeqCst);
    let id = unique_id("not-http");
    let reply = assert_refused(
        "not_http",
        COMPLETIONS,
        &id,
        completion("x"),
        503,
        "protocol error",
    )
    .await;
    assert_eq!(reply.header("retry-after"), Some("1"));
    assert_eq!(
        common::NOT_HTTP_CONNECTIONS.load(Ordering::SeqCst) - before,
        2,
        "one attempt more (prefill_retries: 1)"
    );
    assert_listener_still_answers("not_http", "nope").await;
}

/// Tests that count the attempts of the `not_http` listener's prefill.
static NOT_HTTP: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn an_unknown_prefill_cluster_is_503_naming_it_and_the_listener_keeps_working() {
    let h = harness();
    for (path, body) in [
        (COMPLETIONS, r#"{"prompt":"x"}"#),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
        ),
        ("/v1/responses", r#"{"input":"x"}"#),
    ] {
        let id = unique_id("unknown-cluster");
        assert_refused(
            "unknown_cluster",
            path,
            &id,
            body,
            503,
            "\"no_such_cluster\": Envoy has no such cluster",
        )
        .await;
        assert!(h.prefill_requests(&id).is_empty());
    }
    assert_listener_still_answers("unknown_cluster", "[]").await;
}

// ----------------------------------------------------------------------------------------
// Prefill refused at once: a cluster without endpoints

/// How a test client sends its body.
#[derive(Clone, Copy, Debug)]
enum Upload {
    /// In one piece, with a `content-length`.
    Whole,
    /// Chunked, in pieces of this many bytes, each after a pause: the filter gets them in
    /// several body callbacks, the last of which sends the prefill call.
    Trickled(usize),
    /// Over HTTP/2 in this many DATA frames, the last with END_STREAM. Unlike HTTP/1.1 (whose
    /// codec ends every body with an empty frame of its own), the last body callback holds
    /// the body's last bytes.
    H2(usize),
    /// Over HTTP/2 in three DATA frames, then trailers: the trailers' callback sends it.
    H2Trailers,
}

/// A completions or chat request for `prompt`.
fn request_for(path: &str, prompt: &str) -> serde_json::Value {
    if path == COMPLETIONS {
        json!({"prompt": prompt, "max_tokens": 3})
    } else {
        json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 3})
    }
}

/// What a client got: status, `x-mock-kv`, body; or what became of the exchange.
type Got = Result<(u16, Option<String>, String), String>;

/// POSTs `body` to `path` on `listener` with `x-request-id: id`, as `upload` says, giving
/// the exchange 10 s.
async fn post_as(listener: &str, path: &str, id: &str, body: &str, upload: Upload) -> Got {
    const PATIENCE: Duration = Duration::from_secs(10);
    let request = Request::post(listener, path).id(id).timeout(PATIENCE);
    let request = match upload {
        Upload::Whole => request.body(body),
        Upload::Trickled(size) => request.trickled(body, size, Duration::from_millis(30)),
        Upload::H2(_) | Upload::H2Trailers => {
            let (frames, trailers) = match upload {
                Upload::H2(frames) => (frames, vec![]),
                _ => (3, vec![("x-trailer".to_owned(), "end".to_owned())]),
            };
            let sender = h2_connect(harness().port(listener)).await?;
            let size = body.len().div_ceil(frames);
            let request = H2Request {
                method: "POST".to_owned(),
                path: path.to_owned(),
                headers: vec![
                    ("content-type".to_owned(), "application/json".to_owned()),
                    ("x-request-id".to_owned(), id.to_owned()),
                ],
                data: body.as_bytes().chunks(size).map(<[u8]>::to_vec).collect(),
                trailers,
                reset_after: None,
            };
            return match h2_exchange(&sender, request, PATIENCE).await {
                H2Outcome::Response(response) => {
                    let kv = response.header("x-mock-kv").map(str::to_owned);
                    Ok((response.status, kv, response.text()))
                }
                other => Err(format!("{other:?}")),
            };
        }
    };
    let reply = request.try_send().await?;
    let kv = reply.header("x-mock-kv").map(str::to_owned);
    Ok((reply.status, kv, reply.body))
}

/// Served by decode alone: 200 from a decode that recomputed the prompt, and decode got the
/// client's body once, whole, without any `kv_transfer_params` (the client's bytes as sent
/// when it had none).
fn check_recomputed(id: &str, client: &str, got: Got) -> Result<(), String> {
    let decoded = harness().decode_requests(id);
    let bodies: Vec<String> = decoded
        .iter()
        .map(|request| String::from_utf8_lossy(&request.body).into_owned())
        .collect();
    let seen = format!("client got {got:?}; decode got {bodies:?}");
    let (status, kv, _) = got.as_ref().map_err(|_| seen.clone())?;
    if *status != 200 || kv.as_deref() != Some("recomputed") || bodies.len() != 1 {
        return Err(seen);
    }
    let expected: Vec<(String, String)> = members_of(client.as_bytes())
        .unwrap_or_default()
        .into_iter()
        .filter(|(key, _)| key != "kv_transfer_params")
        .collect();
    let whole = if client.contains("kv_transfer_params") {
        members_of(&decoded[0].body) == Some(expected)
    } else {
        bodies[0] == client
    };
    if !whole {
        return Err(format!("decode did not get the client's body: {seen}"));
    }
    Ok(())
}

#[tokio::test]
async fn a_prefill_refused_at_once_falls_back_to_decode_with_the_whole_body() {
    // Envoy refuses a call to a cluster without endpoints at once: the fallback to decode is
    // decided inside the request's own body (or trailers) callback, not the root's. Resumed
    // there with the host's continue_stream, an HTTP/2 body in one DATA frame went to decode
    // as headers alone (content-length 0) with the headers held, and never with them passed
    // on (the client waited until its timeout).
    let h = harness();
    let before = h.counter("pd_filter_decode_only_fallbacks");
    let mut cases = 0;
    let mut failures = Vec::new();
    for listener in ["no_hosts_held", "no_hosts_passed"] {
        for (path, upload) in [
            (COMPLETIONS, Upload::Whole),
            ("/v1/chat/completions", Upload::Whole),
            (COMPLETIONS, Upload::Trickled(16)),
            ("/v1/chat/completions", Upload::Trickled(16)),
            (COMPLETIONS, Upload::H2(1)),
            ("/v1/chat/completions", Upload::H2(1)),
            (COMPLETIONS, Upload::H2(3)),
            ("/v1/chat/completions", Upload::H2(3)),
            (COMPLETIONS, Upload::H2Trailers),
        ] {
            for client_kv in [false, true] {
                let id = unique_id("no-hosts");
                let prompt = format!("{id} decode alone");
                let mut body = request_for(path, &prompt);
                if client_kv {
                    // The client's own, which the fallback drops.
                    body["kv_transfer_params"] = json!({"remote_host": "6.6.6.6"});
                }
                let body = body.to_string();
                let got = post_as(listener, path, &id, &body, upload).await;
                cases += 1;
                if let Err(error) = check_recomputed(&id, &body, got) {
                    failures.push(format!(
                        "{listener} {path} {upload:?} client kv {client_kv}: {error}"
                    ));
                }
                if !h.prefill_requests(&id).is_empty() {
                    failures.push(format!("{listener} {path}: prefill was called"));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {cases} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let fallbacks = h.counter("pd_filter_decode_only_fallbacks") - before;
    assert!(fallbacks >= cases as u64, "{fallbacks} fallbacks counted");
    assert_filter_healthy();
}

#[tokio::test]
async fn a_prefill_refused_at_once_is_503_under_the_default_policy() {
    let h = harness();
    for (path, upload) in [
        (COMPLETIONS, Upload::Whole),
        ("/v1/chat/completions", Upload::Whole),
        (COMPLETIONS, Upload::Trickled(16)),
        (COMPLETIONS, Upload::H2(1)),
        (COMPLETIONS, Upload::H2(3)),
        (COMPLETIONS, Upload::H2Trailers),
    ] {
        let id = unique_id("no-hosts-fail");
        let body = request_for(path, &format!("{id} refused")).to_string();
        let got = post_as("no_hosts_fail", path, &id, &body, upload).await;
        let Ok((status, _, text)) = got else {
            panic!("{path} {upload:?}: {got:?}");
        };
        assert_eq!(status, 503, "{path} {upload:?}: {text}");
        let error: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("\"prefill_no_hosts\""),
            "{path} {upload:?}: {text}"
        );
        assert_eq!(error["error"]["code"], 503, "{text}");
        assert!(
            h.decode_requests(&id).is_empty(),
            "{path} {upload:?}: decode was called"
        );
    }
    assert_listener_still_answers("no_hosts_fail", "[]").await;
}

// ----------------------------------------------------------------------------------------
// Decode faults

#[tokio::test]
async fn decode_error_statuses_reach_the_client_as_decode_sent_them() {
    for status in [400u16, 429, 500, 503] {
        let id = unique_id("decode-status");
        let body = completion(&format!("x mock:decode_status={status}"));
        let reply = Request::post("default", COMPLETIONS)
            .id(&id)
            .body(&body)
            .send()
            .await;
        assert_eq!(reply.status, status, "{}", reply.body);
        // Decode's own error body, not one from the filter.
        let kind = match status {
            400 => "BadRequestError",
            429 => "RateLimitError",
            _ => "InternalServerError",
        };
        assert_eq!(
            reply.json(),
            json!({"error": {"message": format!("mock decode failure {status}"),
                             "type": kind, "param": null, "code": status}})
        );
        assert_eq!(reply.header("content-type"), Some("application/json"));
        assert_legs(&id, COMPLETIONS, &body);
    }
    assert_still_serves("default").await;
}

#[tokio::test]
async fn a_decode_reset_mid_stream_truncates_the_answer_and_the_next_request_works() {
    for (path, stream) in [
        (COMPLETIONS, true),
        ("/v1/chat/completions", true),
        ("/v1/responses", true),
        (COMPLETIONS, false),
    ] {
        let id = unique_id("decode-reset");
        let prompt = "truncated mock:decode_reset_mid_stream";
        let body = match path {
            COMPLETIONS => json!({"prompt": prompt, "max_tokens": 20, "stream": stream}),
            "/v1/chat/completions" => json!({"messages": [{"role": "user", "content": prompt}],
                "max_tokens": 20, "stream": stream}),
            _ => json!({"input": prompt, "max_output_tokens": 20, "stream": stream}),
        };
        let body = body.to_string();
        match Request::post("default", path)
            .id(&id)
            .body(&body)
            .try_send()
            .await
        {
            // The usual outcome: the status line came, then the body broke off.
            Err(error) => assert!(error.contains("status 200"), "{path}: {error}"),
            // Otherwise the client must be able to tell the answer is incomplete.
            Ok(reply) => {
                let (text, _, ended) = answer_text(&reply.body);
                assert!(
                    reply.status != 200 || !ended || text.split_whitespace().count() < 20,
                    "{path}: a cut answer looks complete: {}",
                    reply.body
                );
            }
        }
        assert_legs(&id, path, &body);
        assert_still_serves("default").await;
    }
}

// ----------------------------------------------------------------------------------------
// The client goes away

#[tokio::test]
async fn a_client_disconnecting_during_prefill_leaves_the_filter_serving_and_decode_untouched() {
    let h = harness();
    let started = Instant::now();
    let ids: Vec<String> = (0..4).map(|_| unique_id("client-gone")).collect();
    let mut tasks = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let (listener, id) = (if i % 2 == 0 { "default" } else { "strict" }, id.clone());
        tasks.push(tokio::spawn(async move {
            // The client leaves while prefill is still running.
            Request::post(listener, COMPLETIONS)
                .id(&id)
                .body(completion("gone mock:prefill_delay_ms=2000"))
                .leave_after(Duration::from_millis(300))
                .await
        }));
    }
    for task in tasks {
        assert!(!task.await.unwrap(), "answered within 300 ms");
    }
    // Served while the abandoned prefills are still in flight.
    assert_still_serves("default").await;
    assert_still_serves("strict").await;
    // After the prefills have answered (2 s), none of them went on to decode (which got only
    // the release of their KV, tests/kv_release.rs).
    tokio::time::sleep(Duration::from_millis(2600).saturating_sub(started.elapsed())).await;
    for id in &ids {
        assert_eq!(h.prefill_requests(id).len(), 1, "{id}");
        assert!(
            h.decode_requests(id).is_empty(),
            "decode was called for {id}"
        );
    }
    assert_still_serves("default").await;
    assert_still_serves("strict").await;
}

#[tokio::test]
async fn a_client_disconnecting_mid_body_reaches_no_backend() {
    let h = harness();
    let id = unique_id("half-body");
    // 20 KB of an announced 100 KB, then the client gives up and closes the connection.
    let start = [&b"{\"prompt\":\"half"[..], &[b'x'; 20_000]].concat();
    let request = Request::post("default", COMPLETIONS)
        .id(&id)
        .unfinished_body(start, 100_000)
        .try_send();
    let gave_up = tokio::time::timeout(Duration::from_millis(100), request).await;
    assert!(gave_up.is_err(), "answered before the body was complete");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(h.prefill_requests(&id).is_empty());
    assert!(h.decode_requests(&id).is_empty());
    assert_still_serves("default").await;
}

// ----------------------------------------------------------------------------------------
// Bad input

#[tokio::test]
async fn bodies_that_are_empty_or_not_json_objects_are_400_and_reach_no_backend() {
    const NOT_OBJECT: &str = "not a JSON object";
    const NOT_UTF8: &str = "not valid UTF-8";
    let h = harness();
    let cases: &[(&str, &[u8], &str)] = &[
        ("empty", b"", "empty"),
        ("whitespace", b"  \n ", NOT_OBJECT),
        ("not-json", b"prompt=hello", NOT_OBJECT),
        ("truncated", b"{\"prompt\":\"x\"", NOT_OBJECT),
        ("array", b"[{\"prompt\":\"x\"}]", NOT_OBJECT),
        ("number", b"42", NOT_OBJECT),
        ("null", b"null", NOT_OBJECT),
        ("bad-utf8-value", b"{\"prompt\":\"caf\xe9\"}", NOT_UTF8),
        ("bad-utf8-key", b"{\"pr\xc3\x28mpt\":\"x\"}", NOT_UTF8),
        ("nul-bytes", b"\0\0\0\0", NOT_OBJECT),
        ("word", b"hello", NOT_OBJECT),
        ("numbers", b"[1,2,3]", NOT_OBJECT),
        ("string", b"\"prompt\"", NOT_OBJECT),
        ("bad-utf8-bytes", b"{\"prompt\":\"\xff\xfe\"}", NOT_UTF8),
        ("trailing", b"{\"prompt\":\"x\"} {}", NOT_OBJECT),
    ];
    for path in [COMPLETIONS, "/v1/chat/completions", "/v1/responses"] {
        for (label, body, reason) in cases {
            let id = unique_id(label);
            assert_refused("default", path, &id, body, 400, reason).await;
            assert!(
                h.prefill_requests(&id).is_empty(),
                "{label}: prefill called"
            );
        }
    }
    assert_still_serves("default").await;
}

#[tokio::test]
async fn deeply_nested_json_gets_a_clean_4xx() {
    let h = harness();
    let depth = 50_000;
    let cases = [
        (
            "deep-arrays",
            format!(
                "{{\"prompt\":{}\"x\"{},\"max_tokens\":5}}",
                "[".repeat(depth),
                "]".repeat(depth)
            ),
        ),
        (
            "deep-objects",
            format!(
                "{{\"prompt\":\"x\",\"extra\":{}1{}}}",
                "{\"a\":".repeat(depth),
                "}".repeat(depth)
            ),
        ),
        (
            "deep-unbalanced",
            format!("{{\"prompt\":{}", "[".repeat(depth)),
        ),
        (
            "deep-top-level",
            format!("{}{}", "[".repeat(depth), "]".repeat(depth)),
        ),
    ];
    for (label, body) in cases {
        let id = unique_id(label);
        let reply = Request::post("default", COMPLETIONS)
            .id(&id)
            .body(body)
            .send()
            .await;
        // From the filter, or prefill's own 400 passed on: an OpenAI error either way.
        assert!(
            (400..500).contains(&reply.status),
            "{label}: {} {}",
            reply.status,
            reply.body
        );
        assert_error_without_decode(&reply, &id, reply.status, "");
        assert!(h.prefill_requests(&id).len() <= 1);
        assert_still_serves("default").await;
    }
}

#[tokio::test]
async fn duplicates_of_a_capped_key_become_one_capped_member_on_prefill() {
    let id = unique_id("duplicates");
    let original = r#"{"max_tokens":50,"prompt":"dupword twice","n":2,"min_tokens":2,"stream":true,"stream_options":{"include_usage":true},"max_tokens":6,"n":3,"min_tokens":3,"stream":false,"stream_options":null,"kv_transfer_params":"a","kv_transfer_params":{"b":1}}"#;
    // Prefill: one max_tokens, one min_tokens and one n of 1, one stream false, one
    // kv_transfer_params asking for a remote decode, no stream_options: a client cannot
    // multiply what the filter adds. Decode: the client's bytes with one kv_transfer_params,
    // what prefill issued for "dupword twice".
    let (reply, _) = assert_served("default", COMPLETIONS, &id, original).await;
    // Decode sees the last of each duplicate, like any JSON parser: 3 choices of 6 tokens.
    let answer = reply.json();
    assert_eq!(answer["choices"].as_array().map(Vec::len), Some(3));
    assert_eq!(
        answer["choices"][2]["text"],
        expected_decode_text("dupword", 6)
    );
    assert_still_serves("default").await;
}

#[tokio::test]
async fn huge_numbers_are_kept_byte_exact_on_decode() {
    let id = unique_id("numbers");
    let numbers = [
        ("seed", "123456789012345678901234567890123456789"),
        ("user_id", "-98765432109876543210987654321"),
        (
            "temperature",
            "0.1000000000000000055511151231257827021181583404541015625",
        ),
        ("top_p", "1.0E0"),
        ("presence_penalty", "-0.0"),
        ("frequency_penalty", "2e-308"),
        ("repetition_penalty", "1.7976931348623157e+308"),
    ];
    let mut original = String::from("{\"prompt\":\"bignum here\",\"max_tokens\":5");
    for (key, value) in numbers {
        original.push_str(&format!(",\"{key}\":{value}"));
    }
    original.push_str(",\"logit_bias\":{\"50256\":-100.000000000000000000001}}");
    // Decode: the client's bytes and the kv_transfer_params prefill issued, nothing
    // reformatted; prefill: every number as the client wrote it.
    assert_served("default", COMPLETIONS, &id, &original).await;
    assert_still_serves("default").await;
}

/// A completions body of exactly `size` bytes.
fn body_of_size(size: usize) -> String {
    let frame = json!({"prompt": "limitword ", "max_tokens": 5}).to_string();
    let padding = "z".repeat(size - frame.len());
    let body = json!({"prompt": format!("limitword {padding}"), "max_tokens": 5}).to_string();
    assert_eq!(body.len(), size);
    body
}

#[tokio::test]
async fn bodies_just_under_and_just_over_the_strict_limit() {
    // The strict listener allows 64 KiB = 65536 bytes, for the client's body and for the
    // decode body it becomes (the client's plus prefill's kv_transfer_params, about 200
    // bytes from the mock): Envoy must never be handed a body over the limit.
    let h = harness();
    for (size, ok) in [
        (65_000, true),
        (65_400, false),
        (65_536, false),
        (65_537, false),
        (65_600, false),
        (80_000, false),
    ] {
        for framing in ["content-length", "chunked"] {
            let id = unique_id("limit");
            let body = body_of_size(size);
            let request = Request::post("strict", COMPLETIONS).id(&id);
            let request = match framing {
                // The limit is found while buffering rather than from content-length.
                "chunked" => request.chunked(&body, 10_000),
                _ => request.body(&body),
            };
            let reply = request.send().await;
            if ok {
                assert_eq!(reply.status, 200, "{size} {framing}: {}", reply.body);
                assert_eq!(reply.header("x-mock-kv"), Some("reused"));
                assert_legs(&id, COMPLETIONS, &body);
            } else {
                assert_error_without_decode(&reply, &id, 413, "65536");
                // Up to the limit prefill runs; then decode's body, with prefill's
                // kv_transfer_params added, would not fit.
                let prefilled = h.prefill_requests(&id).len();
                assert_eq!(prefilled, usize::from(size <= 65_536), "{size} {framing}");
            }
        }
    }
    assert_still_serves("strict").await;
}

#[tokio::test]
async fn content_types_other_than_json_are_400_and_a_missing_one_is_accepted() {
    let h = harness();
    for content_type in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonl",
        "application/xml",
    ] {
        for (path, body) in [
            (
                "/v1/chat/completions",
                r#"{"messages":[{"role":"user","content":"x"}]}"#,
            ),
            (COMPLETIONS, r#"{"prompt":"x"}"#),
        ] {
            let id = unique_id("content-type");
            let reply = Request::post("default", path)
                .id(&id)
                .header("content-type", content_type)
                .body(body)
                .send()
                .await;
            assert_error_without_decode(&reply, &id, 400, "application/json");
            assert!(h.prefill_requests(&id).is_empty());
        }
    }
    for content_type in [
        None,
        Some("application/json"),
        Some("application/json; charset=utf-8"),
        Some("Application/JSON"),
    ] {
        let id = unique_id("content-type-ok");
        let prompt = format!("{id} typed");
        let body = completion(&prompt);
        let request = Request::post("default", COMPLETIONS).id(&id);
        let request = match content_type {
            Some(content_type) => request.header("content-type", content_type),
            None => request.without_content_type(),
        };
        let reply = request.body(&body).send().await;
        assert_eq!(reply.status, 200, "{content_type:?}: {}", reply.body);
        assert_eq!(answer_text(&reply.body).0, expected_decode_text(&prompt, 5));
        // Prefill gets content-type application/json whatever the client sent.
        assert_legs(&id, COMPLETIONS, &body);
    }
    // A compressed body: neither the filter nor vLLM decodes it, and the client is told why
    // rather than that its body is not JSON.
    let gzip_of_a_prompt: &[u8] = &[
        0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0xab, 0x56, 0x2a, 0x28, 0xca,
        0xcf, 0x2d, 0x28, 0x51, 0xb2, 0x52, 0xaa, 0x50, 0xaa, 0x05, 0x00,
    ];
    for coding in ["gzip", "br"] {
        let id = unique_id("content-encoding");
        let reply = Request::post("default", COMPLETIONS)
            .id(&id)
            .header("content-encoding", coding)
            .body(gzip_of_a_prompt)
            .send()
            .await;
        assert_error_without_decode(&reply, &id, 400, "uncompressed");
        assert!(reply.body.contains(coding), "{}", reply.body);
        assert!(h.prefill_requests(&id).is_empty());
    }
    let id = unique_id("content-encoding-identity");
    let body = completion(&format!("{id} plain"));
    let reply = Request::post("default", COMPLETIONS)
        .id(&id)
        .header("content-encoding", "identity")
        .body(&body)
        .send()
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_still_serves("default").await;
}

#[tokio::test]
async fn client_kv_transfer_params_are_replaced_on_both_legs_or_refused_as_vllm_refuses() {
    let h = harness();
    // Not an object: vLLM refuses the request, so the filter does, before prefill.
    for client_kv in [json!("junk"), json!(42), json!([1, 2, 3]), json!(true)] {
        let id = unique_id("client-kv-refused");
        let original =
            format!(r#"{{"prompt":"x","kv_transfer_params":{client_kv},"max_tokens":5}}"#);
        let reply = assert_refused(
            "default",
            COMPLETIONS,
            &id,
            &original,
            400,
            "kv_transfer_params must be an object (or null)",
        )
        .await;
        assert_eq!(reply.json()["error"]["param"], "kv_transfer_params");
        assert!(
            h.prefill_requests(&id).is_empty(),
            "{client_kv}: prefill was called"
        );
    }
    for client_kv in [
        json!(null),
        json!({}),
        // A forged object pointing at someone else's blocks.
        json!({"do_remote_prefill": true, "do_remote_decode": false,
               "remote_engine_id": "evil", "remote_request_id": "stolen",
               "remote_block_ids": [999_999], "remote_host": "10.0.0.1", "remote_port": 1,
               "mock_prompt_fingerprint": "0000000000000000", "remote_num_tokens": 3}),
    ] {
        let id = unique_id("client-kv");
        let prompt = format!("{id} forged");
        let original = format!(
            r#"{{"prompt":{},"kv_transfer_params":{client_kv},"max_tokens":5}}"#,
            json!(prompt)
        );
        // Prefill asked for a remote decode; decode got prefill's kv_transfer_params in place
        // of the client's, every other byte of the client's body where it was.
        let (reply, kv) = assert_served("default", COMPLETIONS, &id, &original).await;
        assert_eq!(answer_text(&reply.body).0, expected_decode_text(&prompt, 5));
        assert_ne!(kv["remote_request_id"], "stolen");
        assert_ne!(kv["remote_block_ids"], json!([999_999]));
    }
    assert_still_serves("default").await;
}

#[tokio::test]
async fn messages_of_the_wrong_type_get_prefills_400_with_its_message() {
    let h = harness();
    for (messages, message) in [
        (json!("hello"), "messages must be an array of messages"),
        (
            json!({"role": "user"}),
            "messages must be an array of messages",
        ),
        (json!(7), "messages must be an array of messages"),
        (json!([1, 2]), "each message must be an object"),
        (
            json!([{"role": "user", "content": 5}]),
            "message content must be a string or an array of parts",
        ),
    ] {
        let id = unique_id("bad-messages");
        let body = json!({"messages": messages, "max_tokens": 5}).to_string();
        let reply =
            assert_refused("default", "/v1/chat/completions", &id, &body, 400, message).await;
        assert_eq!(reply.json()["error"]["type"], "BadRequestError");
        // The filter passed the field on as the client sent it.
        assert_prefill_got("/v1/chat/completions", &body, &h.only_prefill(&id));
    }
    assert_still_serves("default").await;
}
