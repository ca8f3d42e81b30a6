//! One real Envoy with the built filter and a pair of mock vLLM servers, shared by the tests
//! of one test binary. Each listener runs the filter with a different plugin configuration.
#![allow(dead_code)]

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant};

use mock_vllm::{MockServer, RecordedRequest, Role};

mod oracle;
mod request;
// What each leg must get (oracle) and the one test client (request); not every test uses all.
#[allow(unused_imports)]
pub use {oracle::*, request::*};

/// The header on the filter's KV release calls to decode.
pub const KV_RELEASE_HEADER: &str = "x-pd-kv-release";

/// How a test listener routes to decode.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum DecodeRoute {
    /// Everything to the `decode` cluster.
    Plain,
    /// `x-pd-model: model-b` to `decode_b`, the rest to `decode`.
    ByModelHeader,
    /// With `x-gateway-destination-endpoint`, to exactly that host (an endpoint picker's
    /// choice, through an ORIGINAL_DST cluster); without it, to `decode`.
    ByPickerHeader,
    /// To a closed port: decode never takes the request.
    Unreachable,
    /// To the `decode_outage` cluster, whose port is closed until a test starts a decode
    /// there ([`Harness::outage_decode_port`]).
    Outage,
    /// To the same port through a cluster of its own (`decode_outage_passed`): a pool the
    /// filter follows apart from `decode_outage`, whose outage another listener of the same
    /// VM may have seen first.
    OutageOwnPool,
    /// To a port that never completes a connection: Envoy gives up after its connect
    /// timeout (1 s), long after prefill answered.
    Blackholed,
    /// To a server that takes connections and never reads from them: Envoy is connected, but
    /// decode never reads the request.
    Deaf,
    /// To the mock decode through a cluster of the listener's own, whose stats count only
    /// that listener's decode streams.
    Counted(&'static str),
    /// To a decode whose JSON answer ends with trailers ([`TRAILERS_ANSWER`]), through a
    /// cluster that takes them (`enable_trailers`).
    Trailers,
    /// To `decode_half_dead`, the mock decode and a closed port taken in turn, on a route that
    /// retries connection failures (as Istio's routes do unless told otherwise).
    RetryingHalfDead,
}

pub struct Listener {
    pub name: &'static str,
    pub plugin_config: &'static str,
    pub decode_route: DecodeRoute,
    /// `allow_on_headers_stop_iteration` on the wasm filter.
    pub allow_on_headers_stop_iteration: bool,
    /// The listener's `per_connection_buffer_limit_bytes`.
    pub buffer_limit_bytes: u32,
}

/// 16 MiB, above the 8 MiB body limit the filter gets on such a listener unless its
/// configuration sets one, as in `envoy/envoy.yaml` (which buffers bodies up to its virtual
/// host's `request_body_buffer_limit`, 16 MiB, with a 1 MiB listener; its own tests are in
/// tests/manifests.rs).
const BUFFER_LIMIT_BYTES: u32 = 16 * 1024 * 1024;
const SHIPPED_MAX_REQUEST_BODY_BYTES: u64 = 8 * 1024 * 1024;

/// Envoy's default buffer limit, and the filter's default body limit.
pub const ENVOY_DEFAULT_BUFFER_LIMIT_BYTES: u32 = 1024 * 1024;

const fn plain(name: &'static str, plugin_config: &'static str) -> Listener {
    Listener {
        name,
        plugin_config,
        decode_route: DecodeRoute::Plain,
        allow_on_headers_stop_iteration: false,
        buffer_limit_bytes: BUFFER_LIMIT_BYTES,
    }
}

/// The listeners of the test Envoy, each running the filter with its own configuration.
pub const LISTENERS: &[Listener] = &[
    // As envoy/envoy.yaml ships: headers held until prefill has answered.
    Listener {
        allow_on_headers_stop_iteration: true,
        ..plain("default", r#"{"hold_request_headers":true}"#)
    },
    // Each with decode streams of its own to count: headers held, and passed at once (as
    // under Istio). /v1/messages is a stripped path on both (the mock decode reads its body
    // before answering, as for every API it serves).
    Listener {
        allow_on_headers_stop_iteration: true,
        decode_route: DecodeRoute::Counted("decode_held"),
        ..plain(
            "held",
            r#"{"hold_request_headers":true,"paths":["/v1/completions","/v1/chat/completions","/v1/responses"]}"#,
        )
    },
    Listener {
        decode_route: DecodeRoute::Counted("decode_passed"),
        ..plain(
            "passed",
            r#"{"paths":["/v1/completions","/v1/chat/completions","/v1/responses"]}"#,
        )
    },
    plain(
        "strict",
        r#"{"on_missing_kv_transfer_params":"fail","prefill_timeout_ms":1500,"max_request_body_bytes":65536,"prefill_time_header":"x-pd-prefill-ms"}"#,
    ),
    plain(
        "unreachable",
        r#"{"prefill_cluster":"prefill_unreachable"}"#,
    ),
    plain("not_http", r#"{"prefill_cluster":"prefill_not_http"}"#),
    plain(
        "unknown_cluster",
        r#"{"prefill_cluster":"no_such_cluster"}"#,
    ),
    Listener {
        name: "models",
        plugin_config: r#"{"model_prefill_clusters":{"model-b":"prefill_b"},"model_header":"x-pd-model"}"#,
        decode_route: DecodeRoute::ByModelHeader,
        allow_on_headers_stop_iteration: true,
        buffer_limit_bytes: BUFFER_LIMIT_BYTES,
    },
    Listener {
        name: "scheduled",
        plugin_config: r#"{"prefill_host_cluster":"prefill_original_dst","prefill_hosts_allowed":["127.0.0.2/32"],"replace_local_remote_host":true,"prefill_timeout_ms":5000}"#,
        decode_route: DecodeRoute::ByPickerHeader,
        allow_on_headers_stop_iteration: false,
        buffer_limit_bytes: BUFFER_LIMIT_BYTES,
    },
    plain(
        "decode_only",
        r#"{"prefill_cluster":"prefill_unreachable","on_prefill_failure":"decode_only","prefill_retries":2}"#,
    ),
    // Envoy's buffer no larger than the filter's body limit: a body just under the limit
    // grows past the buffer when decode's kv_transfer_params go in (tests/security.rs).
    Listener {
        buffer_limit_bytes: 65536,
        ..plain("tight_buffer", r#"{"max_request_body_bytes":65536}"#)
    },
    // Envoy's buffer below the filter's (default, 1 MiB) body limit: a decode body past
    // Envoy's buffer makes Envoy answer from inside the filter's host call (tests/security.rs).
    Listener {
        buffer_limit_bytes: 65536,
        ..plain("undersized_buffer", "")
    },
    // The same, to a decode whose JSON answer ends with trailers: the filter holds it in
    // Envoy's buffer and rewrites it there (tests/security.rs).
    Listener {
        buffer_limit_bytes: 65536,
        decode_route: DecodeRoute::Trailers,
        ..plain("undersized_answer", "")
    },
    // Envoy's default buffer limit and the filter's default body limit, as on Istio's
    // gateway when the plugin's configuration leaves the limit out (tests/security.rs).
    Listener {
        buffer_limit_bytes: ENVOY_DEFAULT_BUFFER_LIMIT_BYTES,
        ..plain("envoy_defaults", "")
    },
    plain("usage_decode", r#"{"usage":"decode"}"#),
    // Several prompts in one completions request are decode's alone (tests/pd_flow.rs).
    Listener {
        allow_on_headers_stop_iteration: true,
        ..plain(
            "batches",
            r#"{"several_prompts":"decode_only","hold_request_headers":true}"#,
        )
    },
    // Prefill gets the client's tool_choice (tests/pd_flow.rs).
    plain(
        "tool_choice_as_sent",
        r#"{"prefill_tool_choice":"as_sent"}"#,
    ),
    // The vLLM servers share one store of responses (tests/pd_flow.rs).
    plain("shared_store", r#"{"responses_store":"shared"}"#),
    // One KV release in flight per worker: the others wait (tests/kv_release.rs).
    plain("one_release", r#"{"max_kv_releases_in_flight":1}"#),
    // Two prefills per client and worker may run on after their clients left
    // (tests/kv_release.rs).
    plain(
        "abandon_limit",
        r#"{"max_abandoned_prefills_per_client":2}"#,
    ),
    // Two log lines a second per worker (tests/observability.rs); the others write all.
    plain("quiet_log", r#"{"max_log_lines_per_second":2}"#),
    // Room in each VM for about two requests' prompt logprobs (tests/security.rs).
    plain(
        "small_vm_budget",
        r#"{"max_request_body_bytes":1048576,"max_vm_held_bytes":2097152}"#,
    ),
    // Only chat orchestrated: vLLM's other generation paths are stripped paths, and the mock
    // decode records what reaches them.
    plain("stripping", r#"{"paths":["/v1/chat/completions"]}"#),
    // Prefill's cluster has no endpoints: Envoy refuses every callout at once, inside the
    // request's own callback, where the closed port of `decode_only` fails later, in the
    // root's. Decode recomputes, the headers held (as shipped) or passed at once (as under
    // Istio); and the default policy answers the client (tests/reliability.rs).
    Listener {
        allow_on_headers_stop_iteration: true,
        ..plain(
            "no_hosts_held",
            r#"{"prefill_cluster":"prefill_no_hosts","on_prefill_failure":"decode_only","hold_request_headers":true}"#,
        )
    },
    plain(
        "no_hosts_passed",
        r#"{"prefill_cluster":"prefill_no_hosts","on_prefill_failure":"decode_only"}"#,
    ),
    plain("no_hosts_fail", r#"{"prefill_cluster":"prefill_no_hosts"}"#),
    // Decode cannot be reached; KV releases still go to the `decode` cluster.
    Listener {
        decode_route: DecodeRoute::Unreachable,
        ..plain("decode_unreachable", "")
    },
    // Decode cannot be reached, nor at first the cluster releases go to (`decode_late`,
    // where a test starts a decode later). Headers held as shipped, so that the router's
    // failed connection to decode never comes before prefill has the request.
    // Decode is down until a test starts it (tests/kv_release.rs): headers held as shipped,
    // with no probe for a minute, so that only a KV release that decode answers ends the
    // refusals; and passed at once as under Istio.
    Listener {
        decode_route: DecodeRoute::Outage,
        allow_on_headers_stop_iteration: true,
        ..plain(
            "decode_outage",
            r#"{"decode_cluster":"decode_outage","hold_request_headers":true,"decode_outage_retry_ms":60000}"#,
        )
    },
    Listener {
        decode_route: DecodeRoute::OutageOwnPool,
        ..plain(
            "decode_outage_passed",
            r#"{"decode_outage_retry_ms":1000,"decode_cluster":"decode_outage_passed"}"#,
        )
    },
    Listener {
        decode_route: DecodeRoute::Unreachable,
        allow_on_headers_stop_iteration: true,
        ..plain(
            "release_retry",
            r#"{"decode_cluster":"decode_late","hold_request_headers":true}"#,
        )
    },
    // Decode is connected but never reads the request; releases go to `decode`.
    Listener {
        decode_route: DecodeRoute::Deaf,
        ..plain("decode_deaf", "")
    },
    // Decode's connection times out after prefill answered; releases go to `decode`.
    Listener {
        decode_route: DecodeRoute::Blackholed,
        ..plain("decode_blackholed", "")
    },
    // Decode's answer ends with trailers (tests/one_vllm.rs).
    Listener {
        decode_route: DecodeRoute::Trailers,
        ..plain("decode_trailers", "")
    },
    // Headers passed at once (as under Istio) to a route that retries connection failures
    // over a pool with a dead host (tests/security.rs).
    Listener {
        decode_route: DecodeRoute::RetryingHalfDead,
        ..plain("retrying_half_dead", "")
    },
];

/// What the decode of the `decode_trailers` listener answers every request with, chunked and
/// followed by a trailer: usage as decode counts it under P/D, its whole prompt cached.
pub const TRAILERS_ANSWER: &str = r#"{"id":"cmpl-trailers","object":"text_completion","created":0,"model":"m","choices":[{"index":0,"text":" done","finish_reason":"length"}],"usage":{"prompt_tokens":999,"total_tokens":1003,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":999}}}"#;

pub struct Harness {
    pub prefill: MockServer,
    pub decode: MockServer,
    /// A second prefill, on 127.0.0.2: the `prefill_b` cluster, and a scheduler's target.
    pub prefill_b: MockServer,
    /// A second decode: the `decode_b` cluster, and an endpoint picker's target.
    pub decode_b: MockServer,
    /// A local port nothing listens on.
    pub closed_port: u16,
    /// The port of the `decode_late` cluster: nothing listens there until a test starts a
    /// decode on it (tests/kv_release.rs).
    pub late_decode_port: u16,
    /// The port of the `decode_outage` cluster, closed until a test starts a decode there.
    pub outage_decode_port: u16,
    listener_ports: Vec<(String, u16)>,
    pub admin_port: u16,
    pub envoy_log: PathBuf,
}

impl Harness {
    /// The local port Envoy bound for `listener`.
    pub fn port(&self, listener: &str) -> u16 {
        self.listener_ports
            .iter()
            .find(|(name, _)| name == listener)
            .map(|(_, port)| *port)
            .unwrap_or_else(|| panic!("no listener {listener}"))
    }

    pub fn url(&self, listener: &str, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port(listener))
    }

    pub fn prefill_requests(&self, id: &str) -> Vec<RecordedRequest> {
        self.prefill.requests_with_id(id)
    }

    /// The requests decode got for `id` to serve, without the filter's KV releases.
    pub fn decode_requests(&self, id: &str) -> Vec<RecordedRequest> {
        let mut requests = self.decode.requests_with_id(id);
        requests.retain(|request| request.header(KV_RELEASE_HEADER).is_none());
        requests
    }

    /// The KV releases decode got for `id` (tests/kv_release.rs).
    pub fn kv_releases(&self, id: &str) -> Vec<RecordedRequest> {
        let mut requests = self.decode.requests_with_id(id);
        requests.retain(|request| request.header(KV_RELEASE_HEADER).is_some());
        requests
    }

    /// The one prefill request carrying `id`.
    pub fn only_prefill(&self, id: &str) -> RecordedRequest {
        let mut requests = self.prefill_requests(id);
        assert_eq!(requests.len(), 1, "prefill requests for {id}: {requests:?}");
        requests.remove(0)
    }

    /// The one decode request carrying `id`.
    pub fn only_decode(&self, id: &str) -> RecordedRequest {
        let mut requests = self.decode_requests(id);
        assert_eq!(requests.len(), 1, "decode requests for {id}: {requests:?}");
        requests.remove(0)
    }

    /// The filter's stats (`wasmcustom.pd_filter.*`) from Envoy's admin endpoint, by their
    /// names there (labels in Istio's `label=.=value;.;` form).
    pub fn stats(&self) -> std::collections::HashMap<String, String> {
        let text = http_get(self.admin_port, "/stats?filter=pd_filter").unwrap_or_default();
        text.lines()
            .filter_map(|line| line.split_once(": "))
            .map(|(name, value)| {
                let name = name.strip_prefix("wasmcustom.").unwrap_or(name);
                (name.to_owned(), value.to_owned())
            })
            .collect()
    }

    /// Everything on Envoy's `/stats/prometheus`.
    pub fn prometheus(&self) -> Prometheus {
        let text = http_get(self.admin_port, "/stats/prometheus").expect("/stats/prometheus");
        Prometheus::parse(&text)
    }

    /// A series of `/stats/prometheus`, written as in PromQL: `pd_filter_requests_passed_through`
    /// or `pd_filter_requests{api="completions",outcome="decoded"}` (every label given). 0 when
    /// absent.
    pub fn counter(&self, series: &str) -> u64 {
        let (name, labels) = parse_series(series);
        self.prometheus()
            .value(&name, &labels)
            .map(|value| value as u64)
            .unwrap_or(0)
    }

    pub fn envoy_log_text(&self) -> String {
        std::fs::read_to_string(&self.envoy_log).unwrap_or_default()
    }
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn wasm_path() -> PathBuf {
    let path = std::env::var_os("PD_FILTER_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/wasm32-wasip1/release/pd_filter.wasm"));
    assert!(
        path.exists(),
        "{} is missing: run `make build` first (make test does)",
        path.display()
    );
    path
}

pub fn envoy_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("ENVOY_BIN") {
        return PathBuf::from(path);
    }
    let venv = repo_root().join(".venv/bin/envoy");
    if venv.exists() {
        return venv;
    }
    PathBuf::from("envoy")
}

static HARNESS: OnceLock<Harness> = OnceLock::new();

/// The shared stack, started on first use.
pub fn harness() -> &'static Harness {
    HARNESS.get_or_init(start)
}

fn start() -> Harness {
    let (sender, receiver) = mpsc::channel();
    // This thread lives as long as the test process: it owns the mocks' runtime and is the
    // parent of Envoy, which gets SIGKILL when it goes away.
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let mocks = runtime.block_on(async {
            let start = |role, addr| async move {
                MockServer::start(role, addr).await.expect("mock server")
            };
            [
                start(Role::Prefill, "127.0.0.1:0").await,
                start(Role::Decode, "127.0.0.1:0").await,
                start(Role::Prefill, "127.0.0.2:0").await,
                start(Role::Decode, "127.0.0.1:0").await,
            ]
        });
        let ports = Ports {
            prefill: mocks[0].port(),
            decode: mocks[1].port(),
            prefill_b: mocks[2].port(),
            decode_b: mocks[3].port(),
            closed: closed_port(),
            blackhole: blackhole_port(),
            deaf: deaf_port(),
            late: closed_port(),
            outage: closed_port(),
            trailers: trailers_port(),
            not_http: not_http_port(),
        };
        let envoy = start_envoy(&ports);
        sender
            .send((mocks, (ports.closed, ports.late, ports.outage), envoy))
            .expect("harness receiver");
        runtime.block_on(std::future::pending::<()>());
    });
    let (
        mocks,
        (closed_port, late_decode_port, outage_decode_port),
        (listener_ports, admin_port, envoy_log),
    ) = receiver.recv().expect("harness did not start");
    let [prefill, decode, prefill_b, decode_b] = mocks;
    Harness {
        prefill,
        decode,
        prefill_b,
        decode_b,
        closed_port,
        late_decode_port,
        outage_decode_port,
        listener_ports,
        admin_port,
        envoy_log,
    }
}

/// A local port nothing listens on until a test binds it. It is taken below the kernel's
/// range of ephemeral ports: a port in that range may become a connection's own end (even,
/// when Envoy connects to it while it is closed, a connection to itself), and a mock could
/// then not bind it. Each call gives another port.
pub fn closed_port() -> u16 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(32768);
    const LOWEST: u64 = 10_000;
    if ephemeral_low > LOWEST + 1_000 {
        let span = ephemeral_low - LOWEST;
        let start = u64::from(std::process::id()) * 7;
        for _ in 0..200 {
            let port = LOWEST + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
            if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
                return port as u16;
            }
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

static RUN_COUNTER: AtomicU64 = AtomicU64::new(0);

struct Ports {
    prefill: u16,
    decode: u16,
    prefill_b: u16,
    decode_b: u16,
    closed: u16,
    blackhole: u16,
    deaf: u16,
    late: u16,
    outage: u16,
    trailers: u16,
    not_http: u16,
}

/// Connections the server of [`not_http_port`] has taken.
pub static NOT_HTTP_CONNECTIONS: AtomicU64 = AtomicU64::new(0);

/// A local port whose server reads a request's head and answers bytes that are not HTTP,
/// then closes the connection. Lives as long as the test process.
fn not_http_port() -> u16 {
    use std::io::{Read, Write};
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            NOT_HTTP_CONNECTIONS.fetch_add(1, Ordering::SeqCst);
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap_or(0) == 1 {
                head.push(byte[0]);
            }
            let _ = stream.write_all(b"\x00\x01 this is not HTTP\r\n\r\n");
        }
    });
    port
}

/// A local port whose server takes every connection and never reads from it: what a
/// request looks like to Envoy when decode is too busy to read it. Lives as long as the
/// test process.
fn deaf_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    port
}

/// A local port whose server answers every request with [`TRAILERS_ANSWER`], chunked and
/// ended by a trailer, once it has read the request. Lives as long as the test process.
fn trailers_port() -> u16 {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream);
                loop {
                    // Decode answers once it has the whole request: with headers passed at
                    // once, its body comes chunked when prefill has answered.
                    let mut length = 0usize;
                    let mut chunked = false;
                    let mut line = String::new();
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        if let Some((name, value)) = line.split_once(':') {
                            if name.eq_ignore_ascii_case("content-length") {
                                length = value.trim().parse().unwrap_or(0);
                            }
                            if name.eq_ignore_ascii_case("transfer-encoding") {
                                chunked = value.trim().eq_ignore_ascii_case("chunked");
                            }
                        }
                    }
                    if chunked {
                        loop {
                            line.clear();
                            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                                return;
                            }
                            let size = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
                            // The chunk and its CRLF; after the last one, the blank line.
                            let mut chunk = vec![0; size + 2];
                            if reader.read_exact(&mut chunk).is_err() {
                                return;
                            }
                            if size == 0 {
                                break;
                            }
                        }
                    } else {
                        let mut body = vec![0; length];
                        if reader.read_exact(&mut body).is_err() {
                            return;
                        }
                    }
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                         transfer-encoding: chunked\r\n\r\n{:x}\r\n{TRAILERS_ANSWER}\r\n\
                         0\r\nx-decode-trailer: 1\r\n\r\n",
                        TRAILERS_ANSWER.len()
                    );
                    if reader.get_mut().write_all(answer.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// A local port whose accept queue is full and never drained: the kernel drops every new
/// SYN, so a connection attempt hangs until the client gives up. Lives as long as the test
/// process.
fn blackhole_port() -> u16 {
    // SAFETY: plain socket calls on a descriptor this function owns; the address structure
    // is initialised before use and outlives the calls that read it.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0, "socket");
        let mut addr: libc::sockaddr_in = std::mem::zeroed();
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let bound = libc::bind(fd, std::ptr::addr_of!(addr).cast(), len);
        assert_eq!(bound, 0, "bind");
        assert_eq!(libc::listen(fd, 0), 0, "listen");
        let mut bound_addr: libc::sockaddr_in = std::mem::zeroed();
        let mut bound_len = len;
        libc::getsockname(
            fd,
            std::ptr::addr_of_mut!(bound_addr).cast(),
            &mut bound_len,
        );
        let port = u16::from_be(bound_addr.sin_port);
        // One connection fills a backlog of 0; it is kept, never accepted.
        let filler = std::net::TcpStream::connect(("127.0.0.1", port)).expect("fill the backlog");
        std::mem::forget(filler);
        port
    }
}

fn start_envoy(ports: &Ports) -> (Vec<(String, u16)>, u16, PathBuf) {
    let dir = repo_root().join("target/envoy-test").join(format!(
        "{}-{}",
        std::process::id(),
        RUN_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("test dir");
    let config_path = dir.join("envoy.yaml");
    let admin_path = dir.join("admin-address");
    let log_path = dir.join("envoy.log");
    let config = envoy_config(&wasm_path(), ports);
    std::fs::write(&config_path, config).expect("write envoy config");

    let log_file = std::fs::File::create(&log_path).expect("envoy log");
    let mut command = Command::new(envoy_binary());
    command
        .arg("-c")
        .arg(&config_path)
        .args(["--concurrency", "2", "--use-dynamic-base-id", "-l", "info"])
        .arg("--admin-address-path")
        .arg(&admin_path)
        .stdout(Stdio::null())
        .stderr(Stdio::from(log_file));
    // SAFETY: prctl is async-signal-safe; it only asks the kernel to kill Envoy when the
    // thread that started it (the harness thread) ends.
    unsafe {
        command.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child: Child = command
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start envoy ({e}); run `make envoy` or set ENVOY_BIN"));

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "envoy exited with {status}:\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        if let Some(found) = read_listener_ports(&admin_path) {
            std::mem::forget(child);
            return (found.0, found.1, log_path);
        }
        assert!(
            Instant::now() < deadline,
            "envoy did not come up:\n{}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The ports Envoy bound for the listeners (all configured with port 0), once all are up.
fn read_listener_ports(admin_path: &Path) -> Option<(Vec<(String, u16)>, u16)> {
    let admin = std::fs::read_to_string(admin_path).ok()?;
    let admin_port: u16 = admin.trim().rsplit(':').next()?.parse().ok()?;
    let text = http_get(admin_port, "/listeners?format=json")?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    let mut ports = Vec::new();
    for status in value["listener_statuses"].as_array()? {
        let name = status["name"].as_str()?.to_owned();
        let port = status["local_address"]["socket_address"]["port_value"].as_u64()? as u16;
        ports.push((name, port));
    }
    (ports.len() == LISTENERS.len()).then_some((ports, admin_port))
}

/// A minimal blocking GET, for the admin endpoint.
pub fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    if head.split(' ').nth(1) != Some("200") {
        return None;
    }
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Some(body.to_owned());
    }
    let mut rest = body;
    let mut decoded = String::new();
    loop {
        let (size_line, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size_line.trim(), 16).ok()?;
        if size == 0 {
            return Some(decoded);
        }
        decoded.push_str(after.get(..size)?);
        rest = after.get(size + 2..)?;
    }
}

/// The `stats_config` of `envoy/envoy.yaml` (the rules that make the filter's labels), as
/// JSON, which is YAML too: the test Envoy shows the stats as users see them.
pub fn shipped_stats_config() -> serde_json::Value {
    let path = repo_root().join("envoy/envoy.yaml");
    let text = std::fs::read_to_string(&path).expect("envoy/envoy.yaml");
    let config: serde_json::Value = serde_yaml_ng::from_str(&text).expect("envoy.yaml is YAML");
    let stats_config = config["stats_config"].clone();
    assert!(
        stats_config.is_object(),
        "envoy/envoy.yaml has no stats_config"
    );
    stats_config
}

/// One sample of `/stats/prometheus`.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// Envoy's `/stats/prometheus`: each family's type and its samples.
#[derive(Debug, Clone, Default)]
pub struct Prometheus {
    /// Family name and its `# TYPE` (counter, gauge, histogram, summary).
    pub types: Vec<(String, String)>,
    pub samples: Vec<Sample>,
}

impl Prometheus {
    /// Reads the text exposition format as Envoy writes it.
    pub fn parse(text: &str) -> Prometheus {
        let mut parsed = Prometheus::default();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                if let Some((name, kind)) = rest.split_once(' ') {
                    parsed.types.push((name.to_owned(), kind.trim().to_owned()));
                }
                continue;
            }
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').expect("sample line");
            let (name, labels) = parse_series(series);
            let value = value.parse().unwrap_or(f64::NAN);
            parsed.samples.push(Sample {
                name,
                labels,
                value,
            });
        }
        parsed
    }

    /// The type of a family, by the name in its `# TYPE` line.
    pub fn family_type(&self, family: &str) -> Option<&str> {
        self.types
            .iter()
            .find(|(name, _)| name == family)
            .map(|(_, kind)| kind.as_str())
    }

    /// The samples of a family: for a histogram, its `_bucket`, `_sum` and `_count` series.
    pub fn family(&self, family: &str) -> Vec<&Sample> {
        let histogram = self.family_type(family) == Some("histogram");
        self.samples
            .iter()
            .filter(|sample| {
                sample.name == family
                    || (histogram
                        && ["_bucket", "_sum", "_count"]
                            .iter()
                            .any(|suffix| sample.name == format!("{family}{suffix}")))
            })
            .collect()
    }

    /// The value of the series with exactly these labels.
    pub fn value(&self, name: &str, labels: &[(String, String)]) -> Option<f64> {
        let mut wanted = labels.to_vec();
        wanted.sort();
        self.samples
            .iter()
            .find(|sample| {
                let mut have = sample.labels.clone();
                have.sort();
                sample.name == name && have == wanted
            })
            .map(|sample| sample.value)
    }
}

/// `name{a="x",b="y"}` into the name and its labels (values without escapes, as Envoy's are).
pub fn parse_series(series: &str) -> (String, Vec<(String, String)>) {
    let Some((name, rest)) = series.split_once('{') else {
        return (series.trim().to_owned(), Vec::new());
    };
    let body = rest
        .trim_end()
        .strip_suffix('}')
        .expect("labels end with }");
    let labels = body
        .split(',')
        .filter(|pair| !pair.trim().is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').expect("label=value");
            let value = value.trim().trim_matches('"');
            (key.trim().to_owned(), value.to_owned())
        })
        .collect();
    (name.trim().to_owned(), labels)
}

fn envoy_config(wasm: &Path, ports: &Ports) -> String {
    let mut listeners = String::new();
    for listener in LISTENERS {
        listeners.push_str(&listener_yaml(listener, wasm));
    }
    let clusters = [
        cluster_yaml("prefill", "127.0.0.1", ports.prefill),
        cluster_yaml("decode", "127.0.0.1", ports.decode),
        cluster_yaml("prefill_b", "127.0.0.2", ports.prefill_b),
        cluster_yaml("decode_b", "127.0.0.1", ports.decode_b),
        cluster_yaml("prefill_unreachable", "127.0.0.1", ports.closed),
        empty_cluster_yaml("prefill_no_hosts"),
        cluster_yaml("decode_blackhole", "127.0.0.1", ports.blackhole),
        cluster_yaml("decode_deaf", "127.0.0.1", ports.deaf),
        cluster_yaml("decode_held", "127.0.0.1", ports.decode),
        cluster_yaml("decode_late", "127.0.0.1", ports.late),
        cluster_yaml("decode_outage", "127.0.0.1", ports.outage),
        cluster_yaml("decode_outage_passed", "127.0.0.1", ports.outage),
        trailers_cluster_yaml("decode_trailers", ports.trailers),
        cluster_yaml("prefill_not_http", "127.0.0.1", ports.not_http),
        cluster_yaml("decode_passed", "127.0.0.1", ports.decode),
        half_dead_cluster_yaml("decode_half_dead", ports.decode, ports.closed),
        original_dst_cluster_yaml("prefill_original_dst", "x-envoy-original-dst-host"),
        original_dst_cluster_yaml("decode_picker", "x-gateway-destination-endpoint"),
    ]
    .concat();
    let stats_config = shipped_stats_config();
    format!(
        r#"stats_flush_interval: 1s
stats_config: {stats_config}
admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: 0 }}
static_resources:
  listeners:
{listeners}
  clusters:
{clusters}
"#
    )
}

fn cluster_yaml(name: &str, address: &str, port: u16) -> String {
    format!(
        r#"  - name: {name}
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: {address}, port_value: {port} }}
"#
    )
}

/// A round-robin cluster of a live port and a closed one.
fn half_dead_cluster_yaml(name: &str, live: u16, closed: u16) -> String {
    let cluster = cluster_yaml(name, "127.0.0.1", live);
    cluster.replace(
        "      - lb_endpoints:\n",
        &format!(
            "      - lb_endpoints:\n        - endpoint:\n            address:\n              socket_address: {{ address: 127.0.0.1, port_value: {closed} }}\n"
        ),
    )
}

/// A cluster whose HTTP/1 answers keep their trailers (Envoy drops them otherwise).
fn trailers_cluster_yaml(name: &str, port: u16) -> String {
    let cluster = cluster_yaml(name, "127.0.0.1", port);
    let options = r#"    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http_protocol_options: { enable_trailers: true }
"#;
    cluster.replacen(
        "    load_assignment:\n",
        &format!("{options}    load_assignment:\n"),
        1,
    )
}

/// A cluster without endpoints: Envoy refuses every call to it at once (no healthy host).
fn empty_cluster_yaml(name: &str) -> String {
    format!(
        r#"  - name: {name}
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: {name}
      endpoints: []
"#
    )
}

/// A cluster whose destination is the `ip:port` in a request header.
fn original_dst_cluster_yaml(name: &str, header: &str) -> String {
    format!(
        r#"  - name: {name}
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 1s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: {header}
"#
    )
}

fn routes_yaml(route: DecodeRoute) -> String {
    let routes = match route {
        DecodeRoute::Counted(cluster) => {
            return format!(
                r#"              - match: {{ prefix: "/" }}
                route: {{ cluster: {cluster}, timeout: 0s }}
"#
            )
        }
        // The prefill time the filter leaves in the filter state, as an access log would
        // read it (tests/one_vllm.rs).
        DecodeRoute::Plain => {
            r#"              - match: { prefix: "/" }
                route: { cluster: decode, timeout: 0s }
                response_headers_to_add:
                - header: { key: x-test-prefill-ms, value: "%FILTER_STATE(wasm.pd_prefill_ms:PLAIN)%" }
"#
        }
        DecodeRoute::ByModelHeader => {
            r#"              - match:
                  prefix: "/"
                  headers: [{ name: x-pd-model, string_match: { exact: model-b } }]
                route: { cluster: decode_b, timeout: 0s }
              - match: { prefix: "/" }
                route: { cluster: decode, timeout: 0s }
"#
        }
        DecodeRoute::Unreachable => {
            r#"              - match: { prefix: "/" }
                route: { cluster: prefill_unreachable, timeout: 0s }
"#
        }
        DecodeRoute::Outage => {
            r#"              - match: { prefix: "/" }
                route: { cluster: decode_outage, timeout: 0s }
"#
        }
        DecodeRoute::OutageOwnPool => {
            r#"              - match: { prefix: "/" }
                route: { cluster: decode_outage_passed, timeout: 0s }
"#
        }
        DecodeRoute::Blackholed => {
            r#"              - match: { prefix: "/" }
                route: { cluster: decode_blackhole, timeout: 0s }
"#
        }
        DecodeRoute::Deaf => {
            r#"              - match: { prefix: "/" }
                route: { cluster: decode_deaf, timeout: 0s }
"#
        }
        DecodeRoute::Trailers => {
            r#"              - match: { prefix: "/" }
                route: { cluster: decode_trailers, timeout: 0s }
"#
        }
        DecodeRoute::RetryingHalfDead => {
            r#"              - match: { prefix: "/" }
                route:
                  cluster: decode_half_dead
                  timeout: 0s
                  retry_policy: { retry_on: "connect-failure,refused-stream", num_retries: 2 }
"#
        }
        DecodeRoute::ByPickerHeader => {
            r#"              - match:
                  prefix: "/"
                  headers: [{ name: x-gateway-destination-endpoint, present_match: true }]
                route: { cluster: decode_picker, timeout: 0s }
              - match: { prefix: "/" }
                route: { cluster: decode, timeout: 0s }
"#
        }
    };
    routes.to_owned()
}

fn listener_yaml(listener: &Listener, wasm: &Path) -> String {
    // Tests read the filter's log lines per request: none is dropped for the rate.
    let mut config: serde_json::Value = if listener.plugin_config.is_empty() {
        serde_json::json!({})
    } else {
        serde_json::from_str(listener.plugin_config).expect("plugin configuration is JSON")
    };
    if config.get("max_log_lines_per_second").is_none() {
        config["max_log_lines_per_second"] = serde_json::json!(0);
    }
    if listener.buffer_limit_bytes == BUFFER_LIMIT_BYTES
        && config.get("max_request_body_bytes").is_none()
    {
        config["max_request_body_bytes"] = serde_json::json!(SHIPPED_MAX_REQUEST_BODY_BYTES);
    }
    let plugin_config = serde_json::to_string(&config.to_string()).expect("json string");
    // A listener that passes request headers on at once stands for Istio's gateway, which
    // also lets WebSocket upgrades through on every route.
    let upgrades = if listener.allow_on_headers_stop_iteration {
        ""
    } else {
        "          upgrade_configs: [{ upgrade_type: websocket }]\n"
    };
    format!(
        r#"  - name: {name}
    address:
      socket_address: {{ address: 127.0.0.1, port_value: 0 }}
    per_connection_buffer_limit_bytes: {buffer_limit}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
{upgrades}          route_config:
            virtual_hosts:
            - name: decode
              domains: ["*"]
              routes:
{routes}          http_filters:
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: pd-filter
                root_id: pd-filter
                failure_policy: FAIL_RELOAD
                allow_on_headers_stop_iteration: {allow}
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: {plugin_config}
                vm_config:
                  vm_id: pd-filter-{name}
                  runtime: envoy.wasm.runtime.v8
                  code: {{ local: {{ filename: "{wasm}" }} }}
          # As in the shipped configurations: no request reaches a route unless the filter saw
          # it (envoy/envoy.yaml, pd-filter-guard).
          - name: pd-filter-guard
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC
              rules_stat_prefix: pd_filter_guard
              rules:
                action: DENY
                policies:
                  pd-filter-did-not-run:
                    permissions: [{{ any: true }}]
                    principals:
                      - not_id:
                          filter_state:
                            key: wasm.pd_filter_ran
                            string_match: {{ exact: "yes" }}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#,
        name = listener.name,
        routes = routes_yaml(listener.decode_route),
        allow = listener.allow_on_headers_stop_iteration,
        buffer_limit = listener.buffer_limit_bytes,
        upgrades = upgrades,
        wasm = wasm.display()
    )
}

static ID_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A request id no other test uses.
pub fn unique_id(label: &str) -> String {
    format!(
        "{label}-{}-{}",
        std::process::id(),
        ID_COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

// ---------------------------------------------------------------------------------------
// Helpers for the reliability and load tests.

/// Lines of the Envoy log that show the filter or its VM failed: a Rust panic, a wasm trap,
/// or a proxy-wasm callback that did not return normally.
pub fn envoy_log_failures() -> Vec<String> {
    const MARKERS: &[&str] = &["panicked", "wasm trap", "Function: proxy_on"];
    harness()
        .envoy_log_text()
        .lines()
        .filter(|line| MARKERS.iter().any(|marker| line.contains(marker)))
        .map(str::to_owned)
        .collect()
}

/// Asserts the Envoy log has no panic, wasm trap or failed proxy-wasm callback.
pub fn assert_envoy_log_clean() {
    let failures = envoy_log_failures();
    assert!(
        failures.is_empty(),
        "the Envoy log shows filter failures:\n{}",
        failures.join("\n")
    );
}

/// Envoy's counters and gauges whose name contains `part`, from the admin endpoint.
pub fn envoy_stats(part: &str) -> Vec<(String, u64)> {
    let text = http_get(harness().admin_port, "/stats").unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let (name, value) = line.split_once(": ")?;
            let value = value.trim().parse().ok()?;
            name.contains(part).then(|| (name.to_owned(), value))
        })
        .collect()
}

/// The mock's prompt fingerprint (FNV-1a, 64 bits, lowercase hex) of a prompt text.
pub fn mock_fingerprint(prompt: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in prompt.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{hash:016x}")
}

/// The text the decode mock generates for `limit` tokens when it reused the KV cache:
/// "mock decode answer for <first prompt word> mock decode …", one space after each word.
pub fn expected_decode_text(prompt: &str, limit: usize) -> String {
    let first = prompt.split_whitespace().next().unwrap_or("nothing");
    let cycle = ["mock", "decode", "answer", "for", first];
    (0..limit).map(|i| format!("{} ", cycle[i % 5])).collect()
}

/// The generated text of an answer, streamed (SSE) or not, for any of the three endpoints;
/// with the number of SSE events and whether the stream ended properly (`[DONE]`, or
/// `response.completed` on /v1/responses). A non-streamed answer counts as ended.
pub fn answer_text(body: &str) -> (String, usize, bool) {
    let trimmed = body.trim_start();
    if trimmed.starts_with('{') {
        let value: serde_json::Value = serde_json::from_str(trimmed).unwrap_or_default();
        let text = value["choices"][0]["text"]
            .as_str()
            .or_else(|| value["choices"][0]["message"]["content"].as_str())
            .or_else(|| value["output"][0]["content"][0]["text"].as_str())
            .or_else(|| value["message"]["content"][0]["text"].as_str())
            .unwrap_or_default()
            .to_owned();
        return (text, 0, true);
    }
    let mut text = String::new();
    let mut events = 0;
    let mut ended = false;
    for event in body.split("\n\n").filter(|e| !e.trim().is_empty()) {
        events += 1;
        let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
            continue;
        };
        if data == "[DONE]" {
            ended = true;
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
        // vLLM 0.33 ends a response cut by its max_output_tokens as incomplete.
        if value["type"] == "response.completed" || value["type"] == "response.incomplete" {
            ended = true;
        }
        if let Some(delta) = value["choices"][0]["text"]
            .as_str()
            .or_else(|| value["choices"][0]["delta"]["content"].as_str())
            .or_else(|| {
                (value["type"] == "response.output_text.delta")
                    .then(|| value["delta"].as_str())
                    .flatten()
            })
            .or_else(|| {
                (value["type"] == "content-delta")
                    .then(|| value["delta"]["message"]["content"]["text"].as_str())
                    .flatten()
            })
        {
            text.push_str(delta);
        }
    }
    (text, events, ended)
}

/// Asserts no pd-filter VM was reloaded (a reload means one crashed), no request got past
/// Envoy without the filter seeing it, and the Envoy log is clean.
pub fn assert_filter_healthy() {
    let nonzero = |part: &str| -> Vec<(String, u64)> {
        envoy_stats(part)
            .into_iter()
            .filter(|(_, value)| *value != 0)
            .collect()
    };
    let reloads = nonzero("wasm.pd-filter.vm_reload");
    assert!(
        reloads.is_empty(),
        "pd-filter VMs were reloaded: {reloads:?}"
    );
    let unseen = nonzero("rbac.pd_filter_guard.denied");
    assert!(
        unseen.is_empty(),
        "requests Envoy ran without pd-filter: {unseen:?}"
    );
    assert_envoy_log_clean();
}
