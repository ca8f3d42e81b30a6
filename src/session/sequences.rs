//! The state machine driven by random sequences of host events, in any order a hostile
//! client, a failing prefill or decode, or Envoy's timing can bring about, as the filter
//! drives it (src/filter.rs): commands are carried out, the host's reports go back in.
//! Whatever the sequence, the session never panics, never sends a request on to decode
//! without prefill's KV (unless it chose to recompute on decode), never passes on a client's
//! `kv_transfer_params`, never writes request headers after they went on, never answers
//! twice, and touches no stream once it has ended.

use super::*;
use serde_json::Value;
use std::time::Duration;

/// A small deterministic generator: each sequence is reproduced from its seed.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

const CONFIGS: &[&str] = &[
    "{}",
    r#"{"hold_request_headers":true}"#,
    r#"{"hold_request_headers":true,"on_missing_kv_transfer_params":"fail","prefill_retries":2}"#,
    r#"{"hold_request_headers":true,"max_abandoned_prefills_per_client":1}"#,
    r#"{"hold_request_headers":true,"model_header":"x-pd-model","usage":"decode"}"#,
    r#"{"prefill_retries":0,"release_kv_on_abandon":false,"max_request_body_bytes":300}"#,
    r#"{"hold_request_headers":true,"prefill_host_cluster":"dst","prefill_hosts_allowed":["10.0.0.0/8"],"replace_local_remote_host":true,"prefill_retries":2}"#,
];

const PATHS: &[&str] = &[
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/completions?x=1",
    "/v1//completions",
    "/invocations",
    "/v1/models",
];

/// The client's `kv_transfer_params`: no worker may ever see them.
const CLIENT_KV: &str = "client-kv-marker";

fn client_body(random: &mut Random, path: &str) -> Vec<u8> {
    let stream = random.chance(40);
    let client_kv = if random.chance(40) {
        format!(r#","kv_transfer_params":{{"remote_engine_id":"{CLIENT_KV}"}}"#)
    } else {
        String::new()
    };
    let limits = if random.chance(10) {
        r#""max_tokens":2,"min_tokens":5"#
    } else {
        r#""max_tokens":5"#
    };
    let body = match random.below(20) {
        0 => "{bad".to_owned(),
        1 => String::new(),
        2 => "[1,2]".to_owned(),
        3 => format!("{{\"prompt\":\"{}\",\"max_tokens\":3}}", "x".repeat(400)),
        _ if path.contains("chat") => format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],{limits},"stream":{stream},"stream_options":{{"include_usage":{stream}}}{client_kv}}}"#
        ),
        _ if path.contains("responses") => {
            format!(
                r#"{{"model":"m","input":"hi","max_output_tokens":5,"stream":{stream}{client_kv}}}"#
            )
        }
        _ if path.contains("messages") => format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"max_tokens":5,"stream":{stream}{client_kv}}}"#
        ),
        _ => format!(r#"{{"model":"m","prompt":"p",{limits},"stream":{stream}{client_kv}}}"#),
    };
    body.into_bytes()
}

fn prefill_answer(random: &mut Random, token: u32) -> (Option<u16>, Vec<u8>) {
    let kv = format!(
        r#"{{"remote_engine_id":"prefill-kv-{token}","remote_block_ids":[1],"remote_host":"127.0.0.1","remote_port":5600}}"#
    );
    let usage = r#""usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}"#;
    let (status, body) = match random.below(10) {
        0 => (Some(200), format!(r#"{{"id":"p",{usage}}}"#)),
        1 => (
            Some(400),
            r#"{"error":{"message":"no","type":"BadRequestError","param":null,"code":400}}"#
                .to_owned(),
        ),
        2 => (
            Some(*random.pick(&[500, 502, 503, 504, 429, 302])),
            "down".to_owned(),
        ),
        3 => (None, String::new()),
        4 => (Some(200), "not json".to_owned()),
        _ => (
            Some(200),
            format!(r#"{{"id":"p","choices":[{{"text":"a"}}],{usage},"kv_transfer_params":{kv}}}"#),
        ),
    };
    (status, body.into_bytes())
}

fn decode_answer(random: &mut Random) -> (&'static str, Vec<u8>) {
    if random.chance(50) {
        let mut stream = String::new();
        for word in ["a", "b", "c"] {
            stream.push_str(&format!(
                "data: {{\"id\":\"d\",\"choices\":[{{\"index\":0,\"text\":\"{word}\"}}]}}\n\n"
            ));
        }
        stream.push_str("data: {\"id\":\"d\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":3,\"total_tokens\":6,\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\ndata: [DONE]\n\n");
        ("text/event-stream", stream.into_bytes())
    } else {
        (
            "application/json",
            br#"{"id":"d","choices":[{"text":"abc"}],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6,"prompt_tokens_details":{"cached_tokens":3}}}"#.to_vec(),
        )
    }
}

/// Splits `bytes` at up to two random places.
fn chunks(random: &mut Random, bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut cuts: Vec<usize> = (0..random.below(3))
        .map(|_| random.below(bytes.len() + 1))
        .collect();
    cuts.sort_unstable();
    let mut parts = Vec::new();
    let mut from = 0;
    for cut in cuts {
        parts.push(bytes[from..cut].to_vec());
        from = cut;
    }
    parts.push(bytes[from..].to_vec());
    parts
}

/// Envoy, as the filter sees it, for one request.
struct Host {
    random: Random,
    session: Session,
    now_ms: u64,
    trace: Vec<String>,
    /// The request body Envoy holds.
    held: Vec<u8>,
    /// The request headers as they stand.
    headers: Vec<(String, Vec<u8>)>,
    /// The configuration honours the scheduler's prefill hosts (and removes its header).
    scheduled: bool,
    upload: Vec<Vec<u8>>,
    upload_ended: bool,
    headers_went_on: bool,
    request_went_on: bool,
    replies: usize,
    done: bool,
    in_response_callback: bool,
    response_began: bool,
    response: Vec<Vec<u8>>,
    response_type: &'static str,
    next_token: u32,
    outstanding: Vec<u32>,
    /// Tokens whose answer handed over KV.
    kv_tokens: Vec<u32>,
    dispatched: usize,
    orchestrated: bool,
    fallback: bool,
    generation_path: bool,
    max_calls: usize,
}

impl Host {
    fn fail(&self, what: &str) -> ! {
        panic!("{what}\nsequence:\n{}", self.trace.join("\n"))
    }

    fn now(&self) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000) + Duration::from_millis(self.now_ms)
    }

    fn carry_out(&mut self, commands: Vec<Command>) {
        for command in commands {
            self.trace.push(format!("  -> {}", brief(&command)));
            let stream_command = !matches!(
                command,
                Command::ReleaseKv(_) | Command::Record(_) | Command::DispatchPrefill(_)
            );
            if self.done && stream_command {
                self.fail("a command for a stream that has ended");
            }
            match command {
                Command::SetRequestHeader { .. }
                | Command::RemoveRequestHeader(_)
                | Command::ClearRouteCache => {
                    if self.headers_went_on || self.request_went_on {
                        self.fail("request headers written after they went on");
                    }
                    match command {
                        Command::SetRequestHeader { name, value } => {
                            self.headers.retain(|(n, _)| *n != name);
                            self.headers.push((name, value.into_bytes()));
                        }
                        Command::RemoveRequestHeader(name) => {
                            self.headers.retain(|(n, _)| *n != name);
                        }
                        _ => {}
                    }
                }
                Command::DispatchPrefill(call) => {
                    self.orchestrated = true;
                    self.dispatched += 1;
                    if self.dispatched > self.max_calls {
                        self.fail("more prefill calls than prefill_retries allows");
                    }
                    if String::from_utf8_lossy(&call.body).contains(CLIENT_KV) {
                        self.fail("the client's kv_transfer_params went to prefill");
                    }
                    let token = if self.random.chance(90) {
                        self.next_token += 1;
                        self.outstanding.push(self.next_token);
                        Ok(self.next_token)
                    } else {
                        Err(CallRefused::AtOnce)
                    };
                    self.trace.push(format!("dispatched: {token:?}"));
                    let now = self.now();
                    let more = self.session.on_prefill_dispatched(token, now);
                    self.carry_out(more);
                }
                Command::ReplaceRequestBody { body, replaced_len } => {
                    if self.request_went_on {
                        self.fail("the request body written after it went on");
                    }
                    let mut whole = body;
                    whole.extend_from_slice(self.held.get(replaced_len..).unwrap_or_default());
                    self.held = whole;
                }
                Command::ReadRequestBody => {
                    let now = self.now();
                    let more = self
                        .session
                        .on_request_body_reread(Some(self.held.clone()), now);
                    self.carry_out(more);
                }
                Command::ResumeRequest => self.request_goes_on(),
                Command::ReleaseKv(call) => {
                    if !String::from_utf8_lossy(&call.body).contains("prefill-kv-") {
                        self.fail("a KV release without prefill's KV");
                    }
                }
                Command::SendReply(reply) => {
                    self.replies += 1;
                    if self.replies > 1 {
                        self.fail("a second answer");
                    }
                    if serde_json::from_slice::<Value>(&reply.body).is_err() {
                        self.fail("an answer that is not JSON");
                    }
                }
                Command::DiscardRequestBody(len) => {
                    if self.random.chance(90) {
                        self.held.drain(..len.min(self.held.len()));
                    } else {
                        let more = self.session.on_discard_failed();
                        self.carry_out(more);
                    }
                }
                Command::AddResponseHeader { .. }
                | Command::RemoveResponseHeader(_)
                | Command::ReplaceResponseBody { .. } => {
                    if !self.in_response_callback {
                        self.fail("the response changed outside its callbacks");
                    }
                }
                Command::SetFilterState { .. } => {}
                Command::Record(Metric::Orchestrated(_)) => self.orchestrated = true,
                Command::Record(Metric::DecodeOnlyFallback) => self.fallback = true,
                Command::Record(_) => {}
            }
        }
    }

    /// The request goes on to decode with the body Envoy holds.
    fn request_goes_on(&mut self) {
        if self.request_went_on {
            return;
        }
        if self.replies > 0 {
            self.fail("the request went on after an answer");
        }
        self.request_went_on = true;
        self.headers_went_on = true;
        let has = |name: &str| self.headers.iter().any(|(n, _)| n == name);
        if has(KV_RELEASE_HEADER) {
            self.fail("the client's x-pd-kv-release went on");
        }
        if self.scheduled && self.orchestrated && has("x-prefiller-host-port") {
            self.fail("the scheduler's prefill hosts went on to decode");
        }
        let body = String::from_utf8_lossy(&self.held).into_owned();
        self.trace.push(format!("  decode gets: {body}"));
        if self.generation_path && body.contains(CLIENT_KV) {
            self.fail("decode got the client's kv_transfer_params");
        }
        if !self.orchestrated {
            return;
        }
        if !self.upload_ended {
            self.fail("an orchestrated request went on before its body ended");
        }
        let with_kv: Vec<u32> = self
            .kv_tokens
            .iter()
            .copied()
            .filter(|token| body.contains(&format!("\"prefill-kv-{token}\"")))
            .collect();
        if self.fallback {
            if body.contains("prefill-kv-") {
                self.fail("a request sent to recompute on decode carries prefill's KV");
            }
        } else if with_kv.len() != 1 || body.matches("prefill-kv-").count() != 1 {
            self.fail("decode without exactly one KV prefill handed over");
        }
        if serde_json::from_slice::<Value>(&self.held).is_err() {
            self.fail("decode's body is not JSON");
        }
    }

    fn step(&mut self, step: Step, from_headers: bool) {
        self.carry_out(step.commands);
        if step.flow == Flow::Continue && !self.done {
            if from_headers && !self.upload_ended {
                self.headers_went_on = true;
            } else if self.replies == 0 {
                self.request_goes_on();
            }
        }
    }

    fn body_step(&mut self, step: BodyStep) {
        match step {
            BodyStep::Step(step) => self.step(step, false),
            BodyStep::ReadBody => {
                let now = self.now();
                let step = self.session.on_request_complete(self.held.clone(), now);
                self.step(step, false);
            }
        }
    }

    fn response_step(&mut self, step: BodyStep, end_of_stream: bool, chunk: &[u8]) {
        self.in_response_callback = true;
        let step = match step {
            BodyStep::Step(step) => step,
            BodyStep::ReadBody => self.session.on_response_body_read(chunk, end_of_stream),
        };
        self.carry_out(step.commands);
        self.in_response_callback = false;
    }

    /// One event the host could bring about now; false when none is left.
    fn event(&mut self) -> bool {
        // Weighted: the client leaving and Envoy answering for decode are the rarer events.
        let mut choices: Vec<u8> = Vec::new();
        if !self.done && !self.upload.is_empty() {
            choices.extend([0; 8]);
            choices.push(1);
        }
        if !self.outstanding.is_empty() {
            choices.extend([2; 8]);
        }
        if !self.done && self.request_went_on && (!self.response_began || !self.response.is_empty())
        {
            choices.extend([4; 8]);
        }
        if choices.is_empty() && (self.done || self.replies > 0) || self.trace.len() > 400 {
            return false;
        }
        choices.extend([5, 5]);
        if !self.done {
            choices.push(3);
        }
        if !self.done && !self.response_began && self.replies == 0 {
            choices.push(6);
        }
        match *self.random.pick(&choices) {
            0 => {
                let chunk = self.upload.remove(0);
                let end = self.upload.is_empty();
                self.held.extend_from_slice(&chunk);
                self.trace
                    .push(format!("request body {} bytes, end {end}", chunk.len()));
                if end {
                    self.upload_ended = true;
                }
                let step = self.session.on_request_body(self.held.len(), end);
                self.body_step(step);
            }
            1 => {
                // The rest of the body as Envoy gives it, then trailers.
                for chunk in std::mem::take(&mut self.upload) {
                    self.held.extend_from_slice(&chunk);
                    self.trace
                        .push(format!("request body {} bytes", chunk.len()));
                    let step = self.session.on_request_body(self.held.len(), false);
                    self.body_step(step);
                    if self.done {
                        return true;
                    }
                }
                self.upload_ended = true;
                self.trace.push("request trailers".to_owned());
                let step = self.session.on_request_trailers();
                self.body_step(step);
            }
            2 => {
                let at = self.random.below(self.outstanding.len());
                let token = self.outstanding.remove(at);
                let token = if self.random.chance(5) {
                    token + 1000
                } else {
                    token
                };
                let (status, body) = prefill_answer(&mut self.random, token);
                if status == Some(200) && body.windows(11).any(|w| w == b"prefill-kv-") {
                    self.kv_tokens.push(token);
                }
                self.trace.push(format!(
                    "prefill answers {token}: {status:?} {}",
                    String::from_utf8_lossy(&body)
                ));
                let head = PrefillHead {
                    status,
                    retry_after: None,
                };
                let now = self.now();
                let commands = self.session.on_prefill_response(token, head, &body, now);
                self.carry_out(commands);
            }
            3 => self.client_leaves(),
            4 => self.decode_answers(),
            6 => self.envoy_answers(),
            _ => {
                self.now_ms += *self.random.pick(&[1, 50, 300, 2_500, 40_000]);
                self.trace.push(format!("time {} ms", self.now_ms));
            }
        }
        true
    }

    fn client_leaves(&mut self) {
        self.trace.push("the stream ends".to_owned());
        if self.session.wants_address_on_leaving() {
            self.session
                .on_leaving_client_address(Some(b"10.0.0.9:4000"));
        }
        let mut commands = Vec::new();
        if self.session.awaits_decode_answer() {
            let now = self.now();
            let connected = self.random.chance(50);
            commands = self
                .session
                .on_client_left_before_decode_answered(now, || connected);
        }
        commands.extend(self.session.on_stream_done());
        self.done = true;
        self.carry_out(commands);
    }

    /// Envoy answers the client itself (its request timeout, decode unreachable, an
    /// overload), whatever the filter is waiting for, and the stream ends.
    fn envoy_answers(&mut self) {
        self.response_began = true;
        let status = *self.random.pick(&[408, 413, 503, 504]);
        let details = *self.random.pick(&[
            "request_overall_timeout",
            "upstream_reset_before_response_started{connection_failure}",
            "overload",
        ]);
        let connected = self.random.chance(50);
        self.trace.push(format!("Envoy answers {status} {details}"));
        if self.session.watches_response() {
            let wanted = self.session.wants_response_details(Some(status));
            let head = ResponseHead {
                status: Some(status),
                content_type: Some("application/json"),
                has_request_id: true,
                content_length: None,
                content_encoding: None,
                end_of_stream: false,
                code_details: wanted.then_some(details),
                decode_connected: wanted.then_some(connected),
                envoys_own_at: wanted.then(|| self.now()),
            };
            self.in_response_callback = true;
            let step = self.session.on_response_headers(&head);
            self.carry_out(step.commands);
            self.in_response_callback = false;
        }
        let body = br#"{"error":{"message":"envoy","type":"x","param":null,"code":503}}"#;
        let step = self.session.on_response_body(body.len(), true);
        self.response_step(step, true, body);
        self.client_leaves();
    }

    fn decode_answers(&mut self) {
        if !self.response_began {
            self.response_began = true;
            let (content_type, body) = decode_answer(&mut self.random);
            self.response_type = content_type;
            let status = if self.random.chance(75) {
                200
            } else {
                *self.random.pick(&[400, 404, 500, 503])
            };
            let length = body.len().to_string();
            let announce = self.random.chance(50);
            let head = ResponseHead {
                status: Some(status),
                content_type: Some(content_type),
                has_request_id: false,
                content_length: announce.then_some(length.as_bytes()),
                content_encoding: None,
                end_of_stream: false,
                code_details: Some("via_upstream"),
                decode_connected: None,
                envoys_own_at: None,
            };
            self.trace
                .push(format!("decode answers {status} {content_type}"));
            self.response = chunks(&mut self.random, &body);
            if self.session.watches_response() {
                let wanted = self.session.wants_response_details(Some(status));
                let head = ResponseHead {
                    code_details: wanted.then_some("via_upstream"),
                    ..head
                };
                self.in_response_callback = true;
                let step = self.session.on_response_headers(&head);
                self.carry_out(step.commands);
                self.in_response_callback = false;
            }
            return;
        }
        let chunk = self.response.remove(0);
        let end = self.response.is_empty();
        self.trace
            .push(format!("decode body {} bytes, end {end}", chunk.len()));
        let step = self.session.on_response_body(chunk.len(), end);
        self.response_step(step, end, &chunk);
        if end {
            self.client_leaves();
        }
    }
}

fn brief(command: &Command) -> String {
    match command {
        Command::DispatchPrefill(call) => {
            format!("DispatchPrefill({})", String::from_utf8_lossy(&call.body))
        }
        Command::ReleaseKv(call) => format!("ReleaseKv({})", String::from_utf8_lossy(&call.body)),
        Command::ReplaceRequestBody { body, replaced_len } => format!(
            "ReplaceRequestBody({} bytes for {replaced_len})",
            body.len()
        ),
        Command::SendReply(reply) => format!(
            "SendReply({} {})",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        ),
        Command::ReplaceResponseBody { body, .. } => {
            format!("ReplaceResponseBody({} bytes)", body.len())
        }
        other => format!("{other:?}"),
    }
}

fn run(seed: u64) {
    let mut random = Random(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let config_text = *random.pick(CONFIGS);
    let config = Config::from_json(config_text.as_bytes()).unwrap();
    let max_calls = 1 + config.prefill_retries as usize;
    let held = HeldBytes::new(config.max_vm_held_bytes);
    let session = Session::new(Rc::new(config), held);
    let path = *random.pick(PATHS);
    let method = if random.chance(90) {
        "POST"
    } else {
        *random.pick(&["GET", "post"])
    };
    let body = client_body(&mut random, path);
    let mut headers: Vec<(String, Vec<u8>)> = vec![
        (":method".to_owned(), method.as_bytes().to_vec()),
        (":path".to_owned(), path.as_bytes().to_vec()),
        (":authority".to_owned(), b"gateway".to_vec()),
    ];
    if random.chance(70) {
        headers.push(("x-request-id".to_owned(), b"req-1".to_vec()));
    }
    if random.chance(10) {
        headers.push((KV_RELEASE_HEADER.to_owned(), b"1".to_vec()));
    }
    if random.chance(30) {
        let hosts = *random.pick(&[
            "10.0.0.9:8000",
            "10.0.0.9:8000,10.0.0.10:8000,10.1.0.1:8000",
            "192.168.1.1:8000",
            "not a host",
            "",
        ]);
        headers.push((
            "x-prefiller-host-port".to_owned(),
            hosts.as_bytes().to_vec(),
        ));
    }
    let content_type = if random.chance(95) {
        "application/json"
    } else {
        "text/plain"
    };
    headers.push(("content-type".to_owned(), content_type.as_bytes().to_vec()));
    let no_body = random.chance(5);
    let upload = if no_body {
        Vec::new()
    } else {
        chunks(&mut random, &body)
    };
    let generation_path = method == "POST" && path != "/v1/models";
    let mut host = Host {
        random,
        session,
        now_ms: 0,
        trace: vec![format!(
            "seed {seed}: {config_text} {method} {path} {}",
            String::from_utf8_lossy(&body)
        )],
        held: Vec::new(),
        headers: headers.clone(),
        scheduled: config_text.contains("prefill_host_cluster"),
        upload,
        upload_ended: no_body,
        headers_went_on: false,
        request_went_on: false,
        replies: 0,
        done: false,
        in_response_callback: false,
        response_began: false,
        response: Vec::new(),
        response_type: "",
        next_token: 0,
        outstanding: Vec::new(),
        kv_tokens: Vec::new(),
        dispatched: 0,
        orchestrated: false,
        fallback: false,
        generation_path,
        max_calls,
    };
    let mut step = host.session.on_request_headers(headers.as_slice(), no_body);
    if host.session.wants_client_address() {
        if let Some(refused) = host.session.on_client_address(Some(b"10.0.0.9:4000")) {
            step = refused;
        }
    }
    host.step(step, true);
    while host.event() {}
    if !host.done {
        host.client_leaves();
    }
    // Prefill calls still out answer after the stream ended.
    while !host.outstanding.is_empty() {
        host.event();
    }
}

#[test]
fn no_sequence_of_host_events_breaks_the_sessions_promises() {
    let sequences = if cfg!(target_arch = "wasm32") {
        2_000
    } else {
        20_000
    };
    for seed in 0..sequences {
        run(seed);
    }
}
