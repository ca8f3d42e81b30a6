//! A timing harness for the per-request work on the body that runs the same code natively and
//! as wasm32 under Node's WASI (as `make test-wasm` runs the unit tests), so that the wasm
//! build can be compared with native on the same machine: `make bench-wasm`, or
//! `cargo test --release -p pd-filter --lib timing -- --ignored --nocapture`.
//!
//! Each line it prints: `TIMING <native|wasm32> <body> <step> <bytes> <ns per call>`, the
//! median of 7 batches of about 40 ms each, on the bodies of `make bench` (bench/body.rs).

use std::hint::black_box;
use std::time::{Duration, Instant};

use crate::api::Api;
use crate::held_bytes::HeldBytes;
use crate::json::JsonObject;
use crate::protocol::usage::{merge_answer, prompt_usage, EventStream};
use crate::protocol::{prepare, read_prefill_answer, PrefillAnswer};

#[path = "../bench/body.rs"]
mod body;

/// Median nanoseconds per call of `f`.
fn time(mut f: impl FnMut()) -> f64 {
    // Calibrate: enough calls for a batch of about 40 ms.
    let mut calls = 1u32;
    loop {
        let start = Instant::now();
        for _ in 0..calls {
            f();
        }
        if start.elapsed() >= Duration::from_millis(40) || calls >= 1 << 24 {
            break;
        }
        calls *= 2;
    }
    let mut batches: Vec<f64> = (0..7)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..calls {
                f();
            }
            start.elapsed().as_nanos() as f64 / f64::from(calls)
        })
        .collect();
    batches.sort_by(f64::total_cmp);
    batches[batches.len() / 2]
}

/// One timed step: its name and the work.
type Step<'a> = (&'static str, Box<dyn FnMut() + 'a>);

/// A timed step on an answer: its name, the answer's bytes and the work.
type AnswerStep<'a> = (&'static str, &'a [u8], Box<dyn FnMut() + 'a>);

#[test]
#[ignore = "timing, not a test: make bench-wasm"]
fn timing() {
    let target = if cfg!(target_arch = "wasm32") {
        "wasm32"
    } else {
        "native"
    };
    let kv = match read_prefill_answer(Some(200), body::PREFILL_ANSWER) {
        PrefillAnswer::KvTransferParams(handed) => handed.kv,
        other => panic!("the bench prefill answer has no kv_transfer_params: {other:?}"),
    };
    for &(label, size) in body::SIZES {
        let body = body::chat_body(size);
        let prepared = prepare(Api::ChatCompletions, &body).unwrap();
        let steps: [Step; 4] = [
            (
                "scan",
                Box::new(|| {
                    black_box(JsonObject::parse(black_box(&body)).is_ok());
                }),
            ),
            (
                "prepare",
                Box::new(|| {
                    black_box(prepare(Api::ChatCompletions, black_box(&body)).is_ok());
                }),
            ),
            (
                "inject",
                Box::new(|| {
                    black_box(prepared.decode.edit_with_kv(black_box(&body), kv));
                }),
            ),
            (
                "pd_request",
                Box::new(|| {
                    let prepared = prepare(Api::ChatCompletions, black_box(&body)).unwrap();
                    black_box(&prepared.prefill_body);
                    let PrefillAnswer::KvTransferParams(handed) =
                        read_prefill_answer(Some(200), black_box(body::PREFILL_ANSWER))
                    else {
                        unreachable!()
                    };
                    black_box(prepared.decode.edit_with_kv(&body, handed.kv));
                }),
            ),
        ];
        for (step, mut f) in steps {
            let ns = time(&mut f);
            println!("TIMING {target} {label} {step} {size} {ns:.0}");
        }
    }
    usage_timing(target);
}

/// Usage merging of decode's answer: a JSON answer, and a stream of 16 events in one chunk
/// whose usage event changes.
fn usage_timing(target: &str) {
    let prefill = br#"{"usage":{"prompt_tokens":300,"completion_tokens":1,"total_tokens":301,"prompt_tokens_details":{"cached_tokens":16}}}"#;
    let prompt = prompt_usage(Api::ChatCompletions, prefill).unwrap();
    let answer = br#"{"id":"chatcmpl-1","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"The answer is forty-two, as computed by the backend."},"finish_reason":"stop"}],"usage":{"prompt_tokens":300,"completion_tokens":12,"total_tokens":312,"prompt_tokens_details":{"cached_tokens":300}}}"#;
    let chunk = |delta: &str| {
        format!(
            "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":null}}]}}\n\n"
        )
    };
    let mut stream = chunk(r#"{"role":"assistant","content":""}"#);
    for word in 0..13 {
        stream.push_str(&chunk(&format!(r#"{{"content":"word{word} "}}"#)));
    }
    stream.push_str("data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":300,\"completion_tokens\":12,\"total_tokens\":312,\"prompt_tokens_details\":{\"cached_tokens\":300}}}\n\ndata: [DONE]\n\n");
    let stream = stream.into_bytes();
    // One event of 1 MB (a long `response.completed`, say) arriving 1 KiB at a time: the
    // work per chunk must not grow with what of the event waits already.
    let long_event = {
        let mut event = chunk(&format!(r#"{{"content":"{}"}}"#, "x".repeat(1_000_000)));
        event.push_str("data: [DONE]\n\n");
        event.into_bytes()
    };
    let steps: [AnswerStep; 3] = [
        (
            "usage_json",
            answer,
            Box::new(|| {
                black_box(merge_answer(
                    Api::ChatCompletions,
                    black_box(answer),
                    &prompt,
                ));
            }),
        ),
        (
            "usage_stream",
            &stream,
            Box::new(|| {
                let mut events = EventStream::new(HeldBytes::new(usize::MAX), usize::MAX);
                black_box(events.on_chunk(
                    Api::ChatCompletions,
                    &prompt,
                    black_box(&stream),
                    false,
                ));
            }),
        ),
        (
            "usage_long_event",
            &long_event,
            Box::new(|| {
                let mut events = EventStream::new(HeldBytes::new(usize::MAX), usize::MAX);
                for piece in long_event.chunks(1024) {
                    black_box(events.on_chunk(Api::ChatCompletions, &prompt, piece, false));
                }
            }),
        ),
    ];
    for (step, bytes, mut f) in steps {
        let ns = time(&mut f);
        println!("TIMING {target} answer {step} {} {ns:.0}", bytes.len());
    }
}
