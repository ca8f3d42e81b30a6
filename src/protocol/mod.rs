//! The P/D protocol, free of any host calls, by job: which requests are the filter's
//! ([`paths`]), what prefill and decode receive ([`rewrite`]), what the prefill answer means
//! ([`prefill_answer`]), which workers a request may go to ([`scheduling`]) and what the
//! client is answered when something is wrong ([`errors`]).

pub mod echo;
pub mod errors;
pub mod kv_release;
pub mod limits;
pub mod paths;
pub mod prefill_answer;
pub mod prompt_logprobs;
pub mod rewrite;
pub mod scheduling;
pub mod usage;

pub use errors::ClientError;
pub use prefill_answer::{
    read_prefill_answer, FailureKind, PrefillAnswer, PrefillFailure, PrefillKv,
};
pub use rewrite::{
    check_content_encoding, check_content_type, is_vllm_json, media_type, prepare, prepare_with,
    ClientEcTransferParams, DecodePlan, PrefillOptions, PrefillToolChoice, PreparedRequest,
    ResponsesStore, KV_TRANSFER_PARAMS,
};
