//! The filter's own work for one request, natively, without Envoy: for counting it with
//! callgrind (`bench/native-instructions.sh`), which Envoy's JIT-compiled wasm hides.
//!
//! `native_work <workload> <repetitions>`, workloads:
//! - `request`: a 1 KB chat request of `make bench` from its headers to decode's answer,
//!   usage merged (the session's every step, as the filter drives it);
//! - `request_merge_off`: the same with `"usage":"decode"`;
//! - `token_event`, `usage_event`: one chunk of decode's stream, a token's event or the
//!   usage event, through the usage merge;
//! - `usage_answer`: the usage merge of a 522-byte JSON chat answer.

use std::hint::black_box;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use pd_filter::api::Api;
use pd_filter::config::Config;
use pd_filter::held_bytes::HeldBytes;
use pd_filter::protocol::usage::{merge_answer, prompt_usage_for_decode, EventStream, PromptUsage};
use pd_filter::session::{BodyStep, PrefillHead, ResponseHead, Session};

// Only some of the bench's bodies are used here.
#[allow(dead_code)]
#[path = "../bench/body.rs"]
mod body;

const DECODE_ANSWER: &[u8] = br#"{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":"The answer is forty-two, as computed by the bench backend."},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":12,"total_tokens":13}}"#;
const LONG_ANSWER: &[u8] = br#"{"id":"chatcmpl-b7d5f0c2a1e34f6b9c8d7e6f5a4b3c2d","object":"chat.completion","created":1764640000,"model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":"Hello! How can I help you today?","refusal":null,"tool_calls":[]},"logprobs":null,"finish_reason":"stop","stop_reason":null}],"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":230,"total_tokens":240,"completion_tokens":10,"prompt_tokens_details":{"cached_tokens":224}},"prompt_logprobs":null,"kv_transfer_params":null}"#;
const TOKEN_EVENT: &[u8] = b"data: {\"id\":\"chatcmpl-b7d5f0c2a1e34f6b9c8d7e6f5a4b3c2d\",\"object\":\"chat.completion.chunk\",\"created\":1764640000,\"model\":\"bench-model\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" answer\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n";
const USAGE_EVENT: &[u8] = b"data: {\"id\":\"chatcmpl-b7d5f0c2a1e34f6b9c8d7e6f5a4b3c2d\",\"object\":\"chat.completion.chunk\",\"created\":1764640000,\"model\":\"bench-model\",\"choices\":[],\"usage\":{\"prompt_tokens\":230,\"total_tokens\":240,\"completion_tokens\":10,\"prompt_tokens_details\":{\"cached_tokens\":224}}}\n\n";

fn request(config: &Rc<Config>, held: &HeldBytes, body: &[u8]) -> usize {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
    let mut session = Session::new(config.clone(), held.clone());
    let headers: Vec<(String, Vec<u8>)> = vec![
        (":method".into(), b"POST".to_vec()),
        (":path".into(), b"/v1/chat/completions".to_vec()),
        (":authority".into(), b"bench".to_vec()),
        // Envoy sets one (generate_request_id) before the filter runs.
        (
            "x-request-id".into(),
            b"5f0c2a1e-34f6-4b9c-8d7e-6f5a4b3c2d11".to_vec(),
        ),
        ("content-type".into(), b"application/json".to_vec()),
        ("content-length".into(), body.len().to_string().into_bytes()),
    ];
    let mut commands = session.on_request_headers(&headers, false).commands.len();
    let _ = session.on_request_body(body.len(), true);
    commands += session
        .on_request_complete(body.to_vec(), now)
        .commands
        .len();
    commands += session.on_prefill_dispatched(Ok(1), now).len();
    let head = PrefillHead {
        status: Some(200),
        retry_after: None,
    };
    commands += session
        .on_prefill_response(1, head, body::PREFILL_ANSWER, now)
        .len();
    let length = DECODE_ANSWER.len().to_string();
    let head = ResponseHead {
        status: Some(200),
        content_type: Some("application/json"),
        content_length: Some(length.as_bytes()),
        ..ResponseHead::default()
    };
    if session.watches_response() {
        commands += session.on_response_headers(&head).commands.len();
        commands += match session.on_response_body(DECODE_ANSWER.len(), false) {
            BodyStep::ReadBody => session
                .on_response_body_read(DECODE_ANSWER, false)
                .commands
                .len(),
            BodyStep::Step(step) => step.commands.len(),
        };
    }
    session.on_stream_done();
    commands
}

fn prompt() -> PromptUsage {
    let usage = br#"{"prompt_tokens":230,"total_tokens":231,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":16}}"#;
    match prompt_usage_for_decode(Api::ChatCompletions, usage, b"{}") {
        Some(prompt) => prompt,
        None => unreachable!("the usage above has prompt counts"),
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let workload = args.next().unwrap_or_default();
    let repetitions: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(1);
    let mut checksum = 0usize;
    match workload.as_str() {
        "request" | "request_merge_off" => {
            let usage = if workload == "request" {
                "merge"
            } else {
                "decode"
            };
            let json = format!(
                r#"{{"hold_request_headers":true,"prefill_cluster":"prefill","prefill_timeout_ms":120000,"usage":"{usage}"}}"#
            );
            let config = match Config::from_json(json.as_bytes()) {
                Ok(config) => Rc::new(config),
                Err(error) => unreachable!("{error}"),
            };
            let held = HeldBytes::new(config.max_vm_held_bytes);
            let body = body::chat_body(1024);
            for _ in 0..repetitions {
                checksum += request(&config, &held, black_box(&body));
            }
        }
        "token_event" | "usage_event" => {
            let prompt = prompt();
            let chunk = if workload == "token_event" {
                TOKEN_EVENT
            } else {
                USAGE_EVENT
            };
            let mut events = EventStream::new(HeldBytes::new(1 << 20), 1 << 20);
            for _ in 0..repetitions {
                let out = events.on_chunk(Api::ChatCompletions, &prompt, black_box(chunk), false);
                checksum += usize::from(matches!(out, pd_filter::protocol::usage::Rewritten::AsIs));
            }
        }
        "usage_answer" => {
            let prompt = prompt();
            for _ in 0..repetitions {
                let merged = merge_answer(Api::ChatCompletions, black_box(LONG_ANSWER), &prompt);
                checksum += merged.map_or(0, |merged| merged.len());
            }
        }
        other => {
            eprintln!("unknown workload {other:?}: request, request_merge_off, token_event, usage_event, usage_answer");
            std::process::exit(2);
        }
    }
    println!("{checksum}");
}
