//! The adapter to the proxy-wasm host. It only moves bytes between Envoy and
//! [`crate::protocol`]; every host call goes through `hostcalls` so that an unexpected host
//! status is handled as a value instead of panicking the VM (the SDK's trait helpers unwrap).

use std::rc::Rc;
use std::time::{Duration, SystemTime};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use crate::config::Config;
use crate::protocol::{
    self, ClientError, DecodePlan, Endpoint, FailureKind, PrefillFailure, PrefillOutcome,
};
use crate::stats::Stats;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(PdRoot { config: None, stats: None }) });
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
        let stats = match &self.stats {
            Some(stats) => stats.clone(),
            None => Rc::new(Stats::define()),
        };
        Some(Box::new(PdRequest {
            config: self.config.clone(),
            stats,
            request_id: String::new(),
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
    Buffering {
        endpoint: Endpoint,
        prefill_headers: Vec<(String, String)>,
    },
    /// The prefill callout is in flight; the client body is held by Envoy.
    AwaitingPrefill {
        token: u32,
        original: Vec<u8>,
        decode_plan: DecodePlan,
        started: Option<SystemTime>,
    },
}

struct PdRequest {
    config: Option<Rc<Config>>,
    stats: Rc<Stats>,
    request_id: String,
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
        let state = std::mem::replace(&mut self.state, State::PassThrough);
        let State::AwaitingPrefill {
            token,
            original,
            decode_plan,
            started,
        } = state
        else {
            self.state = state;
            return;
        };
        if token != token_id {
            log::warn!("[{}] ignoring an unknown callout answer", self.request_id);
            self.state = State::AwaitingPrefill {
                token,
                original,
                decode_plan,
                started,
            };
            return;
        }
        self.prefill_time = started.and_then(|started| {
            hostcalls::get_current_time()
                .ok()?
                .duration_since(started)
                .ok()
        });
        if let Some(elapsed) = self.prefill_time {
            self.stats.prefill_latency(elapsed.as_millis() as u64);
        }
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

        match protocol::interpret_prefill_response(
            status,
            &body,
            config.on_missing_kv_transfer_params,
        ) {
            Ok(PrefillOutcome::KvTransferParams(kv)) => {
                let decode_body = protocol::decode_body(&original, &decode_plan, kv);
                if let Err(status) = hostcalls::set_buffer(
                    BufferType::HttpRequestBody,
                    0,
                    original.len(),
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
                log::warn!(
                    "[{}] prefill failure ({}): {reason}; decode will recompute the prompt",
                    self.request_id,
                    FailureKind::NoKvTransferParams.name()
                );
                self.stats.prefill_failure(FailureKind::NoKvTransferParams);
                self.stats.decode_only_fallback();
                self.resume();
            }
            Err(failure) => self.fail_prefill(&failure),
        }
    }
}

impl HttpContext for PdRequest {
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

    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(config) = self.config.clone() else {
            self.reply_error(&ClientError::internal(
                "pd-filter has no valid configuration",
            ));
            return Action::Pause;
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
                if let Err(status) =
                    hostcalls::set_map_value(MapType::HttpRequestHeaders, "x-request-id", Some(&id))
                {
                    log::warn!("[{id}] could not set x-request-id: {status:?}");
                }
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
        // The decode body is longer than the client's: let Envoy frame it.
        if let Err(status) =
            hostcalls::set_map_value(MapType::HttpRequestHeaders, "content-length", None)
        {
            log::warn!(
                "[{}] could not remove content-length: {status:?}",
                self.request_id
            );
        }

        let authority =
            request_header(":authority").unwrap_or_else(|| config.prefill_cluster.clone());
        let mut prefill_headers = vec![
            (":method".to_owned(), "POST".to_owned()),
            (":path".to_owned(), path),
            (":authority".to_owned(), authority),
            ("content-type".to_owned(), "application/json".to_owned()),
            ("x-request-id".to_owned(), self.request_id.clone()),
        ];
        for name in &config.forward_headers {
            if let Some(value) = request_header(name) {
                prefill_headers.push((name.clone(), value));
            }
        }
        self.state = State::Buffering {
            endpoint,
            prefill_headers,
        };
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let State::Buffering { endpoint, .. } = &self.state else {
            return match self.state {
                State::PassThrough => Action::Continue,
                _ => Action::Pause,
            };
        };
        let endpoint = *endpoint;
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

        let State::Buffering {
            prefill_headers, ..
        } = std::mem::replace(&mut self.state, State::PassThrough)
        else {
            return Action::Continue;
        };
        let headers: Vec<(&str, &str)> = prefill_headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .collect();
        match self.dispatch_http_call(
            &config.prefill_cluster,
            headers,
            Some(&prepared.prefill_body),
            vec![],
            config.prefill_timeout,
        ) {
            Ok(token) => {
                self.state = State::AwaitingPrefill {
                    token,
                    original: body,
                    decode_plan: prepared.decode_plan,
                    started: hostcalls::get_current_time().ok(),
                };
            }
            Err(status) => {
                log::debug!("[{}] dispatch_http_call: {status:?}", self.request_id);
                self.fail_prefill(&PrefillFailure::not_dispatched(&config.prefill_cluster));
            }
        }
        Action::Pause
    }
}

impl PdRequest {
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

/// A request header as text; absent when missing, not UTF-8, or unreadable.
fn request_header(name: &str) -> Option<String> {
    let value = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name).ok()??;
    String::from_utf8(value).ok()
}
