//! Faults on either leg and bad client input, through a real Envoy running the built filter.
//! Each test ends with a normal request that must be served (the filter's VM is never lost)
//! and checks that the Envoy log shows no panic, wasm trap or failed proxy-wasm callback, and
//! that no VM was reloaded.

mod common;

use std::time::{Duration, Instant};

use common::{
    answer_text, assert_filter_healthy, client, expected_decode_text, harness, mock_fingerprint,
    post, send, try_send, unique_id, Reply,
};
use serde_json::{json, Value};

fn remote_decode_request() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
           "remote_block_ids": null, "remote_host": null, "remote_port": null})
}

/// A normal request on `listener` that must be served with the prefill's KV, with its own
/// answer; then the filter must still be healthy.
async fn assert_still_serves(listener: &str) {
    let h = harness();
    let id = unique_id("after");
    let prompt = format!("{id} must still be served");
    let body = json!({"prompt": prompt, "max_tokens": 6}).to_string();
    let reply = post(listener, "/v1/completions", &id, body).await;
    assert_eq!(reply.status, 200, "{listener}: {}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"), "{listener}");
    assert_eq!(answer_text(&reply.body).0, expected_decode_text(&prompt, 6));
    h.only_prefill(&id);
    let decode = h.only_decode(&id).json();
    assert_eq!(
        decode["kv_transfer_params"]["mock_prompt_fingerprint"],
        mock_fingerprint(&prompt)
    );
    assert_filter_healthy();
}

/// An OpenAI-shaped error with this status, carrying the request id; nothing reached decode.
fn assert_error_without_decode(reply: &Reply, id: &str, status: u16, text: &str) {
    reply.assert_error(status, text);
    assert_eq!(reply.header("x-request-id"), Some(id), "{}", reply.body);
    assert!(
        harness().decode_requests(id).is_empty(),
        "decode was called for {id}"
    );
}

fn completion(prompt: &str) -> String {
    json!({"prompt": prompt, "max_tokens": 5}).to_string()
}

// ----------------------------------------------------------------------------------------
// Prefill faults

#[tokio::test]
async fn prefill_error_statuses_map_to_the_documented_client_statuses() {
    for (sent, expected, text) in [
        (
            400,
            400,
            "prefill rejected the request (400): mock prefill failure 400",
        ),
        (404, 404, "prefill rejected the request (404)"),
        (429, 429, "prefill rejected the request (429)"),
        (500, 502, "prefill failed (500): mock prefill failure 500"),
        (502, 502, "prefill failed (502)"),
        (503, 503, "prefill is unavailable (503)"),
        (504, 504, "prefill timed out (504)"),
    ] {
        let id = unique_id("prefill-status");
        let body = completion(&format!("x mock:prefill_status={sent}"));
        let reply = post("default", "/v1/completions", &id, body).await;
        assert_error_without_decode(&reply, &id, expected, text);
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
    let reply = post("strict", "/v1/completions", &id, completion(prompt)).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(started.elapsed() >= Duration::from_millis(800));
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));
    assert_eq!(answer_text(&reply.body).0, expected_decode_text(prompt, 5));
    assert_still_serves("strict").await;
}

#[tokio::test]
async fn a_prefill_hanging_past_the_timeout_is_504_and_its_late_answer_never_reaches_decode() {
    let h = harness();
    let id = unique_id("prefill-hang");
    let started = Instant::now();
    let body = completion("x mock:prefill_delay_ms=3000");
    let reply = post("strict", "/v1/completions", &id, body).await;
    let elapsed = started.elapsed();
    assert_error_without_decode(&reply, &id, 504, "prefill timed out");
    assert!(
        elapsed >= Duration::from_millis(1400) && elapsed < Duration::from_millis(2900),
        "answered after {elapsed:?}, the timeout is 1.5 s"
    );
    // The filter serves others while the abandoned prefill still sleeps.
    assert_still_serves("strict").await;
    // Once the mock has answered the abandoned callout, decode still has nothing.
    tokio::time::sleep(Duration::from_millis(3400).saturating_sub(started.elapsed())).await;
    h.only_prefill(&id);
    assert!(h.decode_requests(&id).is_empty());
    assert_still_serves("strict").await;
}

#[tokio::test]
async fn a_prefill_reset_before_answering_is_503() {
    let id = unique_id("prefill-reset");
    let reply = post(
        "default",
        "/v1/completions",
        &id,
        completion("x mock:prefill_reset"),
    )
    .await;
    assert_error_without_decode(&reply, &id, 503, "reset");
    assert_still_serves("default").await;
}

#[tokio::test]
async fn a_prefill_reset_mid_answer_is_502() {
    for listener in ["default", "strict"] {
        let id = unique_id("prefill-reset-mid");
        let body = completion("x mock:prefill_reset_mid_answer");
        let reply = post(listener, "/v1/completions", &id, body).await;
        assert_error_without_decode(&reply, &id, 502, "reset");
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
    let reply = post("default", "/v1/completions", &id, original.clone()).await;
    assert_eq!(reply.status, 200, "{directive}: {}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("recomputed"), "{directive}");
    assert_eq!(answer_text(&reply.body).0, expected_decode_text(&prompt, 5));
    assert_eq!(h.only_decode(&id).body, original.as_bytes(), "{directive}");
    assert_still_serves("default").await;

    let id = unique_id("unusable-kv-strict");
    let reply = post("strict", "/v1/completions", &id, original).await;
    assert_error_without_decode(&reply, &id, 502, strict_text);
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
    let reply = post("default", "/v1/completions", &id, completion(prompt)).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));
    assert_eq!(answer_text(&reply.body).0, expected_decode_text(prompt, 5));
    let decode = h.only_decode(&id);
    assert!(decode.body.len() < 10_000, "the padding reached decode");
    assert_still_serves("default").await;
}

#[tokio::test]
async fn an_unreachable_prefill_is_503_and_the_listener_keeps_working() {
    let h = harness();
    for _ in 0..3 {
        let id = unique_id("unreachable");
        let reply = post("unreachable", "/v1/completions", &id, completion("x")).await;
        assert_error_without_decode(&reply, &id, 503, "prefill is unavailable");
    }
    // That listener's filter still answers: its own 400, and a pass-through GET.
    let id = unique_id("unreachable-bad");
    let reply = post("unreachable", "/v1/completions", &id, "nope").await;
    assert_error_without_decode(&reply, &id, 400, "not a JSON object");
    let reply = send(client().get(h.url("unreachable", "/v1/models"))).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_still_serves("default").await;
}

#[tokio::test]
async fn an_unknown_prefill_cluster_is_503_naming_it_and_the_listener_keeps_working() {
    let h = harness();
    for _ in 0..3 {
        let id = unique_id("unknown-cluster");
        let reply = post("unknown_cluster", "/v1/responses", &id, r#"{"input":"x"}"#).await;
        assert_error_without_decode(&reply, &id, 503, "\"no_such_cluster\"");
        assert!(h.prefill_requests(&id).is_empty());
    }
    let id = unique_id("unknown-cluster-bad");
    let reply = post("unknown_cluster", "/v1/completions", &id, "[]").await;
    assert_error_without_decode(&reply, &id, 400, "not a JSON object");
    let reply = send(client().get(h.url("unknown_cluster", "/v1/models"))).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_still_serves("default").await;
}

// ----------------------------------------------------------------------------------------
// Decode faults

#[tokio::test]
async fn decode_error_statuses_reach_the_client_as_decode_sent_them() {
    let h = harness();
    for status in [400u16, 429, 500, 503] {
        let id = unique_id("decode-status");
        let body = completion(&format!("x mock:decode_status={status}"));
        let reply = post("default", "/v1/completions", &id, body).await;
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
        h.only_prefill(&id);
        h.only_decode(&id);
    }
    assert_still_serves("default").await;
}

#[tokio::test]
async fn a_decode_reset_mid_stream_truncates_the_answer_and_the_next_request_works() {
    let h = harness();
    for (path, stream) in [
        ("/v1/completions", true),
        ("/v1/chat/completions", true),
        ("/v1/responses", true),
        ("/v1/completions", false),
    ] {
        let id = unique_id("decode-reset");
        let prompt = "truncated mock:decode_reset_mid_stream";
        let body = match path {
            "/v1/completions" => json!({"prompt": prompt, "max_tokens": 20, "stream": stream}),
            "/v1/chat/completions" => json!({"messages": [{"role": "user", "content": prompt}],
                "max_tokens": 20, "stream": stream}),
            _ => json!({"input": prompt, "max_output_tokens": 20, "stream": stream}),
        };
        let request = client()
            .post(h.url("default", path))
            .header("content-type", "application/json")
            .header("x-request-id", &id)
            .body(body.to_string());
        match try_send(request).await {
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
        h.only_prefill(&id);
        h.only_decode(&id);
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
            let body = completion("gone mock:prefill_delay_ms=2000");
            let request = client()
                .post(harness().url(listener, "/v1/completions"))
                .header("content-type", "application/json")
                .header("x-request-id", &id)
                .body(body)
                .send();
            // Dropping the future closes the connection while prefill is still running.
            tokio::time::timeout(Duration::from_millis(300), request).await
        }));
    }
    for task in tasks {
        assert!(task.await.unwrap().is_err(), "answered within 300 ms");
    }
    // Served while the abandoned prefills are still in flight.
    assert_still_serves("default").await;
    assert_still_serves("strict").await;
    // After the prefills have answered (2 s), none of them went on to decode.
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
    use tokio::io::AsyncWriteExt;
    let h = harness();
    let id = unique_id("half-body");
    let url = h.url("default", "/");
    let port = url.rsplit(':').next().unwrap().trim_end_matches('/');
    let mut stream = tokio::net::TcpStream::connect(format!("127.0.0.1:{port}"))
        .await
        .unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
         x-request-id: {id}\r\ncontent-length: 100000\r\n\r\n{{\"prompt\":\"half"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&[b'x'; 20_000]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(stream);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(h.prefill_requests(&id).is_empty());
    assert!(h.decode_requests(&id).is_empty());
    assert_still_serves("default").await;
}

// ----------------------------------------------------------------------------------------
// Bad input

#[tokio::test]
async fn bodies_that_are_empty_or_not_json_objects_are_400_and_reach_no_backend() {
    let h = harness();
    let cases: &[(&str, &[u8], &str)] = &[
        ("empty", b"", "empty"),
        ("whitespace", b"  \n ", "not a JSON object"),
        ("not-json", b"prompt=hello", "not a JSON object"),
        ("truncated", b"{\"prompt\":\"x\"", "not a JSON object"),
        ("array", b"[{\"prompt\":\"x\"}]", "not a JSON object"),
        ("number", b"42", "not a JSON object"),
        ("null", b"null", "not a JSON object"),
        (
            "bad-utf8-value",
            b"{\"prompt\":\"caf\xe9\"}",
            "not valid UTF-8",
        ),
        (
            "bad-utf8-key",
            b"{\"pr\xc3\x28mpt\":\"x\"}",
            "not valid UTF-8",
        ),
        ("nul-bytes", b"\0\0\0\0", "not a JSON object"),
    ];
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/responses"] {
        for (label, body, reason) in cases {
            let id = unique_id(label);
            let reply = post("default", path, &id, body.to_vec()).await;
            assert_error_without_decode(&reply, &id, 400, reason);
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
        let reply = post("default", "/v1/completions", &id, body).await;
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
    let h = harness();
    let id = unique_id("duplicates");
    let original = r#"{"max_tokens":50,"prompt":"dupword twice","n":2,"min_tokens":2,"stream":true,"stream_options":{"include_usage":true},"max_tokens":6,"n":3,"min_tokens":3,"stream":false,"stream_options":null,"kv_transfer_params":"a","kv_transfer_params":{"b":1}}"#;
    let reply = post("default", "/v1/completions", &id, original).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));
    // Decode sees the last of each duplicate, like any JSON parser: 3 choices of 6 tokens.
    let answer = reply.json();
    assert_eq!(answer["choices"].as_array().map(Vec::len), Some(3));
    assert_eq!(
        answer["choices"][2]["text"],
        expected_decode_text("dupword", 6)
    );

    let prefill = h.only_prefill(&id);
    let text = String::from_utf8(prefill.body.clone()).unwrap();
    // One member per edited key, whatever the client repeated: nothing can be amplified.
    assert_eq!(text.matches("\"max_tokens\":1").count(), 1, "{text}");
    assert_eq!(text.matches("\"n\":1").count(), 1, "{text}");
    assert_eq!(text.matches("\"stream\":false").count(), 1, "{text}");
    for gone in [
        "min_tokens",
        "stream_options",
        "\"max_tokens\":50",
        "\"n\":3",
    ] {
        assert!(!text.contains(gone), "{gone} reached prefill: {text}");
    }
    assert_eq!(text.matches("\"kv_transfer_params\":").count(), 1, "{text}");
    assert_eq!(
        prefill.json()["kv_transfer_params"],
        remote_decode_request()
    );
    assert!(
        !text.contains("\"b\":1") && !text.contains("\"a\""),
        "{text}"
    );

    // Decode: the client's bytes with one kv_transfer_params, prefill's, where the last was.
    let decode = h.only_decode(&id);
    let decode_text = String::from_utf8(decode.body.clone()).unwrap();
    let kv = decode.json()["kv_transfer_params"].clone();
    assert_eq!(
        kv["mock_prompt_fingerprint"],
        mock_fingerprint("dupword twice")
    );
    let kv_text = serde_json::to_string(&kv).unwrap();
    assert_eq!(decode_text.matches(&kv_text).count(), 1, "{decode_text}");
    assert_eq!(decode_text.matches("\"kv_transfer_params\"").count(), 1);
    let (head, _) = original.split_once("\"kv_transfer_params\"").unwrap();
    assert!(decode_text.starts_with(head), "{decode_text}");
    assert_still_serves("default").await;
}

#[tokio::test]
async fn huge_numbers_are_kept_byte_exact_on_decode() {
    let h = harness();
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
    let reply = post("default", "/v1/completions", &id, original.clone()).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));

    let decode = h.only_decode(&id);
    let kv = decode.json()["kv_transfer_params"].clone();
    let expected = format!(
        "{},\"kv_transfer_params\":{}}}",
        &original[..original.len() - 1],
        serde_json::to_string(&kv).unwrap()
    );
    // The mock writes compact JSON, which the filter splices verbatim.
    assert_eq!(String::from_utf8(decode.body).unwrap(), expected);
    let prefill = String::from_utf8(h.only_prefill(&id).body).unwrap();
    for (key, value) in numbers {
        assert!(
            prefill.contains(&format!("\"{key}\":{value}")),
            "{key} changed on prefill: {prefill}"
        );
    }
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

fn chunked(body: String) -> reqwest::Body {
    let bytes = body.into_bytes();
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        bytes.chunks(10_000).map(|c| Ok(c.to_vec())).collect();
    reqwest::Body::wrap_stream(futures_util::stream::iter(chunks))
}

#[tokio::test]
async fn bodies_just_under_and_just_over_the_strict_limit() {
    // The strict listener allows 64 KiB = 65536 bytes, for the client's body and for the
    // decode body it becomes (the client's plus prefill's kv_transfer_params, about 200
    // bytes from the mock): Envoy must never be handed a body over the limit.
    let h = harness();
    for (size, status) in [
        (65_000, 200),
        (65_400, 413),
        (65_536, 413),
        (65_537, 413),
        (65_600, 413),
    ] {
        for framing in ["content-length", "chunked"] {
            let id = unique_id("limit");
            let body = body_of_size(size);
            let body: reqwest::Body = match framing {
                "chunked" => chunked(body),
                _ => body.into(),
            };
            let reply = post("strict", "/v1/completions", &id, body).await;
            if status == 200 {
                assert_eq!(reply.status, 200, "{size} {framing}: {}", reply.body);
                assert_eq!(reply.header("x-mock-kv"), Some("reused"));
                assert!(h.only_decode(&id).body.len() > size);
            } else {
                assert_error_without_decode(&reply, &id, 413, "65536");
                let prefilled = h.prefill_requests(&id).len();
                assert_eq!(prefilled, usize::from(size <= 65_536), "{size} {framing}");
            }
        }
    }
    assert_still_serves("strict").await;
}

#[tokio::test]
async fn content_types_other_than_json_are_415_and_a_missing_one_is_accepted() {
    let h = harness();
    for content_type in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonl",
        "application/xml",
    ] {
        let id = unique_id("content-type");
        let reply = send(
            client()
                .post(h.url("default", "/v1/chat/completions"))
                .header("content-type", content_type)
                .header("x-request-id", &id)
                .body(r#"{"messages":[{"role":"user","content":"x"}]}"#),
        )
        .await;
        assert_error_without_decode(&reply, &id, 415, "application/json");
        assert!(h.prefill_requests(&id).is_empty());
    }
    for content_type in [
        None,
        Some("application/json"),
        Some("application/json; charset=utf-8"),
        Some("Application/JSON"),
    ] {
        let id = unique_id("content-type-ok");
        let prompt = format!("{id} typed");
        let mut request = client()
            .post(h.url("default", "/v1/completions"))
            .header("x-request-id", &id)
            .body(completion(&prompt));
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        let reply = send(request).await;
        assert_eq!(reply.status, 200, "{content_type:?}: {}", reply.body);
        assert_eq!(answer_text(&reply.body).0, expected_decode_text(&prompt, 5));
        assert_eq!(
            h.only_prefill(&id).header("content-type"),
            Some("application/json")
        );
    }
    assert_still_serves("default").await;
}

#[tokio::test]
async fn client_kv_transfer_params_of_any_type_are_replaced_on_both_legs() {
    let h = harness();
    for client_kv in [
        json!("junk"),
        json!(42),
        json!([1, 2, 3]),
        json!(null),
        json!(true),
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
        let reply = post("default", "/v1/completions", &id, original.clone()).await;
        assert_eq!(reply.status, 200, "{client_kv}: {}", reply.body);
        assert_eq!(reply.header("x-mock-kv"), Some("reused"), "{client_kv}");
        assert_eq!(answer_text(&reply.body).0, expected_decode_text(&prompt, 5));

        let prefill = h.only_prefill(&id).json();
        assert_eq!(prefill["kv_transfer_params"], remote_decode_request());
        let decode = h.only_decode(&id);
        let kv = decode.json()["kv_transfer_params"].clone();
        assert_eq!(kv["mock_prompt_fingerprint"], mock_fingerprint(&prompt));
        assert_ne!(kv["remote_request_id"], "stolen");
        assert_ne!(kv["remote_block_ids"], json!([999_999]));
        // Replaced in place: every other byte of the client's body is where it was.
        // Split at the member, not the bare value: "42" can also stand in the request id.
        let key = r#""kv_transfer_params":"#;
        let (before, tail) = original.split_once(&format!("{key}{client_kv}")).unwrap();
        let head = format!("{before}{key}");
        let head = head.as_str();
        let decode_text = String::from_utf8(decode.body).unwrap();
        assert!(decode_text.starts_with(head), "{decode_text}");
        assert!(decode_text.ends_with(tail), "{decode_text}");
        let kv_text = &decode_text[head.len()..decode_text.len() - tail.len()];
        assert_eq!(serde_json::from_str::<Value>(kv_text).unwrap(), kv);
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
        let reply = post("default", "/v1/chat/completions", &id, body).await;
        assert_error_without_decode(
            &reply,
            &id,
            400,
            &format!("prefill rejected the request (400): {message}"),
        );
        assert_eq!(reply.json()["error"]["type"], "BadRequestError");
        // The filter passed the field on as the client sent it.
        assert_eq!(h.only_prefill(&id).json()["messages"], messages);
    }
    assert_still_serves("default").await;
}
