//! pd-filter: an Envoy proxy-wasm HTTP filter that runs vLLM prefill/decode disaggregation.
//!
//! Everything the filter decides is host-free and tested natively and as wasm32:
//! [`session`] (one request's state machine), [`callouts`] (a worker's calls, which outlive
//! requests), [`protocol`] (the P/D protocol by job),
//! [`config`], [`headers`], [`held_bytes`], [`held_headers_check`], [`abandoned`],
//! [`decode_outage`], [`upload_slices`], [`vm_roots`], [`request_id`], [`json`],
//! [`log_budget`] and [`api`].
//! `filter`, `host`, `logger` and `stats` are the thin adapter to the proxy-wasm host; they
//! are only built for wasm32 and left out of test builds, so that the unit tests also run as
//! wasm32 (under Node's WASI). `dispatch` (the module's exports and its registry of contexts)
//! is built for wasm32 and for the unit tests, there without its host calls.

// What runs inside Envoy must not panic: a panic kills the VM for every later request.
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing,
        clippy::unreachable,
        clippy::todo,
        clippy::unimplemented
    )
)]

pub mod abandoned;
pub mod api;
pub mod callouts;
pub mod config;
pub mod decode_outage;
pub mod headers;
pub mod held_bytes;
pub mod held_headers_check;
pub mod json;
pub mod log_budget;
pub mod protocol;
pub mod request_id;
pub mod session;
pub mod upload_slices;
pub mod vm_roots;

// The unit tests' heap count (a global allocator), to bound the peaks of a callback.
#[cfg(test)]
mod alloc_count;

// Also in the unit tests (native and wasm32), without its host calls.
#[cfg(any(test, target_arch = "wasm32"))]
mod dispatch;
#[cfg(all(target_arch = "wasm32", not(test)))]
mod filter;
#[cfg(all(target_arch = "wasm32", not(test)))]
mod host;
#[cfg(all(target_arch = "wasm32", not(test)))]
mod logger;
#[cfg(all(target_arch = "wasm32", not(test)))]
mod stats;
#[cfg(test)]
mod timing;
