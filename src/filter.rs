//! The adapter to the proxy-wasm host: it turns host callbacks into [`Session`] events and
//! the session's commands into host calls, and decides nothing itself. Every host call goes
//! through `hostcalls` so that an unexpected host status is handled as a value instead of
//! panicking the VM (the SDK's trait helpers unwrap).

use std::rc::Rc;
use std::time::{SystemTime, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use crate::config::Config;
use crate::session::{BodyStep, Command, Flow, HostFailure, Session, Step};
use crate::stats::Stats;

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
                    config.orchestrated_paths.len(),
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
            session: Session::new(self.config.clone()),
            stats,
        }))
    }
}

struct PdRequest {
    session: Session,
    stats: Rc<Stats>,
}

fn now() -> SystemTime {
    hostcalls::get_current_time().unwrap_or(UNIX_EPOCH)
}

fn as_pairs(headers: &[(String, String)]) -> Vec<(&str, &str)> {
    headers
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_str()))
        .collect()
}

fn action(flow: Flow) -> Action {
    match flow {
        Flow::Continue => Action::Continue,
        Flow::Pause => Action::Pause,
    }
}

impl Context for PdRequest {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
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
        let commands = self
            .session
            .on_prefill_answer(token_id, status, &body, now());
        self.execute(commands);
    }

    fn on_done(&mut self) -> bool {
        self.session.on_client_gone();
        true
    }
}

impl HttpContext for PdRequest {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // One host call for all headers rather than one per header.
        let headers = hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default();
        let step = self.session.on_request_headers(&headers, end_of_stream);
        self.run(step)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let step = self.session.on_request_body(body_size, end_of_stream);
        self.run_body_step(step)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let step = self.session.on_request_trailers();
        self.run_body_step(step)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let commands = self.session.on_response_headers();
        self.execute(commands);
        Action::Continue
    }
}

impl PdRequest {
    fn run_body_step(&mut self, step: BodyStep) -> Action {
        match step {
            BodyStep::Step(step) => self.run(step),
            BodyStep::ReadBody => {
                match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, usize::MAX) {
                    Ok(body) => {
                        let step = self
                            .session
                            .on_request_complete(body.unwrap_or_default(), now());
                        self.run(step)
                    }
                    Err(status) => {
                        log::debug!("get_buffer(HttpRequestBody): {status:?}");
                        let commands = self.session.on_host_failure(HostFailure::ReadRequestBody);
                        self.execute(commands);
                        Action::Pause
                    }
                }
            }
        }
    }

    fn run(&mut self, step: Step) -> Action {
        self.execute(step.commands);
        action(step.flow)
    }

    fn execute(&mut self, commands: Vec<Command>) {
        let mut queue = std::collections::VecDeque::from(commands);
        while let Some(command) = queue.pop_front() {
            let follow_up = self.perform(command);
            for command in follow_up.into_iter().rev() {
                queue.push_front(command);
            }
        }
    }

    /// Carries out one command; a command whose result the session needs returns the
    /// session's next commands.
    fn perform(&mut self, command: Command) -> Vec<Command> {
        let request_id = self.session.request_id();
        match command {
            Command::SetRequestHeader { name, value } => {
                if let Err(status) =
                    hostcalls::set_map_value(MapType::HttpRequestHeaders, &name, Some(&value))
                {
                    log::warn!("[{request_id}] could not set request header {name}: {status:?}");
                }
            }
            Command::RemoveRequestHeader(name) => {
                if let Err(status) =
                    hostcalls::set_map_value(MapType::HttpRequestHeaders, &name, None)
                {
                    log::warn!("[{request_id}] could not remove request header {name}: {status:?}");
                }
            }
            Command::ClearRouteCache => {
                let _ = hostcalls::call_foreign_function("clear_route_cache", None);
            }
            Command::DispatchPrefill(call) => {
                let headers = as_pairs(&call.headers);
                // The trait method, not `hostcalls`: the SDK must know the token to route
                // the answer back to this context.
                let token = self
                    .dispatch_http_call(
                        &call.cluster,
                        headers,
                        Some(&call.body),
                        vec![],
                        call.timeout,
                    )
                    .map_err(|status| log::debug!("dispatch_http_call: {status:?}"))
                    .ok();
                return self.session.on_prefill_dispatched(token, now());
            }
            Command::ReplaceRequestBody { body, replaced_len } => {
                if let Err(status) =
                    hostcalls::set_buffer(BufferType::HttpRequestBody, 0, replaced_len, &body)
                {
                    log::debug!("[{request_id}] set_buffer(HttpRequestBody): {status:?}");
                    return self
                        .session
                        .on_host_failure(HostFailure::ReplaceRequestBody);
                }
            }
            Command::ResumeRequest => {
                if let Err(status) = hostcalls::resume_http_request() {
                    log::error!("[{request_id}] could not resume the request: {status:?}");
                }
            }
            Command::SendReply(reply) => {
                let headers = as_pairs(&reply.headers);
                if let Err(status) = hostcalls::send_http_response(
                    u32::from(reply.status),
                    headers,
                    Some(&reply.body),
                ) {
                    log::error!("[{request_id}] could not send the error reply: {status:?}");
                }
            }
            Command::AddResponseHeader { name, value } => {
                if let Err(status) =
                    hostcalls::add_map_value(MapType::HttpResponseHeaders, &name, &value)
                {
                    log::warn!("[{request_id}] could not add {name}: {status:?}");
                }
            }
            Command::Record(metric) => self.stats.record(metric),
        }
        Vec::new()
    }
}
