//! The state machine, event by event: every policy the filter applies, without a host.

use super::*;
use serde_json::{json, Value};

/// Prefill's answer with no headers of note, as most tests give it.
trait AnsweredByPrefill {
    fn on_prefill_answer(
        &mut self,
        token: u32,
        status: Option<u16>,
        body: &[u8],
        now: SystemTime,
    ) -> Vec<Command>;
}

impl AnsweredByPrefill for Session {
    fn on_prefill_answer(
        &mut self,
        token: u32,
        status: Option<u16>,
        body: &[u8],
        now: SystemTime,
    ) -> Vec<Command> {
        let head = PrefillHead {
            status,
            retry_after: None,
        };
        self.on_prefill_response(token, head, body, now)
    }
}

const T0: Duration = Duration::from_secs(1_000);
const KV: &str = r#"{"remote_engine_id":"e","remote_block_ids":[1],"remote_host":"127.0.0.1","remote_port":5600}"#;

fn at(offset_ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + T0 + Duration::from_millis(offset_ms)
}

fn session(config: &str) -> Session {
    let config = Config::from_json(config.as_bytes()).unwrap();
    let held = HeldBytes::new(config.max_vm_held_bytes);
    Session::new(Rc::new(config), held)
}

fn headers(method: &str, path: &str, extra: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    let mut list = vec![
        (":method".to_owned(), method.as_bytes().to_vec()),
        (":path".to_owned(), path.as_bytes().to_vec()),
        (":authority".to_owned(), b"gateway".to_vec()),
        ("x-request-id".to_owned(), b"req-1".to_vec()),
        ("content-type".to_owned(), b"application/json".to_vec()),
    ];
    for (name, value) in extra {
        list.retain(|(existing, _)| existing != name);
        list.push((name.to_string(), value.as_bytes().to_vec()));
    }
    list
}

fn post(path: &str) -> Vec<(String, Vec<u8>)> {
    headers("POST", path, &[])
}

/// Headers, then the whole body in one chunk: the commands of the body step.
fn send(session: &mut Session, headers: &[(String, Vec<u8>)], body: &str) -> Step {
    let step = session.on_request_headers(headers, false);
    assert!(!has_reply(&step.commands), "{:?}", step.commands);
    assert_eq!(
        session.on_request_body(body.len(), true),
        BodyStep::ReadBody
    );
    session.on_request_complete(body.as_bytes().to_vec(), at(0))
}

fn removes_a_response_header(commands: &[Command]) -> bool {
    commands
        .iter()
        .any(|c| matches!(c, Command::RemoveResponseHeader(_)))
}

fn has_reply(commands: &[Command]) -> bool {
    commands.iter().any(|c| matches!(c, Command::SendReply(_)))
}

fn reply(commands: &[Command]) -> (u16, Value) {
    commands
        .iter()
        .find_map(|c| match c {
            Command::SendReply(reply) => {
                Some((reply.status, serde_json::from_slice(&reply.body).unwrap()))
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no reply in {commands:?}"))
}

fn dispatched(commands: &[Command]) -> &HttpCall {
    commands
        .iter()
        .find_map(|c| match c {
            Command::DispatchPrefill(call) => Some(call),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no prefill call in {commands:?}"))
}

fn call_header<'a>(call: &'a HttpCall, name: &str) -> Option<&'a str> {
    call.headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// The request body after the replacement among `commands`, if any, made to `original`.
fn replaced_body(original: &str, commands: &[Command]) -> Option<Value> {
    commands.iter().find_map(|c| match c {
        Command::ReplaceRequestBody { body, replaced_len } => {
            let mut whole = body.clone();
            whole.extend_from_slice(&original.as_bytes()[*replaced_len..]);
            Some(serde_json::from_slice(&whole).unwrap())
        }
        _ => None,
    })
}

fn metrics(commands: &[Command]) -> Vec<Metric> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::Record(Metric::PrefillLatency(..)) => None,
            Command::Record(metric) => Some(*metric),
            _ => None,
        })
        .collect()
}

fn prefill_ok() -> String {
    format!(r#"{{"id":"p","kv_transfer_params":{KV}}}"#)
}

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":50,"min_tokens":5,"stream":true}"#;

#[test]
fn held_headers_wait_for_prefill_where_the_host_allows_it() {
    let mut held = session(r#"{"hold_request_headers":true}"#);
    let step = held.on_request_headers(&post("/v1/chat/completions"), false);
    assert_eq!(step.flow, Flow::Pause);
    // Requests that are not orchestrated are never held.
    let mut other = session(r#"{"hold_request_headers":true}"#);
    let step = other.on_request_headers(&headers("GET", "/v1/models", &[]), true);
    assert_eq!(step.flow, Flow::Continue);
    // A stripped path's body is held whole: its headers wait with it, and go on with it.
    let mut stripped = session(r#"{"hold_request_headers":true}"#);
    let step = stripped.on_request_headers(&post("/invocations"), false);
    assert_eq!(step.flow, Flow::Pause);
    let body = br#"{"prompt":"x","kv_transfer_params":{"a":1}}"#.to_vec();
    assert_eq!(
        stripped.on_request_body(body.len(), true),
        BodyStep::ReadBody
    );
    assert_eq!(
        stripped.on_request_complete(body, at(0)).flow,
        Flow::Continue
    );
    let mut held = session(r#"{"hold_request_headers":true}"#);
    send(&mut held, &post("/v1/chat/completions"), CHAT);
    held.on_prefill_dispatched(Ok(1), at(0));
    let commands = held.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    assert_eq!(commands.last(), Some(&Command::ResumeRequest));
}

#[test]
fn a_request_says_whether_its_headers_wait_for_its_body() {
    const HOLD: &str = r#"{"hold_request_headers":true}"#;
    let held_for_body = |config: &str, headers: &[(String, Vec<u8>)], end_of_stream: bool| {
        let mut s = session(config);
        s.on_request_headers(headers, end_of_stream);
        s.headers_held_for_body()
    };
    assert!(held_for_body(HOLD, &post("/v1/chat/completions"), false));
    assert!(held_for_body(HOLD, &post("/invocations"), false));
    assert!(!held_for_body("{}", &post("/v1/chat/completions"), false));
    // Passed through, answered at once, or no body to come: nothing waits for a body.
    assert!(!held_for_body(HOLD, &post("/v1/embeddings"), false));
    assert!(!held_for_body(HOLD, &post("/v1/chat/completions"), true));
    let oversized = headers(
        "POST",
        "/v1/chat/completions",
        &[("content-length", "99999999999")],
    );
    let refused = held_for_body(HOLD, &oversized, false);
    let mut s = session(HOLD);
    let step = s.on_request_headers(&oversized, false);
    assert_eq!(
        refused,
        !has_reply(&step.commands),
        "a refusal sent at once holds nothing"
    );
}

#[test]
fn a_clients_kv_release_mark_is_removed_on_every_path() {
    for path in ["/v1/chat/completions", "/v1/embeddings", "/invocations"] {
        let mut s = session("{}");
        let step = s.on_request_headers(&headers("POST", path, &[(KV_RELEASE_HEADER, "1")]), false);
        assert!(
            step.commands
                .contains(&Command::RemoveRequestHeader(KV_RELEASE_HEADER.to_owned())),
            "{path}: {:?}",
            step.commands
        );
    }
}

#[test]
fn request_headers_the_host_cannot_give_are_a_500() {
    let mut s = session("{}");
    let commands = s.on_host_failure(HostFailure::ReadRequestHeaders);
    assert_eq!(reply(&commands).0, 500);
}

#[test]
fn a_content_coding_that_is_not_utf8_is_refused_not_read_as_absent() {
    for (name, value) in [
        ("content-encoding", &b"gzip\xff"[..]),
        ("content-encoding", b"\xff"),
    ] {
        let mut list = headers("POST", "/v1/completions", &[]);
        list.retain(|(existing, _)| existing != name);
        list.push((name.to_owned(), value.to_vec()));
        let mut s = session("{}");
        let step = s.on_request_headers(&list, false);
        let (status, body) = reply(&step.commands);
        assert_eq!(status, 400, "{name}: {value:?}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|message| message.contains('\u{fffd}')),
            "{name}: {body}"
        );
    }
}

#[test]
fn a_protocol_upgrade_on_a_filtered_path_is_refused_and_elsewhere_passed_on() {
    let config = r#"{"paths":["/v1/chat/completions"]}"#;
    for (method, path) in [
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
    ] {
        let mut s = session(config);
        let list = headers(
            method,
            path,
            &[("upgrade", "websocket"), ("connection", "upgrade")],
        );
        let step = s.on_request_headers(&list, false);
        assert_eq!(step.flow, Flow::Pause, "{method} {path}");
        let (status, body) = reply(&step.commands);
        assert_eq!(status, 400, "{method} {path}");
        assert_eq!(body["error"]["type"], "BadRequestError", "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|message| message.contains("\"websocket\"")),
            "{body}"
        );
    }
    // vLLM's realtime API is a WebSocket of decode's own.
    let mut s = session(config);
    let list = headers("GET", "/v1/realtime", &[("upgrade", "websocket")]);
    let step = s.on_request_headers(&list, true);
    assert_eq!(step.flow, Flow::Continue);
    assert!(!step
        .commands
        .iter()
        .any(|c| matches!(c, Command::SendReply(_))));
}

#[test]
fn an_orchestrated_request_goes_through_prefill_then_decode() {
    let mut session = session(r#"{"prefill_time_header":"x-pd-prefill-ms"}"#);
    let step = session.on_request_headers(&post("/v1/chat/completions"), false);
    assert_eq!(step.flow, Flow::Continue);
    assert_eq!(
        step.commands,
        vec![
            Command::RemoveRequestHeader("content-length".into()),
            Command::SetRequestHeader {
                name: "accept-encoding".into(),
                value: "identity".into()
            },
            // The headers go on before the body is rewritten: no retry may resend it.
            Command::SetRequestHeader {
                name: "x-envoy-max-retries".into(),
                value: "0".into()
            }
        ]
    );
    assert_eq!(
        session.on_request_body(10, false),
        BodyStep::Step(Step::new(Flow::Pause, vec![]))
    );
    assert_eq!(
        session.on_request_body(CHAT.len(), true),
        BodyStep::ReadBody
    );

    let step = session.on_request_complete(CHAT.as_bytes().to_vec(), at(0));
    assert_eq!(step.flow, Flow::Pause);
    assert_eq!(
        metrics(&step.commands),
        vec![Metric::Orchestrated(Api::ChatCompletions)]
    );
    let call = dispatched(&step.commands);
    assert_eq!(&*call.cluster, "prefill");
    assert_eq!(call.timeout, Duration::from_secs(120));
    assert_eq!(call_header(call, ":path"), Some("/v1/chat/completions"));
    assert_eq!(
        call_header(call, ":authority"),
        Some("prefill"),
        "the cluster's, not the client's"
    );
    assert_eq!(call_header(call, "x-request-id"), Some("req-1"));
    let prefill: Value = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(prefill["max_tokens"], 1);
    assert_eq!(prefill["stream"], false);
    assert_eq!(prefill["min_tokens"], 1);
    assert_eq!(prefill["kv_transfer_params"]["do_remote_decode"], true);

    assert!(session.on_prefill_dispatched(Ok(7), at(1)).is_empty());
    let commands = session.on_prefill_answer(7, Some(200), prefill_ok().as_bytes(), at(40));
    let decode = replaced_body(CHAT, &commands).unwrap();
    let expected: Value = serde_json::from_str(KV).unwrap();
    assert_eq!(decode["kv_transfer_params"], expected);
    assert_eq!(decode["max_tokens"], 50);
    assert_eq!(decode["min_tokens"], 5);
    assert_eq!(decode["stream"], true);
    assert_eq!(commands.last(), Some(&Command::ResumeRequest));
    assert!(commands.contains(&Command::Record(Metric::PrefillLatency(
        PrefillResult::Kv,
        Duration::from_millis(40)
    ))));
    assert_eq!(
        metrics(&commands),
        vec![Metric::Request(Api::ChatCompletions, Outcome::Decoded)]
    );

    assert_eq!(
        session.on_response_headers(&upstream(200)).commands,
        vec![Command::AddResponseHeader {
            name: "x-pd-prefill-ms".into(),
            value: "40".into()
        }]
    );
}

#[test]
fn other_requests_pass_through_untouched() {
    for (method, path) in [
        ("GET", "/v1/models"),
        ("GET", "/v1/completions"),
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/completions/"),
    ] {
        let mut session = session("");
        let step = session.on_request_headers(&headers(method, path, &[]), false);
        assert_eq!(step.flow, Flow::Continue, "{method} {path}");
        assert_eq!(step.commands, vec![Command::Record(Metric::PassedThrough)]);
        assert_eq!(
            session.on_request_body(10, true),
            BodyStep::Step(Step::new(Flow::Continue, vec![]))
        );
        assert_eq!(
            session.on_request_trailers(),
            BodyStep::Step(Step::new(Flow::Continue, vec![]))
        );
    }
}

#[test]
fn spellings_a_backend_would_decode_are_refused() {
    for path in ["/v1/%63ompletions", "/v1%2Fcompletions", "//v1/completions"] {
        for method in ["POST", "GET"] {
            let mut session = session("");
            let step = session.on_request_headers(&headers(method, path, &[]), false);
            assert_eq!(step.flow, Flow::Pause);
            let (status, body) = reply(&step.commands);
            assert_eq!(status, 400, "{path}");
            assert_eq!(body["error"]["type"], "BadRequestError");
            assert_eq!(metrics(&step.commands), vec![Metric::BadRequest]);
        }
    }
}

#[test]
fn bad_requests_are_answered_before_prefill() {
    let mut s = session(r#"{"max_request_body_bytes":100}"#);
    let step = s.on_request_headers(
        &headers("POST", "/v1/completions", &[("content-type", "text/plain")]),
        false,
    );
    assert_eq!(reply(&step.commands).0, 400);

    let mut s = session("");
    let step = s.on_request_headers(&post("/v1/completions"), true);
    assert_eq!(reply(&step.commands).0, 400);

    let mut s = session(r#"{"max_request_body_bytes":100}"#);
    let step = s.on_request_headers(
        &headers("POST", "/v1/completions", &[("content-length", "101")]),
        false,
    );
    assert_eq!(reply(&step.commands).0, 413);

    let mut s = session(r#"{"max_request_body_bytes":100}"#);
    s.on_request_headers(&post("/v1/completions"), false);
    assert!(matches!(s.on_request_body(101, false), BodyStep::Step(_)));
    match s.on_request_body(20, true) {
        BodyStep::Step(step) => assert_eq!(reply(&step.commands).0, 413),
        other => panic!("{other:?}"),
    }
    // Nothing more happens to an answered request.
    assert_eq!(
        s.on_request_body(200, true),
        BodyStep::Step(Step::new(Flow::Pause, vec![]))
    );

    let mut s = session("");
    let step = send(&mut s, &post("/v1/completions"), "[1]");
    assert_eq!(reply(&step.commands).0, 400);
    assert!(!step
        .commands
        .iter()
        .any(|c| matches!(c, Command::DispatchPrefill(_))));
}

fn discarded(step: &Step) -> Vec<usize> {
    step.commands
        .iter()
        .filter_map(|c| match c {
            Command::DiscardRequestBody(len) => Some(*len),
            _ => None,
        })
        .collect()
}

fn body_step(step: BodyStep) -> Step {
    match step {
        BodyStep::Step(step) => step,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_refused_upload_is_dropped_to_its_end_before_the_answer() {
    const HELD: &str = r#"{"hold_request_headers":true,"max_request_body_bytes":100}"#;
    // Refused with the headers, which can be held without the body: its chunks are
    // dropped as they come, and the answer waits for the last.
    for (refused, status) in [
        (
            headers("POST", "/v1/completions", &[("content-type", "text/plain")]),
            400,
        ),
        (
            headers("POST", "/v1/completions", &[("content-length", "150")]),
            413,
        ),
        (post("/v1%2Fcompletions"), 400),
    ] {
        let mut s = session(HELD);
        let step = s.on_request_headers(&refused, false);
        assert_eq!(step.flow, Flow::Pause);
        assert!(!has_reply(&step.commands), "{:?}", step.commands);
        // Counted when decided.
        assert!(
            recorded(&step.commands).contains(&Metric::BadRequest),
            "{status}"
        );
        let step = body_step(s.on_request_body(60, false));
        assert_eq!((step.flow, discarded(&step)), (Flow::Pause, vec![60]));
        assert!(!has_reply(&step.commands));
        let step = body_step(s.on_request_body(90, true));
        assert_eq!(reply(&step.commands).0, status);
        assert!(discarded(&step).is_empty());
        assert!(!s.watches_response());
    }

    // Refused once the body outgrew the limit: what Envoy holds is dropped at once.
    let mut s = session(HELD);
    s.on_request_headers(&post("/v1/completions"), false);
    let step = body_step(s.on_request_body(120, false));
    assert_eq!(
        recorded(&step.commands),
        vec![
            Metric::BadRequest,
            Metric::Request(Api::Completions, Outcome::ClientError)
        ]
    );
    assert_eq!((step.flow, discarded(&step)), (Flow::Pause, vec![120]));
    assert!(!has_reply(&step.commands));
    // Trailers end it too.
    assert_eq!(reply(&body_step(s.on_request_trailers()).commands).0, 413);

    // Up to four times the limit is read; past that the answer goes out at once.
    let mut s = session(HELD);
    s.on_request_headers(&post("/v1/completions"), false);
    assert!(!has_reply(
        &body_step(s.on_request_body(120, false)).commands
    ));
    assert!(!has_reply(
        &body_step(s.on_request_body(280, false)).commands
    ));
    assert_eq!(
        reply(&body_step(s.on_request_body(1, false)).commands).0,
        413
    );
    let mut s = session(HELD);
    let declared = headers("POST", "/v1/completions", &[("content-length", "401")]);
    assert_eq!(
        reply(&s.on_request_headers(&declared, false).commands).0,
        413
    );

    // Envoy would not drop the upload: the answer goes out now.
    let mut s = session(HELD);
    s.on_request_headers(&declared_text_plain(), false);
    assert_eq!(reply(&s.on_discard_failed()).0, 400);

    // A model header needs the headers held too.
    let mut s = session(r#"{"model_header":"x-pd-model","max_request_body_bytes":100}"#);
    let step = s.on_request_headers(&declared_text_plain(), false);
    assert!(!has_reply(&step.commands), "{:?}", step.commands);
    assert_eq!(
        reply(&body_step(s.on_request_body(10, true)).commands).0,
        400
    );

    // Headers Envoy cannot hold without the body (no `hold_request_headers`): answered at
    // once, as is a request whose body has ended.
    let mut s = session(r#"{"max_request_body_bytes":100}"#);
    let step = s.on_request_headers(&declared_text_plain(), false);
    assert_eq!(reply(&step.commands).0, 400);
    let mut s = session(HELD);
    let step = s.on_request_headers(&declared_text_plain(), true);
    assert_eq!(reply(&step.commands).0, 400);
}

fn declared_text_plain() -> Vec<(String, Vec<u8>)> {
    headers("POST", "/v1/completions", &[("content-type", "text/plain")])
}

#[test]
fn trailers_end_the_body_and_prefill_still_runs() {
    let mut s = session("");
    s.on_request_headers(&post("/v1/completions"), false);
    assert_eq!(
        s.on_request_body(5, false),
        BodyStep::Step(Step::new(Flow::Pause, vec![]))
    );
    assert_eq!(s.on_request_trailers(), BodyStep::ReadBody);
    let step = s.on_request_complete(
        br#"{"prompt":"x","kv_transfer_params":{"remote_host":"6.6.6.6"}}"#.to_vec(),
        at(0),
    );
    let prefill: Value = serde_json::from_slice(&dispatched(&step.commands).body).unwrap();
    assert_eq!(prefill["kv_transfer_params"]["do_remote_decode"], true);

    let mut s = session("");
    s.on_request_headers(&post("/v1/completions"), false);
    assert_eq!(s.on_request_trailers(), BodyStep::ReadBody);
    let step = s.on_request_complete(Vec::new(), at(0));
    assert_eq!(reply(&step.commands).0, 400);
}

#[test]
fn a_decode_body_that_would_not_fit_is_413_and_never_written() {
    let limit = 200;
    let mut s = session(&format!(r#"{{"max_request_body_bytes":{limit}}}"#));
    let body = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(limit - 20));
    let step = send(&mut s, &post("/v1/completions"), &body);
    dispatched(&step.commands);
    s.on_prefill_dispatched(Ok(1), at(0));
    let commands = s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    assert_eq!(reply(&commands).0, 413);
    assert!(replaced_body(&body, &commands).is_none());
    assert!(!commands.contains(&Command::ResumeRequest));
    // Prefill's KV will never be read: it is released.
    released(&commands);
}

fn upstream(status: u16) -> ResponseHead<'static> {
    ResponseHead {
        status: Some(status),
        content_type: Some("application/json"),
        has_request_id: true,
        content_length: Some(b"200"),
        content_encoding: None,
        end_of_stream: false,
        code_details: Some("via_upstream"),
        decode_connected: None,
        envoys_own_at: None,
    }
}

fn unreached(details: &'static str) -> ResponseHead<'static> {
    ResponseHead {
        status: Some(503),
        content_type: Some("text/plain"),
        has_request_id: true,
        content_length: Some(b"200"),
        content_encoding: None,
        end_of_stream: false,
        code_details: Some(details),
        decode_connected: None,
        envoys_own_at: None,
    }
}

/// The release call among `commands`.
fn release_call(commands: &[Command]) -> &HttpCall {
    commands
        .iter()
        .find_map(|c| match c {
            Command::ReleaseKv(call) => Some(call),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no release in {commands:?}"))
}

fn released(commands: &[Command]) -> Value {
    let call = release_call(commands);
    assert_eq!(&*call.cluster, "decode");
    assert_eq!(call.timeout, Duration::from_secs(30));
    assert_eq!(call_header(call, ORIGINAL_DST_HEADER), None);
    assert_eq!(call_header(call, ":authority"), Some("decode"));
    assert_eq!(call_header(call, KV_RELEASE_HEADER), Some("1"));
    serde_json::from_slice(&call.body).unwrap()
}

fn has_release(commands: &[Command]) -> bool {
    commands.iter().any(|c| matches!(c, Command::ReleaseKv(_)))
}

/// A request whose prefill call went out (token 1).
fn prefilling(config: &str) -> Session {
    prefilling_body(config, r#"{"prompt":"x","max_tokens":50,"stream":true}"#)
}

fn prefilling_body(config: &str, body: &str) -> Session {
    let mut s = session(config);
    send(&mut s, &post("/v1/completions"), body);
    s.on_prefill_dispatched(Ok(1), at(0));
    s
}

/// The prefill answer, with what the adapter does for a retry: the body Envoy holds is
/// read again (`body`), and the session writes the next call from it.
fn answer_retrying(
    s: &mut Session,
    token: u32,
    status: Option<u16>,
    answer: &[u8],
    body: &str,
    now: SystemTime,
) -> Vec<Command> {
    let commands = s.on_prefill_answer(token, status, answer, now);
    if commands == [Command::ReadRequestBody] {
        return s.on_request_body_reread(Some(body.as_bytes().to_vec()), now);
    }
    commands
}

#[test]
fn a_client_that_leaves_during_its_upload_is_counted_once() {
    let mut s = session("");
    s.on_request_headers(&post("/v1/completions"), false);
    let _ = s.on_request_body(10, false);
    assert_eq!(
        metrics(&s.on_stream_done()),
        vec![Metric::Request(Api::Completions, Outcome::Abandoned)]
    );
    assert!(s.on_stream_done().is_empty());
    // Not an orchestrated path: not counted among them.
    let mut s = session("");
    s.on_request_headers(&post("/v1/embeddings"), false);
    assert!(metrics(&s.on_stream_done()).is_empty());
}

#[test]
fn a_client_that_leaves_during_prefill_has_its_kv_released() {
    let mut s = prefilling("");
    assert_eq!(
        metrics(&s.on_stream_done()),
        vec![Metric::Request(Api::Completions, Outcome::Abandoned)],
        "counted once, as it leaves"
    );
    assert!(s.on_stream_done().is_empty());
    let commands = s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(900));
    let release = released(&commands);
    let kv: Value = serde_json::from_str(KV).unwrap();
    assert_eq!(release["kv_transfer_params"], kv);
    assert_eq!(release["max_tokens"], 1);
    assert_eq!(release["stream"], false);
    // The filter kept only the head of the body during prefill: the release is the
    // smallest request that takes the KV.
    assert_eq!(release["prompt"], serde_json::json!([0]));
    assert!(!has_reply(&commands));
    assert!(!commands.contains(&Command::ResumeRequest));
    // Nothing twice.
    assert!(s
        .on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(901))
        .is_empty());

    // Bodies the filter keeps whole (the client sent kv_transfer_params of its own, which
    // decode's edit replaces; prompt logprobs, which decode must not be asked for) get the
    // smallest release too: nothing of the client's reaches decode with prefill's KV.
    for body in [
        r#"{"prompt":"x","max_tokens":50,"kv_transfer_params":{"remote_host":"6.6.6.6"}}"#,
        r#"{"model":"m","prompt":"x","prompt_logprobs":5,"echo":true}"#,
    ] {
        let mut s = prefilling_body("", body);
        s.on_stream_done();
        let release = released(&s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(9)));
        assert_eq!(release["prompt"], serde_json::json!([0]), "{body}");
        assert_eq!(release["kv_transfer_params"], kv, "{body}");
        assert!(release.get("prompt_logprobs").is_none(), "{body}");
        assert!(release.get("echo").is_none(), "{body}");
    }

    // Gone before the call went out: released once it answers.
    let mut s = session("");
    send(&mut s, &post("/v1/completions"), r#"{"prompt":"x"}"#);
    assert_eq!(s.on_stream_done().len(), 1);
    assert!(s.on_prefill_dispatched(Ok(3), at(1)).is_empty());
    released(&s.on_prefill_answer(3, Some(200), prefill_ok().as_bytes(), at(2)));

    // No KV, nothing to release (its failure counted all the same); not configured,
    // nothing released.
    let mut s = prefilling("");
    s.on_stream_done();
    assert_eq!(
        s.on_prefill_answer(1, Some(503), b"", at(2)),
        vec![
            Command::Record(Metric::PrefillLatency(
                PrefillResult::Failed,
                Duration::from_millis(2)
            )),
            Command::Record(Metric::PrefillFailure(FailureKind::Status)),
        ]
    );
    let mut s = prefilling(r#"{"release_kv_on_abandon":false}"#);
    s.on_stream_done();
    assert_eq!(
        s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(2)),
        vec![Command::Record(Metric::PrefillLatency(
            PrefillResult::Kv,
            Duration::from_millis(2)
        ))]
    );
}

/// Every metric recorded, the prefill latency too.
fn all_metrics(commands: &[Command]) -> Vec<Metric> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::Record(metric) => Some(*metric),
            _ => None,
        })
        .collect()
}

/// A prefill outage whose clients leave before `prefill_timeout_ms` shows in the prefill
/// stats too, not only as abandoned requests: each leg counts as the request would have.
#[test]
fn the_prefill_legs_of_clients_that_left_are_counted() {
    for (status, answer, kind, result) in [
        (
            Some(500),
            &b"boom"[..],
            Some(FailureKind::Status),
            PrefillResult::Failed,
        ),
        (None, b"", Some(FailureKind::Reset), PrefillResult::Failed),
        (
            Some(504),
            b"",
            Some(FailureKind::Timeout),
            PrefillResult::Failed,
        ),
        (
            Some(200),
            br#"{"id":"p"}"#,
            Some(FailureKind::NoKvTransferParams),
            PrefillResult::NoKv,
        ),
        // The client's own mistake is no prefill failure.
        (
            Some(400),
            br#"{"error":{"message":"no"}}"#,
            None,
            PrefillResult::Failed,
        ),
    ] {
        let mut s = prefilling("");
        s.on_stream_done();
        let commands = s.on_prefill_answer(1, status, answer, at(7));
        let mut expected = vec![Metric::PrefillLatency(result, Duration::from_millis(7))];
        expected.extend(kind.map(Metric::PrefillFailure));
        assert_eq!(all_metrics(&commands), expected, "{status:?}");
    }
    // A reset at the deadline is prefill timing out, as for a client that stayed.
    let mut s = prefilling(r#"{"prefill_timeout_ms":1000}"#);
    s.on_stream_done();
    let commands = s.on_prefill_answer(1, None, b"", at(1000));
    assert!(metrics(&commands).contains(&Metric::PrefillFailure(FailureKind::Timeout)));
}

#[test]
fn kv_is_released_only_when_decode_never_took_the_request() {
    let unreachable = "upstream_reset_before_response_started{remote_connection_failure}";
    let mut s = session("");
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":9}"#;
    send(&mut s, &post("/v1/chat/completions"), chat);
    s.on_prefill_dispatched(Ok(1), at(0));
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    assert!(
        !s.wants_response_details(Some(200)),
        "a 200 is decode's own"
    );
    assert!(s.wants_response_details(Some(503)));
    let commands = s.on_response_headers(&unreached(unreachable)).commands;
    // The client's body is no longer held once decode has it: the release is one token
    // of prompt, for the same model, on the same KV.
    let release = released(&commands);
    assert_eq!(release["prompt"], serde_json::json!([0]));
    assert_eq!(release["max_tokens"], 1);
    assert_eq!(release["model"], "m");
    assert!(release["kv_transfer_params"].is_object(), "{release}");
    let path = commands.iter().find_map(|c| match c {
        Command::ReleaseKv(call) => call_header(call, ":path"),
        _ => None,
    });
    assert_eq!(path, Some("/v1/completions"));
    assert!(!s.wants_response_details(Some(503)), "asked once");
    assert!(
        s.on_response_headers(&unreached(unreachable))
            .commands
            .is_empty(),
        "once"
    );

    let mut s = prefilling("");
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    assert!(!has_release(
        &s.on_response_headers(&upstream(200)).commands
    ));

    // The client leaving mid-stream: decode has the KV already.
    let mut s = prefilling("");
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    s.on_response_headers(&upstream(200));
    s.on_stream_done();
    let mut s2 = prefilling("");
    s2.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    s2.on_stream_done();
    assert!(s2
        .on_response_headers(&unreached(unreachable))
        .commands
        .is_empty());

    // Without kv_transfer_params (decode only) there is nothing to release.
    let mut s = prefilling("");
    s.on_prefill_answer(1, Some(200), b"{}", at(5));
    assert!(!has_release(
        &s.on_response_headers(&unreached(unreachable)).commands
    ));

    // A body that could not be written: the client gets 500, the KV is released.
    let mut s = prefilling("");
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    let commands = s.on_host_failure(HostFailure::ReplaceRequestBody);
    assert_eq!(reply(&commands).0, 500);
    released(&commands);
}

#[test]
fn kv_is_released_when_the_client_leaves_before_decode_can_have_read_the_request() {
    let window = 2_000;
    let connected = || true;
    let never_asked = || -> bool { panic!("the connection need not be looked at") };
    // Within the window after the request went on: released, connection or not.
    let mut s = prefilling("");
    assert!(!s.awaits_decode_answer(), "prefill still working");
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    assert!(s.awaits_decode_answer());
    released(&s.on_client_left_before_decode_answered(at(5 + window - 1), never_asked));
    assert!(!s.awaits_decode_answer(), "released once");
    assert!(s
        .on_client_left_before_decode_answered(at(6), never_asked)
        .is_empty());
    // Later: only when decode was never connected.
    for (connected_then, releases) in [(false, true), (true, false)] {
        let mut s = prefilling("");
        s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
        let commands = s.on_client_left_before_decode_answered(at(5 + window), || connected_then);
        assert_eq!(
            has_release(&commands),
            releases,
            "connected: {connected_then}"
        );
    }
    // Switched off with the rest of the releases (and with decode outages not followed,
    // which read the same details).
    let mut s = prefilling(r#"{"release_kv_on_abandon":false,"decode_outage_retry_ms":0}"#);
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    assert!(s
        .on_client_left_before_decode_answered(at(6), connected)
        .is_empty());

    // Decode answered: it has the KV.
    let mut s = prefilling("");
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    s.on_response_headers(&upstream(200));
    assert!(!s.awaits_decode_answer());
}

#[test]
fn an_answer_envoy_made_before_any_decode_connection_releases_the_kv() {
    // A 408 while the request waited in decode's pool: no detail names an unreached decode,
    // but the stream never had a connection.
    for (connected, releases) in [(Some(false), true), (Some(true), false)] {
        let mut s = prefilling("");
        s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
        let timeout = ResponseHead {
            status: Some(408),
            code_details: Some("request_overall_timeout"),
            decode_connected: connected,
            ..upstream(408)
        };
        assert_eq!(
            has_release(&s.on_response_headers(&timeout).commands),
            releases
        );
    }
}

#[test]
fn kv_is_released_when_decode_refuses_a_request_prefill_served() {
    // Prefill served one capped token; decode checks the client's own limits against the
    // context left after the prompt, which only it knows, and says 400.
    let mut s = prefilling_body("", r#"{"prompt":"x","max_tokens":8,"min_tokens":5}"#);
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    assert!(s.wants_response_details(Some(400)));
    let release = released(&s.on_response_headers(&upstream(400)).commands);
    assert_eq!(release["max_tokens"], 1);
    assert!(release.get("min_tokens").is_none(), "{release}");

    // Envoy's own 4xx (no decode worker wrote it) is no sign either way, with a connection
    // to decode...
    let mut s = prefilling("");
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    let envoys = ResponseHead {
        code_details: Some("request_overall_timeout"),
        decode_connected: Some(true),
        ..upstream(408)
    };
    assert!(!has_release(&s.on_response_headers(&envoys).commands));
    // ...but its 413 for decode's body written past its buffer is: the filter held the whole
    // body until then, so decode got none of it.
    let mut s = prefilling("");
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    let too_large = ResponseHead {
        code_details: Some("request_payload_too_large"),
        decode_connected: Some(true),
        ..upstream(413)
    };
    assert!(has_release(&s.on_response_headers(&too_large).commands));

    // Switched off with the rest of the releases (and with decode outages not followed,
    // which read the same details).
    let mut s = prefilling(r#"{"release_kv_on_abandon":false,"decode_outage_retry_ms":0}"#);
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    assert!(!s.wants_response_details(Some(400)));
    assert!(!has_release(
        &s.on_response_headers(&upstream(400)).commands
    ));
}

#[test]
fn retries_go_to_the_next_scheduled_host_within_the_time_budget() {
    let config = r#"{"prefill_host_cluster":"dst","prefill_hosts_allowed":["10.0.0.0/8"],"prefill_retries":3,"prefill_timeout_ms":1000}"#;
    let mut s = session(config);
    let hosts = [("x-prefiller-host-port", "10.0.0.1:8000,10.0.0.2:8000")];
    let step = send(
        &mut s,
        &headers("POST", "/v1/completions", &hosts),
        r#"{"prompt":"x"}"#,
    );
    let call = dispatched(&step.commands);
    assert_eq!(&*call.cluster, "dst");
    assert_eq!(
        call_header(call, ORIGINAL_DST_HEADER),
        Some("10.0.0.1:8000")
    );
    assert_eq!(call_header(call, ":authority"), Some("10.0.0.1:8000"));
    assert_eq!(call.timeout, Duration::from_millis(1000));

    let mut seen = vec![];
    let mut now = 0;
    for token in 1..=3 {
        s.on_prefill_dispatched(Ok(token), at(now));
        now += 100;
        let commands = answer_retrying(
            &mut s,
            token,
            Some(503),
            b"no healthy upstream",
            r#"{"prompt":"x"}"#,
            at(now),
        );
        let call = dispatched(&commands);
        seen.push(call_header(call, ORIGINAL_DST_HEADER).unwrap().to_owned());
        assert_eq!(
            call_header(call, ":authority"),
            call_header(call, ORIGINAL_DST_HEADER)
        );
        assert_eq!(call.timeout, Duration::from_millis(1000 - now));
        assert!(
            metrics(&commands).is_empty(),
            "a retry is not a failure yet"
        );
    }
    assert_eq!(seen, ["10.0.0.2:8000", "10.0.0.1:8000", "10.0.0.2:8000"]);
    s.on_prefill_dispatched(Ok(4), at(now));
    let commands = s.on_prefill_answer(4, Some(503), b"no healthy upstream", at(now + 1));
    assert_eq!(reply(&commands).0, 503);
    assert_eq!(
        metrics(&commands),
        vec![
            Metric::PrefillFailure(FailureKind::Unreachable),
            Metric::Request(Api::Completions, Outcome::PrefillFailed),
        ]
    );
}

#[test]
fn a_retry_reads_the_body_envoy_holds_again() {
    let body = r#"{"model":"m","prompt":"x","max_tokens":40,"min_tokens":2,"stream":true}"#;
    let mut s = prefilling_body("", body);
    // Only the head of the body was kept: the retry asks for the body Envoy holds.
    let commands = s.on_prefill_answer(1, Some(503), b"no healthy upstream", at(5));
    assert_eq!(commands, [Command::ReadRequestBody]);
    let commands = s.on_request_body_reread(Some(body.as_bytes().to_vec()), at(5));
    let call = dispatched(&commands);
    let prefill: Value = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(prefill["prompt"], "x");
    assert_eq!(prefill["max_tokens"], 1);
    assert_eq!(prefill["min_tokens"], 1, "{prefill}");
    // The retry is served like the first attempt: decode gets the client's own limits.
    s.on_prefill_dispatched(Ok(2), at(6));
    let commands = s.on_prefill_answer(2, Some(200), prefill_ok().as_bytes(), at(9));
    let decode = replaced_body(body, &commands).unwrap();
    assert_eq!(decode["max_tokens"], 40);
    assert_eq!(decode["min_tokens"], 2);
    assert_eq!(decode["stream"], true);
    assert!(decode["kv_transfer_params"].is_object());

    // A body that cannot be read again ends the request with prefill's failure.
    let mut s = prefilling_body("", body);
    s.on_prefill_answer(1, Some(503), b"no healthy upstream", at(5));
    let commands = s.on_request_body_reread(None, at(5));
    assert_eq!(reply(&commands).0, 503);
    // A body read when no retry waits for one changes nothing.
    assert!(s
        .on_request_body_reread(Some(body.as_bytes().to_vec()), at(6))
        .is_empty());

    // A body kept whole (the client sent kv_transfer_params, which decode's edit replaces)
    // is retried without reading it again.
    let whole = r#"{"prompt":"x","kv_transfer_params":{"remote_host":"6.6.6.6"}}"#;
    let mut s = prefilling_body("", whole);
    let commands = s.on_prefill_answer(1, Some(503), b"no healthy upstream", at(5));
    dispatched(&commands);
}

#[test]
fn no_retry_in_the_last_moments_of_the_budget() {
    // A retry sent with under a millisecond left would reach Envoy with a timeout of 0: none.
    for failed_at in [999, 800] {
        let mut s = session(r#"{"prefill_retries":5,"prefill_timeout_ms":1000}"#);
        send(&mut s, &post("/v1/completions"), r#"{"prompt":"x"}"#);
        s.on_prefill_dispatched(Ok(1), at(0));
        let commands = s.on_prefill_answer(1, Some(503), b"busy", at(failed_at));
        assert_eq!(reply(&commands).0, 503, "failed at {failed_at} ms");
    }
    let mut s = session(r#"{"prefill_retries":5,"prefill_timeout_ms":1000}"#);
    send(&mut s, &post("/v1/completions"), r#"{"prompt":"x"}"#);
    s.on_prefill_dispatched(Ok(1), at(0));
    let commands = s.on_prefill_answer(1, Some(503), b"busy", at(700));
    assert_eq!(
        commands,
        vec![Command::ReadRequestBody],
        "retried: the body read again"
    );
}

#[test]
fn no_retry_once_the_budget_is_spent_or_for_what_prefill_worked_on() {
    let mut s = session(r#"{"prefill_retries":5,"prefill_timeout_ms":1000}"#);
    send(&mut s, &post("/v1/completions"), r#"{"prompt":"x"}"#);
    s.on_prefill_dispatched(Ok(1), at(0));
    let commands = s.on_prefill_answer(1, None, b"", at(1000));
    // Ended without headers as its time was up: Envoy's timeout of an answer that began.
    assert_eq!(reply(&commands).0, 504);

    for (status, body, expected) in [
        (504, &b"upstream request timeout"[..], 504),
        (500, &b"{}"[..], 502),
        (
            400,
            &br#"{"error":{"message":"bad","type":"BadRequestError"}}"#[..],
            400,
        ),
    ] {
        let mut s = session(r#"{"prefill_retries":5}"#);
        send(&mut s, &post("/v1/completions"), r#"{"prompt":"x"}"#);
        s.on_prefill_dispatched(Ok(1), at(0));
        let commands = s.on_prefill_answer(1, Some(status), body, at(10));
        assert_eq!(reply(&commands).0, expected);
    }
}

#[test]
fn a_call_reset_when_its_time_is_up_timed_out() {
    // Envoy resets, rather than answers 504, a call whose headers had come when
    // prefill_timeout_ms ran out; a reset before then is prefill's.
    // Envoy's timer may fire a turn of its event loop before the filter's clock says so.
    for (answered_ms, status, kind) in [
        (700, 502, FailureKind::Reset),
        (800, 504, FailureKind::Timeout),
        (1000, 504, FailureKind::Timeout),
        (1003, 504, FailureKind::Timeout),
    ] {
        let mut s = session(r#"{"prefill_timeout_ms":1000}"#);
        send(&mut s, &post("/v1/completions"), r#"{"prompt":"x"}"#);
        s.on_prefill_dispatched(Ok(1), at(0));
        let commands = s.on_prefill_answer(1, None, b"", at(answered_ms));
        let (got, body) = reply(&commands);
        assert_eq!(got, status, "{answered_ms} ms: {body}");
        assert!(
            metrics(&commands).contains(&Metric::PrefillFailure(kind)),
            "{answered_ms} ms: {commands:?}"
        );
        if status == 504 {
            assert!(body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("within prefill_timeout_ms (1000 ms)")));
        }
    }
}

#[test]
fn a_call_that_cannot_be_sent_is_503_without_retry() {
    let mut s = session(r#"{"prefill_retries":3}"#);
    send(&mut s, &post("/v1/completions"), r#"{"prompt":"x"}"#);
    let commands = s.on_prefill_dispatched(Err(CallRefused::AtOnce), at(0));
    let (status, body) = reply(&commands);
    assert_eq!(status, 503);
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("\"prefill\""), "{message}");
    assert!(message.contains("pool"), "{message}");
    assert!(!message.contains("no such cluster"), "{message}");
    // A cluster Envoy does not have is named as such.
    let mut s = session("");
    send(&mut s, &post("/v1/completions"), r#"{"prompt":"x"}"#);
    let commands = s.on_prefill_dispatched(Err(CallRefused::NoSuchCluster), at(0));
    let (status, body) = reply(&commands);
    assert_eq!(status, 503);
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.ends_with("Envoy has no such cluster"), "{message}");
}

#[test]
fn several_prompts_go_to_decode_alone_where_the_operator_says_so() {
    let body = r#"{"prompt":["one","two"],"max_tokens":5,"stream":true,"kv_transfer_params":{"remote_host":"6.6.6.6"}}"#;
    // By default they are refused: no client reaches decode without prefill.
    let mut s = session("");
    let step = send(&mut s, &post("/v1/completions"), body);
    assert_eq!(reply(&step.commands).0, 400);

    let mut s = session(r#"{"several_prompts":"decode_only"}"#);
    let step = send(&mut s, &post("/v1/completions"), body);
    assert_eq!(step.flow, Flow::Continue, "{:?}", step.commands);
    assert!(
        !step
            .commands
            .iter()
            .any(|c| matches!(c, Command::DispatchPrefill(_) | Command::SendReply(_))),
        "{:?}",
        step.commands
    );
    // Decode gets the client's body, but for the client's kv_transfer_params.
    assert_eq!(
        replaced_body(body, &step.commands).unwrap(),
        serde_json::json!({"prompt":["one","two"],"max_tokens":5,"stream":true})
    );
    assert_eq!(
        metrics(&step.commands),
        vec![Metric::Request(Api::Completions, Outcome::DecodeOnly)]
    );
    // Decode's answer goes to the client as decode wrote it.
    let step = s.on_response_headers(&ResponseHead {
        content_type: Some("text/event-stream"),
        ..upstream(200)
    });
    assert!(!has_reply(&step.commands), "{:?}", step.commands);
    let chunk = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n";
    assert!(matches!(
        s.on_response_body(chunk.len(), false),
        BodyStep::Step(_)
    ));

    // A single prompt is orchestrated as ever; so are other APIs' lists.
    for (path, one) in [
        ("/v1/completions", r#"{"prompt":["one"],"max_tokens":5}"#),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
        ),
    ] {
        let mut s = session(r#"{"several_prompts":"decode_only"}"#);
        let step = send(&mut s, &post(path), one);
        dispatched(&step.commands);
    }
}

#[test]
fn decode_only_sends_decode_no_kv_transfer_params_at_all() {
    let body =
        r#"{"prompt":"x","kv_transfer_params":{"remote_host":"6.6.6.6","do_remote_prefill":true}}"#;
    // A 2xx without kv_transfer_params, under the default policy.
    let mut s = session("");
    send(&mut s, &post("/v1/completions"), body);
    s.on_prefill_dispatched(Ok(1), at(0));
    let commands = s.on_prefill_answer(1, Some(200), br#"{"id":"p"}"#, at(3));
    assert_eq!(
        replaced_body(body, &commands).unwrap(),
        serde_json::json!({"prompt":"x"})
    );
    assert_eq!(commands.last(), Some(&Command::ResumeRequest));
    assert_eq!(
        metrics(&commands),
        vec![
            Metric::PrefillFailure(FailureKind::NoKvTransferParams),
            Metric::DecodeOnlyFallback,
            Metric::Request(Api::Completions, Outcome::DecodeOnly),
        ]
    );

    // Prefill unreachable, with on_prefill_failure decode_only.
    let mut s = session(r#"{"on_prefill_failure":"decode_only","prefill_retries":0}"#);
    send(&mut s, &post("/v1/completions"), body);
    s.on_prefill_dispatched(Ok(1), at(0));
    let commands = s.on_prefill_answer(1, Some(503), b"no healthy upstream", at(3));
    assert_eq!(
        replaced_body(body, &commands).unwrap(),
        serde_json::json!({"prompt":"x"})
    );
    assert!(commands.contains(&Command::Record(Metric::DecodeOnlyFallback)));

    // Without client kv_transfer_params the body goes as it is.
    let mut s = session("");
    send(&mut s, &post("/v1/completions"), r#"{"prompt":"x"}"#);
    s.on_prefill_dispatched(Ok(1), at(0));
    let commands = s.on_prefill_answer(1, Some(200), b"{}", at(3));
    assert!(replaced_body(r#"{"prompt":"x"}"#, &commands).is_none());
    assert_eq!(commands.last(), Some(&Command::ResumeRequest));

    // A client error is the client's, whatever the policy; `fail` answers 502.
    for (config, status, answer, expected) in [
        (
            r#"{"on_prefill_failure":"decode_only"}"#,
            422,
            &b"{}"[..],
            422,
        ),
        (
            r#"{"on_missing_kv_transfer_params":"fail"}"#,
            200,
            &b"{}"[..],
            502,
        ),
    ] {
        let mut s = session(config);
        send(&mut s, &post("/v1/completions"), body);
        s.on_prefill_dispatched(Ok(1), at(0));
        let commands = s.on_prefill_answer(1, Some(status), answer, at(3));
        assert_eq!(reply(&commands).0, expected);
    }
}

#[test]
fn answers_for_other_calls_or_gone_clients_change_nothing() {
    let mut s = session("");
    send(&mut s, &post("/v1/completions"), r#"{"prompt":"x"}"#);
    s.on_prefill_dispatched(Ok(5), at(0));
    assert!(s
        .on_prefill_answer(4, Some(200), prefill_ok().as_bytes(), at(1))
        .is_empty());
    s.on_stream_done();
    let commands = s.on_prefill_answer(5, Some(200), prefill_ok().as_bytes(), at(2));
    assert!(commands
        .iter()
        .all(|c| matches!(c, Command::ReleaseKv(_) | Command::Record(_))));
    assert!(s.on_prefill_dispatched(Ok(6), at(3)).is_empty());
}

/// README, `model_header`: a client's copy of the model header is removed from every request
/// the filter sees, not only on the paths it orchestrates, so that no path lets a client pick
/// a model's decode route; only orchestrated paths get it set again from the body.
#[test]
fn a_clients_model_header_is_removed_on_every_path() {
    let config = r#"{"model_header":"x-model"}"#;
    for (method, path) in [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/embeddings"),
        ("POST", "/invocations"),
        ("GET", "/v1/models"),
    ] {
        let mut s = session(config);
        let step = s.on_request_headers(&headers(method, path, &[("x-model", "forged")]), false);
        for command in [
            Command::RemoveRequestHeader("x-model".into()),
            Command::ClearRouteCache,
        ] {
            assert!(
                step.commands.contains(&command),
                "{method} {path}: {:?}",
                step.commands
            );
        }
    }
}

#[test]
fn the_model_picks_the_prefill_pool_and_the_decode_route() {
    let config =
        r#"{"model_prefill_clusters":{"model-b":"prefill_b"},"model_header":"x-pd-model"}"#;
    let mut s = session(config);
    let spoofed = headers("POST", "/v1/completions", &[("x-pd-model", "model-b")]);
    let step = s.on_request_headers(&spoofed, false);
    assert_eq!(
        step.flow,
        Flow::Pause,
        "headers are held until the model is known"
    );
    assert!(step
        .commands
        .contains(&Command::RemoveRequestHeader("x-pd-model".into())));
    s.on_request_body(10, true);
    let step = s.on_request_complete(br#"{"prompt":"x"}"#.to_vec(), at(0));
    assert_eq!(&*dispatched(&step.commands).cluster, "prefill");
    assert!(!step
        .commands
        .iter()
        .any(|c| matches!(c, Command::SetRequestHeader { .. })));

    let mut s = session(config);
    let step = send(
        &mut s,
        &post("/v1/completions"),
        r#"{"model":"model-b","prompt":"x"}"#,
    );
    assert_eq!(&*dispatched(&step.commands).cluster, "prefill_b");
    assert!(step.commands.contains(&Command::SetRequestHeader {
        name: "x-pd-model".into(),
        value: "model-b".into()
    }));
    assert!(step.commands.contains(&Command::ClearRouteCache));

    for model in ["a\r\nb", "a\u{0}b", "a\u{7f}b", " model-b"] {
        let mut s = session(config);
        let body = serde_json::json!({"model": model, "prompt": "x"}).to_string();
        let step = send(&mut s, &post("/v1/completions"), &body);
        assert_eq!(reply(&step.commands).0, 400, "{model:?}");
        assert!(!step
            .commands
            .iter()
            .any(|c| matches!(c, Command::DispatchPrefill(_))));
    }
}

#[test]
fn a_models_kv_is_released_through_its_own_decode_pool() {
    let config = r#"{"model_prefill_clusters":{"model-b":"prefill_b"},"model_decode_clusters":{"model-b":"decode_b"}}"#;
    for (model, decode_pool) in [("model-b", "decode_b"), ("model-a", "decode")] {
        let mut s = session(config);
        let body = serde_json::json!({"model": model, "prompt": "x"}).to_string();
        send(&mut s, &post("/v1/completions"), &body);
        s.on_prefill_dispatched(Ok(1), at(0));
        s.on_stream_done();
        let commands = s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
        assert_eq!(&*release_call(&commands).cluster, decode_pool, "{model}");
    }
}

#[test]
fn scheduled_hosts_must_be_allowed_and_never_reach_decode() {
    let config = r#"{"prefill_host_cluster":"dst","prefill_hosts_allowed":["127.0.0.2/32"]}"#;
    let mut s = session(config);
    let admin = headers(
        "POST",
        "/v1/completions",
        &[("x-prefiller-host-port", "127.0.0.1:9901")],
    );
    let step = s.on_request_headers(&admin, false);
    let (status, body) = reply(&step.commands);
    assert_eq!(status, 400);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("x-prefiller-host-port"));

    let mut s = session(config);
    let allowed = headers(
        "POST",
        "/v1/completions",
        &[("x-prefiller-host-port", "127.0.0.2:8000")],
    );
    let step = s.on_request_headers(&allowed, false);
    assert!(step.commands.contains(&Command::RemoveRequestHeader(
        "x-prefiller-host-port".into()
    )));

    // Without a scheduler cluster the header means nothing and the default pool is used.
    let mut s = session("");
    let step = send(&mut s, &admin, r#"{"prompt":"x"}"#);
    let call = dispatched(&step.commands);
    assert_eq!(&*call.cluster, "prefill");
    assert_eq!(call_header(call, ORIGINAL_DST_HEADER), None);
}

/// A request whose prefill went to the scheduler-named 10.0.0.9 (token 1), with
/// `replace_local_remote_host` on.
fn prefilling_at_a_scheduled_host() -> Session {
    let config = r#"{"prefill_host_cluster":"dst","prefill_hosts_allowed":["10.0.0.0/8"],"replace_local_remote_host":true}"#;
    let mut s = session(config);
    let hosts = headers(
        "POST",
        "/v1/completions",
        &[("x-prefiller-host-port", "10.0.0.9:8000")],
    );
    send(&mut s, &hosts, r#"{"prompt":"x"}"#);
    s.on_prefill_dispatched(Ok(1), at(0));
    s
}

#[test]
fn the_reached_host_replaces_a_loopback_remote_host() {
    let mut s = prefilling_at_a_scheduled_host();
    let commands = s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(1));
    assert_eq!(
        replaced_body(r#"{"prompt":"x"}"#, &commands).unwrap()["kv_transfer_params"]["remote_host"],
        "10.0.0.9"
    );
}

/// The release of a client that left during prefill names the same host decode would
/// have read from: with `localhost`, decode's KV read would never reach prefill.
#[test]
fn a_release_after_the_client_left_names_the_reached_host() {
    let mut s = prefilling_at_a_scheduled_host();
    s.on_stream_done();
    let commands = s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(1));
    assert_eq!(
        released(&commands)["kv_transfer_params"]["remote_host"],
        "10.0.0.9"
    );
}

#[test]
fn other_generation_apis_lose_client_kv_transfer_params() {
    let mut s = session("");
    let step = s.on_request_headers(&post("/invocations"), false);
    assert_eq!(step.flow, Flow::Continue);
    assert_eq!(s.on_request_body(10, true), BodyStep::ReadBody);
    let body = r#"{"model":"m","kv_transfer_params":{"remote_host":"6.6.6.6"}}"#;
    let step = s.on_request_complete(body.as_bytes().to_vec(), at(0));
    assert_eq!(step.flow, Flow::Continue);
    assert_eq!(
        replaced_body(body, &step.commands).unwrap(),
        serde_json::json!({"model":"m"})
    );

    let mut s = session("");
    s.on_request_headers(&post("/invocations"), false);
    let step = s.on_request_complete(br#"{"model":"m"}"#.to_vec(), at(0));
    assert_eq!(step, Step::new(Flow::Continue, vec![]));
}

#[test]
fn other_generation_apis_refuse_a_body_the_filter_cannot_read() {
    // vLLM's json.loads reads UTF-16; passed on untouched, the client's kv_transfer_params
    // would reach decode.
    let mut s = session("");
    s.on_request_headers(&post("/invocations"), false);
    let text = r#"{"x":1,"kv_transfer_params":{"remote_host":"6.6.6.6"}}"#;
    let body: Vec<u8> = text.encode_utf16().flat_map(u16::to_le_bytes).collect();
    let step = s.on_request_complete(body, at(0));
    assert_eq!(step.flow, Flow::Pause);
    assert_eq!(reply(&step.commands).0, 400);
    assert!(!step
        .commands
        .iter()
        .any(|c| matches!(c, Command::ReplaceRequestBody { .. })));
    // NaN it reads as vLLM does: the client's kv_transfer_params go.
    let mut s = session("");
    s.on_request_headers(&post("/invocations"), false);
    let body = r#"{"x":NaN,"kv_transfer_params":{"remote_host":"6.6.6.6"}}"#;
    let step = s.on_request_complete(body.as_bytes().to_vec(), at(0));
    assert_eq!(step.flow, Flow::Continue);
    let written = step.commands.iter().find_map(|c| match c {
        Command::ReplaceRequestBody { body, .. } => Some(String::from_utf8_lossy(body)),
        _ => None,
    });
    let written = written.expect("the body written without the client's kv_transfer_params");
    assert!(!written.contains("kv_transfer_params"), "{written}");
}

#[test]
fn a_request_id_is_made_when_the_client_has_none() {
    let mut s = session("");
    let list: Vec<(String, Vec<u8>)> = post("/v1/completions")
        .into_iter()
        .filter(|(name, _)| name != "x-request-id")
        .collect();
    let step = s.on_request_headers(&list, false);
    let id = step
        .commands
        .iter()
        .find_map(|c| match c {
            Command::SetRequestHeader { name, value } if name == "x-request-id" => Some(value),
            _ => None,
        })
        .unwrap();
    assert_eq!(s.request_id(), id);
    assert_eq!(id.len(), 36);
}

#[test]
fn a_client_request_id_that_could_forge_log_lines_is_replaced() {
    let forged = "abc\u{2028}[critical][main] forged line";
    for (id, kept) in [
        ("req-7f3a:b_c.d~", true),
        (forged, false),
        ("two words", false),
        ("tab\there", false),
        (&"x".repeat(129), false),
        (&"x".repeat(128), true),
    ] {
        let mut s = session("");
        let mut list: Vec<(String, Vec<u8>)> = post("/v1/completions")
            .into_iter()
            .filter(|(name, _)| name != "x-request-id")
            .collect();
        list.push(("x-request-id".to_owned(), id.as_bytes().to_vec()));
        let step = s.on_request_headers(&list, false);
        let set = step.commands.iter().find_map(|c| match c {
            Command::SetRequestHeader { name, value } if name == "x-request-id" => Some(value),
            _ => None,
        });
        if kept {
            assert_eq!(s.request_id(), id);
            assert_eq!(set, None);
        } else {
            assert_eq!(set.map(String::as_str), Some(s.request_id()), "{id:?}");
            assert_eq!(s.request_id().len(), 36, "{id:?}");
        }
    }
}

#[test]
fn post_in_another_case_is_405_on_orchestrated_and_stripped_paths_only() {
    let config = r#"{"paths":["/v1/chat/completions"]}"#;
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let mut s = session(config);
        let step = s.on_request_headers(&headers("post", path, &[]), false);
        assert_eq!(reply(&step.commands).0, 405, "{path}");
    }
    // POST itself is served on both.
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let mut s = session(config);
        let step = s.on_request_headers(&headers("POST", path, &[]), false);
        assert!(!has_reply(&step.commands), "{path}");
    }
    // Elsewhere, and for other methods, the request is not the filter's.
    let mut s = session(config);
    let step = s.on_request_headers(&headers("post", "/v1/models", &[]), false);
    assert!(!has_reply(&step.commands));
    let mut s = session(config);
    let step = s.on_request_headers(&headers("GET", "/v1/chat/completions", &[]), false);
    assert!(!has_reply(&step.commands));
}

#[test]
fn without_configuration_every_request_is_500() {
    let reply = reply_without_configuration();
    assert_eq!(reply.status, 500);
    let body: Value = serde_json::from_slice(&reply.body).unwrap();
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no valid configuration"));
}

#[test]
fn host_failures_become_500() {
    let mut s = session("");
    send(&mut s, &post("/v1/completions"), r#"{"prompt":"x"}"#);
    let commands = s.on_host_failure(HostFailure::ReplaceRequestBody);
    assert_eq!(reply(&commands).0, 500);
}

/// Whether decode's stream is read chunk by chunk for its usage.
fn reads_stream(config: &str, path: &str, body: &str) -> bool {
    let prefill_answer = if path == "/v1/responses" {
        format!(
            r#"{{"id":"p","kv_transfer_params":{KV},"usage":{{"input_tokens":3,"output_tokens":1,"total_tokens":4,"input_tokens_details":{{"cached_tokens":0}}}}}}"#
        )
    } else {
        prefill_with_usage(0)
    };
    let mut s = session(config);
    send(&mut s, &post(path), body);
    s.on_prefill_dispatched(Ok(1), at(0));
    s.on_prefill_answer(1, Some(200), prefill_answer.as_bytes(), at(5));
    s.on_response_headers(&ResponseHead {
        content_type: Some("text/event-stream"),
        ..upstream(200)
    });
    s.on_response_body(40, false) == BodyStep::ReadBody
}

/// Envoy gives no body callback at the end of an answer that ends with trailers: the answer
/// it holds is read and rewritten from the trailers' callback.
#[test]
fn a_json_answer_that_ends_with_trailers_is_merged_there() {
    let answer = br#"{"id":"d","choices":[{"text":"abc"}],"usage":{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":3}}}"#;
    let mut s = prefilling("");
    s.on_prefill_answer(1, Some(200), prefill_with_usage(1).as_bytes(), at(5));
    s.on_response_headers(&upstream(200));
    assert_eq!(
        s.on_response_body(answer.len(), false),
        BodyStep::Step(Step::new(Flow::Pause, vec![]))
    );
    assert_eq!(s.on_response_trailers(), BodyStep::ReadBody);
    let step = s.on_response_body_read(answer, true);
    let [Command::ReplaceResponseBody {
        body, replaced_len, ..
    }] = step.commands.as_slice()
    else {
        panic!("not rewritten: {:?}", step.commands);
    };
    assert_eq!(*replaced_len, answer.len());
    let merged: Value = serde_json::from_slice(body).unwrap();
    assert_eq!(merged["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
    // Read once: trailers of an answer already rewritten change nothing.
    assert_eq!(
        s.on_response_trailers(),
        BodyStep::Step(Step::new(Flow::Continue, vec![]))
    );
}

#[test]
fn an_answer_of_the_announced_length_is_merged_without_waiting_for_the_streams_end() {
    let answer = br#"{"id":"d","choices":[{"text":"abc"}],"usage":{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":3}}}"#;
    let answer_length = answer.len().to_string();
    let mut s = prefilling("");
    s.on_prefill_answer(1, Some(200), prefill_with_usage(1).as_bytes(), at(5));
    s.on_response_headers(&ResponseHead {
        content_length: Some(answer_length.as_bytes()),
        ..upstream(200)
    });
    assert_eq!(
        s.on_response_body(answer.len() - 1, false),
        BodyStep::Step(Step::new(Flow::Pause, vec![])),
        "not whole yet"
    );
    assert_eq!(s.on_response_body(answer.len(), false), BodyStep::ReadBody);
    let step = s.on_response_body_read(answer, false);
    assert!(matches!(
        step.commands.as_slice(),
        [Command::ReplaceResponseBody { .. }]
    ));
    assert_eq!(step.flow, Flow::Continue);
    // The stream's end, in a call of its own, goes on as it is.
    assert_eq!(
        s.on_response_body(0, true),
        BodyStep::Step(Step::new(Flow::Continue, vec![]))
    );
}

#[test]
fn decodes_usage_is_left_alone_where_vllm_counts_prefills_hits_itself() {
    // vLLM 0.33 hands prefill's cache hits to decode in kv_transfer_params, and decode
    // reports them: the answer is already one vLLM's and is neither held nor read.
    let kv = r#"{"remote_engine_id":"e","remote_block_ids":[1],"remote_prefill_cached_tokens":1}"#;
    let prefill_answer = format!(
        r#"{{"id":"p","kv_transfer_params":{kv},"usage":{{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,"prompt_tokens_details":{{"cached_tokens":1}}}}}}"#
    );
    for (content_type, length) in [
        ("application/json", Some("120")),
        ("text/event-stream", None),
    ] {
        let mut s = prefilling("");
        s.on_prefill_answer(1, Some(200), prefill_answer.as_bytes(), at(5));
        let step = s.on_response_headers(&ResponseHead {
            content_type: Some(content_type),
            content_length: length.map(str::as_bytes),
            ..upstream(200)
        });
        assert_eq!(step.flow, Flow::Continue, "{content_type}");
        assert!(
            !removes_a_response_header(&step.commands),
            "{content_type}: {:?}",
            step.commands
        );
        assert_eq!(
            s.on_response_body(120, false),
            BodyStep::Step(Step::new(Flow::Continue, vec![])),
            "{content_type}"
        );
    }
    // Not a count: decode's figure cannot be vouched for, and the merge runs.
    for hits in ["null", "\"1\"", "-1"] {
        let kv = format!(r#"{{"remote_engine_id":"e","remote_prefill_cached_tokens":{hits}}}"#);
        assert!(
            !crate::protocol::usage::decode_counts_prefills_hits(kv.as_bytes()),
            "{hits}"
        );
    }
}

const HOLDS_HEADERS: &str = r#"{"hold_request_headers":true,"max_request_body_bytes":4096}"#;

/// A session that merges usage into decode's JSON answer of `length` announced bytes; the
/// step its response headers took.
fn merging_answer_of(config: &str, length: &str) -> (Session, Step) {
    let mut s = prefilling(config);
    s.on_prefill_answer(1, Some(200), prefill_with_usage(1).as_bytes(), at(5));
    let step = s.on_response_headers(&ResponseHead {
        content_length: Some(length.as_bytes()),
        ..upstream(200)
    });
    (s, step)
}

#[test]
fn with_headers_held_a_merged_json_answer_keeps_a_content_length_of_its_own() {
    let answer = br#"{"id":"d","choices":[{"text":"abc"}],"usage":{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":3}}}"#;
    let (mut s, step) = merging_answer_of(HOLDS_HEADERS, &answer.len().to_string());
    assert_eq!(step.flow, Flow::Pause, "the headers wait for the body");
    assert!(
        !removes_a_response_header(&step.commands),
        "{:?}",
        step.commands
    );
    assert_eq!(s.on_response_body(answer.len(), false), BodyStep::ReadBody);
    let step = s.on_response_body_read(answer, false);
    assert_eq!(step.flow, Flow::Continue);
    let [Command::ReplaceResponseBody {
        body,
        announce_length: true,
        ..
    }] = step.commands.as_slice()
    else {
        panic!("{:?}", step.commands);
    };
    assert_ne!(body.as_slice(), answer.as_slice());
}

#[test]
fn with_headers_held_an_answer_left_as_it_was_keeps_decodes_headers() {
    let prefill = format!(
        r#"{{"id":"p","kv_transfer_params":{KV},"usage":{{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}}}"#
    );
    let answer = br#"{"id":"d","choices":[{"text":"abc"}],"usage":{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12}}"#;
    let mut s = prefilling(HOLDS_HEADERS);
    s.on_prefill_answer(1, Some(200), prefill.as_bytes(), at(5));
    let step = s.on_response_headers(&ResponseHead {
        content_length: Some(answer.len().to_string().as_bytes()),
        ..upstream(200)
    });
    assert_eq!(step.flow, Flow::Pause);
    assert_eq!(s.on_response_body(answer.len(), false), BodyStep::ReadBody);
    assert_eq!(
        s.on_response_body_read(answer, false),
        Step::new(Flow::Continue, vec![])
    );
}

#[test]
fn headers_wait_only_for_a_json_body_worth_holding() {
    // Larger than the limit: decode's answer goes on as it is, headers and all.
    let (mut s, step) = merging_answer_of(HOLDS_HEADERS, "5000");
    assert_eq!(step.flow, Flow::Continue);
    assert!(!removes_a_response_header(&step.commands));
    assert_eq!(
        s.on_response_body(4000, false),
        BodyStep::Step(Step::new(Flow::Continue, vec![]))
    );
    // Empty, or no body at all.
    assert_eq!(merging_answer_of(HOLDS_HEADERS, "0").1.flow, Flow::Continue);
    let mut s = prefilling(HOLDS_HEADERS);
    s.on_prefill_answer(1, Some(200), prefill_with_usage(1).as_bytes(), at(5));
    let head = ResponseHead {
        end_of_stream: true,
        ..upstream(200)
    };
    assert_eq!(s.on_response_headers(&head).flow, Flow::Continue);
    // Without the host's leave to hold headers, Envoy frames the merged answer.
    let (_, step) = merging_answer_of("", "150");
    assert_eq!(step.flow, Flow::Continue);
    assert!(step
        .commands
        .contains(&Command::RemoveResponseHeader("content-length".to_owned())));
    // A length that is not a number cannot be kept.
    let (_, step) = merging_answer_of(HOLDS_HEADERS, "many");
    assert_eq!(step.flow, Flow::Continue);
    assert!(step
        .commands
        .contains(&Command::RemoveResponseHeader("content-length".to_owned())));
}

#[test]
fn an_answer_the_merge_leaves_as_it_was_is_not_written_back() {
    // Neither leg reports cached_tokens (vLLM's default) and both count the same prompt.
    let prefill = format!(
        r#"{{"id":"p","kv_transfer_params":{KV},"usage":{{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}}}"#
    );
    let answer = br#"{"id":"d","choices":[{"text":"abc"}],"usage":{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12}}"#;
    let mut s = prefilling("");
    s.on_prefill_answer(1, Some(200), prefill.as_bytes(), at(5));
    s.on_response_headers(&upstream(200));
    assert_eq!(s.on_response_body(answer.len(), true), BodyStep::ReadBody);
    assert!(s.on_response_body_read(answer, true).commands.is_empty());
}

#[test]
fn a_stream_is_read_for_usage_only_where_decode_sends_usage() {
    let completions = "/v1/completions";
    // vLLM sends usage in a completions or chat stream only when stream_options are there
    // (vLLM 0.11's include_usage defaults to true inside them), or when forced on the server.
    for (body, read) in [
        (r#"{"prompt":"x","stream":true}"#, false),
        (
            r#"{"prompt":"x","stream":true,"stream_options":null}"#,
            false,
        ),
        (r#"{"prompt":"x","stream":true,"stream_options":{}}"#, true),
        (
            r#"{"prompt":"x","stream":true,"stream_options":{"include_usage":"yes"}}"#,
            true,
        ),
        (
            r#"{"prompt":"x","stream_options":{},"stream":true,"stream_options":null}"#,
            false,
        ),
    ] {
        assert_eq!(reads_stream("", completions, body), read, "{body}");
    }
    let forced = r#"{"decode_forces_include_usage":true}"#;
    assert!(reads_stream(
        forced,
        completions,
        r#"{"prompt":"x","stream":true}"#
    ));
    let chat = r#"{"messages":[{"role":"user","content":"x"}],"stream":true}"#;
    assert!(!reads_stream("", "/v1/chat/completions", chat));
    // The Responses API always ends its stream with usage.
    assert!(reads_stream(
        "",
        "/v1/responses",
        r#"{"input":"x","stream":true}"#
    ));
}

#[test]
fn a_stream_is_read_whatever_details_prefill_reported() {
    // Prefill's usage without details does not tell vLLM's default (no
    // --enable-prompt-tokens-details) from a prompt without cache hits under that flag,
    // where decode reports the KV it pulled as hits: the stream is read either way.
    let streams_read = |path: &str, body: &str, prefill_usage: &str| {
        let mut s = session("");
        send(&mut s, &post(path), body);
        s.on_prefill_dispatched(Ok(1), at(0));
        let answer = format!(r#"{{"id":"p","kv_transfer_params":{KV},"usage":{prefill_usage}}}"#);
        s.on_prefill_answer(1, Some(200), answer.as_bytes(), at(5));
        s.on_response_headers(&ResponseHead {
            content_type: Some("text/event-stream"),
            ..upstream(200)
        });
        s.on_response_body(40, false) == BodyStep::ReadBody
    };
    let completions = r#"{"prompt":"x","stream":true,"stream_options":{"include_usage":true}}"#;
    let counts = r#""prompt_tokens":3,"completion_tokens":1,"total_tokens":4"#;
    for (usage, read) in [
        (format!("{{{counts}}}"), true),
        (
            format!(r#"{{{counts},"prompt_tokens_details":null}}"#),
            true,
        ),
        (
            format!(r#"{{{counts},"prompt_tokens_details":{{"cached_tokens":0}}}}"#),
            true,
        ),
    ] {
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let body = if path == "/v1/completions" {
                completions.to_owned()
            } else {
                completions.replace(r#""prompt":"x""#, r#""messages":[]"#)
            };
            assert_eq!(streams_read(path, &body, &usage), read, "{path} {usage}");
        }
    }
    assert!(streams_read(
        "/v1/messages",
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"x"}],"stream":true}"#,
        r#"{"input_tokens":3,"output_tokens":1}"#
    ));
    // So is a JSON answer.
    let mut s = prefilling("");
    let answer = format!(r#"{{"id":"p","kv_transfer_params":{KV},"usage":{{{counts}}}}}"#);
    s.on_prefill_answer(1, Some(200), answer.as_bytes(), at(5));
    s.on_response_headers(&upstream(200));
    assert_eq!(s.on_response_body(10, true), BodyStep::ReadBody);
}

/// vLLM 0.11 with `--enable-prompt-tokens-details` reports details only where the prompt had
/// cache hits (`if enable_prompt_tokens_details and num_cached_tokens`): a prefill without
/// hits answers `"prompt_tokens_details":null`, just as without the flag, while decode, which
/// counts the KV it pulled as hits, reports them. Its stream is read and those hits cleared,
/// as in a JSON answer.
#[test]
fn decodes_hits_are_cleared_in_a_stream_whose_prefill_had_none() {
    for (path, body) in [
        (
            "/v1/completions",
            r#"{"prompt":"x","stream":true,"stream_options":{"include_usage":true}}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[],"stream":true,"stream_options":{"include_usage":true}}"#,
        ),
    ] {
        for prefill_usage in [
            r#"{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,"prompt_tokens_details":null}"#,
            r#"{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}"#,
        ] {
            let mut s = session("");
            send(&mut s, &post(path), body);
            s.on_prefill_dispatched(Ok(1), at(0));
            let answer =
                format!(r#"{{"id":"p","kv_transfer_params":{KV},"usage":{prefill_usage}}}"#);
            s.on_prefill_answer(1, Some(200), answer.as_bytes(), at(5));
            s.on_response_headers(&ResponseHead {
                content_type: Some("text/event-stream"),
                ..upstream(200)
            });
            let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\n";
            assert_eq!(
                s.on_response_body(usage.len(), false),
                BodyStep::ReadBody,
                "{path} {prefill_usage}"
            );
            let step = s.on_response_body_read(usage, false);
            let [Command::ReplaceResponseBody { body, .. }] = step.commands.as_slice() else {
                panic!("{path} {prefill_usage}: {:?}", step.commands);
            };
            let text = String::from_utf8_lossy(body);
            let data: Value =
                serde_json::from_str(text.trim().trim_start_matches("data: ")).unwrap();
            assert_eq!(
                data["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
                "{path} {prefill_usage}"
            );
        }
    }
}

fn prefill_with_usage(cached: u64) -> String {
    format!(
        r#"{{"id":"p","kv_transfer_params":{KV},"usage":{{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,"prompt_tokens_details":{{"cached_tokens":{cached}}}}}}}"#
    )
}

#[test]
fn decode_counting_another_prompt_is_counted_once_per_request() {
    let asks_usage = r#"{"prompt":"x","stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}"#;
    let mismatches = |decode_prompt_tokens: u64| {
        let mut s = prefilling_body("", asks_usage);
        s.on_prefill_answer(1, Some(200), prefill_with_usage(1).as_bytes(), at(5));
        s.on_response_headers(&ResponseHead {
            content_type: Some("text/event-stream"),
            ..upstream(200)
        });
        let mut recorded = 0;
        for completion_tokens in 1..=3 {
            let event = format!(
                "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{decode_prompt_tokens},\"completion_tokens\":{completion_tokens}}}}}\n\n"
            );
            let step = s.on_response_body_read(event.as_bytes(), false);
            recorded += step
                .commands
                .iter()
                .filter(|c| **c == Command::Record(Metric::PromptMismatch))
                .count();
        }
        recorded
    };
    // Prefill counted 3 prompt tokens.
    assert_eq!(mismatches(3), 0);
    assert_eq!(mismatches(4), 1, "every usage event shows it; counted once");
}

#[test]
fn the_client_sees_prefills_prompt_counts_and_decodes_output_counts() {
    let answer = br#"{"id":"d","choices":[{"text":"abc"}],"usage":{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":3}}}"#;
    let mut s = prefilling("");
    s.on_prefill_answer(1, Some(200), prefill_with_usage(1).as_bytes(), at(5));
    let commands = s.on_response_headers(&upstream(200)).commands;
    assert!(commands.contains(&Command::RemoveResponseHeader("content-length".into())));
    assert_eq!(
        s.on_response_body(10, false),
        BodyStep::Step(Step::new(Flow::Pause, vec![])),
        "a JSON answer is held until it is whole"
    );
    assert_eq!(s.on_response_body(answer.len(), true), BodyStep::ReadBody);
    let step = s.on_response_body_read(answer, true);
    let Some(Command::ReplaceResponseBody {
        body, replaced_len, ..
    }) = step.commands.first()
    else {
        panic!("{:?}", step.commands);
    };
    assert_eq!(*replaced_len, answer.len());
    let merged: Value = serde_json::from_slice(body).unwrap();
    assert_eq!(merged["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
    assert_eq!(merged["usage"]["completion_tokens"], 9);
    assert_eq!(merged["usage"]["total_tokens"], 12);

    // A stream: only the usage event changes, every other chunk goes as it came.
    let asks_usage = r#"{"prompt":"x","stream":true,"stream_options":{"include_usage":true}}"#;
    let mut s = prefilling_body("", asks_usage);
    s.on_prefill_answer(1, Some(200), prefill_with_usage(0).as_bytes(), at(5));
    let head = ResponseHead {
        content_type: Some("text/event-stream; charset=utf-8"),
        ..upstream(200)
    };
    // The usage event changes length: a stream that came with a content-length goes on
    // without one (Envoy frames it); one without has nothing to remove.
    let mut chunked = prefilling_body("", asks_usage);
    chunked.on_prefill_answer(1, Some(200), prefill_with_usage(0).as_bytes(), at(5));
    let without_length = ResponseHead {
        content_length: None,
        ..head
    };
    assert!(!removes_a_response_header(
        &chunked.on_response_headers(&without_length).commands
    ));
    assert!(s
        .on_response_headers(&head)
        .commands
        .contains(&Command::RemoveResponseHeader("content-length".into())));
    let token = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
    assert_eq!(s.on_response_body(token.len(), false), BodyStep::ReadBody);
    assert!(s.on_response_body_read(token, false).commands.is_empty());
    let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\n";
    let step = s.on_response_body_read(usage, false);
    assert!(matches!(
        step.commands.as_slice(),
        [Command::ReplaceResponseBody { .. }]
    ));

    // Configured off, or an error answer: untouched.
    for (config, status) in [(r#"{"usage":"decode"}"#, 200), ("", 500)] {
        let mut s = prefilling(config);
        s.on_prefill_answer(1, Some(200), prefill_with_usage(1).as_bytes(), at(5));
        s.on_response_headers(&upstream(status));
        assert_eq!(
            s.on_response_body(answer.len(), true),
            BodyStep::Step(Step::new(Flow::Continue, vec![]))
        );
    }

    // A compressed answer (a proxy between the filter and decode may compress one): its bytes
    // cannot be read, so neither a stream nor a JSON answer is held, read or written.
    for content_type in ["text/event-stream", "application/json"] {
        for coding in [&b"gzip"[..], b" br ", b"deflate, gzip"] {
            let mut s = prefilling_body("", asks_usage);
            s.on_prefill_answer(1, Some(200), prefill_with_usage(0).as_bytes(), at(5));
            let head = ResponseHead {
                content_type: Some(content_type),
                content_encoding: Some(coding),
                ..upstream(200)
            };
            let step = s.on_response_headers(&head);
            assert_eq!(step.flow, Flow::Continue, "{content_type}");
            assert!(!removes_a_response_header(&step.commands));
            assert_eq!(
                s.on_response_body(40, false),
                BodyStep::Step(Step::new(Flow::Continue, vec![])),
                "{content_type} {coding:?}"
            );
        }
    }
    // "identity" is no encoding.
    let mut s = prefilling_body("", asks_usage);
    s.on_prefill_answer(1, Some(200), prefill_with_usage(0).as_bytes(), at(5));
    let identity = ResponseHead {
        content_type: Some("text/event-stream"),
        content_encoding: Some(b"identity"),
        ..upstream(200)
    };
    s.on_response_headers(&identity);
    assert_eq!(s.on_response_body(40, false), BodyStep::ReadBody);
}

#[test]
fn every_answer_of_an_orchestrated_request_carries_its_request_id() {
    let mut s = prefilling("");
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    let head = ResponseHead {
        has_request_id: false,
        ..upstream(200)
    };
    assert!(s
        .on_response_headers(&head)
        .commands
        .contains(&Command::AddResponseHeader {
            name: "x-request-id".into(),
            value: "req-1".into()
        }));
}

/// Every metric a list of commands records, prefill latency by what prefill came to.
fn recorded(commands: &[Command]) -> Vec<Metric> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::Record(Metric::PrefillLatency(result, _)) => {
                Some(Metric::PrefillLatency(*result, Duration::ZERO))
            }
            Command::Record(metric) => Some(*metric),
            _ => None,
        })
        .collect()
}

/// A completions request whose prefill answers `status` and `body`: everything it recorded
/// after its prefill began.
fn outcome_of(config: &str, status: Option<u16>, body: &[u8]) -> Vec<Metric> {
    let mut s = prefilling(config);
    recorded(&s.on_prefill_answer(1, status, body, at(5)))
}

#[test]
fn each_request_has_one_outcome_and_client_errors_are_no_prefill_failures() {
    use FailureKind::*;
    use Outcome::*;
    let latency = |result| Metric::PrefillLatency(result, Duration::ZERO);
    let request = |outcome| Metric::Request(Api::Completions, outcome);
    let refused = br#"{"error":{"message":"bad","type":"BadRequestError"}}"#;
    let ok = prefill_ok();
    // Configuration, prefill's status and body, and what the request records.
    type Case<'a> = (&'a str, Option<u16>, &'a [u8], Vec<Metric>);
    let cases: Vec<Case> = vec![
        (
            "",
            Some(200),
            ok.as_bytes(),
            vec![latency(PrefillResult::Kv), request(Decoded)],
        ),
        (
            "",
            Some(200),
            b"{}",
            vec![
                latency(PrefillResult::NoKv),
                Metric::PrefillFailure(NoKvTransferParams),
                Metric::DecodeOnlyFallback,
                request(DecodeOnly),
            ],
        ),
        (
            r#"{"on_missing_kv_transfer_params":"fail"}"#,
            Some(200),
            b"{}",
            vec![
                latency(PrefillResult::NoKv),
                Metric::PrefillFailure(NoKvTransferParams),
                request(PrefillFailed),
            ],
        ),
        // The request itself is wrong: prefill is fine.
        (
            "",
            Some(400),
            refused,
            vec![latency(PrefillResult::Failed), request(ClientError)],
        ),
        (
            r#"{"on_prefill_failure":"decode_only"}"#,
            Some(422),
            refused,
            vec![latency(PrefillResult::Failed), request(ClientError)],
        ),
        (
            "",
            Some(500),
            b"{}",
            vec![
                latency(PrefillResult::Failed),
                Metric::PrefillFailure(Status),
                request(PrefillFailed),
            ],
        ),
        (
            r#"{"on_prefill_failure":"decode_only"}"#,
            Some(500),
            b"{}",
            vec![
                latency(PrefillResult::Failed),
                Metric::PrefillFailure(Status),
                Metric::DecodeOnlyFallback,
                request(DecodeOnly),
            ],
        ),
        (
            "",
            Some(504),
            b"upstream request timeout",
            vec![
                latency(PrefillResult::Failed),
                Metric::PrefillFailure(Timeout),
                request(PrefillFailed),
            ],
        ),
        (
            r#"{"prefill_retries":0}"#,
            None,
            b"",
            vec![
                latency(PrefillResult::Failed),
                Metric::PrefillFailure(Reset),
                request(PrefillFailed),
            ],
        ),
    ];
    for (config, status, body, expected) in cases {
        assert_eq!(
            outcome_of(config, status, body),
            expected,
            "{config} {status:?} {}",
            String::from_utf8_lossy(body)
        );
    }

    // A call that cannot be sent.
    let mut s = session("");
    send(&mut s, &post("/v1/completions"), r#"{"prompt":"x"}"#);
    assert_eq!(
        recorded(&s.on_prefill_dispatched(Err(CallRefused::AtOnce), at(0))),
        vec![
            latency(PrefillResult::Failed),
            Metric::PrefillFailure(Unreachable),
            request(PrefillFailed),
        ]
    );

    // A decode body over the limit, after prefill made KV: the client's request is too big.
    let limit = 200;
    let mut s = session(&format!(r#"{{"max_request_body_bytes":{limit}}}"#));
    let body = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(limit - 20));
    send(&mut s, &post("/v1/completions"), &body);
    s.on_prefill_dispatched(Ok(1), at(0));
    let commands = s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    assert_eq!(
        recorded(&commands),
        vec![
            latency(PrefillResult::Kv),
            Metric::BadRequest,
            request(ClientError)
        ]
    );
}

#[test]
fn the_filters_own_refusals_are_client_errors_of_their_api() {
    let client_error = |api| {
        vec![
            Metric::BadRequest,
            Metric::Request(api, Outcome::ClientError),
        ]
    };
    // Refused with the headers.
    let mut s = session("");
    let wrong_type = headers("POST", "/v1/responses", &[("content-type", "text/plain")]);
    let step = s.on_request_headers(&wrong_type, false);
    assert_eq!(reply(&step.commands).0, 400);
    assert_eq!(recorded(&step.commands), client_error(Api::Responses));
    // Refused with the body, before any prefill.
    let mut s = session("");
    let step = send(&mut s, &post("/v1/chat/completions"), "[1]");
    assert_eq!(recorded(&step.commands), client_error(Api::ChatCompletions));
    let mut s = session(r#"{"max_request_body_bytes":100}"#);
    s.on_request_headers(&post("/v1/completions"), false);
    let BodyStep::Step(step) = s.on_request_body(101, false) else {
        panic!("not refused")
    };
    assert_eq!(recorded(&step.commands), client_error(Api::Completions));

    // Not an orchestrated API: a bad request, with no outcome.
    let mut s = session("");
    let step = s.on_request_headers(&post("//v1/completions"), false);
    assert_eq!(recorded(&step.commands), vec![Metric::BadRequest]);
    let mut s = session(r#"{"max_request_body_bytes":100}"#);
    s.on_request_headers(&post("/invocations"), false);
    let BodyStep::Step(step) = s.on_request_body(101, true) else {
        panic!("not refused")
    };
    assert_eq!(reply(&step.commands).0, 413);
    assert_eq!(recorded(&step.commands), vec![Metric::BadRequest]);
}

#[test]
fn an_answer_that_would_outgrow_the_limit_goes_on_as_decode_wrote_it() {
    let answer = format!(
        r#"{{"choices":[{{"text":"{}"}}],"usage":{{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12}}}}"#,
        "x".repeat(400)
    );
    let mut s = prefilling(&format!(
        r#"{{"max_request_body_bytes":{}}}"#,
        answer.len() + 10
    ));
    s.on_prefill_answer(1, Some(200), prefill_with_usage(1).as_bytes(), at(5));
    s.on_response_headers(&upstream(200));
    assert_eq!(s.on_response_body(answer.len(), true), BodyStep::ReadBody);
    let step = s.on_response_body_read(answer.as_bytes(), true);
    assert_eq!(
        step,
        Step::new(Flow::Continue, vec![]),
        "not rewritten past the limit"
    );
}

#[test]
fn only_answers_to_requests_sent_on_to_decode_are_watched() {
    let mut s = session("");
    s.on_request_headers(&headers("GET", "/v1/models", &[]), true);
    assert!(!s.watches_response());
    let mut s = prefilling("");
    assert!(!s.watches_response(), "still prefilling");
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    assert!(s.watches_response());
}

#[test]
fn decode_is_labelled_application_json_whatever_json_type_the_client_named() {
    let set_json = Command::SetRequestHeader {
        name: "content-type".into(),
        value: "application/json".into(),
    };
    for (content_type, relabelled) in [
        (Some("application/json"), false),
        (Some("Application/JSON; charset=utf-8"), false),
        (Some("application/vnd.api+json"), true),
        (Some("application/json ; charset=utf-8"), true),
        (None, true),
    ] {
        let mut list = post("/v1/completions");
        list.retain(|(name, _)| name != "content-type");
        if let Some(value) = content_type {
            list.push(("content-type".into(), value.as_bytes().to_vec()));
        }
        let step = session("").on_request_headers(&list, false);
        assert!(!has_reply(&step.commands), "{content_type:?}");
        assert_eq!(
            step.commands.contains(&set_json),
            relabelled,
            "{content_type:?}: {:?}",
            step.commands
        );
    }
    // A value that is not UTF-8 is not vLLM's application/json either.
    let list = headers("POST", "/v1/completions", &[]);
    let list: Vec<(String, Vec<u8>)> = list
        .into_iter()
        .map(|(name, value)| match name.as_str() {
            "content-type" => (name, b"application/json\xff".to_vec()),
            _ => (name, value),
        })
        .collect();
    let step = session("").on_request_headers(&list, false);
    assert!(step.commands.contains(&set_json));
}

#[test]
fn prompt_logprobs_larger_than_an_answer_the_filter_holds_are_refused_before_decode() {
    let config = r#"{"max_request_body_bytes":600}"#;
    let body = r#"{"prompt":"x","max_tokens":5,"prompt_logprobs":1}"#;
    let logprobs = format!("[null,{}]", vec![r#"{"1":{"logprob":-1.5}}"#; 30].join(","));
    let answer = format!(
        r#"{{"id":"p","kv_transfer_params":{KV},"choices":[{{"text":"a","prompt_logprobs":{logprobs}}}]}}"#
    );
    let mut s = prefilling_body(config, body);
    let commands = s.on_prefill_answer(1, Some(200), answer.as_bytes(), at(5));
    let (status, error) = reply(&commands);
    assert_eq!(status, 400);
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("prompt logprobs"),
        "{error}"
    );
    assert!(has_release(&commands), "prefill's KV is released");
    assert!(!commands.contains(&Command::ResumeRequest));
    // Within the limit, with room for the rest of decode's answer: decode gets the request.
    let roomy = r#"{"max_request_body_bytes":70000}"#;
    let mut s = prefilling_body(roomy, body);
    let commands = s.on_prefill_answer(1, Some(200), answer.as_bytes(), at(5));
    assert!(commands.contains(&Command::ResumeRequest), "{commands:?}");
    // Completions put them into every choice: n copies must fit.
    // However the client spells n, as vLLM reads it.
    // Pydantic reads a string as Python's int or float does; what cannot be read counts as
    // the most.
    for n in [
        "1000",
        "1000.0",
        "1e3",
        r#""1000""#,
        r#"" 1000 ""#,
        r#""+1000""#,
        r#""01000""#,
        r#""1_000""#,
        r#""1000.0""#,
    ] {
        let many = format!(r#"{{"prompt":"x","max_tokens":5,"prompt_logprobs":1,"n":{n}}}"#);
        let mut s = prefilling_body(roomy, &many);
        let commands = s.on_prefill_answer(1, Some(200), answer.as_bytes(), at(5));
        assert_eq!(reply(&commands).0, 400, "n: {n}");
    }
    // An n vLLM cannot read as an integer at all is refused before prefill: prefill's copy
    // would have n = 1 and be served, and only decode would refuse it.
    for n in [r#""a thousand""#, r#""NaN""#, "[1000]", "2.5"] {
        let many = format!(r#"{{"prompt":"x","max_tokens":5,"prompt_logprobs":1,"n":{n}}}"#);
        let mut s = session(roomy);
        let step = send(&mut s, &post("/v1/completions"), &many);
        let (status, error) = reply(&step.commands);
        assert_eq!(status, 400, "n: {n}");
        assert_eq!(error["error"]["param"], "n", "{error}");
    }
}

#[test]
fn a_prefill_call_reset_after_its_answer_began_is_not_sent_again() {
    // vLLM starts a non-streamed answer once the prompt is computed: that prefill holds the
    // KV, and another attempt would compute the prompt again. Envoy also resets a call whose
    // answer is larger than it takes (prompt logprobs can be), which would fail alike.
    for body in [
        r#"{"prompt":"x","max_tokens":5,"prompt_logprobs":1}"#,
        r#"{"prompt":"x","max_tokens":5}"#,
    ] {
        let mut s = prefilling_body("", body);
        let commands = s.on_prefill_answer(1, None, b"", at(5));
        assert!(
            !commands
                .iter()
                .any(|c| matches!(c, Command::DispatchPrefill(_))),
            "{body}: {commands:?}"
        );
        assert_eq!(reply(&commands).0, 502, "{body}");
    }
    // A reset before any answer (Envoy's 503) is tried again.
    let body = r#"{"prompt":"x","max_tokens":5}"#;
    let mut s = prefilling_body("", body);
    let before_headers = b"upstream connect error or disconnect/reset before headers. reset reason: connection termination";
    let commands = answer_retrying(&mut s, 1, Some(503), before_headers, body, at(5));
    assert!(commands
        .iter()
        .any(|c| matches!(c, Command::DispatchPrefill(_))));
}

#[test]
fn what_requests_hold_in_the_vm_stays_within_its_budget() {
    // Two requests' worth of a whole body each (the client's own kv_transfer_params keep
    // it whole), in a VM whose budget holds only one. Each also keeps its headers, model
    // and request id (for its KV release), and the plan of decode's body, counted too.
    let config = r#"{"max_request_body_bytes":400,"max_vm_held_bytes":800}"#;
    let config = Rc::new(Config::from_json(config.as_bytes()).unwrap());
    let held = HeldBytes::new(config.max_vm_held_bytes);
    let whole = format!(
        r#"{{"prompt":"{}","max_tokens":5,"kv_transfer_params":{{"a":1}}}}"#,
        "x".repeat(280)
    );
    let mut first = Session::new(config.clone(), held.clone());
    let step = send(&mut first, &post("/v1/completions"), &whole);
    assert!(!has_reply(&step.commands));
    assert!(held.held() > whole.len());
    let mut second = Session::new(config.clone(), held.clone());
    let step = send(&mut second, &post("/v1/completions"), &whole);
    let (status, body) = reply(&step.commands);
    assert_eq!(status, 503, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_vm_held_bytes"));
    assert!(!step
        .commands
        .iter()
        .any(|c| matches!(c, Command::DispatchPrefill(_))));
    // Once the first request's body is no longer needed, only what its release needs stays
    // held, and the next one fits.
    first.on_prefill_dispatched(Ok(1), at(0));
    first.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    assert!(held.held() < whole.len());
    drop(first);
    assert_eq!(held.held(), 0, "a request that ends gives its share back");
    let mut third = Session::new(config.clone(), held.clone());
    assert!(!has_reply(
        &send(&mut third, &post("/v1/completions"), &whole).commands
    ));
    drop(third);
    assert_eq!(held.held(), 0);

    // Prompt logprobs wait in the VM until decode answers: past the budget, the request
    // is refused after prefill and its KV released.
    let logprobs = format!("[null,{}]", "1".repeat(120_000));
    let answer = format!(
        r#"{{"id":"p","choices":[{{"text":"a","prompt_logprobs":{logprobs}}}],"kv_transfer_params":{KV}}}"#
    );
    let config = r#"{"max_request_body_bytes":200000,"max_vm_held_bytes":200000}"#;
    let config = Rc::new(Config::from_json(config.as_bytes()).unwrap());
    let held = HeldBytes::new(config.max_vm_held_bytes);
    let asks = r#"{"prompt":"p","max_tokens":5,"prompt_logprobs":1}"#;
    let mut decoding = Session::new(config.clone(), held.clone());
    send(&mut decoding, &post("/v1/completions"), asks);
    decoding.on_prefill_dispatched(Ok(1), at(0));
    let commands = decoding.on_prefill_answer(1, Some(200), answer.as_bytes(), at(5));
    assert!(commands.contains(&Command::ResumeRequest), "{commands:?}");
    assert!(held.held() > logprobs.len());
    let mut refused = Session::new(config.clone(), held.clone());
    send(&mut refused, &post("/v1/completions"), asks);
    refused.on_prefill_dispatched(Ok(1), at(0));
    let commands = refused.on_prefill_answer(1, Some(200), answer.as_bytes(), at(5));
    assert_eq!(reply(&commands).0, 503);
    released(&commands);
    assert!(!commands.contains(&Command::ResumeRequest));
    // Given back once they are in decode's answer, while the stream still lives (a client
    // that does not read its answer keeps none of the budget).
    let answer = br#"{"id":"d","choices":[{"text":"abc"}]}"#;
    let length = answer.len().to_string();
    decoding.on_response_headers(&ResponseHead {
        content_length: Some(length.as_bytes()),
        ..upstream(200)
    });
    assert_eq!(held.held(), logprobs.len());
    assert_eq!(
        decoding.on_response_body(answer.len(), false),
        BodyStep::ReadBody
    );
    let step = decoding.on_response_body_read(answer, false);
    assert!(matches!(
        step.commands.as_slice(),
        [Command::ReplaceResponseBody { .. }]
    ));
    assert_eq!(held.held(), 0);
    // An answer that does not get them (an error here) gives them back at its headers.
    let mut refused_by_decode = Session::new(config.clone(), held.clone());
    send(&mut refused_by_decode, &post("/v1/completions"), asks);
    refused_by_decode.on_prefill_dispatched(Ok(1), at(0));
    refused_by_decode.on_prefill_answer(1, Some(200), answer_with(&logprobs).as_bytes(), at(5));
    assert!(held.held() > logprobs.len());
    refused_by_decode.on_response_headers(&upstream(400));
    assert_eq!(held.held(), 0);
}

#[test]
fn the_plan_of_decodes_body_counts_while_prefill_works() {
    // Decode's body is planned from the client's members and kept until prefill answers:
    // a body of many small members costs no more than its few pieces, and one whose plan
    // is really large (the client's kv_transfer_params repeated between its members) counts
    // it against the VM's budget, like the whole body it keeps.
    let config = r#"{"max_request_body_bytes":150000,"max_vm_held_bytes":200000}"#;
    let config = Rc::new(Config::from_json(config.as_bytes()).unwrap());
    let held = HeldBytes::new(config.max_vm_held_bytes);
    let many = format!(
        r#"{{"prompt":"x","max_tokens":5{}}}"#,
        r#","":0"#.repeat(20_000)
    );
    let mut plain = Session::new(config.clone(), held.clone());
    let step = send(&mut plain, &post("/v1/completions"), &many);
    assert!(!has_reply(&step.commands), "{:?}", step.commands);
    assert!(held.held() < 4096, "{} held", held.held());
    drop(plain);
    assert_eq!(held.held(), 0);

    let repeated = format!(
        r#"{{"prompt":"x","max_tokens":5{}}}"#,
        r#","kv_transfer_params":{},"":0"#.repeat(2_500)
    );
    let plan = crate::protocol::prepare_with(
        Api::Completions,
        repeated.as_bytes(),
        config.prefill_options,
    )
    .unwrap()
    .decode
    .heap_bytes();
    assert!(plan > repeated.len() / 2, "{plan}");
    let mut edited = Session::new(config.clone(), held.clone());
    let step = send(&mut edited, &post("/v1/completions"), &repeated);
    assert!(!has_reply(&step.commands), "{:?}", step.commands);
    assert!(held.held() >= repeated.len() + plan, "{} held", held.held());
    // Given back once prefill has answered: decode's body is written.
    edited.on_prefill_dispatched(Ok(1), at(0));
    let commands = edited.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5));
    assert!(commands.contains(&Command::ResumeRequest), "{commands:?}");
    assert!(held.held() < 4096, "{} held", held.held());
    drop(edited);

    // Past the budget with its plan, such a request is refused before prefill.
    let repeated = format!(
        r#"{{"prompt":"x","max_tokens":5{}}}"#,
        r#","kv_transfer_params":{},"":0"#.repeat(4_000)
    );
    assert!(repeated.len() < 150_000);
    let mut refused = Session::new(config.clone(), held.clone());
    let step = send(&mut refused, &post("/v1/completions"), &repeated);
    assert_eq!(reply(&step.commands).0, 503);
    assert!(!step
        .commands
        .iter()
        .any(|c| matches!(c, Command::DispatchPrefill(_))));
    drop(refused);
    assert_eq!(held.held(), 0);
}

#[test]
fn the_kv_kept_for_a_release_counts_until_decode_answers() {
    // Prefill's kv_transfer_params (thousands of block ids for a long prompt) are kept
    // until decode answers, to release them should decode never read the request.
    let config = r#"{"max_request_body_bytes":100000,"max_vm_held_bytes":100000}"#;
    let config = Rc::new(Config::from_json(config.as_bytes()).unwrap());
    let held = HeldBytes::new(config.max_vm_held_bytes);
    let ids: Vec<String> = (0..8_000).map(|i| (100_000 + i).to_string()).collect();
    let kv = format!(
        r#"{{"remote_engine_id":"e","remote_block_ids":[{}],"remote_host":"127.0.0.1","remote_port":5600}}"#,
        ids.join(",")
    );
    let answer = format!(r#"{{"id":"p","kv_transfer_params":{kv}}}"#);
    let body = r#"{"prompt":"p","max_tokens":5}"#;
    let mut first = Session::new(config.clone(), held.clone());
    send(&mut first, &post("/v1/completions"), body);
    first.on_prefill_dispatched(Ok(1), at(0));
    let commands = first.on_prefill_answer(1, Some(200), answer.as_bytes(), at(5));
    assert!(commands.contains(&Command::ResumeRequest), "{commands:?}");
    assert!(held.held() >= kv.len(), "{} held", held.held());
    // Past the budget, the next such request is refused after prefill, its KV released.
    let mut second = Session::new(config.clone(), held.clone());
    send(&mut second, &post("/v1/completions"), body);
    second.on_prefill_dispatched(Ok(1), at(0));
    let commands = second.on_prefill_answer(1, Some(200), answer.as_bytes(), at(5));
    assert_eq!(reply(&commands).0, 503);
    released(&commands);
    assert!(!commands.contains(&Command::ResumeRequest));
    drop(second);
    // Decode answered: the KV is no longer kept.
    first.on_response_headers(&upstream(200));
    assert!(held.held() < 4096, "{} held", held.held());
    drop(first);
    assert_eq!(held.held(), 0);
}

fn answer_with(logprobs: &str) -> String {
    format!(
        r#"{{"id":"p","choices":[{{"text":"a","prompt_logprobs":{logprobs}}}],"kv_transfer_params":{KV}}}"#
    )
}

#[test]
fn what_a_request_keeps_for_its_release_counts_and_a_huge_model_is_not_kept() {
    // A client's forwarded headers (and request id) are kept from its headers on, while its
    // body uploads, until its KV is known to be read: past the VM's budget, the request is
    // refused at its headers, before prefill.
    let config = r#"{"max_request_body_bytes":400,"max_vm_held_bytes":600}"#;
    let config = Rc::new(Config::from_json(config.as_bytes()).unwrap());
    let held = HeldBytes::new(config.max_vm_held_bytes);
    let token = "t".repeat(700);
    let big = headers("POST", "/v1/completions", &[("authorization", &token)]);
    let mut s = Session::new(config.clone(), held.clone());
    let step = s.on_request_headers(&big, false);
    assert_eq!(reply(&step.commands).0, 503);
    assert_eq!(held.held(), 0);

    // Counted while the body uploads, and given back when the client leaves.
    let token = "t".repeat(300);
    let upload = headers("POST", "/v1/completions", &[("authorization", &token)]);
    let mut s = Session::new(config.clone(), held.clone());
    let step = s.on_request_headers(&upload, false);
    assert!(step
        .commands
        .iter()
        .all(|c| !matches!(c, Command::SendReply(_))));
    assert!(held.held() > token.len());
    let mut other = Session::new(config.clone(), held.clone());
    let step = other.on_request_headers(&upload, false);
    assert_eq!(
        reply(&step.commands).0,
        503,
        "the budget holds one such upload"
    );
    s.on_stream_done();
    assert_eq!(held.held(), 0);

    // A model name longer than any model's is not kept: the release names none.
    let model = "m".repeat(2000);
    let body = format!(r#"{{"model":"{model}","prompt":"x","max_tokens":5}}"#);
    let mut s = prefilling_body("", &body);
    s.on_stream_done();
    let release = released(&s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(9)));
    assert!(release.get("model").is_none(), "{release}");
}

#[test]
fn every_copy_of_a_forwarded_header_goes_to_prefill() {
    // Decode gets every line of a header sent on several; prefill got only the first.
    let mut list = post("/v1/completions");
    list.push(("baggage".to_owned(), b"a=1".to_vec()));
    list.push(("baggage".to_owned(), b"b=2".to_vec()));
    let mut s = session("");
    let step = send(&mut s, &list, r#"{"prompt":"x","max_tokens":5}"#);
    let call = dispatched(&step.commands);
    let values: Vec<&str> = call
        .headers
        .iter()
        .filter(|(name, _)| name == "baggage")
        .map(|(_, value)| value.as_str())
        .collect();
    assert_eq!(values, ["a=1", "b=2"]);
}

/// A request from `address` counted among `abandoned`, through its headers: the session and
/// the refusal, if any.
fn from_client(abandoned: &AbandonedPrefills, address: &str) -> (Session, Option<Step>) {
    let mut s = session("").with_abandoned_prefills(abandoned.clone());
    s.on_request_headers(&post("/v1/completions"), false);
    // The address is read before prefill only once some client has left one running.
    assert_eq!(s.wants_client_address(), abandoned.any_running());
    let refusal = if s.wants_client_address() {
        s.on_client_address(Some(address.as_bytes()))
    } else {
        None
    };
    (s, refusal)
}

/// The client at `address` leaves, as the filter sees it.
fn leaves(s: &mut Session, address: &str) {
    if s.wants_address_on_leaving() {
        s.on_leaving_client_address(Some(address.as_bytes()));
    }
    s.on_stream_done();
}

#[test]
fn a_client_that_left_too_many_prefills_running_is_refused_until_they_end() {
    let abandoned = AbandonedPrefills::new(2);
    let mut left = Vec::new();
    for token in 1..=2 {
        let (mut s, refusal) = from_client(&abandoned, "10.0.0.1:4000");
        assert!(refusal.is_none());
        assert_eq!(s.on_request_body(20, true), BodyStep::ReadBody);
        s.on_request_complete(br#"{"prompt":"x"}"#.to_vec(), at(0));
        s.on_prefill_dispatched(Ok(token), at(0));
        leaves(&mut s, "10.0.0.1:4000");
        left.push(s);
    }
    // A client that stays, or leaves before its prefill starts, is not counted.
    let (mut stays, refusal) = from_client(&abandoned, "10.0.0.3:4001");
    assert!(refusal.is_none());
    stays.on_request_body(14, true);
    stays.on_request_complete(br#"{"prompt":"x"}"#.to_vec(), at(0));
    stays.on_prefill_dispatched(Ok(9), at(0));
    let (mut uploading, refusal) = from_client(&abandoned, "10.0.0.3:4002");
    assert!(refusal.is_none());
    leaves(&mut uploading, "10.0.0.3:4002");
    assert_eq!(abandoned.running_for("10.0.0.3"), 0);

    let (_, refusal) = from_client(&abandoned, "10.0.0.1:4003");
    let refusal = refusal.expect("refused at the limit");
    assert_eq!(refusal.flow, Flow::Pause);
    let (status, body) = reply(&refusal.commands);
    assert_eq!(status, 429);
    assert_eq!(body["error"]["type"], "RateLimitError");
    let retry_after = refusal.commands.iter().any(|c| {
        matches!(c, Command::SendReply(r)
            if r.headers.contains(&("retry-after".to_owned(), "1".to_owned())))
    });
    assert!(retry_after, "{:?}", refusal.commands);
    assert!(refusal.commands.contains(&Command::Record(Metric::Request(
        Api::Completions,
        Outcome::ClientError
    ))));
    // Another client is not affected, nor a request with no address.
    assert!(from_client(&abandoned, "10.0.0.2:4000").1.is_none());
    let mut unknown = session("").with_abandoned_prefills(abandoned.clone());
    unknown.on_request_headers(&post("/v1/completions"), false);
    assert!(unknown.on_client_address(None).is_none());

    // Prefill answers one of them, and the request goes with it: room for one more.
    let mut first = left.remove(0);
    released(&first.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(5)));
    drop(first);
    assert!(from_client(&abandoned, "10.0.0.1:4004").1.is_none());
    drop(left);
    assert_eq!(abandoned.running_for("10.0.0.1"), 0);

    // Not limited: the address is not even asked for.
    let mut s = session(r#"{"max_abandoned_prefills_per_client":0}"#)
        .with_abandoned_prefills(AbandonedPrefills::new(0));
    s.on_request_headers(&post("/v1/completions"), false);
    assert!(!s.wants_client_address());
    s.on_request_body(14, true);
    s.on_request_complete(br#"{"prompt":"x"}"#.to_vec(), at(0));
    s.on_prefill_dispatched(Ok(1), at(0));
    assert!(!s.wants_address_on_leaving());
}

#[test]
fn prefills_advice_to_wait_reaches_the_client() {
    // A rate limiter (or a gateway) in front of prefill says how long to wait: the client's
    // SDK waits as long before it tries again.
    let retry_after = |commands: &[Command]| {
        commands.iter().find_map(|c| match c {
            Command::SendReply(r) => r
                .headers
                .iter()
                .find(|(name, _)| name == "retry-after")
                .map(|(_, value)| value.clone()),
            _ => None,
        })
    };
    let limited = br#"{"error":{"message":"slow down","type":"RateLimitError","code":429}}"#;
    for (config, status, answer) in [
        ("", 429, &limited[..]),
        (r#"{"prefill_retries":0}"#, 503, b"busy"),
    ] {
        let mut s = prefilling(config);
        let head = PrefillHead {
            status: Some(status),
            retry_after: Some("3"),
        };
        let commands = s.on_prefill_response(1, head, answer, at(5));
        assert_eq!(reply(&commands).0, status);
        assert_eq!(retry_after(&commands).as_deref(), Some("3"), "{status}");
    }
}

#[test]
fn a_prefill_that_asks_for_a_pause_is_not_asked_again_at_once() {
    let busy = br#"{"error":{"message":"overloaded","type":"ServiceUnavailableError","code":503}}"#;
    let pause = |seconds| PrefillHead {
        status: Some(503),
        retry_after: Some(seconds),
    };
    // One target (the cluster): the client gets the 503 and its advice, prefill one call.
    let mut s = prefilling(r#"{"prefill_retries":2}"#);
    let commands = s.on_prefill_response(1, pause("5"), busy, at(5));
    assert_eq!(reply(&commands).0, 503, "{commands:?}");
    // Without a pause asked for (or with 0 s), the 503 is tried again.
    for seconds in ["0", "soon"] {
        let mut s = prefilling(r#"{"prefill_retries":2}"#);
        let commands = s.on_prefill_response(1, pause(seconds), busy, at(5));
        assert!(
            commands
                .iter()
                .any(|c| matches!(c, Command::DispatchPrefill(_) | Command::ReadRequestBody)),
            "{seconds}: {commands:?}"
        );
    }
    // Another scheduler-listed host is tried; the same host, alone in its list, is not.
    for (listed, retried) in [
        ("10.0.0.1:8000,10.0.0.2:8000", true),
        ("10.0.0.1:8000", false),
    ] {
        let config = r#"{"prefill_host_cluster":"dst","prefill_hosts_allowed":["10.0.0.0/8"],"prefill_retries":2}"#;
        let mut s = session(config);
        let hosts = [("x-prefiller-host-port", listed)];
        send(
            &mut s,
            &headers("POST", "/v1/completions", &hosts),
            r#"{"prompt":"x"}"#,
        );
        s.on_prefill_dispatched(Ok(1), at(0));
        let commands = s.on_prefill_response(1, pause("5"), busy, at(5));
        let again = commands
            .iter()
            .any(|c| matches!(c, Command::DispatchPrefill(_) | Command::ReadRequestBody));
        assert_eq!(again, retried, "{listed}: {commands:?}");
    }
}

#[test]
fn the_filters_503s_say_when_to_try_again() {
    // Prefill could not be called (its pool full, no healthy host, no such cluster).
    let mut s = session(r#"{"prefill_retries":0}"#);
    send(
        &mut s,
        &post("/v1/completions"),
        r#"{"prompt":"x","max_tokens":5}"#,
    );
    let commands = s.on_prefill_dispatched(Err(CallRefused::AtOnce), at(0));
    let has_retry_after = |commands: &[Command]| {
        commands.iter().any(|c| {
            matches!(c, Command::SendReply(r)
                if r.status == 503
                    && r.headers.contains(&("retry-after".to_owned(), "1".to_owned())))
        })
    };
    assert!(has_retry_after(&commands), "{commands:?}");
}

/// A /v1/responses stream decode answers, its usage counting 3 cache hits (prefill: 1).
const RESPONSES_STREAM: &str = concat!(
    "event: response.created\n",
    "data: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\",\"usage\":null}}\n\n",
    "event: response.output_text.delta\n",
    "data: {\"type\":\"response.output_text.delta\",\"delta\":\"Hello\"}\n\n",
    "event: response.output_text.delta\n",
    "data: {\"type\":\"response.output_text.delta\",\"delta\":\" world\"}\n\n",
    "event: response.completed\n",
    "data: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"status\":\"completed\",\"output\":[{\"type\":\"message\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hello world\"}]}],\"usage\":{\"input_tokens\":3,\"output_tokens\":2,\"total_tokens\":5,\"input_tokens_details\":{\"cached_tokens\":3}}}}\n\n",
);

/// A session that reads decode's /v1/responses stream for its usage, and the VM's budget.
fn streaming_responses(config: &str) -> (Session, HeldBytes) {
    let config = Rc::new(Config::from_json(config.as_bytes()).unwrap());
    let held = HeldBytes::new(config.max_vm_held_bytes);
    let mut s = Session::new(config, held.clone());
    send(
        &mut s,
        &post("/v1/responses"),
        r#"{"model":"m","input":"x","stream":true}"#,
    );
    s.on_prefill_dispatched(Ok(1), at(0));
    let prefill = format!(
        r#"{{"id":"p","kv_transfer_params":{KV},"usage":{{"input_tokens":3,"output_tokens":1,"total_tokens":4,"input_tokens_details":{{"cached_tokens":1}}}}}}"#
    );
    s.on_prefill_answer(1, Some(200), prefill.as_bytes(), at(5));
    s.on_response_headers(&ResponseHead {
        content_type: Some("text/event-stream"),
        ..upstream(200)
    });
    (s, held)
}

/// Envoy's side of a streamed answer given in `chunks` (the last with the stream's end):
/// each chunk's buffer as the session's commands leave it (`set_buffer` from offset 0
/// drains `replaced_len` bytes and puts `body` before the rest), checked against `limit`;
/// what the client gets.
fn client_gets(s: &mut Session, chunks: &[&[u8]], limit: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for (index, chunk) in chunks.iter().enumerate() {
        let end = index + 1 == chunks.len();
        let step = match s.on_response_body(chunk.len(), end) {
            BodyStep::ReadBody => s.on_response_body_read(chunk, end),
            BodyStep::Step(step) => step,
        };
        assert_eq!(step.flow, Flow::Continue, "a stream is never held by Envoy");
        let mut buffer = chunk.to_vec();
        for command in step.commands {
            if let Command::ReplaceResponseBody {
                body,
                replaced_len,
                announce_length,
            } = command
            {
                assert!(
                    body.len() <= limit,
                    "{} bytes written, past the limit of {limit}",
                    body.len()
                );
                assert!(!announce_length);
                assert!(replaced_len <= buffer.len());
                buffer.splice(..replaced_len, body);
            }
        }
        out.extend_from_slice(&buffer);
    }
    out
}

#[test]
fn a_chunk_too_large_to_rewrite_loses_no_byte_held_before_it() {
    // A first chunk cut in the middle of an event, held (and replaced by nothing); the rest
    // of the stream in one chunk that, with what was held and the merged usage, is larger
    // than the limit. The client gets decode's stream as decode wrote it.
    let limit = 300;
    let config = format!(r#"{{"max_request_body_bytes":{limit}}}"#);
    let stream = RESPONSES_STREAM.as_bytes();
    let (head, rest) = stream.split_at("event: response.created\nd".len());
    let (mut s, held) = streaming_responses(&config);
    assert_eq!(s.on_response_body(head.len(), false), BodyStep::ReadBody);
    let step = s.on_response_body_read(head, false);
    assert_eq!(
        step.commands,
        vec![Command::ReplaceResponseBody {
            body: Vec::new(),
            replaced_len: head.len(),
            announce_length: false,
        }],
        "the cut event waits for its end"
    );
    assert!(held.held() >= head.len());
    assert_eq!(s.on_response_body(rest.len(), true), BodyStep::ReadBody);
    let step = s.on_response_body_read(rest, true);
    assert_eq!(
        step.commands,
        vec![Command::ReplaceResponseBody {
            body: head.to_vec(),
            replaced_len: 0,
            announce_length: false,
        }],
        "what was held goes before the chunk, written on its own"
    );
    assert_eq!(held.held(), 0, "the budget is given back");
    // The rest of the stream (a trailing empty chunk here) is not even read.
    assert_eq!(
        s.on_response_body(0, true),
        BodyStep::Step(Step::new(Flow::Continue, vec![]))
    );
    let (mut s, _) = streaming_responses(&config);
    let out = client_gets(&mut s, &[head, rest], limit);
    assert_eq!(String::from_utf8_lossy(&out), RESPONSES_STREAM);
    // The same chunk ending in the middle of an event: that event goes on once.
    let (middle, tail) = rest.split_at(rest.len() - 10);
    let (mut s, held) = streaming_responses(&config);
    let out = client_gets(&mut s, &[head, middle, tail], limit);
    assert_eq!(String::from_utf8_lossy(&out), RESPONSES_STREAM);
    assert_eq!(held.held(), 0);
}

#[test]
fn a_stream_reaches_the_client_whole_whatever_its_chunks_and_the_limit() {
    let stream = RESPONSES_STREAM.as_bytes();
    let (mut s, _) = streaming_responses("");
    let merged = client_gets(&mut s, &[stream], usize::MAX);
    assert!(String::from_utf8_lossy(&merged).contains(r#""cached_tokens":1"#));
    assert_eq!(merged.len(), stream.len(), "one digit for another");
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |below: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % below as u64) as usize
    };
    let mut merges = 0;
    let mut given_up = 0;
    for limit in [
        180,
        220,
        260,
        300,
        350,
        450,
        stream.len() - 1,
        stream.len() + 64,
    ] {
        let config = format!(r#"{{"max_request_body_bytes":{limit}}}"#);
        for round in 0..150 {
            // Pieces of 0 to 24, 0 to 120 or 0 to 400 bytes, ending with the stream or in an
            // empty chunk of its own.
            let longest = [24, 120, 400][round % 3];
            let mut chunks: Vec<&[u8]> = Vec::new();
            let mut at = 0;
            while at < stream.len() {
                let end = (at + next(longest + 1)).min(stream.len());
                chunks.push(&stream[at..end]);
                at = end;
            }
            if round % 2 == 0 {
                chunks.push(b"");
            }
            let (mut s, held) = streaming_responses(&config);
            let out = client_gets(&mut s, &chunks, limit);
            let case = || {
                let sizes: Vec<usize> = chunks.iter().map(|chunk| chunk.len()).collect();
                format!("limit {limit}, chunks of {sizes:?}")
            };
            if out == merged {
                merges += 1;
            } else {
                assert_eq!(
                    String::from_utf8_lossy(&out),
                    RESPONSES_STREAM,
                    "{}",
                    case()
                );
                given_up += 1;
            }
            assert_eq!(held.held(), 0, "{}", case());
            if limit > stream.len() {
                assert_eq!(out, merged, "{}", case());
            }
        }
    }
    assert!(
        merges > 0 && given_up > 0,
        "{merges} merged, {given_up} given up"
    );
}

#[test]
fn prefills_answer_is_the_whole_answer_to_a_one_token_echo_with_logprobs() {
    // lm-eval's loglikelihood requests: the prompt's logprobs are prefill's, and the one
    // token asked for is in its answer too.
    let body = r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":1}"#;
    let mut s = session("{}");
    let step = send(&mut s, &post("/v1/completions"), body);
    assert_eq!(
        String::from_utf8_lossy(&dispatched(&step.commands).body),
        body
    );
    s.on_prefill_dispatched(Ok(1), at(0));
    let answer = br#"{"id":"cmpl-1","choices":[{"text":"a b c","logprobs":{"tokens":["a"," b"," c"]}}],"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3},"kv_transfer_params":null}"#;
    let commands = s.on_prefill_answer(1, Some(200), answer, at(5));
    let sent = commands
        .iter()
        .find_map(|c| match c {
            Command::SendReply(reply) => Some(reply),
            _ => None,
        })
        .unwrap();
    assert_eq!(sent.status, 200);
    assert_eq!(sent.body, answer);
    assert!(sent
        .headers
        .contains(&("x-request-id".to_owned(), "req-1".to_owned())));
    assert!(!commands.contains(&Command::ResumeRequest));
    assert_eq!(
        recorded(&commands),
        vec![
            Metric::PrefillLatency(PrefillResult::Answered, Duration::ZERO),
            Metric::Request(Api::Completions, Outcome::PrefillAnswered),
        ]
    );
    // Prefill's refusal is still passed on as vLLM wrote it.
    let mut s = prefilling_body("{}", body);
    let refusal =
        br#"{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}"#;
    let (status, error) = reply(&s.on_prefill_answer(1, Some(400), refusal, at(5)));
    assert_eq!(
        (status, error["error"]["message"].as_str()),
        (400, Some("bad"))
    );
}

#[test]
fn prefills_whole_answer_is_bounded_and_must_be_json() {
    let body = r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":1}"#;
    // Larger than an answer the gateway writes at once: refused, never resumed to decode.
    let mut s = prefilling_body(r#"{"max_request_body_bytes":100}"#, body);
    let large = format!(r#"{{"choices":[{{"text":"{}"}}]}}"#, "x".repeat(200));
    let commands = s.on_prefill_answer(1, Some(200), large.as_bytes(), at(5));
    assert!(!commands.contains(&Command::ResumeRequest));
    let (status, error) = reply(&commands);
    assert_eq!(status, 400);
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("limit of 100 bytes"), "{message}");
    // A 2xx that is not JSON is handled as any prefill answer without KV.
    let mut s = prefilling_body("{}", body);
    let commands = s.on_prefill_answer(1, Some(200), b"not json", at(5));
    assert!(!has_reply(&commands));
    assert_eq!(commands.last(), Some(&Command::ResumeRequest));
    let mut s = prefilling_body(r#"{"on_missing_kv_transfer_params":"fail"}"#, body);
    let (status, _) = reply(&s.on_prefill_answer(1, Some(200), b"not json", at(5)));
    assert_eq!(status, 502);
}

#[test]
fn an_echo_with_logprobs_beyond_one_token_gets_prefills_prompt_before_decodes_answer() {
    let body = r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":2,"n":2}"#;
    let mut s = session("{}");
    let step = send(&mut s, &post("/v1/completions"), body);
    let prefill: Value = serde_json::from_slice(&dispatched(&step.commands).body).unwrap();
    assert_eq!(
        (&prefill["max_tokens"], &prefill["echo"], &prefill["n"]),
        (&json!(0), &json!(true), &json!(1))
    );
    s.on_prefill_dispatched(Ok(1), at(0));
    let answer = format!(
        r#"{{"id":"p","choices":[{{"index":0,"text":"a b","logprobs":{{"text_offset":[0,1],"token_logprobs":[null,-0.5],"tokens":["a"," b"],"top_logprobs":[null,{{" b":-0.5}}]}},"prompt_logprobs":[null,{{"7":{{"logprob":-0.5}}}}]}}],"kv_transfer_params":{KV}}}"#
    );
    let commands = s.on_prefill_answer(1, Some(200), answer.as_bytes(), at(5));
    assert!(commands.contains(&Command::ResumeRequest));
    let decode = replaced_body(body, &commands).unwrap();
    assert_eq!(decode.get("echo"), None);
    assert_eq!(decode["max_tokens"], json!(2));
    assert_eq!(decode["logprobs"], json!(1));

    let decodes = br#"{"id":"d","choices":[{"index":0,"text":" c d","logprobs":{"text_offset":[0,2],"token_logprobs":[-1,-2],"tokens":[" c"," d"],"top_logprobs":[{" c":-1},{" d":-2}]},"prompt_logprobs":null},{"index":1,"text":" e","logprobs":{"text_offset":[0],"token_logprobs":[-3],"tokens":[" e"],"top_logprobs":[{" e":-3}]},"prompt_logprobs":null}]}"#;
    let length = decodes.len().to_string();
    s.on_response_headers(&ResponseHead {
        content_length: Some(length.as_bytes()),
        ..upstream(200)
    });
    assert_eq!(s.on_response_body(decodes.len(), false), BodyStep::ReadBody);
    let step = s.on_response_body_read(decodes, false);
    let [Command::ReplaceResponseBody { body: written, .. }] = step.commands.as_slice() else {
        panic!("{:?}", step.commands);
    };
    let written: Value = serde_json::from_slice(written).unwrap();
    assert_eq!(
        written["choices"][0],
        json!({"index": 0, "text": "a b c d",
            "logprobs": {"text_offset": [0, 1, 3, 5], "token_logprobs": [null, -0.5, -1, -2],
                "tokens": ["a", " b", " c", " d"],
                "top_logprobs": [null, {" b": -0.5}, {" c": -1}, {" d": -2}]},
            "prompt_logprobs": [null, {"7": {"logprob": -0.5}}]})
    );
    assert_eq!(written["choices"][1]["text"], json!("a b e"));
    assert_eq!(
        written["choices"][1]["logprobs"]["text_offset"],
        json!([0, 1, 3])
    );
    assert_eq!(
        written["choices"][1]["prompt_logprobs"],
        written["choices"][0]["prompt_logprobs"]
    );
}

/// A chat request for `model` sent at `now_ms`, sharing `outages` with the VM's others.
fn chat_for(outages: &DecodeOutages, model: &str, now_ms: u64) -> (Session, Vec<Command>) {
    let config = r#"{"model_decode_clusters":{"other":"decode-other"}}"#;
    let mut s = session(config).with_decode_outages(outages.clone());
    let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"x"}}]}}"#);
    s.on_request_headers(&post("/v1/chat/completions"), false);
    s.on_request_body(body.len(), true);
    let step = s.on_request_complete(body.into_bytes(), at(now_ms));
    (s, step.commands)
}

/// Decode's answer (or Envoy's in its place) to a request that went to prefill at `now_ms`.
fn decode_answers(s: &mut Session, head: ResponseHead<'_>, now_ms: u64) {
    s.on_prefill_dispatched(Ok(1), at(now_ms));
    s.on_prefill_answer(1, Some(200), prefill_ok().as_bytes(), at(now_ms + 1));
    s.on_response_headers(&ResponseHead {
        envoys_own_at: Some(at(now_ms + 2)),
        ..head
    });
}

#[test]
fn while_envoy_cannot_connect_to_decode_requests_are_refused_before_prefill() {
    let refused = "upstream_reset_before_response_started{remote_connection_failure}";
    let outages = DecodeOutages::new(Duration::from_millis(1_000));
    for now_ms in [0, 150, 300] {
        let (mut s, commands) = chat_for(&outages, "m", now_ms);
        dispatched(&commands);
        decode_answers(&mut s, unreached(refused), now_ms);
    }

    let (_, commands) = chat_for(&outages, "m", 400);
    assert!(!commands
        .iter()
        .any(|c| matches!(c, Command::DispatchPrefill(_))));
    let (status, body) = reply(&commands);
    assert_eq!(status, 503);
    assert_eq!(body["error"]["type"], "ServiceUnavailableError");
    let retry_after = commands.iter().find_map(|c| match c {
        Command::SendReply(reply) => reply
            .headers
            .iter()
            .find(|(name, _)| name == "retry-after")
            .map(|(_, value)| value.clone()),
        _ => None,
    });
    assert_eq!(retry_after.as_deref(), Some("1"));
    assert_eq!(
        metrics(&commands),
        [Metric::Request(
            Api::ChatCompletions,
            Outcome::DecodeUnreachable
        )]
    );
    // Another decode pool may be up; a model no pool is named for is the default pool's.
    dispatched(&chat_for(&outages, "other", 400).1);
    assert_eq!(reply(&chat_for(&outages, "made-up", 400).1).0, 503);

    // A second later one request goes on to see whether decode is back; the rest wait for it.
    let (mut probe, commands) = chat_for(&outages, "m", 1_310);
    dispatched(&commands);
    assert_eq!(reply(&chat_for(&outages, "m", 1_320).1).0, 503);
    // Decode answered it (an error of its own is an answer): requests go on again.
    decode_answers(&mut probe, upstream(400), 1_310);
    dispatched(&chat_for(&outages, "m", 1_330).1);

    // Where request headers go on before the body, Envoy connects to decode at once and
    // answers while prefill runs.
    let outages = DecodeOutages::new(Duration::from_millis(1_000));
    for now_ms in [0, 150, 300] {
        let (mut s, _) = chat_for(&outages, "m", now_ms);
        s.on_prefill_dispatched(Ok(1), at(now_ms));
        assert!(s.watches_response() && s.wants_response_details(Some(503)));
        s.on_response_headers(&ResponseHead {
            envoys_own_at: Some(at(now_ms + 1)),
            ..unreached(refused)
        });
    }
    assert_eq!(reply(&chat_for(&outages, "m", 400).1).0, 503);

    // Envoy's other answers (a timeout in decode's pool) say nothing about an outage.
    let outages = DecodeOutages::new(Duration::from_millis(1_000));
    for now_ms in [0, 150, 300] {
        let (mut s, _) = chat_for(&outages, "m", now_ms);
        decode_answers(&mut s, unreached("upstream_response_timeout"), now_ms);
    }
    dispatched(&chat_for(&outages, "m", 400).1);
}

/// A host that asked for a pause is not asked again within the same request: with two
/// scheduler-listed hosts that both asked, the third attempt would go back to the first.
#[test]
fn a_host_that_asked_for_a_pause_is_not_tried_again_by_the_same_request() {
    let busy = br#"{"error":{"message":"overloaded","type":"ServiceUnavailableError","code":503}}"#;
    let body = r#"{"prompt":"x"}"#;
    let config = r#"{"prefill_host_cluster":"dst","prefill_hosts_allowed":["10.0.0.0/8"],"prefill_retries":3}"#;
    // The second host answers a pause too, or a 503 without one: neither sends the request
    // back to the first host, which asked it to wait.
    for second_asks_to_wait in [true, false] {
        let mut s = session(config);
        let hosts = [("x-prefiller-host-port", "10.0.0.1:8000,10.0.0.2:8000")];
        send(&mut s, &headers("POST", "/v1/completions", &hosts), body);
        s.on_prefill_dispatched(Ok(1), at(0));
        let pause = PrefillHead {
            status: Some(503),
            retry_after: Some("5"),
        };
        let mut commands = s.on_prefill_response(1, pause, busy, at(5));
        if commands == [Command::ReadRequestBody] {
            commands = s.on_request_body_reread(Some(body.as_bytes().to_vec()), at(5));
        }
        assert_eq!(
            call_header(dispatched(&commands), ORIGINAL_DST_HEADER),
            Some("10.0.0.2:8000")
        );
        s.on_prefill_dispatched(Ok(2), at(6));
        let second = PrefillHead {
            status: Some(503),
            retry_after: second_asks_to_wait.then_some("5"),
        };
        let mut commands = s.on_prefill_response(2, second, busy, at(10));
        if commands == [Command::ReadRequestBody] {
            commands = s.on_request_body_reread(Some(body.as_bytes().to_vec()), at(10));
        }
        assert!(
            !commands
                .iter()
                .any(|c| matches!(c, Command::DispatchPrefill(_))),
            "{second_asks_to_wait}: {commands:?}"
        );
        let (status, _) = reply(&commands);
        assert_eq!(status, 503);
    }
}

/// Under `several_prompts: decode_only` a list goes to decode alone: what is refused only
/// because prefill and decode would compute it apart (beam search, an echo with logprobs in
/// a stream or beyond one token with `truncate_prompt_tokens: -1`, truncation to the
/// context) is served, as one vLLM would serve it.
#[test]
fn a_list_decode_serves_alone_is_not_refused_for_prefills_sake() {
    for body in [
        r#"{"prompt":["one","two"],"max_tokens":5,"use_beam_search":true,"n":2}"#,
        r#"{"prompt":["one","two"],"max_tokens":5,"echo":true,"logprobs":1,"stream":true}"#,
        r#"{"prompt":["one","two"],"max_tokens":5,"truncate_prompt_tokens":-1}"#,
        r#"{"prompt":["one","two"],"max_tokens":5,"echo":true,"logprobs":1,"truncate_prompt_tokens":-1}"#,
    ] {
        let mut s = session(r#"{"several_prompts":"decode_only"}"#);
        let step = send(&mut s, &post("/v1/completions"), body);
        assert_eq!(step.flow, Flow::Continue, "{body}: {:?}", step.commands);
        assert_eq!(
            metrics(&step.commands),
            vec![Metric::Request(Api::Completions, Outcome::DecodeOnly)],
            "{body}"
        );
    }
    // The client's kv_transfer_params where vLLM also reads them are refused all the same.
    let mut s = session(r#"{"several_prompts":"decode_only"}"#);
    let body =
        r#"{"prompt":["one","two"],"vllm_xargs":{"kv_transfer_params":{"remote_host":"6.6.6.6"}}}"#;
    let step = send(&mut s, &post("/v1/completions"), body);
    assert_eq!(reply(&step.commands).0, 400);
}
