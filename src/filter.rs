//! The adapter to the proxy-wasm host. It only moves bytes between Envoy and
//! [`crate::protocol`]; every host call goes through `hostcalls` so that an unexpected host
//! status is handled as a value instead of panicking the VM (the SDK's trait helpers unwrap).

use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use crate::config::{Config, PrefillFailurePolicy};
use crate::protocol::{
    self, ClientError, DecodePlan, Endpoint, FailureKind, PrefillFailure, PrefillOutcome,
};
use crate::stats::Stats;

/// Header an ORIGINAL_DST cluster (`use_http_header: true`) reads the destination from.
const ORIGINAL_DST_HEADER: &str = "x-envoy-original-dst-host";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(PdRoot { config: None, stats: None })
    });
}}

struct PdRoot {
    config: Option<Rc<Config>>,
    stats: Option<Rc<Stats>>,
}

impl Context for PdRoot {}

impl RootContext for PdRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        // Follow Envoy's level, so that debug lines cost nothing per request unless asked for.
        if let Ok(level) = hostcalls::get_log_level() {
            proxy_wasm::set_log_level(level);
        }
        if self.stats.is_none() {
            self.stats = Some(Rc::new(Stats::define()));
        }
        match Config::from_json(&bytes) {
            Ok(config) => {
                log::info!(
                    "pd-filter configured: prefill cluster {:?}, {} paths, prefill timeout {:?}",
                    config.prefill_cluster,
                    config.routes.len(),
                    config.prefill_timeout
                );
                self.config = Some(Rc::new(config));
                true
            }
            Err(error) => {
                log::error!("{error}");
                false
            }
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Defining metrics is a host call per metric: never per request.
        let stats = self
            .stats
            .clone()
            .unwrap_or_else(|| Rc::new(Stats::disabled()));
        Some(Box::new(PdRequest {
            config: self.config.clone(),
            stats,
            request_id: String::new(),
            prefill_headers: Vec::new(),
            scheduled_hosts: Vec::new(),
            state: State::PassThrough,
            prefill_time: None,
        }))
    }
}

enum State {
    /// Not a request the filter orchestrates, or one already sent on to decode.
    PassThrough,
    /// The filter answered the client itself.
    Answered,
    /// Waiting for the rest of the client body.
    Buffering { endpoint: Endpoint },
    /// A prefill callout is in flight; the client body is held by Envoy.
    AwaitingPrefill(Flight),
}

/// The prefill leg of one request, across its attempts.
struct Flight {
    token: u32,
    endpoint: Endpoint,
    original: Vec<u8>,
    decode_plan: DecodePlan,
    cluster: String,
    /// Number of the attempt in flight, from 0.
    attempt: u32,
    started: Option<SystemTime>,
}

struct PdRequest {
    config: Option<Rc<Config>>,
    stats: Rc<Stats>,
    request_id: String,
    /// Headers every prefill attempt carries.
    prefill_headers: Vec<(String, String)>,
    /// Prefill hosts a scheduler chose, tried in order.
    scheduled_hosts: Vec<SocketAddr>,
    state: State,
    /// How long the prefill leg took, once it answered.
    prefill_time: Option<Duration>,
}

impl Context for PdRequest {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let flight = match std::mem::replace(&mut self.state, State::PassThrough) {
            State::AwaitingPrefill(flight) if flight.token == token_id => flight,
            other => {
                self.state = other;
                return;
            }
        };
        let Some(config) = self.config.clone() else {
            return;
        };

        // A reset callout has no headers at all: read them as a list, never `:status` by name.
        let status = hostcalls::get_map_bytes(MapType::HttpCallResponseHeaders)
            .unwrap_or_default()
            .into_iter()
            .find(|(name, _)| name == ":status")
            .and_then(|(_, value)| std::str::from_utf8(&value).ok()?.parse::<u16>().ok());
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        let outcome = protocol::interpret_prefill_response(
            status,
            &body,
            config.on_missing_kv_transfer_params,
        );
        let flight = match &outcome {
            Err(failure) if failure.is_retryable() => match self.retry(&config, flight, failure) {
                Ok(()) => return,
                Err(flight) => flight,
            },
            _ => flight,
        };

        self.prefill_time = flight.started.and_then(|started| {
            hostcalls::get_current_time()
                .ok()?
                .duration_since(started)
                .ok()
        });
        if let Some(elapsed) = self.prefill_time {
            self.stats.prefill_latency(elapsed.as_millis() as u64);
        }

        match outcome {
            Ok(PrefillOutcome::KvTransferParams(kv)) => {
                let reached = self.host_of_attempt(flight.attempt);
                let with_host = reached
                    .filter(|_| config.replace_local_remote_host)
                    .and_then(|host| protocol::with_reachable_remote_host(kv, host.ip()));
                let kv = with_host.as_deref().unwrap_or(kv);
                let decode_body = protocol::decode_body(&flight.original, &flight.decode_plan, kv);
                if let Err(status) = hostcalls::set_buffer(
                    BufferType::HttpRequestBody,
                    0,
                    flight.original.len(),
                    &decode_body,
                ) {
                    log::error!(
                        "[{}] could not replace the request body: {status:?}",
                        self.request_id
                    );
                    self.reply_error(&ClientError::internal(
                        "pd-filter could not write the decode request body",
                    ));
                    return;
                }
                log::debug!(
                    "[{}] prefill answered in {:?}; resuming to decode",
                    self.request_id,
                    self.prefill_time
                );
                self.resume();
            }
            Ok(PrefillOutcome::RecomputeOnDecode(reason)) => {
                self.decode_only(FailureKind::NoKvTransferParams, &reason);
            }
            Err(failure) => {
                if config.on_prefill_failure == PrefillFailurePolicy::DecodeOnly
                    && !failure.is_client_error()
                {
                    self.decode_only(failure.kind, &failure.error.message);
                } else {
                    self.fail_prefill(&failure);
                }
            }
        }
    }
}

impl HttpContext for PdRequest {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(config) = self.config.clone() else {
            self.reply_error(&ClientError::internal(
                "pd-filter has no valid configuration",
            ));
            return Action::Pause;
        };
        // One host call for all headers rather than one per header.
        let headers = hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default();
        let request_header = |name: &str| {
            headers
                .iter()
                .find(|(key, _)| key == name)
                .and_then(|(_, value)| std::str::from_utf8(value).ok())
                .map(str::to_owned)
        };
        let path = request_header(":path");
        let endpoint = path.as_deref().and_then(|path| config.endpoint_for(path));
        let (Some(path), Some(endpoint), Some("POST")) =
            (path, endpoint, request_header(":method").as_deref())
        else {
            self.stats.passed_through();
            return Action::Continue;
        };

        self.request_id = match request_header("x-request-id").filter(|id| !id.is_empty()) {
            Some(id) => id,
            None => {
                let id = crate::request_id::new_request_id();
                set_request_header("x-request-id", Some(&id), &id);
                id
            }
        };

        if let Err(error) = protocol::check_content_type(request_header("content-type").as_deref())
        {
            self.reject(&error);
            return Action::Pause;
        }
        if end_of_stream {
            self.reject(&ClientError::bad_request("request body is empty"));
            return Action::Pause;
        }
        let declared_length =
            request_header("content-length").and_then(|v| v.parse::<usize>().ok());
        if declared_length.is_some_and(|length| length > config.max_request_body_bytes) {
            self.reject(&ClientError::payload_too_large(
                config.max_request_body_bytes,
            ));
            return Action::Pause;
        }
        if config.prefill_host_cluster.is_some() {
            if let Some(value) = request_header(&config.prefill_host_header) {
                // The scheduler's choice is for the prefill leg only.
                set_request_header(&config.prefill_host_header, None, &self.request_id);
                match protocol::parse_prefill_hosts(&config.prefill_host_header, &value) {
                    Ok(hosts) => self.scheduled_hosts = hosts,
                    Err(error) => {
                        self.reject(&error);
                        return Action::Pause;
                    }
                }
            }
        }
        // The decode body is longer than the client's: let Envoy frame it.
        set_request_header("content-length", None, &self.request_id);

        let authority =
            request_header(":authority").unwrap_or_else(|| config.prefill_cluster.clone());
        self.prefill_headers = vec![
            (":method".to_owned(), "POST".to_owned()),
            (":path".to_owned(), path),
            (":authority".to_owned(), authority),
            ("content-type".to_owned(), "application/json".to_owned()),
            ("x-request-id".to_owned(), self.request_id.clone()),
        ];
        for name in &config.forward_headers {
            if let Some(value) = request_header(name) {
                self.prefill_headers.push((name.clone(), value));
            }
        }
        self.state = State::Buffering { endpoint };
        if config.model_header.is_some() {
            // Hold the headers until the model is known, so that Envoy picks the route with
            // it. Needs `allow_on_headers_stop_iteration: true`, or Envoy holds the body too.
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let endpoint = match self.state {
            State::Buffering { endpoint } => endpoint,
            State::PassThrough => return Action::Continue,
            State::Answered | State::AwaitingPrefill(_) => return Action::Pause,
        };
        let Some(config) = self.config.clone() else {
            return Action::Continue;
        };
        if body_size > config.max_request_body_bytes {
            self.reject(&ClientError::payload_too_large(
                config.max_request_body_bytes,
            ));
            return Action::Pause;
        }
        if !end_of_stream {
            return Action::Pause;
        }

        let body = match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size) {
            Ok(body) => body.unwrap_or_default(),
            Err(status) => {
                log::error!(
                    "[{}] could not read the request body: {status:?}",
                    self.request_id
                );
                self.reply_error(&ClientError::internal(
                    "pd-filter could not read the request body",
                ));
                return Action::Pause;
            }
        };
        let prepared = match protocol::prepare(endpoint, &body) {
            Ok(prepared) => prepared,
            Err(error) => {
                self.reject(&error);
                return Action::Pause;
            }
        };
        self.stats.orchestrated(endpoint);
        if let (Some(header), Some(model)) = (&config.model_header, &prepared.model) {
            set_request_header(header, Some(model), &self.request_id);
            // Envoy picked no route yet (the headers are held); make sure it picks it with
            // the model header.
            let _ = hostcalls::call_foreign_function("clear_route_cache", None);
        }

        let cluster = match &config.prefill_host_cluster {
            Some(cluster) if !self.scheduled_hosts.is_empty() => cluster.clone(),
            _ => config
                .prefill_cluster_for(prepared.model.as_deref())
                .to_owned(),
        };
        let mut flight = Flight {
            token: 0,
            endpoint,
            original: body,
            decode_plan: prepared.decode_plan,
            cluster,
            attempt: 0,
            started: hostcalls::get_current_time().ok(),
        };
        match self.dispatch_prefill(&config, &flight, &prepared.prefill_body) {
            Ok(token) => {
                flight.token = token;
                self.state = State::AwaitingPrefill(flight);
            }
            Err(failure) => self.fail_prefill(&failure),
        }
        Action::Pause
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let header = self
            .config
            .as_ref()
            .and_then(|config| config.prefill_time_header.as_deref());
        if let (Some(name), Some(elapsed)) = (header, self.prefill_time) {
            let millis = elapsed.as_millis().to_string();
            if let Err(status) =
                hostcalls::add_map_value(MapType::HttpResponseHeaders, name, &millis)
            {
                log::warn!("[{}] could not add {name}: {status:?}", self.request_id);
            }
        }
        Action::Continue
    }
}

impl PdRequest {
    /// The scheduler-chosen host an attempt goes to, if any: the list is tried in order.
    fn host_of_attempt(&self, attempt: u32) -> Option<SocketAddr> {
        let count = self.scheduled_hosts.len();
        if count == 0 {
            return None;
        }
        self.scheduled_hosts.get(attempt as usize % count).copied()
    }

    /// Time left for prefill attempts, `None` once the budget is spent.
    fn remaining_budget(config: &Config, flight: &Flight) -> Option<Duration> {
        let Some(started) = flight.started else {
            return Some(config.prefill_timeout);
        };
        let elapsed = hostcalls::get_current_time()
            .ok()
            .and_then(|now| now.duration_since(started).ok())
            .unwrap_or_default();
        config
            .prefill_timeout
            .checked_sub(elapsed)
            .filter(|left| !left.is_zero())
    }

    fn dispatch_prefill(
        &mut self,
        config: &Config,
        flight: &Flight,
        prefill_body: &[u8],
    ) -> Result<u32, PrefillFailure> {
        let timeout = Self::remaining_budget(config, flight).unwrap_or(config.prefill_timeout);
        let host = self
            .host_of_attempt(flight.attempt)
            .map(|host| host.to_string());
        let mut headers: Vec<(&str, &str)> = self
            .prefill_headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .collect();
        if let Some(host) = &host {
            headers.push((ORIGINAL_DST_HEADER, host));
        }
        self.dispatch_http_call(
            &flight.cluster,
            headers,
            Some(prefill_body),
            vec![],
            timeout,
        )
        .map_err(|status| {
            log::debug!(
                "[{}] dispatch_http_call to {:?}: {status:?}",
                self.request_id,
                flight.cluster
            );
            PrefillFailure::not_dispatched(&flight.cluster)
        })
    }

    /// Starts the next attempt after a retryable failure, if retries and time are left;
    /// otherwise hands the flight back.
    fn retry(
        &mut self,
        config: &Config,
        flight: Flight,
        failure: &PrefillFailure,
    ) -> Result<(), Flight> {
        if flight.attempt >= config.prefill_retries
            || Self::remaining_budget(config, &flight).is_none()
        {
            return Err(flight);
        }
        // The prefill body is rebuilt rather than kept: retries are rare, memory is not.
        let Ok(prepared) = protocol::prepare(flight.endpoint, &flight.original) else {
            return Err(flight);
        };
        let next = Flight {
            attempt: flight.attempt + 1,
            ..flight
        };
        match self.dispatch_prefill(config, &next, &prepared.prefill_body) {
            Ok(token) => {
                log::info!(
                    "[{}] prefill attempt {} failed ({}): {}; retrying",
                    self.request_id,
                    next.attempt,
                    failure.kind.name(),
                    failure.error.message
                );
                self.state = State::AwaitingPrefill(Flight { token, ..next });
                Ok(())
            }
            Err(_) => Err(next),
        }
    }

    /// Sends the original body to decode without `kv_transfer_params`: decode recomputes.
    fn decode_only(&mut self, kind: FailureKind, reason: &str) {
        log::warn!(
            "[{}] prefill failure ({}): {reason}; decode will recompute the prompt",
            self.request_id,
            kind.name()
        );
        self.stats.prefill_failure(kind);
        self.stats.decode_only_fallback();
        self.resume();
    }

    /// Answers a request the filter will not orchestrate because of its own content.
    fn reject(&mut self, error: &ClientError) {
        self.stats.bad_request();
        log::debug!(
            "[{}] rejected with {}: {}",
            self.request_id,
            error.status,
            error.message
        );
        self.reply_error(error);
    }

    fn fail_prefill(&mut self, failure: &PrefillFailure) {
        self.stats.prefill_failure(failure.kind);
        log::warn!(
            "[{}] prefill failure ({}): answering {}: {}",
            self.request_id,
            failure.kind.name(),
            failure.error.status,
            failure.error.message
        );
        self.reply_error(&failure.error);
    }

    fn resume(&mut self) {
        self.state = State::PassThrough;
        if let Err(status) = hostcalls::resume_http_request() {
            log::error!(
                "[{}] could not resume the request: {status:?}",
                self.request_id
            );
        }
    }

    fn reply_error(&mut self, error: &ClientError) {
        self.state = State::Answered;
        let mut headers = vec![("content-type", "application/json")];
        if !self.request_id.is_empty() {
            headers.push(("x-request-id", self.request_id.as_str()));
        }
        if let Err(status) =
            hostcalls::send_http_response(u32::from(error.status), headers, Some(&error.to_json()))
        {
            log::error!(
                "[{}] could not send the error reply: {status:?}",
                self.request_id
            );
        }
    }
}

/// Sets (or with `None` removes) a request header; only valid before the headers continue.
fn set_request_header(name: &str, value: Option<&str>, request_id: &str) {
    if let Err(status) = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value) {
        log::warn!("[{request_id}] could not set request header {name}: {status:?}");
    }
}
