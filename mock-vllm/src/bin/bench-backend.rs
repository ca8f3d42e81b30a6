//! `bench-backend`: the cheap backend of `make bench` (scripts/bench.sh).
//!
//! ```text
//! bench-backend serve ADDR[,ADDR…] [THREADS]   answer like a vLLM prefill and decode pair
//! bench-backend body SIZE PATH [stream]  write the benchmark's chat body of SIZE bytes to PATH
//!                                        (`stream`: the streamed one, usage chunk asked for)
//! ```
//!
//! Like vLLM, it reads the whole request body before it answers (a backend that answers
//! early makes Envoy drop the upstream connection whenever the filter holds the body). A body
//! carrying `"do_remote_decode":true` is a prefill request and gets a small completion with a
//! `kv_transfer_params` object; any other body gets a small completion as decode would: JSON,
//! or, when the body has `"stream":true`, server-sent events as vLLM writes them (a role
//! chunk, one chunk per word, the chunk with the finish reason, the usage chunk when
//! `"include_usage":true`, `[DONE]`), in one piece but without content-length (chunked, as
//! vLLM sends a stream, which a filter may rewrite on the way). Every answer counts the
//! prompt as one token, as prefill's does (both legs of a request count the same prompt, as
//! vLLM's do; counts that differ make the filter log a warning per request). Every usage
//! has `prompt_tokens_details`, as vLLM's with `--enable-prompt-tokens-details` on both
//! pools, the setting in which the filter's merge has something to change: prefill counts
//! no cache hit, decode's JSON answer counts the prompt as cached (vLLM counts pulled KV as
//! a prefix-cache hit; the JSON answer is the same bytes on every request), and the
//! stream's usage chunk counts it as cached when prefill's KV came with the request.
//! With `BENCH_STREAM_BY_EVENT` set, a stream goes out one event per write, as a generating
//! vLLM sends it. A request with the header `x-bench-event-gap-ms: N` gets its stream one
//! event per write, N milliseconds apart, as tokens come from a generating vLLM: only then
//! does a proxy slower than the backend see each event in a chunk of its own.
//! `GET /stats` counts what it saw, so the bench can check that decode received the KV
//! parameters prefill issued; the filter's KV releases are counted apart. Other `GET`s (a router's health checks) get `{}` and are not
//! counted. Several addresses serve the same handler from the same threads: a router that
//! keys its workers by URL (vllm-router) needs prefill and decode on distinct ports. No
//! validation beyond that: it must not be the bottleneck.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

#[allow(dead_code)] // SIZES is for benches/rewrite.rs
#[path = "../../../bench/body.rs"]
mod body;

const REMOTE_DECODE: &[u8] = br#""do_remote_decode":true"#;
const ENGINE: &[u8] = br#""remote_engine_id":"bench-engine""#;
const STREAM: &[u8] = br#""stream":true"#;
const INCLUDE_USAGE: &[u8] = br#""include_usage":true"#;
/// The prompt's length in tokens in every answer's usage, prefill's too.
const PROMPT_TOKENS: usize = 1;

const DECODE_ANSWER: &[u8] = br#"{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":"The answer is forty-two, as computed by the bench backend."},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":12,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":1}}}"#;

/// The words of the streamed answer, one content chunk each.
const STREAM_WORDS: [&str; 12] = [
    "The",
    " answer",
    " is",
    " forty",
    "-two",
    ",",
    " as",
    " computed",
    " by",
    " the",
    " bench",
    " backend.",
];

/// The streamed answer up to its usage chunk: the same bytes on every request, built once.
fn stream_events() -> &'static [u8] {
    static EVENTS: OnceLock<Vec<u8>> = OnceLock::new();
    EVENTS.get_or_init(|| {
        const CHUNK: &str =
            r#"data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench-model","choices":[{"index":0,"#;
        let mut events = String::new();
        events.push_str(CHUNK);
        events.push_str(
            r#""delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#,
        );
        events.push_str("\n\n");
        for word in STREAM_WORDS {
            events.push_str(CHUNK);
            events.push_str(&format!(
                r#""delta":{{"content":"{word}"}},"logprobs":null,"finish_reason":null}}]}}"#
            ));
            events.push_str("\n\n");
        }
        events.push_str(CHUNK);
        events.push_str(
            r#""delta":{"content":""},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}"#,
        );
        events.push_str("\n\n");
        events.into_bytes()
    })
}

/// Decode's streamed answer to a prompt of `prompt_tokens`, `cached_tokens` of them cached.
fn stream_answer(prompt_tokens: usize, cached_tokens: usize, include_usage: bool) -> Vec<u8> {
    let completion_tokens = STREAM_WORDS.len();
    let mut answer = Vec::with_capacity(stream_events().len() + 512);
    answer.extend_from_slice(stream_events());
    if include_usage {
        answer.extend_from_slice(
            format!(
                concat!(
                    r#"data: {{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench-model","choices":[],"#,
                    r#""usage":{{"prompt_tokens":{},"completion_tokens":{},"total_tokens":{},"#,
                    r#""prompt_tokens_details":{{"cached_tokens":{}}}}}}}"#,
                    "\n\n"
                ),
                prompt_tokens,
                completion_tokens,
                prompt_tokens + completion_tokens,
                cached_tokens
            )
            .as_bytes(),
        );
    }
    answer.extend_from_slice(b"data: [DONE]\n\n");
    answer
}

static PREFILL: AtomicU64 = AtomicU64::new(0);
static DECODE_WITH_KV: AtomicU64 = AtomicU64::new(0);
static DECODE_WITHOUT_KV: AtomicU64 = AtomicU64::new(0);
/// The filter's KV releases (`x-pd-kv-release`), for clients that left mid-request when a
/// run ends: not decode legs of client requests.
static RELEASES: AtomicU64 = AtomicU64::new(0);
static BODY_BYTES: AtomicU64 = AtomicU64::new(0);

/// Whether `needle` (which starts with `"`) occurs in `hay`. The tail is searched first, where
/// the filter puts `kv_transfer_params`; the full scan skips 64-byte blocks without a quote
/// (a branch-free test the compiler vectorizes), so a 1 MB prompt costs well under 0.1 ms.
fn contains_quoted(hay: &[u8], needle: &[u8]) -> bool {
    const TAIL: usize = 4096;
    let tail_start = hay.len().saturating_sub(TAIL);
    if find_from(hay, tail_start, needle) {
        return true;
    }
    find_from(
        &hay[..(tail_start + needle.len()).min(hay.len())],
        0,
        needle,
    )
}

fn find_from(hay: &[u8], start: usize, needle: &[u8]) -> bool {
    let first = needle[0];
    let mut block = start;
    while block < hay.len() {
        let end = (block + 64).min(hay.len());
        let chunk = &hay[block..end];
        if chunk.iter().fold(false, |any, &b| any | (b == first)) {
            for (i, &b) in chunk.iter().enumerate() {
                if b == first && hay[block + i..].starts_with(needle) {
                    return true;
                }
            }
        }
        block = end;
    }
    false
}

/// A response body sent in one piece. A JSON answer announces its length (content-length);
/// a stream of events does not (chunked transfer encoding), as vLLM's server sends one.
struct OnePiece {
    data: Option<Bytes>,
    sized: bool,
    /// Send each event (each `\n\n`-ended part) in its own write, as a generating vLLM does.
    by_event: bool,
    flush_first: bool,
    /// The wait before the next event, when events go out apart in time.
    gap: Option<std::time::Duration>,
    waiting: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Body for OnePiece {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if !self.by_event {
            return Poll::Ready(self.data.take().map(|data| Ok(Frame::data(data))));
        }
        // A pending turn between events makes hyper write out the one before.
        if let Some(gap) = self.gap.filter(|_| self.flush_first) {
            let waiting = self
                .waiting
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(gap)));
            if waiting.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.waiting = None;
            self.flush_first = false;
        }
        if std::mem::take(&mut self.flush_first) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let Some(data) = self.data.as_mut() else {
            return Poll::Ready(None);
        };
        let end = data
            .windows(2)
            .position(|pair| pair == b"\n\n")
            .map_or(data.len(), |at| at + 2);
        let event = data.split_to(end);
        if data.is_empty() {
            self.data = None;
        }
        self.flush_first = true;
        Poll::Ready(Some(Ok(Frame::data(event))))
    }

    fn is_end_stream(&self) -> bool {
        self.sized && self.data.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.data, self.sized) {
            (Some(data), true) => SizeHint::with_exact(data.len() as u64),
            (None, true) => SizeHint::with_exact(0),
            (_, false) => SizeHint::default(),
        }
    }
}

fn json(status: StatusCode, body: impl Into<Bytes>) -> Response<OnePiece> {
    let body = OnePiece {
        data: Some(body.into()),
        sized: true,
        by_event: false,
        flush_first: false,
        gap: None,
        waiting: None,
    };
    answer(status, "application/json", body)
}

fn events(body: impl Into<Bytes>, gap: Option<std::time::Duration>) -> Response<OnePiece> {
    let body = OnePiece {
        data: Some(body.into()),
        sized: false,
        by_event: gap.is_some() || std::env::var_os("BENCH_STREAM_BY_EVENT").is_some(),
        flush_first: false,
        gap,
        waiting: None,
    };
    answer(StatusCode::OK, "text/event-stream", body)
}

fn answer(status: StatusCode, content_type: &'static str, body: OnePiece) -> Response<OnePiece> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    response
}

async fn handle(request: Request<Incoming>) -> Result<Response<OnePiece>, Infallible> {
    let is_get = request.method() == Method::GET;
    let is_stats = is_get && request.uri().path() == "/stats";
    let is_release = request.headers().contains_key("x-pd-kv-release");
    let event_gap = request
        .headers()
        .get("x-bench-event-gap-ms")
        .and_then(|ms| ms.to_str().ok()?.parse().ok())
        .map(std::time::Duration::from_millis);
    // Read the whole body before answering, as vLLM does.
    let body = match request.into_body().collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => return Ok(json(StatusCode::BAD_REQUEST, "{}")),
    };
    if is_stats {
        let stats = format!(
            r#"{{"prefill":{},"decode_with_kv":{},"decode_without_kv":{},"releases":{},"body_bytes":{}}}"#,
            PREFILL.load(Ordering::Relaxed),
            DECODE_WITH_KV.load(Ordering::Relaxed),
            DECODE_WITHOUT_KV.load(Ordering::Relaxed),
            RELEASES.load(Ordering::Relaxed),
            BODY_BYTES.load(Ordering::Relaxed),
        );
        return Ok(json(StatusCode::OK, stats));
    }
    if is_get {
        return Ok(json(StatusCode::OK, "{}"));
    }
    BODY_BYTES.fetch_add(body.len() as u64, Ordering::Relaxed);
    if contains_quoted(&body, REMOTE_DECODE) {
        PREFILL.fetch_add(1, Ordering::Relaxed);
        return Ok(json(StatusCode::OK, body::PREFILL_ANSWER));
    }
    let with_kv = contains_quoted(&body, ENGINE);
    if is_release {
        RELEASES.fetch_add(1, Ordering::Relaxed);
    } else if with_kv {
        DECODE_WITH_KV.fetch_add(1, Ordering::Relaxed);
    } else {
        DECODE_WITHOUT_KV.fetch_add(1, Ordering::Relaxed);
    }
    if contains_quoted(&body, STREAM) {
        let prompt_tokens = PROMPT_TOKENS;
        let cached_tokens = if with_kv { prompt_tokens } else { 0 };
        let include_usage = contains_quoted(&body, INCLUDE_USAGE);
        return Ok(events(
            stream_answer(prompt_tokens, cached_tokens, include_usage),
            event_gap,
        ));
    }
    Ok(json(StatusCode::OK, DECODE_ANSWER))
}

async fn serve(addrs: Vec<SocketAddr>) -> std::io::Result<()> {
    let mut accepting = Vec::new();
    for addr in addrs {
        let listener = TcpListener::bind(addr).await?;
        println!("bench-backend listening on {}", listener.local_addr()?);
        accepting.push(tokio::spawn(accept(listener)));
    }
    for task in accepting {
        task.await.map_err(std::io::Error::other)??;
    }
    Ok(())
}

async fn accept(listener: TcpListener) -> std::io::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service_fn(handle))
                .await;
        });
    }
}

const USAGE: &str =
    "usage: bench-backend serve ADDR[,ADDR...] [THREADS] | bench-backend body SIZE PATH [stream]";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["serve", addr, rest @ ..] => {
            let Ok(addrs) = addr
                .split(',')
                .map(str::parse::<SocketAddr>)
                .collect::<Result<Vec<_>, _>>()
            else {
                eprintln!("bench-backend: bad address {addr:?}\n{USAGE}");
                std::process::exit(2);
            };
            let threads = rest.first().and_then(|t| t.parse().ok()).unwrap_or(1usize);
            let runtime = if threads <= 1 {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
            } else {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(threads)
                    .enable_all()
                    .build()
            };
            let result = runtime.and_then(|rt| rt.block_on(serve(addrs)));
            if let Err(e) = result {
                eprintln!("bench-backend: {e}");
                std::process::exit(1);
            }
        }
        ["body", size, path, rest @ ..] if matches!(rest, [] | ["stream"]) => {
            let Ok(size) = size.parse::<usize>() else {
                eprintln!("bench-backend: bad size {size:?}\n{USAGE}");
                std::process::exit(2);
            };
            let bytes = if rest.is_empty() {
                body::chat_body(size)
            } else {
                body::chat_stream_body(size)
            };
            if let Err(e) = std::fs::write(path, bytes) {
                eprintln!("bench-backend: cannot write {path}: {e}");
                std::process::exit(1);
            }
        }
        _ => {
            eprintln!("{USAGE}");
            std::process::exit(2);
        }
    }
}
