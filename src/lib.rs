//! pd-filter: an Envoy proxy-wasm HTTP filter that runs vLLM prefill/decode disaggregation.
//!
//! The protocol lives in host-agnostic modules ([`config`], [`protocol`], [`json_object`],
//! [`json_scan`]);
//! `filter` is the thin adapter to the proxy-wasm host; it is only built for wasm32 and left
//! out of test builds, so that the protocol's unit tests also run as wasm32 (under Node's WASI).

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

pub mod config;
pub mod json_object;
pub mod json_scan;
pub mod protocol;
pub mod request_id;

#[cfg(all(target_arch = "wasm32", not(test)))]
mod filter;
#[cfg(all(target_arch = "wasm32", not(test)))]
mod stats;
