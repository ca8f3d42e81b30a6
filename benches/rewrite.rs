//! Native micro-benchmark of the filter's per-request work on the body, for the three body
//! sizes of `make bench` (the same bytes: bench/body.rs):
//!
//! - `prepare`: validate the client body and write the prefill request (the rewrite);
//! - `inject`: splice prefill's `kv_transfer_params` into the original body (`decode_body`);
//! - `pd_request`: all the filter does for one request: `prepare`, read the prefill answer
//!   (`interpret_prefill_response`), `decode_body`.
//!
//! Throughput is per byte of client body. `cargo bench --bench rewrite`; scripts/bench.sh
//! runs it with short timings and reads criterion's estimates to print MB/s.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pd_filter::config::MissingKvPolicy;
use pd_filter::protocol::{self, decode_body, prepare, Endpoint, PrefillOutcome};

#[path = "../bench/body.rs"]
mod body;

fn kv_transfer_params() -> &'static [u8] {
    match protocol::interpret_prefill_response(
        Some(200),
        body::PREFILL_ANSWER,
        MissingKvPolicy::RecomputeOnDecode,
    ) {
        Ok(PrefillOutcome::KvTransferParams(kv)) => kv,
        other => panic!("the bench prefill answer has no kv_transfer_params: {other:?}"),
    }
}

fn rewrite(c: &mut Criterion) {
    let kv = kv_transfer_params();
    for &(label, size) in body::SIZES {
        let body = body::chat_body(size);
        assert_eq!(body.len(), size);
        let prepared = prepare(Endpoint::ChatCompletions, &body).expect("bench body is valid");
        // The decode body must be the original plus the parameters, and valid JSON.
        let decoded = decode_body(&body, &prepared.decode_plan, kv);
        serde_json::from_slice::<serde_json::Value>(&decoded).expect("decode body is JSON");
        serde_json::from_slice::<serde_json::Value>(&prepared.prefill_body)
            .expect("prefill body is JSON");

        let mut group = c.benchmark_group(label);
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_function("prepare", |b| {
            b.iter(|| prepare(Endpoint::ChatCompletions, black_box(&body)))
        });
        group.bench_function("inject", |b| {
            b.iter(|| decode_body(black_box(&body), &prepared.decode_plan, black_box(kv)))
        });
        group.bench_function("pd_request", |b| {
            b.iter(|| {
                let prepared = prepare(Endpoint::ChatCompletions, black_box(&body))
                    .expect("bench body is valid");
                black_box(&prepared.prefill_body);
                let answer = black_box(body::PREFILL_ANSWER);
                let kv = match protocol::interpret_prefill_response(
                    Some(200),
                    answer,
                    MissingKvPolicy::RecomputeOnDecode,
                ) {
                    Ok(PrefillOutcome::KvTransferParams(kv)) => kv,
                    _ => unreachable!(),
                };
                decode_body(&body, &prepared.decode_plan, kv)
            })
        });
        group.finish();
    }
}

criterion_group!(benches, rewrite);
criterion_main!(benches);
