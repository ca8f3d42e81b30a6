//! Clients that put exactly the bytes a test wants on the wire: HTTP/1.1 over a plain TCP
//! socket (any method, path, header or framing, even invalid ones), and HTTP/2 with prior
//! knowledge (h2c) with control over DATA frame splits, trailers and stream resets.
//!
//! Used by tests/security.rs and tests/http_fuzz.rs through
//! `#[path = "common/raw_http.rs"] mod raw_http;`.
#![allow(dead_code)]

use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A complete HTTP response as the client read it.
#[derive(Debug, Clone)]
pub struct RawResponse {
    pub status: u16,
    /// Header names lowercase, in order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    /// The first header with that name, in any case.
    pub fn header(&self, name: &str) -> Option<&str> {
        let mut headers = self.headers.iter();
        headers.find_map(|(key, value)| key.eq_ignore_ascii_case(name).then_some(value.as_str()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON, `Null` when it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// Envoy's router adds this header to answers that came from an upstream; the filter's
    /// own answers (and Envoy's local replies) do not have it.
    pub fn came_from_upstream(&self) -> bool {
        self.header("x-envoy-upstream-service-time").is_some()
    }

    /// Asserts an OpenAI-style error with this status, as the filter writes them.
    pub fn assert_json_error(&self, status: u16, context: &str) {
        assert_eq!(self.status, status, "{context}: {}", self.text());
        let body = self.json();
        assert!(
            body["error"]["message"].is_string() && body["error"]["type"].is_string(),
            "{context}: not an OpenAI error body: {}",
            self.text()
        );
        assert_eq!(body["error"]["code"], status, "{context}: {}", self.text());
    }
}

/// What became of a request.
#[derive(Debug)]
pub enum Outcome {
    /// A whole, well-framed response.
    Response(RawResponse),
    /// The connection closed (or was reset) before any response byte.
    Closed,
    /// Bytes came, but not a whole response, before the connection closed.
    Truncated(Vec<u8>),
    /// Bytes came that are not HTTP/1.1.
    Malformed(String),
    /// Nothing conclusive before the deadline.
    Timeout(Vec<u8>),
}

impl Outcome {
    pub fn response(self, context: &str) -> RawResponse {
        match self {
            Outcome::Response(response) => response,
            other => panic!("{context}: no response: {}", other.describe()),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Outcome::Response(r) => format!("response {}", r.status),
            Outcome::Closed => "connection closed without a response".to_owned(),
            Outcome::Truncated(bytes) => format!(
                "truncated response: {:?}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
            ),
            Outcome::Malformed(reason) => format!("malformed response: {reason}"),
            Outcome::Timeout(bytes) => format!(
                "no complete response in time ({} bytes: {:?})",
                bytes.len(),
                String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
            ),
        }
    }
}

/// How the request bytes are written.
#[derive(Debug, Clone, Default)]
pub struct Writing {
    /// Write in pieces of these sizes (the rest in one piece), pausing between them.
    pub pieces: Vec<usize>,
    pub pause: Duration,
    /// Half-close the connection after the last byte (for requests that are incomplete on
    /// purpose: otherwise the server rightly waits for the rest).
    pub shutdown_after: bool,
}

/// Writes `request` to `127.0.0.1:port` and reads one response (skipping 1xx), for a request
/// with `method` (a HEAD answer has no body).
pub async fn exchange(
    port: u16,
    request: Vec<u8>,
    method: &str,
    writing: Writing,
    deadline: Duration,
) -> Outcome {
    let stream = match tokio::time::timeout(
        Duration::from_secs(5),
        TcpStream::connect(("127.0.0.1", port)),
    )
    .await
    {
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) => return Outcome::Malformed(format!("cannot connect: {error}")),
        Err(_) => return Outcome::Timeout(Vec::new()),
    };
    let _ = stream.set_nodelay(true);
    let (mut reader, mut writer) = stream.into_split();
    // Written alongside the reading: the server may answer (and stop reading) early.
    let write = tokio::spawn(async move {
        let mut rest = &request[..];
        for size in writing.pieces {
            let (piece, tail) = rest.split_at(size.min(rest.len()));
            writer.write_all(piece).await?;
            writer.flush().await?;
            rest = tail;
            if !writing.pause.is_zero() {
                tokio::time::sleep(writing.pause).await;
            }
        }
        writer.write_all(rest).await?;
        writer.flush().await?;
        if writing.shutdown_after {
            writer.shutdown().await?;
        } else {
            // Keep the write half open until the reader is done.
            std::future::pending::<()>().await;
        }
        Ok::<_, std::io::Error>(writer)
    });
    let head_request = method.eq_ignore_ascii_case("HEAD");
    let outcome = tokio::time::timeout(deadline, read_response(&mut reader, head_request)).await;
    write.abort();
    match outcome {
        Ok(outcome) => outcome,
        Err(_) => Outcome::Timeout(Vec::new()),
    }
}

async fn read_response(reader: &mut tokio::net::tcp::OwnedReadHalf, head: bool) -> Outcome {
    let mut buffer: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut eof = false;
    loop {
        match parse_response(&buffer, head, eof) {
            Parse::Done(response, used) => {
                if (100..200).contains(&response.status) {
                    buffer.drain(..used);
                    continue;
                }
                return Outcome::Response(response);
            }
            Parse::Bad(reason) => return Outcome::Malformed(reason),
            Parse::More if eof => {
                return if buffer.is_empty() {
                    Outcome::Closed
                } else {
                    Outcome::Truncated(buffer)
                };
            }
            Parse::More => {}
        }
        match reader.read(&mut chunk).await {
            Ok(0) | Err(_) => eof = true,
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
        }
    }
}

enum Parse {
    Done(RawResponse, usize),
    More,
    Bad(String),
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// One response from the start of `buffer`; `eof` allows a body delimited by the close.
fn parse_response(buffer: &[u8], head_request: bool, eof: bool) -> Parse {
    let Some(head_end) = find(buffer, b"\r\n\r\n") else {
        if buffer.len() > 1 << 20 {
            return Parse::Bad("response head over 1 MiB".to_owned());
        }
        return Parse::More;
    };
    let Ok(head) = std::str::from_utf8(&buffer[..head_end]) else {
        return Parse::Bad("response head is not UTF-8".to_owned());
    };
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    let status = parts.next().and_then(|s| s.parse::<u16>().ok());
    let Some(status) = status.filter(|_| version.starts_with("HTTP/1.")) else {
        return Parse::Bad(format!("status line {status_line:?}"));
    };
    let mut headers = Vec::new();
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Parse::Bad(format!("header line {line:?}"));
        };
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
    }
    let body_start = head_end + 4;
    let rest = &buffer[body_start..];
    let header = |name: &str| {
        headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
    };
    let no_body = head_request || (100..200).contains(&status) || status == 204 || status == 304;
    let make = |body: Vec<u8>| RawResponse {
        status,
        headers: headers.clone(),
        body,
    };
    if no_body {
        return Parse::Done(make(Vec::new()), body_start);
    }
    let chunked = header("transfer-encoding")
        .is_some_and(|value| value.to_ascii_lowercase().contains("chunked"));
    if chunked {
        return match dechunk(rest) {
            Ok(Some((body, used))) => Parse::Done(make(body), body_start + used),
            Ok(None) => Parse::More,
            Err(reason) => Parse::Bad(reason),
        };
    }
    if let Some(length) = header("content-length") {
        let Ok(length) = length.parse::<usize>() else {
            return Parse::Bad(format!("content-length {length:?}"));
        };
        if rest.len() >= length {
            return Parse::Done(make(rest[..length].to_vec()), body_start + length);
        }
        return Parse::More;
    }
    if eof {
        Parse::Done(make(rest.to_vec()), buffer.len())
    } else {
        Parse::More
    }
}

/// A chunked body: the data and the bytes used, `None` while incomplete.
fn dechunk(mut rest: &[u8]) -> Result<Option<(Vec<u8>, usize)>, String> {
    let total = rest.len();
    let mut body = Vec::new();
    loop {
        let Some(line_end) = find(rest, b"\r\n") else {
            return Ok(None);
        };
        let line = String::from_utf8_lossy(&rest[..line_end]);
        let size_text = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| format!("chunk size line {line:?}"))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            // Trailers, then an empty line.
            loop {
                let Some(end) = find(rest, b"\r\n") else {
                    return Ok(None);
                };
                let empty = end == 0;
                rest = &rest[end + 2..];
                if empty {
                    return Ok(Some((body, total - rest.len())));
                }
            }
        }
        if rest.len() < size + 2 {
            return Ok(None);
        }
        body.extend_from_slice(&rest[..size]);
        if &rest[size..size + 2] != b"\r\n" {
            return Err("chunk not followed by CRLF".to_owned());
        }
        rest = &rest[size + 2..];
    }
}

/// An HTTP/1.1 request with `content-length` set to the body's length.
pub fn http1_request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut out = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\n").into_bytes();
    for (name, value) in headers {
        out.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    out.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
    out.extend_from_slice(body);
    out
}

/// POSTs `body` as JSON with `x-request-id: id` and reads the answer (60 s at most).
pub async fn post_raw(
    port: u16,
    path: &str,
    id: &str,
    extra: &[(&str, &str)],
    body: &[u8],
) -> Outcome {
    let mut headers = vec![("content-type", "application/json"), ("x-request-id", id)];
    headers.extend_from_slice(extra);
    let request = http1_request("POST", path, &headers, body);
    exchange(
        port,
        request,
        "POST",
        Writing::default(),
        Duration::from_secs(60),
    )
    .await
}

// ---------------------------------------------------------------------------------------
// HTTP/2 with prior knowledge

/// An h2c request: headers, the body in these DATA frames, then optional trailers; or a
/// reset of the stream after `reset_after` DATA frames.
#[derive(Debug, Clone, Default)]
pub struct H2Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub data: Vec<Vec<u8>>,
    pub trailers: Vec<(String, String)>,
    pub reset_after: Option<usize>,
}

#[derive(Debug)]
pub enum H2Outcome {
    Response(RawResponse),
    /// The stream or connection was reset, or refused.
    Reset(String),
    /// The client reset the stream itself, as asked.
    ClientReset,
    Timeout,
    /// The request could not be built (an invalid path or header for the `http` crate).
    NotSent(String),
}

impl H2Outcome {
    pub fn response(self, context: &str) -> RawResponse {
        match self {
            H2Outcome::Response(response) => response,
            other => panic!("{context}: no h2 response: {other:?}"),
        }
    }
}

pub type H2Sender = h2::client::SendRequest<Bytes>;

/// An h2c connection to `127.0.0.1:port` (the connection task runs on the current runtime).
pub async fn h2_connect(port: u16) -> Result<H2Sender, String> {
    let stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (sender, connection) = h2::client::handshake(stream)
        .await
        .map_err(|e| format!("h2 handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// An HTTP/2 connection to `port` whose flow-control windows are `window` bytes, stream and
/// connection, as HTTP/2 clients such as httpx open them (16 MiB).
pub async fn h2_connect_with_window(port: u16, window: u32) -> Result<H2Sender, String> {
    let stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (sender, connection) = h2::client::Builder::new()
        .initial_window_size(window)
        .initial_connection_window_size(window)
        .handshake(stream)
        .await
        .map_err(|e| format!("h2 handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// Sends one request on the connection and reads its answer within `deadline`.
pub async fn h2_exchange(sender: &H2Sender, request: H2Request, deadline: Duration) -> H2Outcome {
    match tokio::time::timeout(deadline, h2_exchange_inner(sender.clone(), request)).await {
        Ok(outcome) => outcome,
        Err(_) => H2Outcome::Timeout,
    }
}

async fn h2_exchange_inner(sender: H2Sender, request: H2Request) -> H2Outcome {
    let headers = request
        .headers
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_str()));
    let built = match request_head(&request.method, &request.path, headers) {
        Ok(built) => built,
        Err(error) => return H2Outcome::NotSent(error),
    };
    let mut trailers = http::HeaderMap::new();
    for (name, value) in &request.trailers {
        let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name.as_bytes()),
            http::HeaderValue::from_str(value),
        ) else {
            return H2Outcome::NotSent(format!("trailer {name}: {value}"));
        };
        trailers.append(name, value);
    }
    let mut sender = match sender.ready().await {
        Ok(sender) => sender,
        Err(error) => return H2Outcome::Reset(format!("not ready: {error}")),
    };
    let no_body = request.data.is_empty() && trailers.is_empty() && request.reset_after.is_none();
    let (response, mut stream) = match sender.send_request(built, no_body) {
        Ok(pair) => pair,
        Err(error) => return H2Outcome::Reset(format!("send_request: {error}")),
    };
    if !no_body {
        let frames = request.data.len();
        for (i, frame) in request.data.into_iter().enumerate() {
            if request.reset_after == Some(i) {
                stream.send_reset(h2::Reason::CANCEL);
                return H2Outcome::ClientReset;
            }
            let last = i + 1 == frames && trailers.is_empty() && request.reset_after.is_none();
            if let Err(error) = stream.send_data(Bytes::from(frame), last) {
                return H2Outcome::Reset(format!("send_data: {error}"));
            }
        }
        if request.reset_after.is_some() {
            // Past the last frame: reset now, with the body unfinished.
            stream.send_reset(h2::Reason::CANCEL);
            return H2Outcome::ClientReset;
        }
        if !trailers.is_empty() {
            if let Err(error) = stream.send_trailers(trailers) {
                return H2Outcome::Reset(format!("send_trailers: {error}"));
            }
        }
    }
    let response = match response.await {
        Ok(response) => response,
        Err(error) => return H2Outcome::Reset(format!("response: {error}")),
    };
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )
        })
        .collect();
    let mut body_stream = response.into_body();
    let mut body = Vec::new();
    while let Some(chunk) = body_stream.data().await {
        match chunk {
            Ok(chunk) => {
                let _ = body_stream.flow_control().release_capacity(chunk.len());
                body.extend_from_slice(&chunk);
            }
            Err(error) => return H2Outcome::Reset(format!("body: {error}")),
        }
    }
    H2Outcome::Response(RawResponse {
        status,
        headers,
        body,
    })
}

/// Sends a whole POST of `body` to `path` as one stream, waits `wait`, then resets the
/// stream (`CANCEL`), as an HTTP/2 client that gives up on its request does.
pub async fn h2_post_then_reset(
    sender: &H2Sender,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    wait: Duration,
) -> Result<(), String> {
    let request = request_head("POST", path, headers.iter().copied())?;
    let mut sender = sender
        .clone()
        .ready()
        .await
        .map_err(|e| format!("not ready: {e}"))?;
    let (response, mut stream) = sender
        .send_request(request, false)
        .map_err(|e| format!("send_request: {e}"))?;
    stream
        .send_data(Bytes::copy_from_slice(body), true)
        .map_err(|e| format!("send_data: {e}"))?;
    match tokio::time::timeout(wait, response).await {
        Err(_) => {
            stream.send_reset(h2::Reason::CANCEL);
            Ok(())
        }
        Ok(answer) => Err(format!("answered before the reset: {answer:?}")),
    }
}

/// A request's head (method, path, headers) for an h2c stream.
fn request_head<'a>(
    method: &str,
    path: &str,
    headers: impl Iterator<Item = (&'a str, &'a str)>,
) -> Result<http::Request<()>, String> {
    let mut builder = http::Request::builder()
        .method(method)
        .uri(format!("http://localhost{path}"));
    for (name, value) in headers {
        builder = builder.header(name, value);
    }
    builder.body(()).map_err(|error| error.to_string())
}
