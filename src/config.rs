//! The plugin configuration: parsed and validated once, when Envoy loads the plugin.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

use serde::Deserialize;

use crate::api::Api;
use crate::protocol::paths::{canonical_path, classify_path, PathVerdict};
use crate::protocol::rewrite::{
    ClientEcTransferParams, PrefillOptions, PrefillToolChoice, ResponsesStore, SeveralPrompts,
    TruncateToContext,
};
use crate::protocol::scheduling::HostAllowlist;

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// What to do when prefill answers 2xx but without usable `kv_transfer_params`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingKvPolicy {
    /// Send the client's body to decode without `kv_transfer_params`: decode recomputes
    /// the prompt. (`recompute_on_decode` is its former name.)
    #[serde(alias = "recompute_on_decode")]
    DecodeOnly,
    /// Answer the client 502.
    Fail,
}

/// What the client's usage counts are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UsagePolicy {
    /// Prompt counts (and `cached_tokens`) from prefill, output counts from decode.
    Merge,
    /// Decode's, untouched.
    Decode,
}

/// What to do when the prefill leg fails (after its retries) with anything but a 4xx.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillFailurePolicy {
    /// Answer the client with the mapped error (502, 503 or 504).
    Fail,
    /// Send the client's body to decode without `kv_transfer_params`: the client is still
    /// served, at the cost of a full prefill on decode.
    DecodeOnly,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawConfig {
    model_prefill_clusters: BTreeMap<String, String>,
    model_header: Option<String>,
    hold_request_headers: bool,
    prefill_host_header: String,
    prefill_host_cluster: Option<String>,
    prefill_hosts_allowed: Vec<String>,
    prefill_retries: u32,
    on_prefill_failure: PrefillFailurePolicy,
    replace_local_remote_host: bool,
    prefill_cluster: String,
    prefill_timeout_ms: u64,
    paths: Vec<String>,
    kv_stripped_paths: Vec<String>,
    max_request_body_bytes: usize,
    max_vm_held_bytes: usize,
    on_missing_kv_transfer_params: MissingKvPolicy,
    forward_headers: Vec<String>,
    prefill_time_header: Option<String>,
    release_kv_on_abandon: bool,
    usage: UsagePolicy,
    prefill_tool_choice: PrefillToolChoice,
    responses_store: ResponsesStore,
    client_ec_transfer_params: ClientEcTransferParams,
    truncate_to_context: TruncateToContext,
    several_prompts: SeveralPrompts,
    decode_forces_include_usage: bool,
    decode_cluster: String,
    model_decode_clusters: BTreeMap<String, String>,
    max_kv_releases_in_flight: u32,
    kv_release_timeout_ms: u64,
    max_abandoned_prefills_per_client: u32,
    decode_outage_retry_ms: u64,
    max_log_lines_per_second: u32,
}

impl Default for RawConfig {
    fn default() -> Self {
        RawConfig {
            prefill_cluster: "prefill".to_owned(),
            prefill_timeout_ms: 120_000,
            paths: vec![
                "/v1/completions".to_owned(),
                "/v1/chat/completions".to_owned(),
                "/v1/responses".to_owned(),
                "/v1/messages".to_owned(),
                "/inference/v1/generate".to_owned(),
                "/cohere/v2/chat".to_owned(),
            ],
            kv_stripped_paths: Vec::new(),
            // Envoy's own default buffer limit: a larger default would let a body Envoy took
            // grow past its buffer once prefill's kv_transfer_params go in, and Envoy's 413
            // from inside the filter's callback crashes it.
            max_request_body_bytes: 1024 * 1024,
            max_vm_held_bytes: 256 * 1024 * 1024,
            on_missing_kv_transfer_params: MissingKvPolicy::DecodeOnly,
            forward_headers: DEFAULT_FORWARD_HEADERS
                .iter()
                .map(|name| (*name).to_owned())
                .collect(),
            prefill_time_header: None,
            model_prefill_clusters: BTreeMap::new(),
            model_header: None,
            hold_request_headers: false,
            prefill_host_header: "x-prefiller-host-port".to_owned(),
            prefill_host_cluster: None,
            prefill_hosts_allowed: Vec::new(),
            prefill_retries: 1,
            on_prefill_failure: PrefillFailurePolicy::Fail,
            replace_local_remote_host: false,
            release_kv_on_abandon: true,
            usage: UsagePolicy::Merge,
            prefill_tool_choice: PrefillToolChoice::Rewrite,
            responses_store: ResponsesStore::PerServer,
            client_ec_transfer_params: ClientEcTransferParams::Refuse,
            truncate_to_context: TruncateToContext::Refuse,
            several_prompts: SeveralPrompts::Refuse,
            decode_forces_include_usage: false,
            decode_cluster: "decode".to_owned(),
            model_decode_clusters: BTreeMap::new(),
            max_kv_releases_in_flight: 64,
            kv_release_timeout_ms: 30_000,
            max_abandoned_prefills_per_client: 32,
            decode_outage_retry_ms: 250,
            max_log_lines_per_second: crate::log_budget::LINES_PER_SECOND,
        }
    }
}

/// Client headers the prefill call carries by default: credentials (`authorization`, and
/// `x-api-key` as Anthropic-style clients send it), trace context (W3C and B3), so that a
/// trace shows both legs, vLLM's `x-vllm-priority`, which it reads before the body's
/// `priority`, so that prefill schedules the request as decode does, and vLLM's
/// `x-session-id` (vLLM 0.34), which it reads for a request's session where the body names
/// none and writes into the KV cache events of the blocks the request stores: prefill is
/// the leg that stores the prompt's blocks, so a router that follows those events sees them
/// under the client's session as it would with one vLLM.
pub const DEFAULT_FORWARD_HEADERS: &[&str] = &[
    "authorization",
    "traceparent",
    "tracestate",
    "baggage",
    "b3",
    "x-b3-traceid",
    "x-b3-spanid",
    "x-b3-parentspanid",
    "x-b3-sampled",
    "x-b3-flags",
    "x-api-key",
    "x-vllm-priority",
    "x-session-id",
];

/// vLLM's generation APIs: a request to one the filter does not orchestrate goes to decode
/// with any client `kv_transfer_params` removed, so that no client can make decode pull KV
/// from a host of its choosing, whatever `paths` leaves out. `kv_stripped_paths` adds to
/// them. (vLLM 0.33: the six APIs orchestrated by default, SageMaker's `/invocations`, which
/// serves chat or completions by the body's shape, and chat batches. Orchestration wins
/// where a path is in both.)
pub const VLLM_GENERATION_PATHS: &[&str] = &[
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/inference/v1/generate",
    "/cohere/v2/chat",
    "/invocations",
    "/v1/chat/completions/batch",
];

/// A path the filter orchestrates and the API it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrchestratedPath {
    pub path: String,
    pub api: Api,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub prefill_cluster: String,
    pub prefill_timeout: Duration,
    pub orchestrated_paths: Vec<OrchestratedPath>,
    /// Generation APIs whose client `kv_transfer_params` are removed on the way to decode.
    pub kv_stripped_paths: Vec<String>,
    pub max_request_body_bytes: usize,
    /// What the requests of one VM may hold in it across callbacks ([`crate::held_bytes`]).
    pub max_vm_held_bytes: usize,
    pub on_missing_kv_transfer_params: MissingKvPolicy,
    /// Lowercase names of client headers copied onto the prefill request.
    pub forward_headers: Vec<String>,
    /// Response header that tells the client how long prefill took, in milliseconds.
    pub prefill_time_header: Option<String>,
    /// Prefill cluster per `model`; others go to `prefill_cluster`.
    pub model_prefill_clusters: BTreeMap<String, String>,
    /// Request header the filter sets to the body's `model` before Envoy picks the route.
    /// Needs `allow_on_headers_stop_iteration: true` on the wasm filter.
    pub model_header: Option<String>,
    /// Hold an orchestrated request's headers as well as its body until prefill has answered,
    /// so that Envoy opens no decode stream for a request still uploading or in prefill.
    /// Needs `allow_on_headers_stop_iteration: true` on the wasm filter (a `model_header`
    /// holds them in any case).
    pub hold_request_headers: bool,
    /// Request header carrying the prefill host(s) a scheduler chose.
    pub prefill_host_header: String,
    /// ORIGINAL_DST cluster used to reach a scheduler-chosen host; the feature is off without it.
    pub prefill_host_cluster: Option<String>,
    /// The hosts a scheduler may choose for prefill.
    pub prefill_hosts_allowed: HostAllowlist,
    /// Extra prefill attempts after a connection failure, reset or 503.
    pub prefill_retries: u32,
    pub on_prefill_failure: PrefillFailurePolicy,
    /// Put the scheduler-chosen prefill host into `kv_transfer_params.remote_host` when
    /// prefill reports localhost.
    pub replace_local_remote_host: bool,
    /// Release prefill's KV when its decode leg will never run (the client left, decode was
    /// never reached, or the filter answered an error after prefill).
    pub release_kv_on_abandon: bool,
    pub usage: UsagePolicy,
    /// How prefill's copy of a request is written where the operator chooses (its
    /// `tool_choice`).
    pub prefill_options: PrefillOptions,
    /// Decode runs with vLLM's `--enable-force-include-usage`: a completions or chat stream
    /// carries usage even when its client did not ask for it, so every such stream is read
    /// for its usage. Otherwise only streams whose client sent `stream_options` are.
    pub decode_forces_include_usage: bool,
    /// The decode cluster releases are sent to.
    pub decode_cluster: String,
    /// Decode cluster per `model` for releases; others go to `decode_cluster`.
    pub model_decode_clusters: BTreeMap<String, String>,
    pub max_kv_releases_in_flight: u32,
    pub kv_release_timeout: Duration,
    /// Prefill calls still running after their client left, per client address and Envoy
    /// worker, past which the client's new requests are refused (429); 0: no limit.
    pub max_abandoned_prefills_per_client: u32,
    /// While Envoy cannot connect to a model's decode, that model's requests are refused
    /// (503) before prefill, one let through per this period; zero: never refused.
    pub decode_outage_retry: Duration,
    /// Lines at info level and above one Envoy worker writes per second; 0: no limit.
    pub max_log_lines_per_second: u32,
}

#[derive(Debug, PartialEq, Eq)]
pub struct ConfigError(String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "invalid pd-filter configuration: {}", self.0)
    }
}

/// Headers the filter itself sets on the prefill request.
const RESERVED_HEADERS: &[&str] = &[
    "accept-encoding",
    "content-type",
    "content-length",
    "x-request-id",
    crate::session::KV_RELEASE_HEADER,
    crate::session::ORIGINAL_DST_HEADER,
];

/// Headers that frame a message or belong to one connection: never the filter's to copy
/// onto prefill's call or to write into a request or an answer.
const CONNECTION_HEADERS: &[&str] = &[
    "connection",
    "content-encoding",
    "content-length",
    "content-type",
    "host",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// A client's credentials, which a header the filter writes would replace.
const CREDENTIAL_HEADERS: &[&str] = &[
    "authorization",
    "cookie",
    "proxy-authorization",
    "x-api-key",
];

/// Headers a scheduler inside the gateway sets to choose a worker (docs/security.md).
const ROUTING_HEADERS: &[&str] = &["x-gateway-destination-endpoint", "x-data-parallel-rank"];

/// Envoy's own headers: its router reads them (timeouts, retries, the original-destination
/// host), on the filter's calls too, which no edge of the connection manager cleans.
fn is_envoys(name: &str) -> bool {
    name.starts_with("x-envoy-")
}

/// A header the filter copies onto prefill's call (`forward_headers`).
fn check_forwarded_header(name: &str) -> Result<(), ConfigError> {
    let why = if RESERVED_HEADERS.contains(&name) {
        "is set by the filter itself"
    } else if CONNECTION_HEADERS.contains(&name) {
        "frames the message or belongs to the client's connection"
    } else if is_envoys(name) {
        "is read by Envoy's router on prefill's call (its timeout, retries or destination): \
         a client would choose them"
    } else {
        return Ok(());
    };
    Err(ConfigError(format!("forward_headers: {name:?} {why}")))
}

/// Why a header the filter writes or takes away is not the operator's to name: one that
/// frames the message, the filter's own, or Envoy's.
fn header_clash(name: &str) -> Option<&'static str> {
    if CONNECTION_HEADERS.contains(&name) {
        Some("frames the message or belongs to the connection")
    } else if RESERVED_HEADERS.contains(&name) {
        Some("is set by the filter itself")
    } else if is_envoys(name) {
        Some("is Envoy's own")
    } else {
        None
    }
}

/// A header the filter writes itself: the body's model on decode's request
/// (`model_header`), or prefill's time on the answer (`prefill_time_header`).
fn check_written_header(key: &str, name: &str, on_request: bool) -> Result<(), ConfigError> {
    let why = if let Some(why) = header_clash(name) {
        why
    } else if on_request && CREDENTIAL_HEADERS.contains(&name) {
        "carries the client's credentials, which the body's model would replace"
    } else if on_request && ROUTING_HEADERS.contains(&name) {
        "chooses a worker: the body's model would choose it"
    } else {
        return Ok(());
    };
    Err(ConfigError(format!("{key}: {name:?} {why}")))
}

/// The header a scheduler names prefill hosts in (`prefill_host_header`): the filter reads
/// it as a host list and removes it, so it can be no header the request needs on its way,
/// nor one the filter or Envoy writes.
fn check_scheduler_header(name: &str) -> Result<(), ConfigError> {
    let why = if let Some(why) = header_clash(name) {
        why
    } else if CREDENTIAL_HEADERS.contains(&name) {
        "carries the client's credentials, which would be read as prefill hosts and removed"
    } else if ROUTING_HEADERS.contains(&name) {
        "chooses the decode worker"
    } else {
        return Ok(());
    };
    Err(ConfigError(format!("prefill_host_header: {name:?} {why}")))
}

/// Refuses a configuration that gives a key twice in one object: JSON readers differ on
/// which one counts, so the setting in force would not be the one an operator reads.
fn check_no_repeated_keys(bytes: &[u8]) -> Result<(), ConfigError> {
    use serde::de::{DeserializeSeed, Error, MapAccess, SeqAccess, Visitor};

    struct Unique;

    impl<'de> DeserializeSeed<'de> for Unique {
        type Value = ();
        fn deserialize<D: serde::Deserializer<'de>>(self, input: D) -> Result<(), D::Error> {
            input.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Unique {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<(), A::Error> {
            while items.next_element_seed(Unique)?.is_some() {}
            Ok(())
        }
        fn visit_map<A: MapAccess<'de>>(self, mut members: A) -> Result<(), A::Error> {
            let mut seen = std::collections::BTreeSet::new();
            while let Some(key) = members.next_key::<String>()? {
                members.next_value_seed(Unique)?;
                if let Some(key) = seen.replace(key) {
                    return Err(A::Error::custom(format!(
                        "{key:?} is given twice in one object (JSON readers differ on which \
                         one counts); give it once"
                    )));
                }
            }
            Ok(())
        }
    }

    let mut input = serde_json::Deserializer::from_slice(bytes);
    Unique
        .deserialize(&mut input)
        .map_err(|e| ConfigError(e.to_string()))
}

/// A header name in the lowercase form Envoy uses.
fn header_name(key: &str, name: &str) -> Result<String, ConfigError> {
    let name = name.to_ascii_lowercase();
    let valid = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if valid {
        Ok(name)
    } else {
        Err(ConfigError(format!("{key}: {name:?} is not a header name")))
    }
}

/// vLLM's generation paths and the configuration's further ones, each once.
fn stripped_paths(configured: Vec<String>) -> Vec<String> {
    let mut paths: Vec<String> = VLLM_GENERATION_PATHS
        .iter()
        .map(|path| (*path).to_owned())
        .collect();
    for path in configured {
        if !paths.contains(&path) {
            paths.push(path);
        }
    }
    paths
}

/// The orchestrated paths, each once, with the API each names.
fn orchestrated_paths(paths: Vec<String>) -> Result<Vec<OrchestratedPath>, ConfigError> {
    if paths.is_empty() {
        return Err(ConfigError("paths must list at least one path".into()));
    }
    let mut orchestrated_paths = Vec::with_capacity(paths.len());
    for path in paths {
        check_plain_path("paths", &path)?;
        let api = Api::from_path(&path).ok_or_else(|| {
            ConfigError(format!(
                "path {path:?} must end in /completions, /chat/completions, /responses, \
                 /messages, /generate or /v2/chat"
            ))
        })?;
        if !orchestrated_paths
            .iter()
            .any(|known: &OrchestratedPath| known.path == path)
        {
            orchestrated_paths.push(OrchestratedPath { path, api });
        }
    }
    Ok(orchestrated_paths)
}

/// The settings of a scheduler that names prefill hosts go together, and may not let it send
/// prefill anywhere.
fn check_scheduler(raw: &RawConfig, allowed: &HostAllowlist) -> Result<(), ConfigError> {
    if raw
        .prefill_host_cluster
        .as_deref()
        .is_some_and(|cluster| cluster.trim().is_empty())
    {
        return Err(ConfigError("prefill_host_cluster must not be empty".into()));
    }
    if raw.prefill_host_cluster.is_some() && allowed.is_empty() {
        return Err(ConfigError(
            "prefill_host_cluster needs prefill_hosts_allowed: the networks or ip:port \
             hosts a scheduler may send prefill to (for example [\"10.0.0.0/8\"])"
                .into(),
        ));
    }
    if raw.replace_local_remote_host && raw.prefill_host_cluster.is_none() {
        return Err(ConfigError(
            "replace_local_remote_host needs prefill_host_cluster: the filter only knows \
             the prefill host when a scheduler chose it"
                .into(),
        ));
    }
    if raw.prefill_host_cluster.is_none() && !allowed.is_empty() {
        return Err(ConfigError(
            "prefill_hosts_allowed is read only with prefill_host_cluster, the cluster that \
             sends prefill to the host a scheduler named; set both, or neither"
                .into(),
        ));
    }
    if allowed.allows_every_address() {
        return Err(ConfigError(
            "prefill_hosts_allowed: a network of prefix length 0 lets a scheduler's header \
             send prefill anywhere, Envoy's admin included; list the prefill pool's \
             networks"
                .into(),
        ));
    }
    Ok(())
}

/// KV releases need a cluster to go to and room to go.
fn check_releases(raw: &RawConfig) -> Result<(), ConfigError> {
    if raw.release_kv_on_abandon && raw.decode_cluster.trim().is_empty() {
        return Err(ConfigError(
            "decode_cluster must name the decode cluster that KV releases go to".into(),
        ));
    }
    if raw.release_kv_on_abandon && raw.max_kv_releases_in_flight == 0 {
        return Err(ConfigError(
            "max_kv_releases_in_flight must be at least 1 (every release would be dropped); \
             to send none, set release_kv_on_abandon to false"
                .into(),
        ));
    }
    Ok(())
}

impl Config {
    /// Parses the plugin configuration; empty input means all defaults.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let raw: RawConfig = if bytes.iter().all(u8::is_ascii_whitespace) {
            RawConfig::default()
        } else {
            let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
                let bom = if bytes.starts_with(UTF8_BOM) {
                    ": it begins with a UTF-8 byte-order mark, which JSON text does not have"
                } else {
                    ""
                };
                ConfigError(format!(
                    "the configuration is not valid JSON ({e}){bom}; in Envoy, give it as a \
                     google.protobuf.StringValue holding the JSON text"
                ))
            })?;
            check_no_repeated_keys(bytes)?;
            check_shapes(&value)?;
            serde_json::from_value(value).map_err(|e| ConfigError(e.to_string()))?
        };

        if raw.prefill_cluster.trim().is_empty() {
            return Err(ConfigError("prefill_cluster must not be empty".into()));
        }
        if raw.max_vm_held_bytes < raw.max_request_body_bytes {
            return Err(ConfigError(format!(
                "max_vm_held_bytes ({}) must be at least max_request_body_bytes ({})",
                raw.max_vm_held_bytes, raw.max_request_body_bytes
            )));
        }
        let prefill_hosts_allowed = HostAllowlist::parse(&raw.prefill_hosts_allowed)
            .map_err(|e| ConfigError(format!("prefill_hosts_allowed: {e}")))?;
        check_scheduler(&raw, &prefill_hosts_allowed)?;
        check_releases(&raw)?;
        let orchestrated_paths = orchestrated_paths(raw.paths)?;
        for path in &raw.kv_stripped_paths {
            check_plain_path("kv_stripped_paths", path)?;
        }
        let mut forward_headers = Vec::with_capacity(raw.forward_headers.len());
        for name in raw.forward_headers {
            let name = header_name("forward_headers", &name)?;
            check_forwarded_header(&name)?;
            // A name listed twice (or in two cases) is one header: copied twice, every value
            // of the client's would reach prefill twice.
            if !forward_headers.contains(&name) {
                forward_headers.push(name);
            }
        }

        let prefill_time_header = raw
            .prefill_time_header
            .map(|name| header_name("prefill_time_header", &name))
            .transpose()?;
        if let Some(name) = &prefill_time_header {
            check_written_header("prefill_time_header", name, false)?;
        }

        let model_header = raw
            .model_header
            .map(|name| header_name("model_header", &name))
            .transpose()?;
        let prefill_host_header = header_name("prefill_host_header", &raw.prefill_host_header)?;
        check_scheduler_header(&prefill_host_header)?;
        if let Some(name) = &model_header {
            check_written_header("model_header", name, true)?;
            if *name == prefill_host_header {
                return Err(ConfigError(format!(
                    "model_header: {name:?} is prefill_host_header: the body's model would \
                     choose the prefill host"
                )));
            }
        }
        for (key, clusters) in [
            ("model_prefill_clusters", &raw.model_prefill_clusters),
            ("model_decode_clusters", &raw.model_decode_clusters),
        ] {
            if let Some((model, _)) = clusters.iter().find(|(_, c)| c.trim().is_empty()) {
                return Err(ConfigError(format!(
                    "{key}: the cluster for {model:?} is empty"
                )));
            }
        }

        Ok(Config {
            model_prefill_clusters: raw.model_prefill_clusters,
            model_header,
            hold_request_headers: raw.hold_request_headers,
            prefill_host_header,
            prefill_host_cluster: raw.prefill_host_cluster,
            prefill_hosts_allowed,
            prefill_retries: raw.prefill_retries,
            on_prefill_failure: raw.on_prefill_failure,
            replace_local_remote_host: raw.replace_local_remote_host,
            prefill_time_header,
            prefill_cluster: raw.prefill_cluster,
            prefill_timeout: Duration::from_millis(raw.prefill_timeout_ms),
            orchestrated_paths,
            kv_stripped_paths: stripped_paths(raw.kv_stripped_paths),
            max_request_body_bytes: raw.max_request_body_bytes,
            max_vm_held_bytes: raw.max_vm_held_bytes,
            on_missing_kv_transfer_params: raw.on_missing_kv_transfer_params,
            forward_headers,
            release_kv_on_abandon: raw.release_kv_on_abandon,
            usage: raw.usage,
            prefill_options: PrefillOptions {
                tool_choice: raw.prefill_tool_choice,
                responses_store: raw.responses_store,
                client_ec_transfer_params: raw.client_ec_transfer_params,
                truncate_to_context: raw.truncate_to_context,
                several_prompts: raw.several_prompts,
            },
            decode_forces_include_usage: raw.decode_forces_include_usage,
            decode_cluster: raw.decode_cluster,
            model_decode_clusters: raw.model_decode_clusters,
            max_kv_releases_in_flight: raw.max_kv_releases_in_flight,
            kv_release_timeout: Duration::from_millis(raw.kv_release_timeout_ms),
            max_abandoned_prefills_per_client: raw.max_abandoned_prefills_per_client,
            decode_outage_retry: Duration::from_millis(raw.decode_outage_retry_ms),
            max_log_lines_per_second: raw.max_log_lines_per_second,
        })
    }

    /// The prefill cluster for a request's `model`.
    pub fn prefill_cluster_for(&self, model: Option<&str>) -> &str {
        model
            .and_then(|model| self.model_prefill_clusters.get(model))
            .unwrap_or(&self.prefill_cluster)
    }

    /// The decode cluster a release for a request's `model` goes to.
    pub fn decode_cluster_for(&self, model: Option<&str>) -> &str {
        model
            .and_then(|model| self.model_decode_clusters.get(model))
            .unwrap_or(&self.decode_cluster)
    }

    /// What a valid configuration may still mean by mistake, one line each, for the log.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        let names_vllms = self
            .orchestrated_paths
            .iter()
            .any(|known| VLLM_GENERATION_PATHS.contains(&known.path.as_str()));
        if !names_vllms {
            let vllms: Vec<&str> = VLLM_GENERATION_PATHS
                .iter()
                .copied()
                .filter(|path| Api::from_path(path).is_some())
                .collect();
            warnings.push(format!(
                "paths lists none of vLLM's own paths ({}): requests to those reach decode \
                 with their kv_transfer_params removed, and decode computes the whole prompt",
                vllms.join(", ")
            ));
        }
        let risky: Vec<String> = [
            (IpAddr::from([127, 0, 0, 1]), "loopback"),
            (IpAddr::from(Ipv6Addr::LOCALHOST), "loopback"),
            (
                IpAddr::from([169, 254, 169, 254]),
                "link-local, a cloud's metadata service",
            ),
        ]
        .into_iter()
        .filter(|(ip, _)| self.prefill_hosts_allowed.covers(*ip))
        .map(|(ip, kind)| format!("{ip} ({kind})"))
        .collect();
        if !risky.is_empty() {
            warnings.push(format!(
                "prefill_hosts_allowed covers {}: a scheduler's header may send prefill's \
                 request there (to Envoy's admin, a metadata service); list only the prefill \
                 pool's networks outside a local test",
                risky.join(" and ")
            ));
        }
        if self.release_kv_on_abandon {
            let prefill_clusters: Vec<&str> = std::iter::once(self.prefill_cluster.as_str())
                .chain(self.model_prefill_clusters.values().map(String::as_str))
                .collect();
            let decode_clusters =
                std::iter::once(&self.decode_cluster).chain(self.model_decode_clusters.values());
            for cluster in decode_clusters {
                if prefill_clusters.contains(&cluster.as_str()) {
                    warnings.push(format!(
                        "KV releases go to {cluster:?}, which is also a prefill cluster: a \
                         release only frees prefill's KV when decode reads it; name the decode \
                         cluster in decode_cluster (model_decode_clusters)"
                    ));
                    break;
                }
            }
        }
        warnings
    }

    /// Whether Envoy lets the filter pause at headers and still give it the body: both
    /// `hold_request_headers` and `model_header` need `allow_on_headers_stop_iteration`, so
    /// either says it is set.
    pub fn headers_may_wait_for_body(&self) -> bool {
        self.hold_request_headers || self.model_header.is_some()
    }

    /// What the filter does with a request to `raw_path`.
    pub fn classify_path(&self, raw_path: &str) -> PathVerdict {
        classify_path(
            raw_path,
            self.orchestrated_paths
                .iter()
                .map(|orchestrated| (orchestrated.path.as_str(), orchestrated.api)),
            &self.kv_stripped_paths,
        )
    }
}

/// The kind of value a key takes, to say in words what is wrong with a value.
#[derive(Clone, Copy)]
enum Shape {
    Text,
    OptionalText,
    Flag,
    /// A whole number up to this.
    Count(u64),
    TextList,
    TextMap,
    /// One of these words.
    Choice(&'static [&'static str]),
}

/// Counts that 0 would make meaningless (no time to answer, no body).
const MUST_BE_ABOVE_ZERO: [&str; 3] = [
    "prefill_timeout_ms",
    "max_request_body_bytes",
    "kv_release_timeout_ms",
];

/// The longest timeout Envoy sends a call with, in milliseconds.
const LONGEST_CALL_MS: u64 = i32::MAX as u64;

const SHAPES: &[(&str, Shape)] = &[
    ("model_prefill_clusters", Shape::TextMap),
    ("model_header", Shape::OptionalText),
    ("hold_request_headers", Shape::Flag),
    ("prefill_host_header", Shape::Text),
    ("prefill_host_cluster", Shape::OptionalText),
    ("prefill_hosts_allowed", Shape::TextList),
    ("prefill_retries", Shape::Count(10)),
    (
        "on_prefill_failure",
        Shape::Choice(&["fail", "decode_only"]),
    ),
    ("replace_local_remote_host", Shape::Flag),
    ("prefill_cluster", Shape::Text),
    // Envoy takes a callout's timeout as a signed 32-bit count of milliseconds, and
    // refuses a call with a longer one as if the cluster were missing.
    ("prefill_timeout_ms", Shape::Count(LONGEST_CALL_MS)),
    ("paths", Shape::TextList),
    ("kv_stripped_paths", Shape::TextList),
    ("max_request_body_bytes", Shape::Count(u32::MAX as u64)),
    ("max_vm_held_bytes", Shape::Count(u32::MAX as u64)),
    (
        "on_missing_kv_transfer_params",
        Shape::Choice(&["decode_only", "recompute_on_decode", "fail"]),
    ),
    ("forward_headers", Shape::TextList),
    ("prefill_time_header", Shape::OptionalText),
    ("release_kv_on_abandon", Shape::Flag),
    ("usage", Shape::Choice(&["merge", "decode"])),
    (
        "prefill_tool_choice",
        Shape::Choice(&["rewrite", "as_sent"]),
    ),
    ("responses_store", Shape::Choice(&["per_server", "shared"])),
    (
        "client_ec_transfer_params",
        Shape::Choice(&["refuse", "pass"]),
    ),
    ("truncate_to_context", Shape::Choice(&["refuse", "serve"])),
    ("several_prompts", Shape::Choice(&["refuse", "decode_only"])),
    ("decode_forces_include_usage", Shape::Flag),
    ("decode_cluster", Shape::Text),
    ("model_decode_clusters", Shape::TextMap),
    ("max_kv_releases_in_flight", Shape::Count(u32::MAX as u64)),
    ("kv_release_timeout_ms", Shape::Count(LONGEST_CALL_MS)),
    (
        "max_abandoned_prefills_per_client",
        Shape::Count(u32::MAX as u64),
    ),
    ("decode_outage_retry_ms", Shape::Count(3_600_000)),
    ("max_log_lines_per_second", Shape::Count(u32::MAX as u64)),
];

/// Says, naming the key, what is wrong with a value of the wrong kind, in words a user reads
/// without knowing Rust's types.
fn check_shapes(value: &serde_json::Value) -> Result<(), ConfigError> {
    use serde_json::Value;
    let Value::Object(object) = value else {
        return Err(ConfigError(
            "the configuration must be a JSON object, like {\"prefill_cluster\": \"prefill\"}"
                .into(),
        ));
    };
    let described = |value: &Value| match value {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("the text {s:?}"),
        Value::Array(_) => "a list".to_owned(),
        Value::Object(_) => "an object".to_owned(),
    };
    for (key, value) in object {
        let Some((_, shape)) = SHAPES.iter().find(|(name, _)| name == key) else {
            let known: Vec<&str> = SHAPES.iter().map(|(name, _)| *name).collect();
            return Err(ConfigError(format!(
                "unknown key {key:?}; the keys are {}",
                known.join(", ")
            )));
        };
        let wrong = |wanted: &str| {
            Err(ConfigError(format!(
                "{key} must be {wanted}, not {}",
                described(value)
            )))
        };
        match (shape, value) {
            (Shape::Text, Value::String(_))
            | (Shape::OptionalText, Value::String(_) | Value::Null)
            | (Shape::Flag, Value::Bool(_)) => {}
            (Shape::Text, _) => return wrong("a text"),
            (Shape::OptionalText, _) => return wrong("a text or null"),
            (Shape::Flag, _) => return wrong("true or false"),
            (Shape::Count(max), Value::Number(n)) => match n.as_u64() {
                Some(0) if MUST_BE_ABOVE_ZERO.contains(&key.as_str()) => {
                    return Err(ConfigError(format!("{key} must be greater than 0")))
                }
                Some(n) if n <= *max => {}
                Some(_) => return wrong(&format!("a whole number up to {max}")),
                // Not a count JSON can hold as one: negative, with a fraction, past what 64
                // bits hold, or written with a decimal point or an exponent. Say which, so that
                // a number too large is not told it must be "1 or more".
                None => return wrong(&count_problem(key, n, *max)),
            },
            (Shape::Count(_), _) => return wrong("a whole number"),
            (Shape::TextList, Value::Array(items)) => {
                let not_text = items.iter().enumerate().find(|(_, item)| !item.is_string());
                if let Some((index, item)) = not_text {
                    return Err(ConfigError(format!(
                        "{key} must be a list of texts, not a list whose item {} is {}",
                        index.saturating_add(1),
                        described(item)
                    )));
                }
            }
            (Shape::TextList, _) => return wrong("a list of texts"),
            (Shape::TextMap, Value::Object(map)) => {
                if let Some((name, member)) = map.iter().find(|(_, member)| !member.is_string()) {
                    return Err(ConfigError(format!(
                        "{key} must be an object whose values are texts, not an object whose \
                         {name:?} is {}",
                        described(member)
                    )));
                }
            }
            (Shape::TextMap, _) => return wrong("an object whose values are texts"),
            (Shape::Choice(words), Value::String(word)) if words.contains(&word.as_str()) => {}
            (Shape::Choice(words), _) => return wrong(&format!("one of {}", words.join(", "))),
        }
    }
    Ok(())
}

/// What a count's value should be, for a number that is not a whole number JSON can hold
/// as written (`n.as_u64()` is `None`).
fn count_problem(key: &str, n: &serde_json::Number, max: u64) -> String {
    let least = u64::from(MUST_BE_ABOVE_ZERO.contains(&key));
    let value = n.as_f64().unwrap_or(f64::NAN);
    if value < 0.0 {
        format!("a whole number, {least} or more")
    } else if value.fract() != 0.0 {
        format!("a whole number from {least} to {max}")
    } else if value > max as f64 {
        format!("a whole number up to {max}")
    } else {
        "a whole number written in digits alone (no decimal point or exponent)".to_owned()
    }
}

/// A configured path must be the form a backend serves, or it could never match.
fn check_plain_path(key: &str, path: &str) -> Result<(), ConfigError> {
    if !path.starts_with('/') || path.contains(['?', '#']) {
        return Err(ConfigError(format!(
            "{key}: path {path:?} must start with '/' and have no query string"
        )));
    }
    if canonical_path(path) != path {
        return Err(ConfigError(format!(
            "{key}: path {path:?} must be written plainly, as {:?}",
            canonical_path(path)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_sent_to_a_prefill_cluster_are_warned_of() {
        let warned = |json: &str| {
            Config::from_json(json.as_bytes())
                .unwrap()
                .warnings()
                .iter()
                .any(|warning| warning.contains("also a prefill cluster"))
        };
        assert!(!warned("{}"));
        assert!(warned(r#"{"decode_cluster":"prefill"}"#));
        assert!(warned(
            r#"{"model_prefill_clusters":{"a":"pa"},"model_decode_clusters":{"a":"pa"}}"#
        ));
        assert!(!warned(
            r#"{"decode_cluster":"prefill","release_kv_on_abandon":false}"#
        ));
    }

    #[test]
    fn a_paths_list_without_vllms_own_paths_is_warned_about() {
        let warnings = |json: &str| Config::from_json(json.as_bytes()).unwrap().warnings();
        assert!(warnings("").is_empty());
        assert!(warnings(r#"{"paths":["/v1/chat/completions"]}"#).is_empty());
        let warned = warnings(r#"{"paths":["/completions","/x/v1/chat/completions"]}"#);
        assert_eq!(warned.len(), 1, "{warned:?}");
        assert!(warned[0].contains("none of vLLM's own paths (/v1/completions,"));
        assert!(!warned[0].contains("/invocations"));
    }

    #[test]
    fn prefill_hosts_allowed_that_cover_loopback_or_metadata_are_warned_about() {
        let warnings = |allowed: &str| {
            Config::from_json(
                format!(r#"{{"prefill_host_cluster":"dst","prefill_hosts_allowed":{allowed}}}"#)
                    .as_bytes(),
            )
            .unwrap()
            .warnings()
        };
        assert!(warnings(r#"["10.0.0.0/8","192.168.1.7:8100"]"#).is_empty());
        for (allowed, named) in [
            (r#"["0.0.0.0/1","128.0.0.0/1"]"#, "127.0.0.1 (loopback)"),
            (r#"["127.0.0.1:8100"]"#, "127.0.0.1 (loopback)"),
            (r#"["::/1"]"#, "::1 (loopback)"),
            (r#"["169.254.0.0/16"]"#, "169.254.169.254 (link-local"),
        ] {
            let warned = warnings(allowed);
            assert_eq!(warned.len(), 1, "{allowed}: {warned:?}");
            assert!(warned[0].contains(named), "{allowed}: {}", warned[0]);
        }
    }

    #[test]
    fn empty_configuration_uses_defaults() {
        for input in [&b""[..], b"  ", b"{}"] {
            let config = Config::from_json(input).unwrap();
            assert_eq!(config.prefill_cluster, "prefill");
            assert_eq!(config.prefill_timeout, Duration::from_secs(120));
            assert_eq!(config.orchestrated_paths.len(), 6);
            assert_eq!(
                config.on_missing_kv_transfer_params,
                MissingKvPolicy::DecodeOnly
            );
            assert_eq!(
                config.forward_headers[..2],
                ["authorization", "traceparent"]
            );
            // vLLM reads both before the body's fields of the same meaning.
            for header in ["x-vllm-priority", "x-session-id"] {
                assert!(
                    config.forward_headers.iter().any(|name| name == header),
                    "{header}"
                );
            }
            assert_eq!(config.prefill_time_header, None);
            assert_eq!(
                config.prefill_options.tool_choice,
                PrefillToolChoice::Rewrite
            );
            assert_eq!(
                config.prefill_options.responses_store,
                ResponsesStore::PerServer
            );
        }
    }

    #[test]
    fn mistakes_an_operator_would_not_notice_are_refused() {
        for (config, said) in [
            (r#"{"prefill_timeout_ms":4294967297}"#, "prefill_timeout_ms"),
            (
                r#"{"kv_release_timeout_ms":4294967296}"#,
                "kv_release_timeout_ms",
            ),
            (
                r#"{"decode_outage_retry_ms":3600001}"#,
                "decode_outage_retry_ms",
            ),
            (r#"{"decode_outage_retry_ms":-1}"#, "decode_outage_retry_ms"),
            (
                r#"{"prefill_hosts_allowed":["10.0.0.0/8"]}"#,
                "only with prefill_host_cluster",
            ),
            (
                r#"{"prefill_host_cluster":"dst","prefill_hosts_allowed":["10.0.0.0/8","0.0.0.0/0"]}"#,
                "prefix length 0",
            ),
            (
                r#"{"prefill_host_cluster":"dst","prefill_hosts_allowed":["::/0"]}"#,
                "prefix length 0",
            ),
        ] {
            let error = Config::from_json(config.as_bytes()).unwrap_err();
            assert!(error.0.contains(said), "{config}: {}", error.0);
        }
        let longest = Config::from_json(br#"{"prefill_timeout_ms":2147483647}"#).unwrap();
        assert_eq!(
            longest.prefill_timeout,
            Duration::from_millis(2_147_483_647)
        );
        for too_long in [
            r#"{"prefill_timeout_ms":2147483648}"#,
            r#"{"kv_release_timeout_ms":2147483648}"#,
        ] {
            let error = Config::from_json(too_long.as_bytes()).unwrap_err();
            assert!(error.0.contains("2147483647"), "{too_long}: {}", error.0);
        }
        // A path listed twice is one path.
        let twice = br#"{"paths":["/v1/completions","/v1/completions"]}"#;
        assert_eq!(
            Config::from_json(twice).unwrap().orchestrated_paths.len(),
            1
        );
    }

    #[test]
    fn a_forwarded_header_listed_twice_is_copied_once() {
        // An audit saw prefill get every value of the client's x-foo twice under
        // ["X-Foo", "x-foo"].
        let config =
            Config::from_json(br#"{"forward_headers":["X-Foo","x-foo","traceparent","X-FOO"]}"#)
                .unwrap();
        assert_eq!(config.forward_headers, ["x-foo", "traceparent"]);
    }

    #[test]
    fn prefill_tool_choice_is_rewrite_or_as_sent() {
        let config = Config::from_json(br#"{"prefill_tool_choice":"as_sent"}"#).unwrap();
        assert_eq!(
            config.prefill_options.tool_choice,
            PrefillToolChoice::AsSent
        );
        let error = Config::from_json(br#"{"prefill_tool_choice":"keep"}"#).unwrap_err();
        assert!(error.0.contains("rewrite, as_sent"), "{}", error.0);
    }

    #[test]
    fn client_ec_transfer_params_are_refused_unless_passed() {
        let config = Config::from_json(b"{}").unwrap();
        assert_eq!(
            config.prefill_options.client_ec_transfer_params,
            ClientEcTransferParams::Refuse
        );
        let config = Config::from_json(br#"{"client_ec_transfer_params":"pass"}"#).unwrap();
        assert_eq!(
            config.prefill_options.client_ec_transfer_params,
            ClientEcTransferParams::Pass
        );
        let error = Config::from_json(br#"{"client_ec_transfer_params":"strip"}"#).unwrap_err();
        assert!(error.0.contains("refuse, pass"), "{}", error.0);
    }

    #[test]
    fn several_prompts_are_refused_unless_decode_serves_them() {
        let config = Config::from_json(b"{}").unwrap();
        assert_eq!(
            config.prefill_options.several_prompts,
            SeveralPrompts::Refuse
        );
        let config = Config::from_json(br#"{"several_prompts":"decode_only"}"#).unwrap();
        assert_eq!(
            config.prefill_options.several_prompts,
            SeveralPrompts::DecodeOnly
        );
        let error = Config::from_json(br#"{"several_prompts":"serve"}"#).unwrap_err();
        assert!(error.0.contains("refuse, decode_only"), "{}", error.0);
    }

    #[test]
    fn truncation_to_the_context_is_refused_unless_served() {
        let config = Config::from_json(b"{}").unwrap();
        assert_eq!(
            config.prefill_options.truncate_to_context,
            TruncateToContext::Refuse
        );
        let config = Config::from_json(br#"{"truncate_to_context":"serve"}"#).unwrap();
        assert_eq!(
            config.prefill_options.truncate_to_context,
            TruncateToContext::Serve
        );
        let error = Config::from_json(br#"{"truncate_to_context":"yes"}"#).unwrap_err();
        assert!(error.0.contains("refuse, serve"), "{}", error.0);
    }

    #[test]
    fn responses_store_is_per_server_or_shared() {
        let config = Config::from_json(br#"{"responses_store":"shared"}"#).unwrap();
        assert_eq!(
            config.prefill_options.responses_store,
            ResponsesStore::Shared
        );
        let error = Config::from_json(br#"{"responses_store":"redis"}"#).unwrap_err();
        assert!(error.0.contains("per_server, shared"), "{}", error.0);
    }

    #[test]
    fn a_release_bound_of_zero_is_refused_unless_releases_are_off() {
        let error = Config::from_json(br#"{"max_kv_releases_in_flight":0}"#).unwrap_err();
        assert!(error.0.contains("release_kv_on_abandon"), "{}", error.0);
        let off = br#"{"max_kv_releases_in_flight":0,"release_kv_on_abandon":false}"#;
        assert!(Config::from_json(off).is_ok());
    }

    #[test]
    fn models_pick_their_prefill_cluster() {
        let config = Config::from_json(
            br#"{"model_prefill_clusters":{"llama":"prefill-llama"},"prefill_cluster":"p"}"#,
        )
        .unwrap();
        assert_eq!(config.prefill_cluster_for(Some("llama")), "prefill-llama");
        assert_eq!(config.prefill_cluster_for(Some("other")), "p");
        assert_eq!(config.prefill_cluster_for(None), "p");
        let config = Config::from_json(
            br#"{"model_decode_clusters":{"llama":"decode-llama"},"decode_cluster":"d"}"#,
        )
        .unwrap();
        assert_eq!(config.decode_cluster_for(Some("llama")), "decode-llama");
        assert_eq!(config.decode_cluster_for(Some("other")), "d");
        assert_eq!(config.decode_cluster_for(None), "d");
        assert_eq!(config.prefill_retries, 1);
        assert_eq!(config.on_prefill_failure, PrefillFailurePolicy::Fail);
        assert_eq!(config.prefill_host_header, "x-prefiller-host-port");
    }

    #[test]
    fn classifies_paths_ignoring_the_query() {
        let config = Config::from_json(b"").unwrap();
        let orchestrated = |path: &str| match config.classify_path(path) {
            PathVerdict::Orchestrate(api) => Some(api),
            _ => None,
        };
        assert_eq!(
            orchestrated("/v1/chat/completions?x=1"),
            Some(Api::ChatCompletions)
        );
        assert_eq!(orchestrated("/v1/responses"), Some(Api::Responses));
        assert_eq!(orchestrated("/v1/completions"), Some(Api::Completions));
        assert_eq!(config.classify_path("/v1/models"), PathVerdict::NotOurs);
        assert_eq!(
            config.classify_path("/v1/completions/x"),
            PathVerdict::NotOurs
        );
        assert_eq!(orchestrated("/v1/messages"), Some(Api::Messages));
        assert_eq!(orchestrated("/inference/v1/generate"), Some(Api::Generate));
        assert_eq!(
            config.classify_path("/invocations"),
            PathVerdict::StripKvTransferParams
        );
        assert!(matches!(
            config.classify_path("/v1/%63ompletions"),
            PathVerdict::Refuse(_)
        ));
    }

    #[test]
    fn vllms_own_apis_left_out_of_paths_are_still_stripped() {
        // A review saw /v1/completions and /v1/responses reach decode with the client's
        // kv_transfer_params under a configuration that orchestrated chat only.
        for config in [
            r#"{"paths":["/v1/chat/completions"]}"#,
            r#"{"paths":["/v1/chat/completions"],"kv_stripped_paths":[]}"#,
            r#"{"paths":["/v1/chat/completions"],"kv_stripped_paths":["/other/generate"]}"#,
        ] {
            let config = Config::from_json(config.as_bytes()).unwrap();
            for path in VLLM_GENERATION_PATHS
                .iter()
                .filter(|path| **path != "/v1/chat/completions")
            {
                assert_eq!(
                    config.classify_path(path),
                    PathVerdict::StripKvTransferParams,
                    "{path}"
                );
            }
            assert_eq!(
                config.classify_path("/v1/chat/completions"),
                PathVerdict::Orchestrate(Api::ChatCompletions)
            );
        }
        let config = Config::from_json(br#"{"kv_stripped_paths":["/other/generate"]}"#).unwrap();
        assert_eq!(
            config.classify_path("/other/generate"),
            PathVerdict::StripKvTransferParams
        );
    }

    #[test]
    fn custom_paths_take_their_api_from_the_suffix() {
        let config =
            Config::from_json(br#"{"paths":["/openai/v1/chat/completions","/x/responses"]}"#)
                .unwrap();
        assert_eq!(
            config.classify_path("/openai/v1/chat/completions"),
            PathVerdict::Orchestrate(Api::ChatCompletions)
        );
        assert_eq!(
            config.classify_path("/x/responses"),
            PathVerdict::Orchestrate(Api::Responses)
        );
        assert_eq!(
            config.classify_path("/v1/completions"),
            PathVerdict::StripKvTransferParams
        );
        assert_eq!(config.classify_path("/v1/models"), PathVerdict::NotOurs);
    }

    #[test]
    fn old_spellings_of_decode_only_still_work() {
        let config =
            Config::from_json(br#"{"on_missing_kv_transfer_params":"recompute_on_decode"}"#)
                .unwrap();
        assert_eq!(
            config.on_missing_kv_transfer_params,
            MissingKvPolicy::DecodeOnly
        );
        let config =
            Config::from_json(br#"{"on_missing_kv_transfer_params":"decode_only"}"#).unwrap();
        assert_eq!(
            config.on_missing_kv_transfer_params,
            MissingKvPolicy::DecodeOnly
        );
    }

    #[test]
    fn scheduler_hosts_need_an_allowlist() {
        let config = Config::from_json(
            br#"{"prefill_host_cluster":"dst","prefill_hosts_allowed":["10.0.0.0/8"]}"#,
        )
        .unwrap();
        assert!(config
            .prefill_hosts_allowed
            .allows("10.2.3.4:8000".parse().unwrap()));
    }

    #[test]
    fn rejects_bad_keys_and_values_with_a_clear_message() {
        let cases: &[(&str, &str)] = &[
            (r#"{"prefill_clustr":"p"}"#, "unknown key \"prefill_clustr\""),
            (
                r#"{"prefill_cluster":""}"#,
                "prefill_cluster must not be empty",
            ),
            (r#"{"prefill_timeout_ms":0}"#, "prefill_timeout_ms"),
            (
                r#"{"kv_release_timeout_ms":0}"#,
                "kv_release_timeout_ms must be greater than 0",
            ),
            (
                r#"{"prefill_timeout_ms":"1s"}"#,
                "prefill_timeout_ms must be a whole number, not the text \"1s\"",
            ),
            (
                r#"{"prefill_retries":99999999999}"#,
                "prefill_retries must be a whole number up to 10",
            ),
            (
                r#"{"prefill_host_header":"Authorization"}"#,
                "prefill_host_header: \"authorization\" carries the client's credentials",
            ),
            (
                r#"{"prefill_host_header":"x-envoy-original-dst-host"}"#,
                "prefill_host_header: \"x-envoy-original-dst-host\" is set by the filter",
            ),
            (
                r#"{"prefill_host_header":"x-envoy-upstream-rq-timeout-ms"}"#,
                "is Envoy's own",
            ),
            (
                r#"{"prefill_host_header":"x-request-id"}"#,
                "is set by the filter itself",
            ),
            (r#"{"prefill_host_header":"host"}"#, "belongs to the connection"),
            (
                r#"{"prefill_host_header":"x-gateway-destination-endpoint"}"#,
                "chooses the decode worker",
            ),
            (
                r#"{"max_request_body_bytes":1e9}"#,
                "max_request_body_bytes must be a whole number written in digits alone (no \
                 decimal point or exponent), not 1000000000.0",
            ),
            ("[]", "must be a JSON object"),
            (
                "\u{feff}{}",
                "not valid JSON (expected value at line 1 column 1): it begins with a UTF-8 \
                 byte-order mark",
            ),
            (r#"{"paths":[]}"#, "at least one path"),
            (r#"{"paths":["/v1/embeddings"]}"#, "must end in"),
            (r#"{"paths":["v1/completions"]}"#, "must start with '/'"),
            (
                r#"{"paths":["/v1//completions"]}"#,
                "must be written plainly",
            ),
            (
                r#"{"kv_stripped_paths":["/v1/%6dessages"]}"#,
                "must be written plainly",
            ),
            (
                r#"{"prefill_host_cluster":"dst"}"#,
                "needs prefill_hosts_allowed",
            ),
            (
                r#"{"prefill_host_cluster":"dst","prefill_hosts_allowed":["host:1"]}"#,
                "prefill_hosts_allowed",
            ),
            (
                r#"{"on_missing_kv_transfer_params":"maybe"}"#,
                "on_missing_kv_transfer_params must be one of decode_only, recompute_on_decode, fail",
            ),
            (
                r#"{"forward_headers":["x-request-id"]}"#,
                "set by the filter",
            ),
            (
                r#"{"forward_headers":["X-PD-KV-Release"]}"#,
                "set by the filter",
            ),
            (r#"{"forward_headers":["bad header"]}"#, "not a header name"),
            (
                r#"{"forward_headers":["X-Envoy-Original-Dst-Host"]}"#,
                "set by the filter",
            ),
            (
                r#"{"forward_headers":["x-envoy-upstream-rq-timeout-ms"]}"#,
                "read by Envoy's router",
            ),
            (
                r#"{"forward_headers":["transfer-encoding"]}"#,
                "frames the message",
            ),
            (r#"{"forward_headers":["host"]}"#, "frames the message"),
            (
                r#"{"prefill_time_header":"content-length"}"#,
                "prefill_time_header: \"content-length\" frames the message",
            ),
            (
                r#"{"prefill_time_header":"x-request-id"}"#,
                "set by the filter",
            ),
            (
                r#"{"model_header":"Authorization"}"#,
                "model_header: \"authorization\" carries the client's credentials",
            ),
            (r#"{"model_header":"x-api-key"}"#, "credentials"),
            (r#"{"model_header":"content-type"}"#, "frames the message"),
            (r#"{"model_header":"x-pd-kv-release"}"#, "set by the filter"),
            (r#"{"model_header":"accept-encoding"}"#, "set by the filter"),
            (
                r#"{"model_header":"x-gateway-destination-endpoint"}"#,
                "chooses a worker",
            ),
            (
                r#"{"model_header":"x-prefiller-host-port"}"#,
                "the body's model would choose the prefill host",
            ),
            (r#"{"model_header":"x-envoy-original-path"}"#, "Envoy's own"),
            (
                r#"{"prefill_cluster":"a","prefill_cluster":"b"}"#,
                "\"prefill_cluster\" is given twice in one object",
            ),
            (
                r#"{"model_prefill_clusters":{"m":"a","m":"b"}}"#,
                "\"m\" is given twice",
            ),
            (r#"{"max_request_body_bytes":0}"#, "max_request_body_bytes"),
            (
                r#"{"max_request_body_bytes":1000,"max_vm_held_bytes":999}"#,
                "max_vm_held_bytes (999) must be at least max_request_body_bytes (1000)",
            ),
            (r#"{"prefill_time_header":"a b"}"#, "prefill_time_header"),
            (
                r#"{"model_prefill_clusters":{"m":""}}"#,
                "cluster for \"m\" is empty",
            ),
            (
                r#"{"model_decode_clusters":{"m":" "}}"#,
                "model_decode_clusters: the cluster for \"m\" is empty",
            ),
            (r#"{"model_header":""}"#, "model_header"),
            // What a careless operator writes for the flags that change what reaches decode.
            (
                r#"{"hold_request_headers":"yes"}"#,
                "hold_request_headers must be true or false",
            ),
            (
                r#"{"decode_forces_include_usage":1}"#,
                "decode_forces_include_usage must be true or false",
            ),
            (r#"{"prefill_retries":-1}"#, "prefill_retries must be a whole number, 0 or more"),
            (
                r#"{"prefill_timeout_ms":-1}"#,
                "prefill_timeout_ms must be a whole number, 1 or more",
            ),
            (r#"{"prefill_retries":11}"#, "up to 10, not 11"),
            // The per-worker bounds: a count, 0 turning them off.
            (
                r#"{"max_log_lines_per_second":-1}"#,
                "max_log_lines_per_second must be a whole number, 0 or more",
            ),
            (
                r#"{"max_log_lines_per_second":"20"}"#,
                "max_log_lines_per_second must be a whole number",
            ),
            (
                r#"{"max_abandoned_prefills_per_client":1.5}"#,
                "max_abandoned_prefills_per_client must be a whole number",
            ),
            // A number too large for 64 bits is too large, not "1 or more"; one written with
            // an exponent or a decimal point is told how to write it.
            (
                r#"{"prefill_timeout_ms":99999999999999999999999}"#,
                "prefill_timeout_ms must be a whole number up to 2147483647, not 1e+23",
            ),
            (
                r#"{"prefill_retries":1e1}"#,
                "prefill_retries must be a whole number written in digits alone",
            ),
            (
                r#"{"prefill_retries":2.5}"#,
                "prefill_retries must be a whole number from 0 to 10, not 2.5",
            ),
            (
                r#"{"kv_release_timeout_ms":-2.5}"#,
                "kv_release_timeout_ms must be a whole number, 1 or more",
            ),
            (r#"{"on_prefill_failure":"retry"}"#, "one of fail, decode_only"),
            (
                r#"{"replace_local_remote_host":true,"prefill_hosts_allowed":["10.0.0.1"]}"#,
                "needs prefill_host_cluster",
            ),
            ("not json", "not valid JSON"),
            // A list or an object whose container is right says which member is wrong.
            (
                r#"{"paths":["/v1/completions",5]}"#,
                "paths must be a list of texts, not a list whose item 2 is 5",
            ),
            (
                r#"{"model_prefill_clusters":{"llama":{"cluster":"p"}}}"#,
                "model_prefill_clusters must be an object whose values are texts, not an \
                 object whose \"llama\" is an object",
            ),
            (
                r#"{"model_decode_clusters":["m"]}"#,
                "model_decode_clusters must be an object whose values are texts, not a list",
            ),
        ];
        for (input, expected) in cases {
            let err = Config::from_json(input.as_bytes()).unwrap_err().to_string();
            assert!(err.contains(expected), "{input}: {err}");
            assert!(err.starts_with("invalid pd-filter configuration: "));
        }
    }
}
