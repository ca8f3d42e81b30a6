//! What the stats say about how a request ended and what its prefill came to.

/// How an orchestrated request ended, as the stats count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Sent to decode with prefill's `kv_transfer_params`.
    Decoded,
    /// Sent to decode without them: decode recomputes the prompt.
    DecodeOnly,
    /// Answered by prefill alone: its answer was the whole answer.
    PrefillAnswered,
    /// Answered 4xx because of the request: by the filter itself, or by prefill.
    ClientError,
    /// Answered 5xx because prefill failed.
    PrefillFailed,
    /// Answered 503 because the filter held as much as it may (`max_vm_held_bytes`).
    Overloaded,
    /// Answered 503 before prefill because Envoy could not connect to decode for the
    /// model's recent requests.
    DecodeUnreachable,
    /// The stream ended while prefill ran, or before the body had all come: the client
    /// left, or Envoy ended the stream (a timeout or limit of its own).
    Abandoned,
}

impl Outcome {
    pub const ALL: [Outcome; 8] = [
        Outcome::Decoded,
        Outcome::DecodeOnly,
        Outcome::PrefillAnswered,
        Outcome::ClientError,
        Outcome::PrefillFailed,
        Outcome::Overloaded,
        Outcome::DecodeUnreachable,
        Outcome::Abandoned,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Outcome::Decoded => "decoded",
            Outcome::DecodeOnly => "decode_only",
            Outcome::PrefillAnswered => "prefill_answered",
            Outcome::ClientError => "client_error",
            Outcome::PrefillFailed => "prefill_failed",
            Outcome::Overloaded => "overloaded",
            Outcome::DecodeUnreachable => "decode_unreachable",
            Outcome::Abandoned => "abandoned",
        }
    }
}

/// What a prefill leg came to, for its latency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillResult {
    /// A 2xx answer with `kv_transfer_params`.
    Kv,
    /// A 2xx answer without usable `kv_transfer_params`.
    NoKv,
    /// No usable answer, after the retries.
    Failed,
    /// A 2xx answer that is the client's whole answer.
    Answered,
}

impl PrefillResult {
    pub const ALL: [PrefillResult; 4] = [
        PrefillResult::Kv,
        PrefillResult::NoKv,
        PrefillResult::Failed,
        PrefillResult::Answered,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PrefillResult::Kv => "kv",
            PrefillResult::NoKv => "no_kv",
            PrefillResult::Failed => "failed",
            PrefillResult::Answered => "answered",
        }
    }
}
