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
