//! pd-filter: an Envoy proxy-wasm HTTP filter that runs vLLM prefill/decode disaggregation.
//!
//! The protocol lives in host-agnostic modules ([`config`], [`protocol`], [`json_object`]);
//! `filter` is the thin adapter to the proxy-wasm host and is only built for wasm32.

pub mod config;
pub mod json_object;
pub mod protocol;
pub mod request_id;

#[cfg(target_arch = "wasm32")]
mod filter;
#[cfg(target_arch = "wasm32")]
mod stats;
