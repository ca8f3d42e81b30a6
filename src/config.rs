//! The plugin configuration: parsed and validated once, when Envoy loads the plugin.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use crate::protocol::Endpoint;

/// What to do when prefill answers 2xx but without usable `kv_transfer_params`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingKvPolicy {
    /// Send the client's original body to decode; decode recomputes the prompt.
    RecomputeOnDecode,
    /// Answer the client 502.
    Fail,
}

/// What to do when the prefill leg fails (after its retries) with anything but a 4xx.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillFailurePolicy {
    /// Answer the client with the mapped error (502, 503 or 504).
    Fail,
    /// Send the original body to decode without `kv_transfer_params`: the client is still
    /// served, at the cost of a full prefill on decode.
    DecodeOnly,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawConfig {
    model_prefill_clusters: BTreeMap<String, String>,
    model_header: Option<String>,
    prefill_host_header: String,
    prefill_host_cluster: Option<String>,
    prefill_retries: u32,
    on_prefill_failure: PrefillFailurePolicy,
    replace_local_remote_host: bool,
    prefill_cluster: String,
    prefill_timeout_ms: u64,
    paths: Vec<String>,
    max_request_body_bytes: usize,
    on_missing_kv_transfer_params: MissingKvPolicy,
    forward_headers: Vec<String>,
    prefill_time_header: Option<String>,
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
            ],
            max_request_body_bytes: 8 * 1024 * 1024,
            on_missing_kv_transfer_params: MissingKvPolicy::RecomputeOnDecode,
            forward_headers: vec!["authorization".to_owned()],
            prefill_time_header: None,
            model_prefill_clusters: BTreeMap::new(),
            model_header: None,
            prefill_host_header: "x-prefiller-host-port".to_owned(),
            prefill_host_cluster: None,
            prefill_retries: 1,
            on_prefill_failure: PrefillFailurePolicy::Fail,
            replace_local_remote_host: false,
        }
    }
}

/// A path the filter orchestrates and the API it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub path: String,
    pub endpoint: Endpoint,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub prefill_cluster: String,
    pub prefill_timeout: Duration,
    pub routes: Vec<Route>,
    pub max_request_body_bytes: usize,
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
    /// Request header carrying the prefill host(s) a scheduler chose.
    pub prefill_host_header: String,
    /// ORIGINAL_DST cluster used to reach a scheduler-chosen host; the feature is off without it.
    pub prefill_host_cluster: Option<String>,
    /// Extra prefill attempts after a connection failure, reset or 503.
    pub prefill_retries: u32,
    pub on_prefill_failure: PrefillFailurePolicy,
    /// Put the scheduler-chosen prefill host into `kv_transfer_params.remote_host` when
    /// prefill reports localhost.
    pub replace_local_remote_host: bool,
}

#[derive(Debug, PartialEq, Eq)]
pub struct ConfigError(String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "invalid pd-filter configuration: {}", self.0)
    }
}

/// Headers the filter itself sets on the prefill request.
const RESERVED_HEADERS: &[&str] = &["content-type", "content-length", "x-request-id"];

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

impl Config {
    /// Parses the plugin configuration; empty input means all defaults.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let raw: RawConfig = if bytes.iter().all(u8::is_ascii_whitespace) {
            RawConfig::default()
        } else {
            serde_json::from_slice(bytes).map_err(|e| ConfigError(e.to_string()))?
        };

        if raw.prefill_cluster.trim().is_empty() {
            return Err(ConfigError("prefill_cluster must not be empty".into()));
        }
        if raw.prefill_timeout_ms == 0 {
            return Err(ConfigError(
                "prefill_timeout_ms must be greater than 0".into(),
            ));
        }
        if raw.max_request_body_bytes == 0 {
            return Err(ConfigError(
                "max_request_body_bytes must be greater than 0".into(),
            ));
        }
        if raw.paths.is_empty() {
            return Err(ConfigError("paths must list at least one path".into()));
        }
        let mut routes = Vec::with_capacity(raw.paths.len());
        for path in raw.paths {
            if !path.starts_with('/') || path.contains('?') {
                return Err(ConfigError(format!(
                    "path {path:?} must start with '/' and have no query string"
                )));
            }
            let endpoint = Endpoint::from_path(&path).ok_or_else(|| {
                ConfigError(format!(
                    "path {path:?} must end in /completions, /chat/completions or /responses"
                ))
            })?;
            routes.push(Route { path, endpoint });
        }
        let mut forward_headers = Vec::with_capacity(raw.forward_headers.len());
        for name in raw.forward_headers {
            let name = header_name("forward_headers", &name)?;
            if RESERVED_HEADERS.contains(&name.as_str()) {
                return Err(ConfigError(format!(
                    "forward_headers: {name:?} is set by the filter itself"
                )));
            }
            forward_headers.push(name);
        }

        let prefill_time_header = raw
            .prefill_time_header
            .map(|name| header_name("prefill_time_header", &name))
            .transpose()?;

        let model_header = raw
            .model_header
            .map(|name| header_name("model_header", &name))
            .transpose()?;
        let prefill_host_header = header_name("prefill_host_header", &raw.prefill_host_header)?;
        for (model, cluster) in &raw.model_prefill_clusters {
            if cluster.trim().is_empty() {
                return Err(ConfigError(format!(
                    "model_prefill_clusters: the cluster for {model:?} is empty"
                )));
            }
        }
        if raw
            .prefill_host_cluster
            .as_deref()
            .is_some_and(|cluster| cluster.trim().is_empty())
        {
            return Err(ConfigError("prefill_host_cluster must not be empty".into()));
        }
        if raw.prefill_retries > 10 {
            return Err(ConfigError("prefill_retries must be at most 10".into()));
        }
        if raw.replace_local_remote_host && raw.prefill_host_cluster.is_none() {
            return Err(ConfigError(
                "replace_local_remote_host needs prefill_host_cluster: the filter only knows \
                 the prefill host when a scheduler chose it"
                    .into(),
            ));
        }

        Ok(Config {
            model_prefill_clusters: raw.model_prefill_clusters,
            model_header,
            prefill_host_header,
            prefill_host_cluster: raw.prefill_host_cluster,
            prefill_retries: raw.prefill_retries,
            on_prefill_failure: raw.on_prefill_failure,
            replace_local_remote_host: raw.replace_local_remote_host,
            prefill_time_header,
            prefill_cluster: raw.prefill_cluster,
            prefill_timeout: Duration::from_millis(raw.prefill_timeout_ms),
            routes,
            max_request_body_bytes: raw.max_request_body_bytes,
            on_missing_kv_transfer_params: raw.on_missing_kv_transfer_params,
            forward_headers,
        })
    }

    /// The prefill cluster for a request's `model`.
    pub fn prefill_cluster_for(&self, model: Option<&str>) -> &str {
        model
            .and_then(|model| self.model_prefill_clusters.get(model))
            .unwrap_or(&self.prefill_cluster)
    }

    /// The endpoint served at `path` (a query string is ignored), if the filter handles it.
    pub fn endpoint_for(&self, path: &str) -> Option<Endpoint> {
        let path = path.split_once('?').map_or(path, |(p, _)| p);
        self.routes
            .iter()
            .find(|route| route.path == path)
            .map(|route| route.endpoint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_configuration_uses_defaults() {
        for input in [&b""[..], b"  ", b"{}"] {
            let config = Config::from_json(input).unwrap();
            assert_eq!(config.prefill_cluster, "prefill");
            assert_eq!(config.prefill_timeout, Duration::from_secs(120));
            assert_eq!(config.routes.len(), 3);
            assert_eq!(
                config.on_missing_kv_transfer_params,
                MissingKvPolicy::RecomputeOnDecode
            );
            assert_eq!(config.forward_headers, vec!["authorization"]);
            assert_eq!(config.prefill_time_header, None);
        }
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
        assert_eq!(config.prefill_retries, 1);
        assert_eq!(config.on_prefill_failure, PrefillFailurePolicy::Fail);
        assert_eq!(config.prefill_host_header, "x-prefiller-host-port");
    }

    #[test]
    fn matches_paths_ignoring_the_query() {
        let config = Config::from_json(b"").unwrap();
        assert_eq!(
            config.endpoint_for("/v1/chat/completions?x=1"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(
            config.endpoint_for("/v1/responses"),
            Some(Endpoint::Responses)
        );
        assert_eq!(
            config.endpoint_for("/v1/completions"),
            Some(Endpoint::Completions)
        );
        assert_eq!(config.endpoint_for("/v1/models"), None);
        assert_eq!(config.endpoint_for("/v1/completions/x"), None);
    }

    #[test]
    fn custom_paths_take_their_endpoint_from_the_suffix() {
        let config =
            Config::from_json(br#"{"paths":["/openai/v1/chat/completions","/x/responses"]}"#)
                .unwrap();
        assert_eq!(
            config.endpoint_for("/openai/v1/chat/completions"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(
            config.endpoint_for("/x/responses"),
            Some(Endpoint::Responses)
        );
        assert_eq!(config.endpoint_for("/v1/completions"), None);
    }

    #[test]
    fn rejects_bad_keys_and_values_with_a_clear_message() {
        let cases: &[(&str, &str)] = &[
            (
                r#"{"prefill_clustr":"p"}"#,
                "unknown field `prefill_clustr`",
            ),
            (
                r#"{"prefill_cluster":""}"#,
                "prefill_cluster must not be empty",
            ),
            (r#"{"prefill_timeout_ms":0}"#, "prefill_timeout_ms"),
            (r#"{"prefill_timeout_ms":"1s"}"#, "invalid type"),
            (r#"{"paths":[]}"#, "at least one path"),
            (r#"{"paths":["/v1/embeddings"]}"#, "must end in"),
            (r#"{"paths":["v1/completions"]}"#, "must start with '/'"),
            (
                r#"{"on_missing_kv_transfer_params":"maybe"}"#,
                "unknown variant",
            ),
            (
                r#"{"forward_headers":["x-request-id"]}"#,
                "set by the filter",
            ),
            (r#"{"forward_headers":["bad header"]}"#, "not a header name"),
            (r#"{"max_request_body_bytes":0}"#, "max_request_body_bytes"),
            (r#"{"prefill_time_header":"a b"}"#, "prefill_time_header"),
            (
                r#"{"model_prefill_clusters":{"m":""}}"#,
                "cluster for \"m\" is empty",
            ),
            (r#"{"model_header":""}"#, "model_header"),
            (r#"{"prefill_retries":-1}"#, "invalid value"),
            (r#"{"prefill_retries":11}"#, "at most 10"),
            (r#"{"on_prefill_failure":"retry"}"#, "unknown variant"),
            (
                r#"{"replace_local_remote_host":true}"#,
                "needs prefill_host_cluster",
            ),
            ("not json", "expected"),
        ];
        for (input, expected) in cases {
            let err = Config::from_json(input.as_bytes()).unwrap_err().to_string();
            assert!(err.contains(expected), "{input}: {err}");
            assert!(err.starts_with("invalid pd-filter configuration: "));
        }
    }
}
