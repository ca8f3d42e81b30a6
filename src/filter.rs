//! The adapter to the proxy-wasm host. It only moves bytes between Envoy and
//! [`crate::protocol`]; every host call goes through `hostcalls` so that an unexpected host
//! status is handled as a value instead of panicking the VM (the SDK's trait helpers unwrap).

use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use crate::config::Config;
use crate::protocol::{self, ClientError, DecodePlan, Endpoint, PrefillOutcome};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(PdRoot { config: None }) });
}}

struct PdRoot {
    config: Option<Rc<Config>>,
}

impl Context for PdRoot {}

impl RootContext for PdRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
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
        Some(Box::new(PdRequest {
            config: self.config.clone(),
            request_id: String::new(),
            state: State::PassThrough,
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
    },
}

struct PdRequest {
    config: Option<Rc<Config>>,
    request_id: String,
    state: State,
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
            };
            return;
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
                self.resume();
            }
            Ok(PrefillOutcome::RecomputeOnDecode(reason)) => {
                log::warn!(
                    "[{}] {reason}; decode will recompute the prompt",
                    self.request_id
                );
                self.resume();
            }
            Err(error) => {
                log::warn!(
                    "[{}] prefill failed, answering {}: {}",
                    self.request_id,
                    error.status,
                    error.message
                );
                self.reply_error(&error);
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
        if request_header(":method").as_deref() != Some("POST") {
            return Action::Continue;
        }
        let Some(path) = request_header(":path") else {
            return Action::Continue;
        };
        let Some(endpoint) = config.endpoint_for(&path) else {
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
            self.reply_error(&error);
            return Action::Pause;
        }
        if end_of_stream {
            self.reply_error(&ClientError::bad_request("request body is empty"));
            return Action::Pause;
        }
        let declared_length =
            request_header("content-length").and_then(|v| v.parse::<usize>().ok());
        if declared_length.is_some_and(|length| length > config.max_request_body_bytes) {
            self.reply_error(&ClientError::payload_too_large(
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
            self.reply_error(&ClientError::payload_too_large(
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
                self.reply_error(&error);
                return Action::Pause;
            }
        };

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
                };
            }
            Err(status) => {
                log::error!(
                    "[{}] prefill callout to cluster {:?} failed to start: {status:?}",
                    self.request_id,
                    config.prefill_cluster
                );
                self.reply_error(&ClientError::prefill_not_dispatched(
                    &config.prefill_cluster,
                ));
            }
        }
        Action::Pause
    }
}

impl PdRequest {
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
