use std::time::Duration;

use mock_vllm::{MockServer, Role};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Reply {
    status: u16,
    head: String,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|line| {
            let (k, v) = line.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
}

/// Writes `request` and reads until the server closes; read errors end the read.
async fn raw(port: u16, request: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return out,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => panic!("timed out reading the answer"),
        }
    }
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

async fn post(port: u16, path: &str, body: &Value, request_id: Option<&str>) -> Reply {
    let body = body.to_string();
    let id = request_id.map_or(String::new(), |id| format!("X-Request-Id: {id}\r\n"));
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{id}\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let text = String::from_utf8(raw(port, request.as_bytes()).await).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("no response head");
    let status = head[9..12].parse().unwrap();
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    Reply {
        status,
        head: head.to_string(),
        body,
    }
}

async fn server(role: Role) -> MockServer {
    MockServer::start(role, "127.0.0.1:0").await.unwrap()
}

fn prefill_kv() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
        "remote_block_ids": null, "remote_host": null, "remote_port": null})
}

#[tokio::test]
async fn min_tokens_above_limit_is_rejected() {
    let p = server(Role::Prefill).await;
    let body = json!({"prompt": "hello there", "max_tokens": 1, "min_tokens": 200});
    let reply = post(p.port(), "/v1/completions", &body, None).await;
    assert_eq!(reply.status, 400);
    assert_eq!(
        reply.json(),
        json!({"error": {"message": "min_tokens must be less than or equal to max_tokens=1, got 200.",
            "type": "BadRequestError", "param": null, "code": 400}})
    );
    let body = json!({"prompt": "x", "stream": false, "stream_options": {"include_usage": true}});
    let reply = post(p.port(), "/v1/completions", &body, None).await;
    assert_eq!(reply.status, 400);
    assert_eq!(
        reply.json()["error"]["message"],
        "Stream options can only be defined when stream=True."
    );
    let reply = post(p.port(), "/v1/nothing", &json!({}), None).await;
    assert_eq!(reply.status, 404);
    assert_eq!(reply.json()["error"]["code"], 404);
}

#[tokio::test]
async fn responses_ignores_max_tokens() {
    let p = server(Role::Prefill).await;
    let mut body =
        json!({"input": "one two three", "max_tokens": 1, "kv_transfer_params": prefill_kv()});
    let reply = post(p.port(), "/v1/responses", &body, None).await;
    assert_eq!(reply.status, 200);
    let v = reply.json();
    assert_eq!(v["kv_transfer_params"]["remote_num_tokens"], 43);
    assert_eq!(v["usage"]["output_tokens"], 40);
    body["max_output_tokens"] = json!(1);
    let v = post(p.port(), "/v1/responses", &body, None).await.json();
    assert_eq!(v["kv_transfer_params"]["remote_num_tokens"], 4);
    assert_eq!(v["kv_transfer_params"]["remote_port"], p.port());
}

/// As vLLM's connectors: an answer its first token ends (the model's end of sequence) hands
/// over no KV; `min_tokens` of 1 holds that token off, and the answer is cut at its limit.
#[tokio::test]
async fn a_first_token_stop_hands_over_no_kv_unless_min_tokens_holds_it_off() {
    let p = server(Role::Prefill).await;
    let mut body = json!({"prompt": "done mock:prefill_first_token_stop", "max_tokens": 1,
        "kv_transfer_params": prefill_kv()});
    let stopped = post(p.port(), "/v1/completions", &body, None).await.json();
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert_eq!(stopped["kv_transfer_params"], Value::Null);
    body["min_tokens"] = json!(1);
    let capped = post(p.port(), "/v1/completions", &body, None).await.json();
    assert_eq!(capped["choices"][0]["finish_reason"], "length");
    assert_eq!(capped["kv_transfer_params"]["do_remote_prefill"], true);
    let generate = json!({"token_ids": [5, 6], "sampling_params": {"max_tokens": 1},
        "kv_transfer_params": prefill_kv(), "mock": "mock:prefill_first_token_stop"});
    let stopped = post(p.port(), "/inference/v1/generate", &generate, None)
        .await
        .json();
    assert_eq!(stopped["kv_transfer_params"], Value::Null);
    let mut held_off = generate;
    held_off["sampling_params"]["min_tokens"] = json!(1);
    let capped = post(p.port(), "/inference/v1/generate", &held_off, None)
        .await
        .json();
    assert!(capped["kv_transfer_params"].is_object(), "{capped}");
}

#[tokio::test]
async fn decode_reused_mismatch_recomputed() {
    let p = server(Role::Prefill).await;
    let d = server(Role::Decode).await;
    let original = json!({"model": "m", "messages": [{"role": "user", "content": "why is the sky blue"}],
        "max_tokens": 5});
    let mut leg = original.clone();
    leg["max_tokens"] = json!(1);
    leg["kv_transfer_params"] = prefill_kv();
    let pv = post(p.port(), "/v1/chat/completions", &leg, None)
        .await
        .json();
    let kv = pv["kv_transfer_params"].clone();
    assert_eq!(kv["remote_block_ids"], json!([1]));
    assert_eq!(kv["remote_num_tokens"], 6);

    let mut decode_body = original.clone();
    decode_body["kv_transfer_params"] = kv.clone();
    let reply = post(d.port(), "/v1/chat/completions", &decode_body, None).await;
    assert_eq!(reply.header("x-mock-kv").as_deref(), Some("reused"));
    let text = reply.json()["choices"][0]["message"]["content"].clone();
    assert_eq!(text, "mock decode answer for why ");
    assert_eq!(reply.json()["model"], "m");

    decode_body["kv_transfer_params"]["mock_prompt_fingerprint"] = json!("0000000000000000");
    let reply = post(d.port(), "/v1/chat/completions", &decode_body, None).await;
    assert_eq!(reply.header("x-mock-kv").as_deref(), Some("mismatch"));
    let content = reply.json()["choices"][0]["message"]["content"].clone();
    assert_eq!(content, "GARBAGE ".repeat(5));

    decode_body["kv_transfer_params"] = json!("oops");
    let reply = post(d.port(), "/v1/chat/completions", &decode_body, None).await;
    assert_eq!(reply.header("x-mock-kv").as_deref(), Some("mismatch"));

    let reply = post(d.port(), "/v1/chat/completions", &original, None).await;
    assert_eq!(reply.header("x-mock-kv").as_deref(), Some("recomputed"));
    assert_eq!(reply.json()["usage"]["completion_tokens"], 5);
}

#[tokio::test]
async fn prefill_reset_writes_nothing() {
    let p = server(Role::Prefill).await;
    let body = json!({"prompt": "mock:prefill_reset please"}).to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    assert!(raw(p.port(), request.as_bytes()).await.is_empty());
    assert_eq!(p.requests().len(), 1);
}

#[tokio::test]
async fn prefill_reset_mid_answer_is_short() {
    let p = server(Role::Prefill).await;
    let body =
        json!({"prompt": "a mock:prefill_reset_mid_answer", "kv_transfer_params": prefill_kv()});
    let reply = post(p.port(), "/v1/completions", &body, None).await;
    assert_eq!(reply.status, 200);
    let length: usize = reply.header("content-length").unwrap().parse().unwrap();
    assert!(!reply.body.is_empty() && reply.body.len() < length);
}

#[tokio::test]
async fn incomplete_body_is_not_recorded() {
    let p = server(Role::Prefill).await;
    let mut stream = TcpStream::connect(("127.0.0.1", p.port())).await.unwrap();
    let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"";
    stream.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(stream);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(p.requests().is_empty());
}

#[tokio::test]
async fn stream_with_usage_ends_with_usage_and_done() {
    let d = server(Role::Decode).await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
        "max_tokens": 9, "stream": true, "stream_options": {"include_usage": true}});
    let reply = post(d.port(), "/v1/chat/completions", &body, None).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("content-type").as_deref(),
        Some("text/event-stream")
    );
    assert_eq!(reply.header("x-mock-kv").as_deref(), Some("recomputed"));
    let events: Vec<&str> = reply.body.split_terminator("\n\n").collect();
    assert_eq!(events.len(), 5, "{events:?}");
    assert_eq!(events[4], "data: [DONE]");
    let usage: Value = serde_json::from_str(&events[3]["data: ".len()..]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    let first: Value = serde_json::from_str(&events[0]["data: ".len()..]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["content"], "mock ");
}

#[tokio::test]
async fn decode_reset_mid_stream_sends_two_events() {
    let d = server(Role::Decode).await;
    let body = json!({"input": "mock:decode_reset_mid_stream", "stream": true});
    let reply = post(d.port(), "/v1/responses", &body, None).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body.matches("event: ").count(), 2);
    assert!(!reply.body.contains("response.completed"));
}

#[tokio::test]
async fn requests_are_filtered_by_id() {
    let d = server(Role::Decode).await;
    let body = json!({"prompt": "x", "max_tokens": 2});
    post(d.port(), "/v1/completions?a=1", &body, Some("one")).await;
    post(d.port(), "/v1/completions", &body, Some("two")).await;
    post(
        d.port(),
        "/v1/completions",
        &json!({"prompt": "y"}),
        Some("one"),
    )
    .await;
    assert_eq!(d.requests().len(), 3);
    let ones = d.requests_with_id("one");
    assert_eq!(ones.len(), 2);
    assert_eq!(ones[0].path, "/v1/completions?a=1");
    assert_eq!(ones[0].header("X-REQUEST-ID"), Some("one"));
    assert_eq!(ones[0].json(), body);
    assert_eq!(ones[1].json()["prompt"], "y");

    let request =
        "GET /mock/requests?request_id=two HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let text = String::from_utf8(raw(d.port(), request.as_bytes()).await).unwrap();
    let list: Value = serde_json::from_str(text.split_once("\r\n\r\n").unwrap().1).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["role"], "decode");
    assert_eq!(list[0]["body"], body.to_string());
}

/// The `(event name, data)` pairs of an SSE body (`None` for data-only events).
fn sse(body: &str) -> Vec<(Option<String>, String)> {
    body.split_terminator("\n\n")
        .map(|event| {
            let mut name = None;
            let mut data = String::new();
            for line in event.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = Some(n.to_string());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = d.to_string();
                }
            }
            (name, data)
        })
        .collect()
}

#[tokio::test]
async fn messages_pd_exchange() {
    let p = server(Role::Prefill).await;
    let d = server(Role::Decode).await;
    let original = json!({"model": "m", "max_tokens": 4, "system": "be brief",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "why is the sky blue"}]}]});
    let mut leg = original.clone();
    leg["max_tokens"] = json!(1);
    leg["kv_transfer_params"] = prefill_kv();
    let reply = post(p.port(), "/v1/messages", &leg, Some("m-1")).await;
    assert_eq!(reply.status, 200);
    let pv = reply.json();
    assert_eq!(pv["type"], "message");
    assert!(pv["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(pv["content"], json!([{"type": "text", "text": "mock "}]));
    assert_eq!(pv["stop_reason"], "max_tokens");
    assert_eq!(
        pv["usage"],
        json!({"input_tokens": 7, "output_tokens": 1, "cache_read_input_tokens": 0})
    );
    let kv = pv["kv_transfer_params"].clone();
    assert_eq!(kv["do_remote_prefill"], true);
    assert_eq!(kv["remote_num_tokens"], 8);
    assert_eq!(p.kv_ledger().issued, 1);
    assert_eq!(p.requests_with_id("m-1")[0].path, "/v1/messages");

    let mut decode_body = original.clone();
    decode_body["kv_transfer_params"] = kv.clone();
    let reply = post(d.port(), "/v1/messages", &decode_body, None).await;
    assert_eq!(reply.header("x-mock-kv").as_deref(), Some("reused"));
    let v = reply.json();
    assert_eq!(v["content"][0]["text"], "mock decode answer for ");
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(
        v["usage"],
        json!({"input_tokens": 7, "output_tokens": 4, "cache_read_input_tokens": 7})
    );
    assert!(v.get("kv_transfer_params").is_none());
    let ledger = p.kv_ledger();
    assert_eq!((ledger.issued, ledger.read, ledger.stranded), (1, 1, 0));

    // Streamed decode: Anthropic events, usage in message_start and message_delta.
    decode_body["stream"] = json!(true);
    let reply = post(d.port(), "/v1/messages", &decode_body, None).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("content-type").as_deref(),
        Some("text/event-stream")
    );
    assert_eq!(reply.header("x-mock-kv").as_deref(), Some("reused"));
    let events = sse(&reply.body);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
    assert_eq!(names.len(), 9, "{names:?}");
    assert_eq!(names[..2], ["message_start", "content_block_start"]);
    assert!(names[2..6].iter().all(|n| *n == "content_block_delta"));
    assert_eq!(
        names[6..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    assert!(!reply.body.contains("[DONE]"));
    let start: Value = serde_json::from_str(&events[0].1).unwrap();
    assert_eq!(start["message"]["usage"]["cache_read_input_tokens"], 7);
    assert_eq!(start["message"]["usage"]["output_tokens"], 0);
    let delta: Value = serde_json::from_str(&events[7].1).unwrap();
    assert_eq!(
        delta["usage"],
        json!({"input_tokens": 7, "output_tokens": 4, "cache_read_input_tokens": 7})
    );

    // KV that is not this prompt's: garbage, as on the other APIs.
    decode_body["stream"] = json!(false);
    decode_body["kv_transfer_params"]["remote_num_tokens"] = json!(9);
    let reply = post(d.port(), "/v1/messages", &decode_body, None).await;
    assert_eq!(reply.header("x-mock-kv").as_deref(), Some("mismatch"));
    assert_eq!(reply.json()["content"][0]["text"], "GARBAGE ".repeat(4));
    assert_eq!(reply.json()["usage"]["cache_read_input_tokens"], 0);
}

#[tokio::test]
async fn messages_prefill_faults_and_errors() {
    let p = server(Role::Prefill).await;
    let d = server(Role::Decode).await;
    let body = json!({"model": "m", "max_tokens": 50, "kv_transfer_params": prefill_kv(),
        "messages": [{"role": "user", "content": "a b c mock:prefill_cached_tokens=2"}]});
    let v = post(p.port(), "/v1/messages", &body, None).await.json();
    // Prefill stops at 40 tokens: before the limit, so the turn ended.
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(
        v["usage"],
        json!({"input_tokens": 4, "output_tokens": 40, "cache_read_input_tokens": 2})
    );
    assert_eq!(v["kv_transfer_params"]["remote_num_tokens"], 44);

    // Streamed prefill answers carry no kv_transfer_params.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let reply = post(p.port(), "/v1/messages", &streamed, None).await;
    assert_eq!(reply.status, 200);
    assert!(reply.body.starts_with("event: message_start\n"));
    assert!(!reply.body.contains("kv_transfer_params"));
    assert_eq!(p.kv_ledger().issued, 1);

    let mut no_kv = body.clone();
    no_kv["kv_transfer_params"] = json!({"do_remote_decode": false});
    let v = post(p.port(), "/v1/messages", &no_kv, None).await.json();
    assert_eq!(v["kv_transfer_params"], Value::Null);

    let mut missing = body.clone();
    missing.as_object_mut().unwrap().remove("max_tokens");
    let reply = post(p.port(), "/v1/messages", &missing, None).await;
    assert_eq!(reply.status, 400);
    assert_eq!(
        reply.json(),
        json!({"type": "error", "error": {"type": "invalid_request_error",
            "message": "max_tokens is required"}})
    );
    missing["max_tokens"] = json!(0);
    let reply = post(p.port(), "/v1/messages", &missing, None).await;
    assert_eq!(reply.status, 400);
    assert_eq!(
        reply.json()["error"]["message"],
        "max_tokens must be positive"
    );

    let failing = json!({"model": "m", "max_tokens": 1,
        "messages": [{"role": "user", "content": "mock:prefill_status=503"}]});
    let reply = post(p.port(), "/v1/messages", &failing, None).await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.json()["error"]["type"], "overloaded_error");

    let cut = json!({"model": "m", "max_tokens": 5, "stream": true,
        "messages": [{"role": "user", "content": "mock:decode_reset_mid_stream"}]});
    let reply = post(d.port(), "/v1/messages", &cut, None).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body.matches("event: ").count(), 2);
    assert!(!reply.body.contains("message_stop"));
}

#[tokio::test]
async fn generate_pd_exchange() {
    let p = server(Role::Prefill).await;
    let d = server(Role::Decode).await;
    let original = json!({"token_ids": [101, 7, 2023, 9], "model": "m",
        "sampling_params": {"max_tokens": 5, "temperature": 0}});
    let mut leg = original.clone();
    leg["sampling_params"]["max_tokens"] = json!(1);
    leg["kv_transfer_params"] = prefill_kv();
    leg["request_id"] = json!("gen-42");
    let reply = post(p.port(), "/inference/v1/generate", &leg, Some("g-1")).await;
    assert_eq!(reply.status, 200);
    let pv = reply.json();
    assert_eq!(pv["request_id"], "gen-42");
    assert_eq!(
        pv["choices"],
        json!([{"index": 0, "logprobs": null, "finish_reason": "length", "token_ids": [426]}])
    );
    assert_eq!(pv["prompt_logprobs"], Value::Null);
    assert!(pv.get("usage").is_none());
    let kv = pv["kv_transfer_params"].clone();
    assert_eq!(kv["remote_num_tokens"], 5);
    assert_eq!(p.requests_with_id("g-1")[0].path, "/inference/v1/generate");

    let mut decode_body = original.clone();
    decode_body["kv_transfer_params"] = kv;
    let reply = post(d.port(), "/inference/v1/generate", &decode_body, None).await;
    assert_eq!(reply.header("x-mock-kv").as_deref(), Some("reused"));
    let v = reply.json();
    assert!(v["request_id"]
        .as_str()
        .unwrap()
        .starts_with("gen-mock-decode-"));
    assert_eq!(
        v["choices"][0]["token_ids"],
        json!([426, 612, 656, 327, 101])
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let ledger = p.kv_ledger();
    assert_eq!((ledger.issued, ledger.read, ledger.stranded), (1, 1, 0));

    // Streamed: one data chunk per token, then [DONE]; no usage even when asked for.
    decode_body["stream"] = json!(true);
    decode_body["stream_options"] = json!({"include_usage": true});
    decode_body["sampling_params"]["max_tokens"] = json!(2);
    let reply = post(d.port(), "/inference/v1/generate", &decode_body, None).await;
    assert_eq!(
        reply.header("content-type").as_deref(),
        Some("text/event-stream")
    );
    // Decode's own limit does not matter: the KV is this prompt's.
    assert_eq!(reply.header("x-mock-kv").as_deref(), Some("reused"));
    let events = sse(&reply.body);
    assert_eq!(events.len(), 3, "{events:?}");
    assert!(events.iter().all(|(name, _)| name.is_none()));
    assert_eq!(events[2].1, "[DONE]");
    let last: Value = serde_json::from_str(&events[1].1).unwrap();
    assert_eq!(
        last["choices"],
        json!([{"index": 0, "logprobs": null, "finish_reason": "length", "token_ids": [612]}])
    );
    assert!(!reply.body.contains("usage"));

    // Another prompt's KV: an obviously wrong sequence.
    decode_body["stream"] = json!(false);
    decode_body
        .as_object_mut()
        .unwrap()
        .remove("stream_options");
    decode_body["token_ids"] = json!([1, 2, 3, 4]);
    let reply = post(d.port(), "/inference/v1/generate", &decode_body, None).await;
    assert_eq!(reply.header("x-mock-kv").as_deref(), Some("mismatch"));
    assert_eq!(reply.json()["choices"][0]["token_ids"], json!([0, 0]));
}

#[tokio::test]
async fn generate_limits_and_prompt_logprobs() {
    let p = server(Role::Prefill).await;
    let d = server(Role::Decode).await;
    // A top-level max_tokens is not in the schema: prefill generates the default 16.
    let leg = json!({"token_ids": [3, 4], "max_tokens": 1, "sampling_params": {},
        "kv_transfer_params": prefill_kv()});
    let v = post(p.port(), "/inference/v1/generate", &leg, None)
        .await
        .json();
    assert_eq!(v["choices"][0]["token_ids"].as_array().unwrap().len(), 16);
    assert_eq!(v["kv_transfer_params"]["remote_num_tokens"], 18);
    // ... so decode cannot use that KV for the same prompt.
    let decode_body = json!({"token_ids": [3, 4], "sampling_params": {"max_tokens": 1},
        "kv_transfer_params": v["kv_transfer_params"]});
    let reply = post(d.port(), "/inference/v1/generate", &decode_body, None).await;
    assert_eq!(reply.header("x-mock-kv").as_deref(), Some("mismatch"));

    let leg = json!({"token_ids": [3, 4, 5], "kv_transfer_params": prefill_kv(),
        "sampling_params": {"max_tokens": 1, "prompt_logprobs": 1, "n": 2}});
    let v = post(p.port(), "/inference/v1/generate", &leg, None)
        .await
        .json();
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    let logprobs = v["prompt_logprobs"].as_array().unwrap();
    assert_eq!(logprobs.len(), 3);
    assert_eq!(logprobs[0], Value::Null);
    assert_eq!(logprobs[1]["1001"]["decoded_token"], "4");
    assert!(v["choices"][0].get("prompt_logprobs").is_none());

    let mut decode_body = leg.clone();
    decode_body["kv_transfer_params"] = v["kv_transfer_params"].clone();
    let reply = post(d.port(), "/inference/v1/generate", &decode_body, None).await;
    assert_eq!(reply.status, 400);
    assert!(reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("prompt_logprobs"));

    let bad = json!({"token_ids": [1], "sampling_params": {"max_tokens": 1, "min_tokens": 200}});
    let reply = post(p.port(), "/inference/v1/generate", &bad, None).await;
    assert_eq!(reply.status, 400);
    assert_eq!(
        reply.json(),
        json!({"error": {"message": "min_tokens must be less than or equal to max_tokens=1, got 200.",
            "type": "BadRequestError", "param": null, "code": 400}})
    );
    let reply = post(
        p.port(),
        "/inference/v1/generate",
        &json!({"token_ids": [1]}),
        None,
    )
    .await;
    assert_eq!(reply.status, 400);
    assert_eq!(
        reply.json()["error"]["message"],
        "sampling_params is required"
    );
    assert_eq!(p.requests().len(), 4);
}

#[tokio::test]
async fn several_prompts_get_their_own_choices_as_from_vllm() {
    // lm-eval's batched loglikelihood request: each prompt's echo and logprobs in a choice of
    // its own, prompt k's choice i at index k * n + i, the usage added up.
    let p = server(Role::Prefill).await;
    let body = json!({"prompt": ["one two", [5, 6, 7]], "echo": true, "logprobs": 1,
        "max_tokens": 1, "n": 2, "temperature": 1.0});
    let reply = post(p.port(), "/v1/completions", &body, None).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let v = reply.json();
    let choices = v["choices"].as_array().unwrap();
    let indexes: Vec<u64> = choices
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indexes, [0, 1, 2, 3]);
    for (choice, prompt) in choices.iter().zip(["one two", "one two", "5 6 7", "5 6 7"]) {
        let text = choice["text"].as_str().unwrap();
        assert!(text.starts_with(prompt), "{text} after {prompt}");
        assert_eq!(choice["logprobs"]["token_logprobs"][0], Value::Null);
    }
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["usage"]["total_tokens"], 9);
    // One prompt in a list, or a list of token ids, is one prompt.
    for prompt in [json!(["one two"]), json!([5, 6, 7])] {
        let body = json!({"prompt": prompt, "max_tokens": 1});
        let reply = post(p.port(), "/v1/completions", &body, None).await;
        assert_eq!(reply.json()["choices"].as_array().unwrap().len(), 1);
    }
}
