//! The P/D flow through a real Envoy running the built filter, against the mock vLLM servers:
//! what reaches prefill and decode, and what the client gets.

mod common;

use common::{harness, post, unique_id};
use serde_json::{json, Value};

fn remote_decode_request() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
           "remote_block_ids": null, "remote_host": null, "remote_port": null})
}

/// The decode body must be the client's bytes with only `kv_transfer_params` added at the end.
fn assert_decode_body_is_original_plus_kv(original: &str, decode_body: &[u8], kv: &Value) {
    let decode_text = std::str::from_utf8(decode_body).unwrap();
    let trimmed = original.trim_end();
    let head = &trimmed[..trimmed.len() - 1];
    assert!(
        decode_text.starts_with(head),
        "decode body does not start with the client's bytes:\n{decode_text}"
    );
    let decode: Value = serde_json::from_slice(decode_body).unwrap();
    assert_eq!(&decode["kv_transfer_params"], kv);
}

#[tokio::test]
async fn completions_prefill_is_capped_and_decode_gets_the_original_with_kv() {
    let h = harness();
    let id = unique_id("completions");
    let original =
        r#"{"model":"m","prompt":"the quick brown fox","max_tokens":7,"temperature":0.5}"#;
    let reply = post("default", "/v1/completions", &id, original).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));
    let text = reply.json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(!text.contains("GARBAGE"), "{text}");
    assert_eq!(text.split_whitespace().count(), 7);

    let prefill = h.only_prefill(&id);
    assert_eq!(prefill.path, "/v1/completions");
    assert_eq!(
        prefill.json(),
        json!({"model":"m","prompt":"the quick brown fox","max_tokens":1,"temperature":0.5,
               "stream":false,"kv_transfer_params":remote_decode_request()})
    );
    let decode = h.only_decode(&id);
    let kv = decode.json()["kv_transfer_params"].clone();
    assert_eq!(kv["do_remote_prefill"], true);
    assert_eq!(kv["remote_num_tokens"], 5);
    assert_decode_body_is_original_plus_kv(original, &decode.body, &kv);
}

#[tokio::test]
async fn chat_caps_max_completion_tokens_and_max_tokens() {
    let h = harness();
    let id = unique_id("chat");
    let original = r#"{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_completion_tokens":5,"max_tokens":9}"#;
    let reply = post("default", "/v1/chat/completions", &id, original).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));
    let content = reply.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(content.split_whitespace().count(), 5);

    let prefill = h.only_prefill(&id).json();
    assert_eq!(prefill["max_completion_tokens"], 1);
    assert_eq!(prefill["max_tokens"], 1);
    let decode = h.only_decode(&id).json();
    assert_eq!(decode["max_completion_tokens"], 5);
    assert_eq!(decode["max_tokens"], 9);
}

#[tokio::test]
async fn responses_without_max_output_tokens_are_capped_and_decode_output_is_right() {
    let h = harness();
    let id = unique_id("responses");
    // max_tokens means nothing to /v1/responses: only max_output_tokens caps it.
    let original = r#"{"model":"m","input":"tell me a story","max_tokens":1}"#;
    let reply = post("default", "/v1/responses", &id, original).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));
    let body = reply.json();
    let text = body["output"][0]["content"][0]["text"].as_str().unwrap();
    assert!(!text.contains("GARBAGE"), "{text}");

    let prefill = h.only_prefill(&id).json();
    assert_eq!(prefill["max_output_tokens"], 1);
    let decode = h.only_decode(&id).json();
    assert!(decode.get("max_output_tokens").is_none());
    assert_eq!(decode["kv_transfer_params"]["remote_num_tokens"], 5);
}

#[tokio::test]
async fn responses_with_max_output_tokens_keep_the_clients_limit_on_decode() {
    let h = harness();
    let id = unique_id("responses-limit");
    let original = r#"{"model":"m","input":"tell me a story","max_output_tokens":12}"#;
    let reply = post("default", "/v1/responses", &id, original).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"));
    assert_eq!(reply.json()["usage"]["output_tokens"], 12);
    assert_eq!(h.only_prefill(&id).json()["max_output_tokens"], 1);
    assert_eq!(h.only_decode(&id).json()["max_output_tokens"], 12);
}

#[tokio::test]
async fn min_tokens_never_reaches_prefill_but_reaches_decode() {
    let h = harness();
    for (label, original) in [
        (
            "min-with-max",
            r#"{"prompt":"a b c","max_tokens":300,"min_tokens":200}"#,
        ),
        (
            "min-alone",
            r#"{"prompt":"a b c","min_tokens":10,"min_completion_tokens":10}"#,
        ),
    ] {
        let id = unique_id(label);
        let reply = post("default", "/v1/completions", &id, original).await;
        assert_eq!(reply.status, 200, "{label}: {}", reply.body);
        let prefill = h.only_prefill(&id).json();
        assert!(prefill.get("min_tokens").is_none(), "{prefill}");
        assert!(prefill.get("min_completion_tokens").is_none(), "{prefill}");
        assert_eq!(prefill["max_tokens"], 1);
        let decode = h.only_decode(&id).json();
        let sent: Value = serde_json::from_str(original).unwrap();
        assert_eq!(decode["min_tokens"], sent["min_tokens"]);
    }
}

#[tokio::test]
async fn n_is_one_on_prefill_and_the_clients_on_decode() {
    let h = harness();
    let id = unique_id("n");
    let original = r#"{"prompt":"pick a number","max_tokens":3,"n":3}"#;
    let reply = post("default", "/v1/completions", &id, original).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["choices"].as_array().unwrap().len(), 3);
    assert_eq!(h.only_prefill(&id).json()["n"], 1);
    assert_eq!(h.only_decode(&id).json()["n"], 3);
}

#[tokio::test]
async fn streaming_with_usage_reaches_the_client_as_sse() {
    let h = harness();
    let id = unique_id("stream");
    let original = r#"{"messages":[{"role":"user","content":"count to four"}],"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}"#;
    let reply = post("default", "/v1/chat/completions", &id, original).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events: Vec<&str> = reply
        .body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let usage: Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    assert_eq!(events.len(), 4 + 2);

    let prefill = h.only_prefill(&id).json();
    assert_eq!(prefill["stream"], false);
    assert!(prefill.get("stream_options").is_none());
    let decode = h.only_decode(&id).json();
    assert_eq!(decode["stream"], true);
    assert_eq!(decode["stream_options"], json!({"include_usage": true}));
}

#[tokio::test]
async fn body_text_is_preserved_exactly_on_decode() {
    let h = harness();
    let id = unique_id("exact");
    // Odd spacing, escapes, a big integer, float spellings, non-ASCII, key order and a
    // client kv_transfer_params that must be replaced where it stands.
    let original = "{ \"prompt\" : \"caf\\u00e9 \u{1F600} \\\"quoted\\\"\",\n  \"seed\": 123456789012345678901234567890,\n  \"temperature\": 1.50E0, \"top_p\":0.10,\n  \"kv_transfer_params\": {\"client\": \"junk\"},\n  \"logit_bias\": {\"50256\": -100}, \"max_tokens\": 2 }\n";
    let reply = post("default", "/v1/completions", &id, original).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let decode = h.only_decode(&id);
    let kv = decode.json()["kv_transfer_params"].clone();
    assert_eq!(kv["do_remote_prefill"], true);
    let (before, after) = original.split_once("{\"client\": \"junk\"}").unwrap();
    let decode_text = std::str::from_utf8(&decode.body).unwrap();
    assert!(decode_text.starts_with(before), "{decode_text}");
    assert!(decode_text.ends_with(after), "{decode_text}");
    let kv_text = &decode_text[before.len()..decode_text.len() - after.len()];
    assert_eq!(serde_json::from_str::<Value>(kv_text).unwrap(), kv);
}

#[tokio::test]
async fn request_id_and_authorization_reach_both_legs() {
    let h = harness();
    let id = unique_id("headers");
    let reply = common::send(
        common::client()
            .post(h.url("default", "/v1/completions"))
            .header("content-type", "application/json")
            .header("x-request-id", &id)
            .header("authorization", "Bearer sk-test")
            .body(r#"{"prompt":"hi","max_tokens":2}"#),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    for leg in [h.only_prefill(&id), h.only_decode(&id)] {
        assert_eq!(leg.header("authorization"), Some("Bearer sk-test"));
        assert_eq!(leg.header("x-request-id"), Some(id.as_str()));
    }
}

#[tokio::test]
async fn a_request_without_an_id_gets_one_shared_by_both_legs() {
    let h = harness();
    let marker = unique_id("no-id-marker");
    let body = json!({"prompt": marker, "max_tokens": 2}).to_string();
    let reply = common::send(
        common::client()
            .post(h.url("default", "/v1/completions"))
            .header("content-type", "application/json")
            .body(body),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let find = |requests: Vec<mock_vllm::RecordedRequest>| {
        requests
            .into_iter()
            .find(|r| String::from_utf8_lossy(&r.body).contains(&marker))
            .expect("request with the marker")
    };
    let prefill = find(h.prefill.requests());
    let decode = find(h.decode.requests());
    let prefill_id = prefill.header("x-request-id").expect("prefill id");
    assert!(!prefill_id.is_empty());
    assert_eq!(decode.header("x-request-id"), Some(prefill_id));
}

#[tokio::test]
async fn other_methods_and_paths_pass_through_untouched() {
    let h = harness();
    let id = unique_id("get");
    let reply = common::send(
        common::client()
            .get(h.url("default", "/v1/models"))
            .header("x-request-id", &id),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["data"][0]["id"], "mock-model");

    // A POST to a path the filter does not handle goes straight to decode, as sent.
    let id = unique_id("other-path");
    let reply = post("default", "/v1/completions/extra", &id, "not json at all").await;
    assert_eq!(reply.status, 404, "{}", reply.body);
    assert!(h.prefill_requests(&id).is_empty());
}
