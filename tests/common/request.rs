//! The one way tests talk to the test Envoy: a request builder and the reply it gives.
//!
//! ```ignore
//! let reply = Request::post("default", "/v1/completions").id(&id).body(json).send().await;
//! ```

use std::time::{Duration, Instant};

use super::harness;

/// A pool of connections: requests sent [`Request::over`] one share its connections, as one
/// real client would. Without it, each request opens its own.
#[derive(Clone)]
pub struct Connections(reqwest::Client);

impl Connections {
    pub fn new() -> Connections {
        Connections(
            reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .expect("http client"),
        )
    }
}

impl Default for Connections {
    fn default() -> Connections {
        Connections::new()
    }
}

/// A request to one of the test Envoy's listeners. POSTs carry `content-type:
/// application/json` unless told otherwise.
pub struct Request {
    method: reqwest::Method,
    url: String,
    headers: Vec<(String, String)>,
    body: Option<reqwest::Body>,
    connections: Option<Connections>,
    timeout: Option<Duration>,
}

impl Request {
    pub fn post(listener: &str, path: &str) -> Request {
        Request::new(reqwest::Method::POST, listener, path)
            .header("content-type", "application/json")
    }

    pub fn get(listener: &str, path: &str) -> Request {
        Request::new(reqwest::Method::GET, listener, path)
    }

    fn new(method: reqwest::Method, listener: &str, path: &str) -> Request {
        Request {
            method,
            url: harness().url(listener, path),
            headers: Vec::new(),
            body: None,
            connections: None,
            timeout: None,
        }
    }

    /// `x-request-id: id`, the id the mocks record requests by.
    pub fn id(self, id: &str) -> Request {
        self.header("x-request-id", id)
    }

    /// Sets a header, replacing one of the same name set before.
    pub fn header(mut self, name: &str, value: impl Into<String>) -> Request {
        self.headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        self.headers.push((name.to_owned(), value.into()));
        self
    }

    /// Sends no `content-type` at all.
    pub fn without_content_type(mut self) -> Request {
        self.headers
            .retain(|(n, _)| !n.eq_ignore_ascii_case("content-type"));
        self
    }

    /// The body, sent with a `content-length`.
    pub fn body(mut self, body: impl AsRef<[u8]>) -> Request {
        self.body = Some(reqwest::Body::from(body.as_ref().to_vec()));
        self
    }

    /// The body in pieces of `size` bytes, with chunked transfer encoding (no
    /// `content-length`), so the filter sees it arrive in several parts.
    pub fn chunked(mut self, body: impl AsRef<[u8]>, size: usize) -> Request {
        let pieces: Vec<Result<Vec<u8>, std::io::Error>> = body
            .as_ref()
            .chunks(size)
            .map(|piece| Ok(piece.to_vec()))
            .collect();
        self.body = Some(reqwest::Body::wrap_stream(futures_util::stream::iter(
            pieces,
        )));
        self
    }

    /// Like [`Request::chunked`], with `pause` before each piece after the first, so that
    /// Envoy reads (and the filter gets) each piece on its own.
    pub fn trickled(mut self, body: impl AsRef<[u8]>, size: usize, pause: Duration) -> Request {
        let pieces: Vec<Vec<u8>> = body.as_ref().chunks(size).map(<[u8]>::to_vec).collect();
        let stream = futures_util::stream::unfold(
            (pieces.into_iter(), true),
            move |(mut pieces, first)| async move {
                let piece = pieces.next()?;
                if !first {
                    tokio::time::sleep(pause).await;
                }
                Some((Ok::<_, std::io::Error>(piece), (pieces, false)))
            },
        );
        self.body = Some(reqwest::Body::wrap_stream(stream));
        self
    }

    /// Announces `content-length: length` but sends only `start`, then nothing more: the
    /// request never completes, for tests of a client that goes away mid-body.
    pub fn unfinished_body(mut self, start: impl Into<Vec<u8>>, length: usize) -> Request {
        let start: Result<Vec<u8>, std::io::Error> = Ok(start.into());
        let stream = futures_util::StreamExt::chain(
            futures_util::stream::iter([start]),
            futures_util::stream::pending(),
        );
        self.body = Some(reqwest::Body::wrap_stream(stream));
        self.header("content-length", length.to_string())
    }

    /// Sends through these connections instead of new ones.
    pub fn over(mut self, connections: &Connections) -> Request {
        self.connections = Some(connections.clone());
        self
    }

    /// Gives the whole exchange this long instead of the connections' 30 s.
    pub fn timeout(mut self, timeout: Duration) -> Request {
        self.timeout = Some(timeout);
        self
    }

    /// Sends the request and leaves after `patience`, closing the connection; `true` when
    /// the whole answer came first.
    pub async fn leave_after(self, patience: Duration) -> bool {
        tokio::time::timeout(patience, self.try_send())
            .await
            .is_ok()
    }

    /// Sends the request and reads the whole reply; panics when that fails.
    pub async fn send(self) -> Reply {
        self.try_send()
            .await
            .unwrap_or_else(|e| panic!("request failed: {e}"))
    }

    /// Like [`Request::send`], but a failure to connect or to read the whole body is
    /// returned, not a panic (for tests where the connection is expected to break).
    pub async fn try_send(self) -> Result<Reply, String> {
        let started = Instant::now();
        let connections = self.connections.unwrap_or_default();
        let mut request = connections.0.request(self.method, &self.url);
        for (name, value) in &self.headers {
            request = request.header(name, value);
        }
        if let Some(body) = self.body {
            request = request.body(body);
        }
        if let Some(timeout) = self.timeout {
            request = request.timeout(timeout);
        }
        let mut response = request.send().await.map_err(|e| format!("send: {e:?}"))?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let mut body = Vec::new();
        let mut first_bytes = None;
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| format!("status {status}, body: {e:?}"))?
        {
            first_bytes.get_or_insert_with(|| started.elapsed());
            body.extend_from_slice(&chunk);
        }
        let latency = started.elapsed();
        Ok(Reply {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
            bytes: body,
            latency,
            first_bytes: first_bytes.unwrap_or(latency),
        })
    }
}

/// What the client got.
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: String,
    /// The body as it came, for one that is not text.
    pub bytes: Vec<u8>,
    /// From sending the request to the end of the reply's body.
    pub latency: Duration,
    /// From sending the request to the first bytes of the reply's body.
    pub first_bytes: Duration,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("reply is not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Asserts an OpenAI-style error with this status whose message contains `text`.
    pub fn assert_error(&self, status: u16, text: &str) {
        assert_eq!(self.status, status, "body: {}", self.body);
        let body = self.json();
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(text), "message {message:?} lacks {text:?}");
        assert_eq!(body["error"]["code"], status);
        assert!(body["error"]["type"].is_string());
    }
}
