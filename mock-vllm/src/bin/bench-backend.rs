//! `bench-backend`: the cheap backend of `make bench` (scripts/bench.sh).
//!
//! ```text
//! bench-backend serve ADDR[,ADDR…] [THREADS]   answer like a vLLM prefill and decode pair
//! bench-backend body SIZE PATH         write the benchmark's chat body of SIZE bytes to PATH
//! ```
//!
//! Like vLLM, it reads the whole request body before it answers (a backend that answers
//! early makes Envoy drop the upstream connection whenever the filter holds the body). A body
//! carrying `"do_remote_decode":true` is a prefill request and gets a small completion with a
//! `kv_transfer_params` object; any other body gets a small completion as decode would.
//! `GET /stats` counts what it saw, so the bench can check that decode received the KV
//! parameters prefill issued. Other `GET`s (a router's health checks) get `{}` and are not
//! counted. Several addresses serve the same handler from the same threads: a router that
//! keys its workers by URL (vllm-router) needs prefill and decode on distinct ports. No
//! validation beyond that: it must not be the bottleneck.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
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

const DECODE_ANSWER: &[u8] = br#"{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":"The answer is forty-two, as computed by the bench backend."},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":12,"total_tokens":13}}"#;

static PREFILL: AtomicU64 = AtomicU64::new(0);
static DECODE_WITH_KV: AtomicU64 = AtomicU64::new(0);
static DECODE_WITHOUT_KV: AtomicU64 = AtomicU64::new(0);
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

fn json(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

async fn handle(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let is_get = request.method() == Method::GET;
    let is_stats = is_get && request.uri().path() == "/stats";
    // Read the whole body before answering, as vLLM does.
    let body = match request.into_body().collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => return Ok(json(StatusCode::BAD_REQUEST, "{}")),
    };
    if is_stats {
        let stats = format!(
            r#"{{"prefill":{},"decode_with_kv":{},"decode_without_kv":{},"body_bytes":{}}}"#,
            PREFILL.load(Ordering::Relaxed),
            DECODE_WITH_KV.load(Ordering::Relaxed),
            DECODE_WITHOUT_KV.load(Ordering::Relaxed),
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
    if contains_quoted(&body, ENGINE) {
        DECODE_WITH_KV.fetch_add(1, Ordering::Relaxed);
    } else {
        DECODE_WITHOUT_KV.fetch_add(1, Ordering::Relaxed);
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
    "usage: bench-backend serve ADDR[,ADDR...] [THREADS] | bench-backend body SIZE PATH";

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
        ["body", size, path] => {
            let Ok(size) = size.parse::<usize>() else {
                eprintln!("bench-backend: bad size {size:?}\n{USAGE}");
                std::process::exit(2);
            };
            if let Err(e) = std::fs::write(path, body::chat_body(size)) {
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
