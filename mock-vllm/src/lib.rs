//! Mock vLLM servers for the prefill and decode roles of P/D disaggregation (NIXL connector).
//!
//! They follow vLLM's NIXL protocol as the filter sees it: prefill answers with
//! `kv_transfer_params` naming its blocks, decode reads them once and reports whether it
//! reused them (`x-mock-kv`); README.md, "The mock vLLM servers", lists the fault directives.

mod proto;

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{channel::Channel, combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket};
use tokio::task::JoinHandle;

use proto::{Answer, Endpoint, Parsed};

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    /// "prefill" or "decode".
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// One inference request as the mock received it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RecordedRequest {
    pub role: Role,
    /// Path including the query string, as received.
    pub path: String,
    /// All request headers in order, names lowercase.
    pub headers: Vec<(String, String)>,
    /// The exact body bytes (serialized as a lossy UTF-8 string).
    #[serde(serialize_with = "lossy_str")]
    pub body: Vec<u8>,
}

fn lossy_str<S: serde::Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&String::from_utf8_lossy(bytes))
}

impl RecordedRequest {
    /// The first header with that name (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body parsed as JSON (Python's `NaN` and infinities as `null`), `Value::Null` if it
    /// is not JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&proto::without_python_numbers(&self.body)).unwrap_or(Value::Null)
    }
}

struct Shared {
    role: Role,
    port: u16,
    log: Mutex<Vec<RecordedRequest>>,
    next_id: AtomicU64,
    next_block: AtomicU64,
    /// Prefill: the KV it issued, by `remote_request_id`, and whether a decode read it.
    kv_ledger: Mutex<HashMap<String, bool>>,
}

/// Prefill's KV blocks as a vLLM prefill worker holds them: issued with each answer, freed
/// when a decode worker reads them (the mock decode tells the prefill it names).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct KvLedger {
    pub issued: u64,
    pub read: u64,
    /// Issued and never read: what a real prefill would keep allocated.
    pub stranded: u64,
}

/// A mock vLLM server running on the current tokio runtime; stops accepting when dropped.
pub struct MockServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl MockServer {
    /// Binds `addr` (e.g. "127.0.0.1:0") and serves `role` on the current tokio runtime.
    pub async fn start(role: Role, addr: &str) -> io::Result<MockServer> {
        let listener = listen(addr).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            role,
            port: addr.port(),
            log: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            next_block: AtomicU64::new(1),
            kv_ledger: Mutex::new(HashMap::new()),
        });
        let task = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(MockServer { shared, addr, task })
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every request whose body was read completely, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.log.lock().unwrap().clone()
    }

    /// Prefill: the KV issued, read by a decode, and stranded.
    pub fn kv_ledger(&self) -> KvLedger {
        self.shared.kv_ledger()
    }

    /// The recorded requests whose `x-request-id` header equals `id`.
    pub fn requests_with_id(&self, id: &str) -> Vec<RecordedRequest> {
        self.shared.with_id(Some(id))
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Shared {
    fn kv_ledger(&self) -> KvLedger {
        let ledger = self.kv_ledger.lock().unwrap();
        let issued = ledger.len() as u64;
        let read = ledger.values().filter(|read| **read).count() as u64;
        KvLedger {
            issued,
            read,
            stranded: issued - read,
        }
    }

    fn with_id(&self, id: Option<&str>) -> Vec<RecordedRequest> {
        let log = self.log.lock().unwrap();
        log.iter()
            .filter(|r| id.is_none() || r.header("x-request-id") == id)
            .cloned()
            .collect()
    }
}

/// How many connections the kernel completes for a server before it accepts them. The
/// standard library's (and tokio's) 128 is less than the tests' bursts: a few hundred
/// requests at once, each of which Envoy connects to prefill and decode for. Past it the
/// kernel drops the connection's SYN, its retransmission comes a second later, and Envoy's
/// 1 s connect timeout ends the connection and every request waiting in that pool (a 503,
/// "connection timeout", for a request of another test). Linux caps it at somaxconn.
const LISTEN_BACKLOG: u32 = 4096;

/// A listener on the first address `addr` resolves to, with [`LISTEN_BACKLOG`].
async fn listen(addr: &str) -> io::Result<TcpListener> {
    let mut last = io::Error::new(io::ErrorKind::InvalidInput, format!("no address in {addr}"));
    for addr in tokio::net::lookup_host(addr).await? {
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        match socket.bind(addr) {
            Ok(()) => return socket.listen(LISTEN_BACKLOG),
            Err(error) => last = error,
        }
    }
    Err(last)
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| handle(shared.clone(), req));
            // Errors (client resets, injected faults) just end the connection.
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

type Body = BoxBody<Bytes, io::Error>;

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut resp = Response::new(full(value.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn error_response(status: u16, message: &str) -> Response<Body> {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, &proto::error_body(status.as_u16(), message))
}

/// An error answer in the shape `endpoint`'s clients get.
fn endpoint_error_response(endpoint: Endpoint, status: u16, message: &str) -> Response<Body> {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = proto::endpoint_error_body(endpoint, status.as_u16(), message);
    json_response(status, &body)
}

/// A response whose body is fed chunk by chunk; the task aborts it (dropping the connection)
/// after `cut_after` chunks when set.
fn channel_response(
    chunks: Vec<Bytes>,
    cut_after: Option<usize>,
    pace: Duration,
) -> Response<Body> {
    let (mut tx, body) = Channel::<Bytes, io::Error>::new(4);
    tokio::spawn(async move {
        for (i, chunk) in chunks.into_iter().enumerate() {
            if cut_after == Some(i) {
                break;
            }
            if tx.send_data(chunk).await.is_err() {
                return;
            }
            tokio::time::sleep(pace).await;
        }
        if cut_after.is_some() {
            // Let the bytes already sent reach the socket before the connection is dropped.
            tokio::time::sleep(Duration::from_millis(50)).await;
            tx.abort(io::Error::other("mock: connection dropped mid-answer"));
        }
    });
    Response::new(body.boxed())
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> io::Result<Response<Body>> {
    let path = req.uri().path().to_string();
    if req.method() == Method::POST {
        if let Some(endpoint) = Endpoint::from_path(&path) {
            return inference(&shared, endpoint, req).await;
        }
        if path == "/mock/kv/read" {
            // A decode read the KV of this remote_request_id (NIXL's notification).
            let id = req.into_body().collect().await.map_err(io::Error::other)?;
            let id = String::from_utf8_lossy(&id.to_bytes()).into_owned();
            if let Some(read) = shared.kv_ledger.lock().unwrap().get_mut(id.trim()) {
                *read = true;
            }
            return Ok(Response::new(full("")));
        }
    }
    if req.method() != Method::GET {
        return Ok(error_response(404, &format!("Not Found: {path}")));
    }
    Ok(match path.as_str() {
        "/health" => Response::new(full("")),
        "/v1/models" => json_response(
            StatusCode::OK,
            &json!({"object": "list", "data": [{"id": "mock-model", "object": "model",
                "created": now(), "owned_by": "mock-vllm", "root": "mock-model",
                "parent": null, "max_model_len": proto::MAX_MODEL_LEN}]}),
        ),
        "/mock/kv" => json_response(StatusCode::OK, &serde_json::to_value(shared.kv_ledger())?),
        "/mock/requests" => {
            let id = req.uri().query().and_then(|q| query_param(q, "request_id"));
            let list = serde_json::to_value(shared.with_id(id.as_deref()))?;
            json_response(StatusCode::OK, &list)
        }
        _ => error_response(404, &format!("Not Found: {path}")),
    })
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
                continue;
            }
            (b'+', _) => out.push(b' '),
            (b, _) => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Fault-injection directives found in a request body, for one role.
#[derive(Default)]
struct Faults {
    status: Option<u64>,
    delay_ms: Option<u64>,
    reset: bool,
    reset_mid: bool,
    no_kv: bool,
    null_kv: bool,
    kv_not_object: bool,
    non_json: bool,
    huge: Option<u64>,
    /// Prefill: prompt tokens its prefix cache already held (`mock:prefill_cached_tokens=N`).
    cached_tokens: Option<u64>,
    /// Prefill: hands its cache hits to decode in `kv_transfer_params`, as vLLM 0.33 does
    /// (`mock:prefill_hands_cached_tokens`).
    hands_cached_tokens: bool,
    /// Decode: the time between two streamed events (`mock:decode_token_delay_ms=N`).
    token_delay_ms: Option<u64>,
    /// Both workers: completions and chat usage without `prompt_tokens_details`, as vLLM
    /// answers without `--enable-prompt-tokens-details`, its default
    /// (`mock:no_prompt_details`, a server flag both pools share).
    no_prompt_details: bool,
    /// A `retry-after` on an error answer (`mock:prefill_retry_after=N`), as a rate limiter
    /// in front of vLLM would send.
    retry_after: Option<u64>,
    /// Decode: a gzip-compressed answer (`mock:decode_gzip`).
    gzip: bool,
    /// Prefill: sends its headers and half its answer, then waits this long before the rest
    /// (`mock:prefill_stall_mid_answer_ms=N`).
    stall_mid_answer_ms: Option<u64>,
    /// Decode: counts this many prompt tokens more than prefill, as a worker that rendered
    /// the request into a longer prompt would (`mock:decode_extra_prompt_tokens=N`).
    extra_prompt_tokens: Option<u64>,
    /// Prefill: the model's first token would end the answer (`mock:prefill_first_token_stop`):
    /// unless `min_tokens` holds it off, the answer stops there and, as in vLLM, no KV is
    /// handed over.
    first_token_stop: bool,
}

impl Faults {
    fn parse(raw: &str, role: Role) -> Faults {
        let key = |name: &str| format!("mock:{}_{name}", role.as_str());
        let flag = |name: &str| has_flag(raw, &key(name));
        let num = |name: &str| number_arg(raw, &format!("{}=", key(name)));
        let prefill = role == Role::Prefill;
        Faults {
            status: num("status"),
            delay_ms: num("delay_ms"),
            reset: flag("reset"),
            reset_mid: flag(if prefill {
                "reset_mid_answer"
            } else {
                "reset_mid_stream"
            }),
            no_kv: prefill && flag("no_kv"),
            null_kv: prefill && flag("null_kv"),
            kv_not_object: prefill && flag("kv_not_object"),
            non_json: prefill && flag("non_json"),
            huge: if prefill { num("huge") } else { None },
            cached_tokens: if prefill { num("cached_tokens") } else { None },
            hands_cached_tokens: prefill && flag("hands_cached_tokens"),
            token_delay_ms: if prefill { None } else { num("token_delay_ms") },
            no_prompt_details: has_flag(raw, "mock:no_prompt_details"),
            retry_after: num("retry_after"),
            gzip: !prefill && flag("gzip"),
            stall_mid_answer_ms: if prefill {
                num("stall_mid_answer_ms")
            } else {
                None
            },
            extra_prompt_tokens: if prefill {
                None
            } else {
                num("extra_prompt_tokens")
            },
            first_token_stop: prefill && flag("first_token_stop"),
        }
    }
}

impl Faults {
    fn pace(&self) -> Duration {
        Duration::from_millis(self.token_delay_ms.unwrap_or(1))
    }
}

/// `pattern` occurs as a whole directive (not as a prefix of a longer one).
fn has_flag(raw: &str, pattern: &str) -> bool {
    raw.match_indices(pattern).any(|(i, _)| {
        raw[i + pattern.len()..]
            .chars()
            .next()
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'))
    })
}

/// The most `mock:prefill_huge` pads an answer with: well past the 32 MiB Envoy takes for a
/// callout's answer.
const MAX_PADDING: usize = 128 << 20;

fn number_arg(raw: &str, prefix: &str) -> Option<u64> {
    raw.match_indices(prefix).find_map(|(i, _)| {
        let rest = &raw[i + prefix.len()..];
        let end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        rest[..end].parse().ok()
    })
}

async fn inference(
    shared: &Shared,
    endpoint: Endpoint,
    req: Request<Incoming>,
) -> io::Result<Response<Body>> {
    let path = req
        .uri()
        .path_and_query()
        .map_or_else(|| req.uri().path().to_string(), |p| p.as_str().to_string());
    let headers = req
        .headers()
        .iter()
        .map(|(k, v)| {
            let value = String::from_utf8_lossy(v.as_bytes()).into_owned();
            (k.as_str().to_ascii_lowercase(), value)
        })
        .collect();
    // An incomplete body (client reset) is an error: nothing is recorded or answered.
    let body = req
        .into_body()
        .collect()
        .await
        .map_err(io::Error::other)?
        .to_bytes();
    let role = shared.role;
    shared.log.lock().unwrap().push(RecordedRequest {
        role,
        path,
        headers,
        body: body.to_vec(),
    });

    let faults = Faults::parse(&String::from_utf8_lossy(&body), role);
    let parsed = proto::parse(endpoint, &body);
    // vLLM refuses a request in its API server (a 4xx) before the engine, which reads the
    // KV, sees it.
    let refused = parsed.is_err() || faults.status.is_some_and(|status| status < 500);
    // A decode worker that closes the connection (`mock:decode_reset`) stands for one killed
    // before its engine took the request: it never reads the KV.
    if role == Role::Decode && !refused && !faults.reset {
        // A decode worker takes the KV as soon as it has the request; one cancelled later
        // still tells prefill (vLLM's abort path), so the KV counts as read from here.
        // Its own task: a request whose connection closes now (the client left) has still
        // been received, and its KV still read.
        let request: Value =
            serde_json::from_slice(&proto::without_python_numbers(&body)).unwrap_or_default();
        let kv = request.get("kv_transfer_params").cloned();
        let _ = tokio::spawn(async move { read_remote_kv(kv.as_ref()).await }).await;
    }
    if let Some(ms) = faults.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(status) = faults.status {
        let status = u16::try_from(status).unwrap_or(500);
        let message = format!("mock {} failure {status}", role.as_str());
        let mut response = endpoint_error_response(endpoint, status, &message);
        if let Some(seconds) = faults.retry_after {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        return Ok(response);
    }
    if faults.reset {
        // Returning an error makes hyper close the connection without writing anything.
        return Err(io::Error::other(format!("mock: {}_reset", role.as_str())));
    }
    if faults.non_json {
        let mut resp = Response::new(full("this is not json"));
        resp.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        return Ok(resp);
    }
    let parsed = match parsed {
        Ok(parsed) => parsed,
        Err(message) => return Ok(endpoint_error_response(endpoint, 400, &message)),
    };
    if endpoint == Endpoint::Completions && !parsed.stream {
        if let Some(prompts) = proto::batched_prompts(&body) {
            return Ok(batched(shared, &parsed, &faults, prompts).await);
        }
    }
    Ok(answer_one(shared, &parsed, &faults))
}

fn answer_one(shared: &Shared, parsed: &Parsed, faults: &Faults) -> Response<Body> {
    match shared.role {
        Role::Prefill => prefill(shared, parsed, faults),
        Role::Decode => decode(shared, parsed, faults),
    }
}

/// Several prompts in one completions request, answered as vLLM answers them: each prompt
/// as a request of its own, then one answer with every prompt's choices in order (prompt
/// `k`'s choice `i` at index `k * n + i`) and the usage added up.
async fn batched(
    shared: &Shared,
    parsed: &Parsed,
    faults: &Faults,
    prompts: Vec<String>,
) -> Response<Body> {
    let mut merged: Option<(Response<()>, Value)> = None;
    for (k, prompt) in prompts.into_iter().enumerate() {
        let one = Parsed {
            prompt,
            ..parsed.clone()
        };
        let response = answer_one(shared, &one, faults);
        if response.status() != StatusCode::OK {
            return response;
        }
        let (head, body) = response.into_parts();
        let Ok(collected) = body.collect().await else {
            return error_response(500, "mock: a batched answer could not be read");
        };
        let Ok(mut object) = serde_json::from_slice::<Value>(&collected.to_bytes()) else {
            return error_response(500, "mock: a batched answer is not JSON");
        };
        if let Some(choices) = object["choices"].as_array_mut() {
            for choice in choices {
                let index = choice["index"].as_u64().unwrap_or(0);
                choice["index"] = json!(k as u64 * parsed.n + index);
            }
        }
        merged = Some(match merged {
            None => (Response::from_parts(head, ()), object),
            Some((head, mut all)) => {
                let choices = object["choices"].as_array().cloned().unwrap_or_default();
                if let Some(all_choices) = all["choices"].as_array_mut() {
                    all_choices.extend(choices);
                }
                for count in ["prompt_tokens", "completion_tokens", "total_tokens"] {
                    let sum = all["usage"][count].as_u64().unwrap_or(0)
                        + object["usage"][count].as_u64().unwrap_or(0);
                    all["usage"][count] = json!(sum);
                }
                let cached = &object["usage"]["prompt_tokens_details"]["cached_tokens"];
                if let (Some(more), Some(so_far)) = (
                    cached.as_u64(),
                    all["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
                ) {
                    all["usage"]["prompt_tokens_details"]["cached_tokens"] = json!(so_far + more);
                }
                (head, all)
            }
        });
    }
    let Some((head, object)) = merged else {
        return error_response(400, "prompt is required");
    };
    let (mut parts, ()) = head.into_parts();
    parts.headers.remove(CONTENT_LENGTH);
    Response::from_parts(parts, full(object.to_string()))
}

fn answer(
    shared: &Shared,
    parsed: &Parsed,
    tokens: Vec<String>,
    cached_tokens: u64,
    cache_writes: Option<u64>,
) -> Answer {
    let prefix = match parsed.endpoint {
        Endpoint::Completions => "cmpl-",
        Endpoint::Chat => "chatcmpl-",
        Endpoint::Responses => "resp-",
        Endpoint::Messages => "msg_",
        Endpoint::Generate => "gen-",
        Endpoint::Cohere => "",
    };
    let seq = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let id = format!(
        "{prefix}mock-{}-{}-{seq}",
        shared.role.as_str(),
        shared.port
    );
    Answer {
        endpoint: parsed.endpoint,
        // Generate answers with the request's own request_id when it has one.
        id: parsed.request_id.clone().unwrap_or(id),
        created: now(),
        model: parsed.model.clone(),
        n: parsed.n,
        limit: parsed.limit,
        prompt_tokens: parsed.prompt_tokens(),
        cached_tokens: cached_tokens.min(parsed.prompt_tokens()),
        cache_writes,
        prompt_details: true,
        tokens,
        echoed: if parsed.echo && parsed.endpoint == Endpoint::Completions {
            proto::prompt_pieces(&parsed.prompt)
        } else {
            Vec::new()
        },
        logprobs: parsed.logprobs,
    }
}

fn sse_response(answer: &Answer, include_usage: bool, cut: bool, pace: Duration) -> Response<Body> {
    let events = answer.events(include_usage);
    let chunks = events.into_iter().map(Bytes::from).collect();
    let mut resp = channel_response(chunks, cut.then_some(2), pace);
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert("cache-control", HeaderValue::from_static("no-cache"));
    resp
}

/// A JSON answer: whole; with `cut`, one that announces its full length and stops halfway;
/// with `stall`, one that waits that long after its first half.
fn object_response(object: &Value, cut: bool, stall: Option<Duration>) -> Response<Body> {
    if !cut && stall.is_none() {
        return json_response(StatusCode::OK, object);
    }
    let bytes = Bytes::from(object.to_string());
    let (half, rest) = (
        bytes.slice(..bytes.len() / 2),
        bytes.slice(bytes.len() / 2..),
    );
    let mut resp = match stall {
        Some(stall) if !cut => channel_response(vec![half, rest], None, stall),
        _ => channel_response(vec![half], Some(1), Duration::from_millis(1)),
    };
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    resp
}

fn prefill(shared: &Shared, parsed: &Parsed, faults: &Faults) -> Response<Body> {
    let generated = parsed.limit.min(40);
    let tokens = proto::generate("prefill", &parsed.prompt, generated, false);
    let cached = faults.cached_tokens.unwrap_or(0);
    // As vLLM 0.33: the rest of the prompt was computed here and written to the cache.
    let writes = faults
        .hands_cached_tokens
        .then(|| parsed.prompt_tokens().saturating_sub(cached));
    let mut answer = answer(shared, parsed, tokens, cached, writes);
    answer.prompt_details = !faults.no_prompt_details;
    if parsed.stream {
        // vLLM only returns kv_transfer_params on non-streamed answers.
        return sse_response(
            &answer,
            parsed.include_usage,
            faults.reset_mid,
            faults.pace(),
        );
    }
    let wants_kv =
        parsed.kv.as_ref().and_then(|kv| kv.get("do_remote_decode")) == Some(&Value::Bool(true));
    // As vLLM's connectors but NIXL from 0.34 on: KV handed over only for an answer cut at
    // its limit.
    let stopped = faults.first_token_stop && parsed.min_tokens == 0;
    // KV that is never sent is never issued: the ledger counts only what a decode could read.
    let kv = if faults.kv_not_object {
        json!("oops")
    } else if faults.null_kv || faults.no_kv || !wants_kv || stopped {
        Value::Null
    } else {
        let prompt_tokens = parsed.prompt_tokens();
        let blocks = prompt_tokens.div_ceil(16);
        let first = shared.next_block.fetch_add(blocks, Ordering::Relaxed);
        let seq = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let request_id = format!("mock-prefill-{}-req-{seq}", shared.port);
        shared
            .kv_ledger
            .lock()
            .unwrap()
            .insert(request_id.clone(), false);
        json!({
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": format!("mock-prefill-{}", shared.port),
            "remote_request_id": request_id,
            "remote_block_ids": (first..first + blocks).collect::<Vec<_>>(),
            "remote_host": "127.0.0.1", "remote_port": shared.port, "tp_size": 1,
            // The engine always generates a token: with `echo` and `max_tokens: 0` too,
            // leaving it out of the answer.
            "remote_num_tokens": prompt_tokens + generated.max(1),
            "mock_prompt_fingerprint": parsed.fingerprint(),
        })
    };
    let mut kv = kv;
    // Only vLLM 0.33 and later serve the Cohere API, and they hand prefill's hits over.
    let hands_hits = faults.hands_cached_tokens || parsed.endpoint == Endpoint::Cohere;
    if hands_hits && kv.is_object() {
        kv["remote_prefill_cached_tokens"] = json!(answer.cached_tokens);
    }
    let mut object = answer.object();
    if stopped {
        if let Some(choices) = object["choices"].as_array_mut() {
            for choice in choices {
                choice["finish_reason"] = json!("stop");
            }
        }
    }
    if parsed.prompt_logprobs.is_some() {
        let logprobs = parsed.prompt_logprobs_value();
        match parsed.endpoint {
            Endpoint::Chat | Endpoint::Generate => object["prompt_logprobs"] = logprobs,
            _ => {
                if let Some(choices) = object["choices"].as_array_mut() {
                    for choice in choices {
                        choice["prompt_logprobs"] = logprobs.clone();
                    }
                }
            }
        }
    }
    if !faults.no_kv {
        object["kv_transfer_params"] = kv;
    }
    if let Some(size) = faults.huge {
        // Bounded, so that no request makes the mock fail to allocate (which aborts it).
        let size = usize::try_from(size).unwrap_or(usize::MAX).min(MAX_PADDING);
        object["padding"] = Value::String("x".repeat(size));
    }
    let stall = faults.stall_mid_answer_ms.map(Duration::from_millis);
    object_response(&object, faults.reset_mid, stall)
}

fn decode(shared: &Shared, parsed: &Parsed, faults: &Faults) -> Response<Body> {
    if parsed.prompt_logprobs.is_some() && parsed.kv.as_ref().is_some_and(|kv| !kv.is_null()) {
        // A decode worker that pulls the prompt's KV never computes the prompt: it cannot
        // give prompt logprobs (vLLM fails such requests).
        return error_response(
            400,
            "prompt_logprobs cannot be computed with kv_transfer_params (remote prefill)",
        );
    }
    let outcome = proto::kv_outcome(
        parsed.kv.as_ref(),
        &parsed.fingerprint(),
        parsed.prompt_tokens(),
    );
    let garbage = outcome == "mismatch";
    let tokens = proto::generate("decode", &parsed.prompt, parsed.limit, garbage);
    // Like vLLM under P/D: the KV pulled from prefill counts as a prefix-cache hit, unless
    // prefill handed over its own hits (vLLM 0.33 and later).
    let prefills_hits = parsed
        .kv
        .as_ref()
        .and_then(|kv| kv.get("remote_prefill_cached_tokens"))
        .and_then(Value::as_u64);
    let cached = match (outcome == "reused", prefills_hits) {
        (true, Some(hits)) => hits,
        (true, None) => parsed.prompt_tokens(),
        (false, _) => 0,
    };
    // vLLM 0.33's decode counts the KV it pulled as neither a hit nor a cache write.
    let writes = prefills_hits.map(|_| 0);
    let mut answer = answer(shared, parsed, tokens, cached, writes);
    answer.prompt_details = !faults.no_prompt_details;
    if let Some(extra) = faults.extra_prompt_tokens {
        answer.prompt_tokens = answer.prompt_tokens.saturating_add(extra);
    }
    let mut resp = if faults.gzip {
        gzip_response(&answer, parsed, faults.pace())
    } else if parsed.stream {
        sse_response(
            &answer,
            parsed.include_usage,
            faults.reset_mid,
            faults.pace(),
        )
    } else {
        object_response(&answer.object(), faults.reset_mid, None)
    };
    resp.headers_mut()
        .insert("x-mock-kv", HeaderValue::from_static(outcome));
    resp
}

/// Decode's answer gzip-compressed (`mock:decode_gzip`), as a proxy in front of vLLM might
/// send it: stored deflate blocks, so that the plain text shows in the compressed bytes (a
/// filter that rewrote it there would break the stream's checksum), one per event.
fn gzip_response(answer: &Answer, parsed: &Parsed, pace: Duration) -> Response<Body> {
    let (plain, content_type): (Vec<Bytes>, _) = if parsed.stream {
        let events = answer.events(parsed.include_usage);
        (
            events.into_iter().map(Bytes::from).collect(),
            "text/event-stream",
        )
    } else {
        (
            vec![Bytes::from(answer.object().to_string())],
            "application/json",
        )
    };
    let mut resp = channel_response(gzip_stored(&plain), None, pace);
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert("content-encoding", HeaderValue::from_static("gzip"));
    resp
}

/// The gzip checksum (CRC-32) of `bytes`.
pub fn crc32(bytes: &[u8]) -> u32 {
    !crc32_update(!0, bytes)
}

/// CRC-32 (bit by bit: the mock's answers are small) carried on over `bytes`.
fn crc32_update(mut crc: u32, bytes: &[u8]) -> u32 {
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xedb8_8320 & (crc & 1).wrapping_neg());
        }
    }
    crc
}

/// `chunks` as one gzip stream in as many pieces: the header with the first, a stored block
/// for each, the last block and the trailer after them.
fn gzip_stored(chunks: &[Bytes]) -> Vec<Bytes> {
    let mut crc = !0u32;
    let mut size = 0u32;
    let mut pieces = Vec::with_capacity(chunks.len() + 1);
    for (index, chunk) in chunks.iter().enumerate() {
        let mut piece = Vec::with_capacity(chunk.len() + 16);
        if index == 0 {
            piece.extend_from_slice(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff]);
        }
        for block in chunk.chunks(0xffff) {
            let len = block.len() as u16;
            piece.push(0);
            piece.extend_from_slice(&len.to_le_bytes());
            piece.extend_from_slice(&(!len).to_le_bytes());
            piece.extend_from_slice(block);
        }
        crc = crc32_update(crc, chunk);
        size = size.wrapping_add(chunk.len() as u32);
        pieces.push(Bytes::from(piece));
    }
    let mut last = vec![1, 0, 0, 0xff, 0xff];
    last.extend_from_slice(&(!crc).to_le_bytes());
    last.extend_from_slice(&size.to_le_bytes());
    pieces.push(Bytes::from(last));
    pieces
}

/// Decode: pulls the KV named by `kv_transfer_params`, which tells the prefill worker that
/// holds it (at `remote_host:remote_port`) that it was read.
async fn read_remote_kv(kv: Option<&Value>) {
    let Some(kv) = kv.and_then(Value::as_object) else {
        return;
    };
    let (Some(host), Some(port), Some(id)) = (
        kv.get("remote_host").and_then(Value::as_str),
        kv.get("remote_port").and_then(Value::as_u64),
        kv.get("remote_request_id").and_then(Value::as_str),
    ) else {
        return;
    };
    let notify = async {
        let mut stream = tokio::net::TcpStream::connect((host, port as u16)).await?;
        let request = format!(
            "POST /mock/kv/read HTTP/1.1\r\nhost: {host}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{id}",
            id.len()
        );
        stream.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        io::Result::Ok(())
    };
    // A prefill that cannot be told just keeps its blocks (and shows them as stranded). Under
    // load (a load review: 150 clients with bodies of up to 2 MB) a 2 s bound lost hundreds
    // of notifications, and the ledger showed KV as stranded that decode had read.
    let _ = tokio::time::timeout(Duration::from_secs(10), notify).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_checksum_is_crc32() {
        // zlib.crc32(b"hello") in Python.
        assert_eq!(crc32(b"hello"), 0x3610_a686);
        assert_eq!(crc32(b""), 0);
    }
}
