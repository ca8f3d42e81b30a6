//! Native micro-benchmark of the filter's per-request work on the body, for the three body
//! sizes of `make bench` (the same bytes: bench/body.rs):
//!
//! - `scan`: validate the client body and index its members (`JsonObject::parse`), alone;
//! - `prepare`: validate the client body and write the prefill request (the rewrite);
//! - `inject`: decode's body as an edit of the original (`DecodePlan::edit_with_kv`: only the
//!   head is written when the client sent no `kv_transfer_params`, as here);
//! - `pd_request`: all the filter does for one request: `prepare`, read the prefill answer
//!   (`read_prefill_answer`), `DecodePlan::edit_with_kv`.
//!
//! Throughput is per byte of client body. `cargo bench --bench rewrite`; scripts/bench.sh
//! runs it with short timings and reads criterion's estimates to print MB/s.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pd_filter::api::Api;
use pd_filter::json::JsonObject;
use pd_filter::protocol::{prepare, read_prefill_answer, PrefillAnswer};

#[path = "../bench/body.rs"]
mod body;

fn kv_transfer_params() -> &'static [u8] {
    match read_prefill_answer(Some(200), body::PREFILL_ANSWER) {
        PrefillAnswer::KvTransferParams(handed) => handed.kv,
        other => panic!("the bench prefill answer has no kv_transfer_params: {other:?}"),
    }
}

fn rewrite(c: &mut Criterion) {
    let kv = kv_transfer_params();
    for &(label, size) in body::SIZES {
        let body = body::chat_body(size);
        assert_eq!(body.len(), size);
        let prepared = prepare(Api::ChatCompletions, &body).expect("bench body is valid");
        // The decode body must be the original plus the parameters, and valid JSON.
        let decoded = prepared.decode.body_with_kv(&body, kv);
        serde_json::from_slice::<serde_json::Value>(&decoded).expect("decode body is JSON");
        serde_json::from_slice::<serde_json::Value>(&prepared.prefill_body)
            .expect("prefill body is JSON");

        let mut group = c.benchmark_group(label);
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_function("scan", |b| {
            b.iter(|| JsonObject::parse(black_box(&body)).is_ok())
        });
        group.bench_function("prepare", |b| {
            b.iter(|| prepare(Api::ChatCompletions, black_box(&body)))
        });
        group.bench_function("inject", |b| {
            b.iter(|| {
                prepared
                    .decode
                    .edit_with_kv(black_box(&body), black_box(kv))
            })
        });
        group.bench_function("pd_request", |b| {
            b.iter(|| {
                let prepared =
                    prepare(Api::ChatCompletions, black_box(&body)).expect("bench body is valid");
                black_box(&prepared.prefill_body);
                let answer = black_box(body::PREFILL_ANSWER);
                let kv = match read_prefill_answer(Some(200), answer) {
                    PrefillAnswer::KvTransferParams(handed) => handed.kv,
                    _ => unreachable!(),
                };
                prepared.decode.edit_with_kv(&body, kv)
            })
        });
        group.finish();
    }
}

criterion_group!(benches, rewrite);
criterion_main!(benches);
