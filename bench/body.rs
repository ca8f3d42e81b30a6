//! The request bodies of the benchmarks, shared (by `#[path]`) between
//! `mock-vllm/src/bin/bench-backend.rs` (which writes them for the load test) and
//! `benches/rewrite.rs` (the native micro-benchmark), so that both measure the same bytes.
//!
//! A chat-completions request whose user message is filler prose with the escapes a real
//! prompt has (`\n` at each line end, now and then a quoted `\"word\"`), padded so that the
//! whole body is exactly the size asked for; streamed (with the usage chunk) or not.

/// The body sizes of the benchmarks: about 1 KB, 64 KB and 1 MB.
pub const SIZES: &[(&str, usize)] = &[("1KB", 1024), ("64KB", 65_536), ("1MB", 1_048_576)];

/// What the bench backend answers a prefill request: one token and `kv_transfer_params`.
pub const PREFILL_ANSWER: &[u8] = br#"{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":"The"},"finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2,"prompt_tokens_details":{"cached_tokens":0}},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3,4,5,6,7,8],"remote_engine_id":"bench-engine","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}}"#;

const WORDS: &[&str] = &[
    "the",
    "model",
    "reads",
    "a",
    "long",
    "prompt",
    "and",
    "writes",
    "its",
    "answer",
    "token",
    "by",
    "token",
    "while",
    "prefill",
    "computes",
    "cache",
    "for",
    "every",
    "layer",
    "of",
    "attention",
    "decode",
    "pulls",
    "blocks",
    "over",
    "network",
    "from",
    "remote",
    "engine",
];

const HEAD: &[u8] = br#"{"model":"bench-model","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":""#;

/// A chat-completions body of exactly `size` bytes (at least 200).
pub fn chat_body(size: usize) -> Vec<u8> {
    let tail = br#""}],"max_tokens":16,"temperature":0.7,"top_p":0.95,"min_tokens":2}"#;
    padded(HEAD, tail, size)
}

/// The same request streamed, with the usage chunk asked for: exactly `size` bytes (at
/// least 250). Only the bench backend writes it (the `1KB-stream` workload).
#[allow(dead_code)]
pub fn chat_stream_body(size: usize) -> Vec<u8> {
    let tail = br#""}],"max_tokens":16,"temperature":0.7,"top_p":0.95,"min_tokens":2,"stream":true,"stream_options":{"include_usage":true}}"#;
    padded(HEAD, tail, size)
}

/// `head`, filler prose, `tail`: exactly `size` bytes, or the least that holds some prose.
fn padded(head: &[u8], tail: &[u8], size: usize) -> Vec<u8> {
    let size = size.max(head.len() + tail.len() + 8);
    let room = size - head.len() - tail.len();

    let mut text = Vec::with_capacity(room + 32);
    let mut state: u32 = 0x9e37_79b9;
    let mut line = 0usize;
    while text.len() < room {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let word = WORDS[state as usize % WORDS.len()].as_bytes();
        if state.is_multiple_of(97) {
            text.extend_from_slice(br#"\""#);
            text.extend_from_slice(word);
            text.extend_from_slice(br#"\""#);
        } else {
            text.extend_from_slice(word);
        }
        line += word.len() + 1;
        if line > 72 {
            text.extend_from_slice(br"\n");
            line = 0;
        } else {
            text.push(b' ');
        }
    }
    // Cut back to the exact size without splitting an escape: drop trailing backslashes.
    text.truncate(room);
    while text.last() == Some(&b'\\') {
        text.pop();
    }
    while text.len() < room {
        text.push(b'.');
    }

    let mut body = Vec::with_capacity(size);
    body.extend_from_slice(head);
    body.extend_from_slice(&text);
    body.extend_from_slice(tail);
    body
}
