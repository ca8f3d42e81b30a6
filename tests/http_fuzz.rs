//! HTTP-level fuzzer (issue #9): for a bounded time, seeded random requests go to every
//! listener of the test Envoy, as raw HTTP/1.1 bytes and over h2c, and the stack must hold:
//!
//! - Envoy stays up and its admin answers; its log shows no panic, wasm trap or failed
//!   proxy-wasm callback; no pd-filter VM is reloaded;
//! - no request that a decode mock recorded carries the client's own `kv_transfer_params`
//!   (every fuzzed client marks them with [`MARKER`] and its case number);
//! - every request ends in a well-formed HTTP response or a closed connection (or reset
//!   stream), never a hang.
//!
//! `PD_HTTP_FUZZ_SECS` (default 20) bounds the run, `PD_HTTP_FUZZ_SEED` replays one (the seed
//! is printed), `PD_HTTP_FUZZ_LISTENERS` (e.g. `default,models`) fuzzes only those listeners. Each of the [`WORKERS`] clients draws its cases from its own generator, seeded
//! from the run's seed, so a seed replays the same cases (their interleaving may differ).
//! Only loopback addresses are ever named in the requests.

mod common;
#[path = "common/raw_http.rs"]
mod raw_http;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{envoy_log_failures, envoy_stats, harness, http_get, members_of, LISTENERS};
use raw_http::{exchange, h2_connect, h2_exchange, H2Outcome, H2Request, Outcome, Writing};

/// Text only a fuzzed client's `kv_transfer_params` contain; followed by `-<seed>-<case>`.
const MARKER: &str = "pdfuzz-client-kv";
const WORKERS: u64 = 4;
/// A request without a complete answer after this long hangs.
const DEADLINE: Duration = Duration::from_secs(30);
/// At most this many cases per run, whatever the time allows.
const MAX_CASES: u64 = 500_000;

// ----------------------------------------------------------------------------------------
// A small seeded generator (splitmix64): no dependency, same sequence everywhere.

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// 0..n (0 when n is 0).
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// lo..=hi
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    fn percent(&mut self, p: usize) -> bool {
        self.below(100) < p
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    fn pick_ref<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// One of `items`, each with its weight.
    fn weighted<T: Copy>(&mut self, items: &[(usize, T)]) -> T {
        let total: usize = items.iter().map(|(w, _)| w).sum();
        let mut at = self.below(total);
        for (weight, item) in items {
            if at < *weight {
                return *item;
            }
            at -= weight;
        }
        items[items.len() - 1].1
    }
}

// ----------------------------------------------------------------------------------------
// What the stack looks like to the fuzzer

struct Env {
    seed: u64,
    /// The listeners fuzzed, with their weights (`PD_HTTP_FUZZ_LISTENERS` narrows them).
    listeners: Vec<(usize, &'static str)>,
    ports: HashMap<&'static str, u16>,
    prefill: u16,
    prefill_b: u16,
    decode: u16,
    decode_b: u16,
    closed: u16,
    admin: u16,
}

impl Env {
    fn new(seed: u64) -> Env {
        let h = harness();
        let ports = LISTENERS
            .iter()
            .map(|listener| (listener.name, h.port(listener.name)))
            .collect();
        let only = std::env::var("PD_HTTP_FUZZ_LISTENERS").unwrap_or_default();
        let listeners: Vec<(usize, &'static str)> = LISTENER_WEIGHTS
            .iter()
            .copied()
            .filter(|(_, name)| only.is_empty() || only.split(',').any(|o| o.trim() == *name))
            .collect();
        assert!(
            !listeners.is_empty(),
            "PD_HTTP_FUZZ_LISTENERS={only} names no listener"
        );
        Env {
            seed,
            listeners,
            ports,
            prefill: h.prefill.port(),
            prefill_b: h.prefill_b.port(),
            decode: h.decode.port(),
            decode_b: h.decode_b.port(),
            closed: h.closed_port,
            admin: h.admin_port,
        }
    }

    fn marker(&self, case: u64) -> String {
        format!("{MARKER}-{}-{case}", self.seed)
    }
}

/// What the workers share: counts, the cases that carried a marker, what went wrong.
#[derive(Default)]
struct Record {
    outcomes: Mutex<BTreeMap<String, u64>>,
    /// Marker → a description of the case that sent it.
    marked: Mutex<HashMap<String, String>>,
    violations: Mutex<Vec<String>>,
    reported: Mutex<HashSet<String>>,
    cases: AtomicU64,
    stop: AtomicBool,
    /// The last cases to finish, with what became of them: shown if Envoy goes away.
    recent: Mutex<std::collections::VecDeque<String>>,
}

impl Record {
    fn count(&self, outcome: String) {
        *self.outcomes.lock().unwrap().entry(outcome).or_default() += 1;
    }

    fn finished(&self, description: &str, outcome: &str) {
        let mut recent = self.recent.lock().unwrap();
        let line: String = format!("{outcome} <- {description}")
            .chars()
            .take(300)
            .collect();
        recent.push_back(line);
        while recent.len() > 40 {
            recent.pop_front();
        }
    }

    /// Remembers which case sent `marker`.
    fn mark(&self, marker: String, description: String) {
        self.marked.lock().unwrap().insert(marker, description);
    }

    /// Records a violation once (by key).
    fn violation(&self, key: String, text: String) {
        if self.reported.lock().unwrap().insert(key) {
            eprintln!("http_fuzz VIOLATION: {text}");
            self.violations.lock().unwrap().push(text);
        }
    }
}

// ----------------------------------------------------------------------------------------
// Generating requests

const ORCHESTRATED: &[&str] = &[
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/inference/v1/generate",
];
/// Paths the filter passes through (not the mocks' `/mock/requests`, which dumps their log).
const OTHER_PATHS: &[&str] = &[
    "/v1/models",
    "/health",
    "/",
    "/v1/completions/x",
    "/v2/completions",
    "/v1/responses/abc",
    "/v1/embeddings",
];

const LISTENER_WEIGHTS: &[(usize, &str)] = &[
    (30, "default"),
    (10, "strict"),
    (14, "models"),
    (14, "scheduled"),
    (10, "decode_only"),
    // Envoy refuses the prefill call at once: decode_only resumes from the request's own
    // callback.
    (5, "no_hosts_held"),
    (5, "no_hosts_passed"),
    (12, "tight_buffer"),
    // Envoy's 1 MiB and the filter's default body limit, headers passed at once (Istio).
    (5, "envoy_defaults"),
    (5, "unreachable"),
    (5, "unknown_cluster"),
];

fn listener_for(rng: &mut Rng, env: &Env) -> &'static str {
    rng.weighted(&env.listeners)
}

/// A path built from an orchestrated one (mostly), spelled in odd ways.
fn random_path(rng: &mut Rng, raw_bytes: bool) -> String {
    let mut path = if rng.percent(85) {
        (rng.pick(ORCHESTRATED)).to_owned()
    } else {
        (rng.pick(OTHER_PATHS)).to_owned()
    };
    if rng.percent(30) {
        for _ in 0..rng.range(1, 3) {
            path = mutate_path(rng, &path, raw_bytes);
        }
    }
    if rng.percent(20) {
        path.push_str(rng.pick(&["?x=1", "?", "?a=b&c=%00", "?stream=true", "?%2F", "?x=/../"]));
    }
    path
}

fn mutate_path(rng: &mut Rng, path: &str, raw_bytes: bool) -> String {
    let chars: Vec<char> = path.chars().collect();
    let slashes: Vec<usize> = (0..chars.len()).filter(|&i| chars[i] == '/').collect();
    let letters: Vec<usize> = (0..chars.len())
        .filter(|&i| chars[i].is_ascii_alphanumeric())
        .collect();
    let at_slash = |rng: &mut Rng| slashes[rng.below(slashes.len())];
    let mut out = chars.clone();
    match rng.below(11) {
        0 | 1 if !letters.is_empty() => {
            // Percent-encode a letter, in upper or lower case hex.
            let i = letters[rng.below(letters.len())];
            let code = if rng.percent(50) {
                format!("%{:02X}", chars[i] as u32)
            } else {
                format!("%{:02x}", chars[i] as u32)
            };
            out.splice(i..=i, code.chars());
        }
        2 if slashes.len() > 1 => {
            let i = slashes[1 + rng.below(slashes.len() - 1)];
            let code = rng.pick(&["%2F", "%2f", "%5C", "\\"]);
            out.splice(i..=i, code.chars());
        }
        3 => {
            let i = at_slash(rng);
            out.insert(i, '/');
        }
        4 => {
            let i = at_slash(rng);
            out.splice(i..i, "/.".chars());
        }
        5 => {
            let i = at_slash(rng);
            out.splice(i..i, "/x/..".chars());
        }
        6 if !letters.is_empty() => {
            let i = letters[rng.below(letters.len())];
            out[i] = if out[i].is_ascii_lowercase() {
                out[i].to_ascii_uppercase()
            } else {
                out[i].to_ascii_lowercase()
            };
        }
        7 => out.push('/'),
        8 => out.extend(";x=1".chars()),
        9 => {
            let i = at_slash(rng);
            let dots = rng.pick(&["/%2e", "/%2E%2E/v1", "/.%2e/v1"]);
            out.splice(i..i, dots.chars());
        }
        _ if raw_bytes => {
            let i = rng.below(out.len() + 1);
            let odd = rng.pick(&["%00", "%ff", " ", "\t", "#frag", "%", "%zz"]);
            out.splice(i..i, odd.chars());
        }
        _ => out.push('/'),
    }
    out.into_iter().collect()
}

/// A hostile client's kv_transfer_params, marked with its case.
fn client_kv(marker: &str) -> String {
    format!(
        r#"{{"remote_host":"6.6.6.6","do_remote_prefill":true,"remote_engine_id":"{marker}","remote_block_ids":[1,2,3],"remote_port":1}}"#
    )
}

/// A JSON-ish body; whether it carries the marker.
fn random_body(rng: &mut Rng, env: &Env, case: u64, path: &str) -> (Vec<u8>, bool) {
    let marker = env.marker(case);
    let kind = rng.below(100);
    let mut marked = false;
    let mut body: Vec<u8> = match kind {
        0..=71 => object_body(rng, case, path, &marker, &mut marked),
        72..=77 => {
            // A valid request cut short.
            let full = object_body(rng, case, path, &marker, &mut marked);
            let cut = rng.below(full.len().max(1));
            full[..cut].to_vec()
        }
        78..=80 => (0..rng.range(1, 300))
            .map(|_| rng.next_u64() as u8)
            .collect(),
        81..=84 => rng
            .pick(&[
                &b"[]"[..],
                b"\"x\"",
                b"42",
                b"null",
                b"true",
                b"[{\"prompt\":\"x\"}]",
                b"{}",
                b"{\"\":1}",
            ])
            .to_vec(),
        85..=87 => Vec::new(),
        88..=91 => {
            let depth = rng.range(10, 5000);
            let (open, close) = if rng.percent(50) {
                ("[", "]")
            } else {
                ("{\"a\":", "}")
            };
            let close_count = if rng.percent(80) {
                depth
            } else {
                rng.below(depth)
            };
            format!(
                "{{\"prompt\":\"deep {case}\",\"extra\":{}1{},\"kv_transfer_params\":{}}}",
                open.repeat(depth),
                close.repeat(close_count),
                client_kv(&marker)
            )
            .into_bytes()
        }
        92..=95 => {
            // Invalid UTF-8 inside a string, a key, or between tokens.
            let mut bytes = object_body(rng, case, path, &marker, &mut marked);
            let bad: &[u8] = rng.pick(&[
                &b"\xff"[..],
                b"\xc3\x28",
                b"\xed\xa0\x80",
                b"\xf0\x28\x8c\x28",
                b"\xc0\xaf",
            ]);
            let at = rng.below(bytes.len());
            bytes.splice(at..at, bad.iter().copied());
            bytes
        }
        _ => {
            // Many duplicates of a member the filter rewrites.
            marked = true;
            let member = match rng.below(4) {
                0 => format!("\"kv_transfer_params\":{},", client_kv(&marker)),
                1 => "\"kv_transfer_params\":null,".to_owned(),
                2 => "\"stream\":true,".to_owned(),
                _ => "\"max_tokens\":9,".to_owned(),
            };
            let mut text = format!(
                "{{\"prompt\":\"dups {case}\",\"kv_transfer_params\":{},",
                client_kv(&marker)
            );
            for _ in 0..rng.range(2, 3000) {
                text.push_str(&member);
            }
            text.push_str("\"max_tokens\":3}");
            text.into_bytes()
        }
    };
    if rng.percent(8) {
        body.splice(0..0, b"\xEF\xBB\xBF".iter().copied());
    }
    if rng.percent(4) {
        body.splice(
            0..0,
            rng.pick(&[&b" "[..], b"\n", b"\t\r\n "]).iter().copied(),
        );
    }
    if rng.percent(4) {
        body.extend_from_slice(rng.pick(&[&b" "[..], b"\n", b" {}", b"x", b"\0"]));
    }
    (body, marked)
}

fn object_body(rng: &mut Rng, case: u64, path: &str, marker: &str, marked: &mut bool) -> Vec<u8> {
    let mut words = format!(
        "fz{case} {}",
        rng.pick(&["hello", "the", "ünï", "tab\\tword"])
    );
    for _ in 0..rng.below(12) {
        words.push(' ');
        words.push_str(rng.pick(&["alpha", "beta", "gamma", "\\u00e9", "\\\"q\\\"", "z"]));
    }
    if rng.percent(20) {
        words.push(' ');
        words.push_str(rng.pick(&[
            "mock:prefill_no_kv",
            "mock:prefill_null_kv",
            "mock:prefill_kv_not_object",
            "mock:prefill_non_json",
            "mock:prefill_status=400",
            "mock:prefill_status=429",
            "mock:prefill_status=500",
            "mock:prefill_status=503",
            "mock:prefill_status=504",
            "mock:prefill_reset",
            "mock:prefill_reset_mid_answer",
            "mock:prefill_delay_ms=200",
            "mock:prefill_huge=200000",
            "mock:decode_status=500",
            "mock:decode_status=429",
        ]));
    }
    let padding = match rng.below(100) {
        0..=69 => 0,
        70..=89 => rng.range(100, 20_000),
        90..=95 => rng.range(20_000, 200_000),
        // Around the 64 KiB limits of `strict` and `tight_buffer`.
        _ => 65_536usize.saturating_sub(rng.range(0, 700)),
    };
    let near_limit = padding > 60_000 && padding < 70_000;
    if padding > 0 && !near_limit {
        words.push(' ');
        words.push_str(&"p".repeat(padding));
    }
    let text = format!("\"{words}\"");

    let mut members: Vec<(String, String)> = Vec::new();
    let endpoint = ORCHESTRATED
        .iter()
        .find(|p| path.contains(&p[4..]))
        .copied()
        .unwrap_or("/v1/completions");
    let all = rng.percent(10);
    if all || endpoint == "/v1/completions" {
        members.push(("prompt".into(), text.clone()));
    }
    if all || endpoint == "/v1/chat/completions" || endpoint == "/v1/messages" {
        members.push((
            "messages".into(),
            format!("[{{\"role\":\"user\",\"content\":{text}}}]"),
        ));
    }
    if all || endpoint == "/v1/responses" {
        members.push(("input".into(), text.clone()));
    }
    if all || endpoint == "/inference/v1/generate" {
        members.push(("token_ids".into(), "[101,102,103]".into()));
        let sampling_params = [
            r#"{"max_tokens":3}"#,
            r#"{"max_tokens":3,"min_tokens":2,"n":2}"#,
            r#"{"max_tokens":3,"max_tokens":900}"#,
            r#"{"max_tokens":"x"}"#,
            "null",
            "[]",
            r#"{"kv_transfer_params":{"remote_host":"6.6.6.6"}}"#,
        ];
        let value = if rng.percent(60) {
            sampling_params[0]
        } else {
            rng.pick(&sampling_params)
        };
        members.push(("sampling_params".into(), value.to_owned()));
    }
    // A clean request takes the first (valid) value of each member it has.
    let clean = rng.percent(45);
    let mut maybe = |rng: &mut Rng, p: usize, key: &str, values: &[&str]| {
        if rng.percent(p) {
            let value = if clean { values[0] } else { rng.pick(values) };
            members.push((key.to_owned(), value.to_owned()));
        }
    };
    maybe(
        rng,
        70,
        "max_tokens",
        &[
            "3",
            "1",
            "16",
            "0",
            "-1",
            "\"5\"",
            "1e3",
            "99999999999999999999",
            "null",
            "true",
            "2.5",
        ],
    );
    maybe(rng, 15, "max_completion_tokens", &["4", "0", "null"]);
    maybe(rng, 15, "max_output_tokens", &["4", "1", "-3"]);
    maybe(
        rng,
        25,
        "stream",
        &["true", "false", "0", "1", "\"true\"", "null"],
    );
    maybe(
        rng,
        if clean { 0 } else { 10 },
        "stream_options",
        &[
            "{\"include_usage\":true}",
            "null",
            "[]",
            "{\"include_usage\":\"x\"}",
        ],
    );
    maybe(rng, 10, "n", &["1", "2", "0", "-1", "\"2\""]);
    maybe(rng, 10, "min_tokens", &["1", "3", "100"]);
    maybe(
        rng,
        30,
        "model",
        &[
            "\"model-a\"",
            "\"model-b\"",
            "\"\"",
            "\"mock-model\"",
            "\"a\\r\\nb\"",
            "\"model-b\\r\\nx-evil: 1\"",
            "\"a\\u0000b\"",
            "\"a\\u007fb\"",
            "\"m\\u00fcdel\"",
            "\"model-\\u0062\"",
            "7",
            "null",
            "[\"model-b\"]",
        ],
    );
    maybe(rng, 10, "temperature", &["0", "0.7", "1e-308", "-0.0"]);
    maybe(
        rng,
        8,
        "extra",
        &[
            "{\"kv_transfer_params\":{\"remote_host\":\"nested\"}}",
            "[1,2,{}]",
            "\"\\ud800\"",
        ],
    );
    if rng.percent(50) {
        *marked = true;
        let key = rng.weighted(&[
            (8, "\"kv_transfer_params\""),
            (1, "\"kv_transfer\\u005fparams\""),
            (1, "\"\\u006bv_transfer_params\""),
        ]);
        let count = rng.weighted(&[(85, 1), (10, 3), (5, 40)]);
        for _ in 0..count {
            members.push((format!("\x01{key}"), client_kv(marker)));
        }
    } else if rng.percent(10) {
        maybe(
            rng,
            100,
            "kv_transfer_params",
            &["null", "0", "\"x\"", "[]", "{}"],
        );
    }
    if rng.percent(10) && !members.is_empty() {
        // Repeat one member a few times.
        let member = members[rng.below(members.len())].clone();
        for _ in 0..rng.range(1, 50) {
            members.push(member.clone());
        }
    }
    // Shuffle.
    for i in (1..members.len()).rev() {
        let j = rng.below(i + 1);
        members.swap(i, j);
    }
    let pretty = rng.percent(10);
    let (colon, comma) = if pretty { (" : ", ",\n  ") } else { (":", ",") };
    let mut out = String::from(if pretty { "{\n  " } else { "{" });
    for (i, (key, value)) in members.iter().enumerate() {
        if i > 0 {
            out.push_str(comma);
        }
        match key.strip_prefix('\x01') {
            Some(raw_key) => out.push_str(raw_key),
            None => {
                out.push('"');
                out.push_str(key);
                out.push('"');
            }
        }
        out.push_str(colon);
        out.push_str(value);
    }
    out.push_str(if pretty { "\n}" } else { "}" });
    if near_limit && out.len() < padding {
        // Pad the prompt so that the whole body is `padding` bytes long.
        let missing = padding - out.len() - 1;
        if let Some(at) = out.find(&format!("fz{case} ")) {
            let insert = at + format!("fz{case} ").len();
            out.insert_str(insert, &format!("{} ", "q".repeat(missing)));
        }
    }
    out.into_bytes()
}

fn content_type(rng: &mut Rng) -> Option<&'static str> {
    rng.weighted(&[
        (60, Some("application/json")),
        (6, Some("application/json; charset=utf-8")),
        (4, Some("APPLICATION/JSON")),
        (4, Some("application/vnd.api+json")),
        (4, Some("text/plain")),
        (3, Some("application/x-www-form-urlencoded")),
        (3, Some("")),
        (3, Some("application/json, text/plain")),
        (13, None),
    ])
}

/// Request headers other than framing, as (name, value) pairs of valid header text.
fn random_headers(rng: &mut Rng, env: &Env, case: u64) -> Vec<(String, String)> {
    let mut headers = Vec::new();
    if let Some(value) = content_type(rng) {
        headers.push(("content-type".to_owned(), value.to_owned()));
    }
    let id = format!("pdfuzz-{}-{case}", env.seed);
    match rng.below(20) {
        0 | 1 => {}
        2 => headers.push(("x-request-id".to_owned(), String::new())),
        3 => {
            headers.push(("x-request-id".to_owned(), id.clone()));
            headers.push(("x-request-id".to_owned(), format!("{id}-again")));
        }
        4 => headers.push(("x-request-id".to_owned(), "r".repeat(rng.range(200, 5000)))),
        _ => headers.push(("x-request-id".to_owned(), id)),
    }
    if rng.percent(25) {
        // Scheduler-chosen prefill hosts: loopback only.
        let hosts = [
            format!("127.0.0.2:{}", env.prefill_b),
            format!("127.0.0.1:{}", env.prefill),
            format!("127.0.0.1:{}", env.admin),
            format!("127.0.0.1:{}", env.closed),
            format!("127.0.0.1:{}", env.decode),
            format!("[::1]:{}", env.closed),
            format!("[::ffff:127.0.0.1]:{}", env.admin),
            format!("127.0.0.2:{},127.0.0.1:{}", env.prefill_b, env.admin),
            format!("127.0.0.1:{},127.0.0.2:{}", env.closed, env.prefill_b),
            "127.0.0.2:0".to_owned(),
            "localhost:8000".to_owned(),
            "garbage".to_owned(),
            String::new(),
            " , ".to_owned(),
            format!("127.0.0.2:{} ", env.prefill_b),
        ];
        headers.push((
            "x-prefiller-host-port".to_owned(),
            rng.pick_ref(&hosts).clone(),
        ));
    }
    if rng.percent(20) {
        let models = ["model-a", "model-b", "", "MODEL-B", "model-b ", "x"];
        headers.push(("x-pd-model".to_owned(), (rng.pick(&models)).to_owned()));
    }
    if rng.percent(8) {
        // An endpoint picker's decode host: loopback mocks or a closed port.
        let hosts = [
            format!("127.0.0.1:{}", env.decode_b),
            format!("127.0.0.1:{}", env.decode),
            format!("127.0.0.1:{}", env.closed),
            "nonsense".to_owned(),
        ];
        headers.push((
            "x-gateway-destination-endpoint".to_owned(),
            rng.pick_ref(&hosts).clone(),
        ));
    }
    if rng.percent(10) {
        headers.push(("authorization".to_owned(), "Bearer fuzz".to_owned()));
    }
    if rng.percent(5) {
        headers.push((
            "x-envoy-original-dst-host".to_owned(),
            format!("127.0.0.1:{}", env.admin),
        ));
    }
    if rng.percent(3) {
        headers.push(("x-big".to_owned(), "b".repeat(rng.range(1_000, 90_000))));
    }
    if rng.percent(3) {
        for i in 0..rng.range(20, 150) {
            headers.push((format!("x-many-{i}"), "v".to_owned()));
        }
    }
    headers
}

/// The names of the first 12 headers, for a case's description.
fn header_names(headers: &[(String, String)]) -> String {
    let names: Vec<&str> = headers.iter().map(|(name, _)| name.as_str()).collect();
    names[..names.len().min(12)].join(",")
}

fn preview(bytes: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(max)]);
    let text: String = text
        .chars()
        .map(|c| if c.is_control() { '·' } else { c })
        .collect();
    if bytes.len() > max {
        format!("{text}…")
    } else {
        text
    }
}

/// What a case of either protocol draws first.
struct Drawn {
    method: String,
    path: String,
    body: Vec<u8>,
    /// Whether the body carries the case's marker.
    marked: bool,
    headers: Vec<(String, String)>,
}

/// A method from `methods`, a path (`raw_bytes`: any bytes, for HTTP/1.1), a body and the
/// headers, drawn in that order.
fn draw(rng: &mut Rng, env: &Env, case: u64, methods: &[(usize, &str)], raw_bytes: bool) -> Drawn {
    let method = rng.weighted(methods).to_owned();
    let path = random_path(rng, raw_bytes);
    let (body, marked) = random_body(rng, env, case, &path);
    let headers = random_headers(rng, env, case);
    Drawn {
        method,
        path,
        body,
        marked,
        headers,
    }
}

// ----------------------------------------------------------------------------------------
// HTTP/1.1 cases

struct H1Case {
    listener: &'static str,
    method: String,
    request: Vec<u8>,
    writing: Writing,
    description: String,
    marked: bool,
}

const H1_METHODS: &[(usize, &str)] = &[
    (72, "POST"),
    (4, "post"),
    (2, "Post"),
    (5, "GET"),
    (3, "PUT"),
    (3, "HEAD"),
    (2, "OPTIONS"),
    (2, "PATCH"),
    (2, "DELETE"),
    (1, "FOO"),
    (2, "POST "),
    (2, "P\x00ST"),
];

fn h1_case(rng: &mut Rng, env: &Env, case: u64) -> H1Case {
    let listener = listener_for(rng, env);
    let Drawn {
        method,
        path,
        body,
        marked,
        mut headers,
    } = draw(rng, env, case, H1_METHODS, true);
    let version = rng.weighted(&[(94, "HTTP/1.1"), (4, "HTTP/1.0"), (2, "HTTP/1.2")]);
    if rng.percent(4) {
        headers.push(("expect".to_owned(), "100-continue".to_owned()));
    }
    if rng.percent(10) {
        headers.push(("connection".to_owned(), "close".to_owned()));
    }

    let mut request = format!("{method} {path} {version}\r\n").into_bytes();
    match rng.below(50) {
        0 => {}
        1 => request.extend_from_slice(b"host: a\r\nhost: b\r\n"),
        _ => request.extend_from_slice(b"host: localhost\r\n"),
    }
    for (name, value) in &headers {
        request.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    if rng.percent(2) {
        // A header line that is not one.
        request.extend_from_slice(rng.pick(&[
            &b"no colon here\r\n"[..],
            b" folded: x\r\n",
            b"x-nul: a\0b\r\n",
        ]));
    }
    let mut writing = Writing::default();
    let framing;
    match rng.below(100) {
        0..=59 => {
            framing = "content-length".to_owned();
            request.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
            request.extend_from_slice(&body);
        }
        60..=69 => {
            // A content-length that lies.
            let declared = if rng.percent(50) {
                writing.shutdown_after = true;
                body.len() + rng.range(1, 5000)
            } else {
                body.len().saturating_sub(rng.range(1, 50))
            };
            framing = format!("content-length {declared} for {}", body.len());
            request.extend_from_slice(format!("content-length: {declared}\r\n\r\n").as_bytes());
            request.extend_from_slice(&body);
        }
        70..=71 => {
            framing = "two content-lengths".to_owned();
            request.extend_from_slice(
                format!(
                    "content-length: {}\r\ncontent-length: {}\r\n\r\n",
                    body.len(),
                    body.len() + 1
                )
                .as_bytes(),
            );
            request.extend_from_slice(&body);
            writing.shutdown_after = true;
        }
        72..=73 => {
            framing = "chunked and content-length".to_owned();
            request.extend_from_slice(
                format!(
                    "transfer-encoding: chunked\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                )
                .as_bytes(),
            );
            request.extend_from_slice(&chunk(rng, &body, &mut writing));
        }
        74..=75 => {
            framing = "no length".to_owned();
            request.extend_from_slice(b"\r\n");
            request.extend_from_slice(&body);
            writing.shutdown_after = rng.percent(50);
        }
        _ => {
            let te = rng.weighted(&[
                (90, "chunked"),
                (4, "Chunked"),
                (3, "gzip, chunked"),
                (3, "chunked, chunked"),
            ]);
            framing = format!("transfer-encoding: {te}");
            request.extend_from_slice(format!("transfer-encoding: {te}\r\n\r\n").as_bytes());
            request.extend_from_slice(&chunk(rng, &body, &mut writing));
        }
    }
    if rng.percent(15) {
        let pieces = rng.range(1, 4);
        writing.pieces = (0..pieces)
            .map(|_| rng.range(1, request.len().max(2)))
            .collect();
        writing.pieces.sort_unstable();
        let mut last = 0;
        for piece in writing.pieces.iter_mut() {
            let size = *piece - last;
            last = *piece;
            *piece = size;
        }
        writing.pause = Duration::from_millis(rng.range(0, 20) as u64);
    }
    if rng.percent(2) {
        writing.shutdown_after = true;
    }
    let description = format!(
        "h1 {listener} {method:?} {path:?} {version} [{}] {framing} body {}B {:?}",
        header_names(&headers),
        body.len(),
        preview(&body, 160)
    );
    H1Case {
        listener,
        method,
        request,
        writing,
        description,
        marked,
    }
}

/// The body with chunked framing, split at random; sometimes broken or unfinished.
fn chunk(rng: &mut Rng, body: &[u8], writing: &mut Writing) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let size = rng.range(1, rest.len().min(20_000));
        let (piece, tail) = rest.split_at(size);
        let line = match rng.below(40) {
            0 => format!("{size:X};ext=1\r\n"),
            1 => format!("{size:x} \r\n"),
            _ => format!("{size:x}\r\n"),
        };
        out.extend_from_slice(line.as_bytes());
        out.extend_from_slice(piece);
        out.extend_from_slice(b"\r\n");
        rest = tail;
    }
    match rng.below(30) {
        0 => {
            // Never finished.
            writing.shutdown_after = true;
        }
        1 => {
            out.extend_from_slice(b"zz\r\n\r\n");
            writing.shutdown_after = true;
        }
        2 => out.extend_from_slice(b"0\r\nx-trailer: 1\r\n\r\n"),
        3 => {
            // A chunk that announces more than it sends.
            out.extend_from_slice(b"ffff\r\nabc");
            writing.shutdown_after = true;
        }
        _ => out.extend_from_slice(b"0\r\n\r\n"),
    }
    out
}

async fn run_h1(env: &Env, record: &Record, case: u64, generated: H1Case) {
    if generated.marked {
        record.mark(env.marker(case), generated.description.clone());
    }
    let port = env.ports[generated.listener];
    let outcome = exchange(
        port,
        generated.request,
        &generated.method,
        generated.writing,
        DEADLINE,
    )
    .await;
    let label = match &outcome {
        Outcome::Response(response) => format!("h1 {}", response.status),
        Outcome::Closed => "h1 closed".to_owned(),
        Outcome::Truncated(_) => "h1 truncated".to_owned(),
        Outcome::Malformed(_) => "h1 malformed".to_owned(),
        Outcome::Timeout(_) => "h1 hang".to_owned(),
    };
    record.finished(&format!("#{case} {}", generated.description), &label);
    record.count(label);
    match outcome {
        Outcome::Response(_) | Outcome::Closed => {}
        Outcome::Malformed(reason) if reason.starts_with("cannot connect") => {
            record.violation(
                format!("connect {case}"),
                format!(
                    "#{case}: cannot connect to Envoy ({reason}): {}",
                    generated.description
                ),
            );
            record.stop.store(true, Ordering::SeqCst);
        }
        other => record.violation(
            format!("h1 {case}"),
            format!("#{case}: {}: {}", other.describe(), generated.description),
        ),
    }
}

// ----------------------------------------------------------------------------------------
// h2c cases: several concurrent streams on one connection

const H2_METHODS: &[(usize, &str)] = &[
    (85, "POST"),
    (5, "GET"),
    (3, "PUT"),
    (3, "HEAD"),
    (4, "post"),
];

/// One h2 stream. With `alone` false it shares its connection with others, so it avoids what
/// makes Envoy drop the whole connection (oversized headers, floods of empty DATA frames).
fn h2_request(rng: &mut Rng, env: &Env, case: u64, alone: bool) -> (H2Request, String, bool) {
    let Drawn {
        method,
        path,
        body,
        marked,
        headers,
    } = draw(rng, env, case, H2_METHODS, false);
    let headers = headers
        .into_iter()
        .filter(|(name, _)| alone || !(name == "x-big" || name.starts_with("x-many-")))
        .collect::<Vec<_>>();
    let frames = if body.is_empty() && rng.percent(50) {
        0
    } else {
        rng.weighted(&[(40, 1), (30, 2), (20, 5), (10, 30)])
    };
    let mut data: Vec<Vec<u8>> = Vec::new();
    if frames > 0 {
        let mut cuts: Vec<usize> = (0..frames - 1).map(|_| rng.below(body.len() + 1)).collect();
        cuts.sort_unstable();
        if !(alone && rng.percent(10)) {
            // No empty DATA frames (Envoy counts those as a flood).
            cuts.retain(|&cut| cut > 0 && cut < body.len());
            cuts.dedup();
        }
        let mut last = 0;
        for cut in cuts {
            data.push(body[last..cut].to_vec());
            last = cut;
        }
        data.push(body[last..].to_vec());
    }
    let trailers = if rng.percent(20) {
        vec![("x-trailer".to_owned(), "1".to_owned())]
    } else if alone && rng.percent(10) {
        vec![("content-length".to_owned(), "1".to_owned())]
    } else {
        Vec::new()
    };
    let reset_after = if rng.percent(10) {
        Some(rng.below(data.len() + 1))
    } else {
        None
    };
    let frame_sizes: Vec<usize> = data.iter().map(Vec::len).collect();
    let trailer_names: Vec<&str> = trailers.iter().map(|(name, _)| name.as_str()).collect();
    let description = format!(
        "h2 {method:?} {path:?} [{}] DATA frames of {frame_sizes:?}{}{} body {}B {:?}",
        header_names(&headers),
        if trailers.is_empty() {
            String::new()
        } else {
            format!(", trailers {trailer_names:?}")
        },
        if reset_after.is_some() {
            ", RST_STREAM"
        } else {
            ""
        },
        body.len(),
        preview(&body, 4096)
    );
    let request = H2Request {
        method,
        path,
        headers,
        data,
        trailers,
        reset_after,
    };
    (request, description, marked)
}

async fn run_h2_batch(
    env: Arc<Env>,
    record: Arc<Record>,
    rng: &mut Rng,
    first_case: u64,
    streams: u64,
) {
    let listener = listener_for(rng, &env);
    let sender = match h2_connect(env.ports[listener]).await {
        Ok(sender) => sender,
        Err(error) => {
            record.count("h2 no connection".to_owned());
            if http_get(env.admin, "/ready").is_none() {
                record.violation(
                    format!("h2 connect {first_case}"),
                    format!("#{first_case}: no h2c connection ({error}) and Envoy's admin is gone"),
                );
                record.stop.store(true, Ordering::SeqCst);
            }
            return;
        }
    };
    let mut tasks = Vec::new();
    for case in first_case..first_case + streams {
        let (request, description, marked) = h2_request(rng, &env, case, streams == 1);
        let description = format!("#{case} {listener} {description}");
        if marked {
            record.mark(env.marker(case), description.clone());
        }
        let (sender, record) = (sender.clone(), record.clone());
        tasks.push(tokio::spawn(async move {
            let outcome = h2_exchange(&sender, request, DEADLINE).await;
            let label = match &outcome {
                H2Outcome::Response(response) => format!("h2 {}", response.status),
                H2Outcome::Reset(reason) => format!("h2 reset ({})", reset_kind(reason)),
                H2Outcome::ClientReset => "h2 client reset".to_owned(),
                H2Outcome::Timeout => "h2 hang".to_owned(),
                H2Outcome::NotSent(_) => "h2 not sendable".to_owned(),
            };
            record.finished(&description, &label);
            record.count(label);
            if let H2Outcome::Timeout = outcome {
                record.violation(
                    format!("h2 {case}"),
                    format!("no answer and no reset within {DEADLINE:?}: {description}"),
                );
            }
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
}

/// A short name for why a stream ended without a response, for the counts.
fn reset_kind(reason: &str) -> String {
    let reason = reason.split(": ").take(2).collect::<Vec<_>>().join(": ");
    reason.chars().take(60).collect()
}

// ----------------------------------------------------------------------------------------
// The invariants

/// The stats that change when a wasm VM fails and is reloaded or recreated.
fn vm_stats() -> Vec<(String, u64)> {
    let mut stats: Vec<(String, u64)> = envoy_stats("wasm.")
        .into_iter()
        .filter(|(name, _)| name.contains("vm_reload") || name.contains("runtime.v8.created"))
        .collect();
    stats.sort();
    stats
}

/// The marker a decode body carries in a top-level `kv_transfer_params` (or anywhere, when
/// the body is not a JSON object at all).
fn marker_in(body: &[u8]) -> Option<String> {
    let find = |text: &str| {
        let at = text.find(MARKER)?;
        let end = text[at..].find(['"', '\\']).map_or(text.len(), |e| at + e);
        Some(text[at..end].to_owned())
    };
    match members_of(body) {
        Some(members) => members
            .iter()
            .filter(|(key, _)| key == "kv_transfer_params")
            .find_map(|(_, value)| find(value)),
        None => find(&String::from_utf8_lossy(body)),
    }
}

fn checkpoint(env: &Env, record: &Record, baseline: &[(String, u64)], when: &str) {
    let alive = http_get(env.admin, "/ready").is_some_and(|text| text.contains("LIVE"));
    if !alive {
        let recent: Vec<String> = record.recent.lock().unwrap().iter().cloned().collect();
        record.violation(
            "envoy gone".to_owned(),
            format!(
                "{when}: Envoy's admin does not answer: Envoy is gone. The last cases to \
                 finish:\n  {}",
                recent.join("\n  ")
            ),
        );
        record.stop.store(true, Ordering::SeqCst);
    }
    for line in envoy_log_failures() {
        record.violation(format!("log {line}"), format!("{when}: Envoy log: {line}"));
    }
    if alive {
        let now = vm_stats();
        if now != baseline {
            record.violation(
                format!("vm stats {now:?}"),
                format!("{when}: wasm VM stats changed from {baseline:?} to {now:?}"),
            );
        }
    }
    let h = harness();
    for (pool, requests) in [
        ("decode", h.decode.requests()),
        ("decode_b", h.decode_b.requests()),
    ] {
        for request in requests {
            if let Some(marker) = marker_in(&request.body) {
                let case = record
                    .marked
                    .lock()
                    .unwrap()
                    .get(&marker)
                    .cloned()
                    .unwrap_or_else(|| "(case not recorded)".to_owned());
                record.violation(
                    format!("marker {marker}"),
                    format!(
                        "{when}: {pool} received the client's kv_transfer_params {marker} \
                         (path {}, body {:?}); sent by {case}",
                        request.path,
                        preview(&request.body, 300)
                    ),
                );
            }
        }
    }
}

// ----------------------------------------------------------------------------------------

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_http_requests_never_crash_envoy_skip_prefill_or_hang() {
    let seed = env_u64("PD_HTTP_FUZZ_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let secs = env_u64("PD_HTTP_FUZZ_SECS").unwrap_or(20);
    eprintln!(
        "http_fuzz: seed {seed} for {secs} s (replay with PD_HTTP_FUZZ_SEED={seed}, \
         longer with PD_HTTP_FUZZ_SECS)"
    );
    let env = Arc::new(Env::new(seed));
    let record = Arc::new(Record::default());
    let baseline = vm_stats();
    assert!(!baseline.is_empty(), "no wasm VM stats on Envoy's admin");
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);

    let mut workers = Vec::new();
    for worker in 0..WORKERS {
        let (env, record) = (env.clone(), record.clone());
        workers.push(tokio::spawn(async move {
            let mut rng = Rng::new(seed.wrapping_mul(31).wrapping_add(worker));
            while Instant::now() < deadline && !record.stop.load(Ordering::SeqCst) {
                // Case numbers are unique across the workers.
                if rng.percent(75) {
                    let case = record.cases.fetch_add(1, Ordering::SeqCst);
                    if case >= MAX_CASES {
                        break;
                    }
                    let generated = h1_case(&mut rng, &env, case);
                    run_h1(&env, &record, case, generated).await;
                } else {
                    let streams = rng.weighted(&[(50, 1u64), (30, 4), (15, 8), (5, 32)]);
                    let first = record.cases.fetch_add(streams, Ordering::SeqCst);
                    if first >= MAX_CASES {
                        break;
                    }
                    run_h2_batch(env.clone(), record.clone(), &mut rng, first, streams).await;
                }
            }
        }));
    }

    // Checkpoints while the workers run.
    let every = Duration::from_secs((secs / 4).clamp(5, 60));
    let mut next = started + every;
    while workers.iter().any(|w| !w.is_finished()) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if Instant::now() >= next {
            checkpoint(
                &env,
                &record,
                &baseline,
                &format!("after {:?}", started.elapsed()),
            );
            next += every;
        }
    }
    for worker in workers {
        worker.await.expect("fuzz worker");
    }
    checkpoint(&env, &record, &baseline, "at the end");

    // After all that, each listener whose prefill works still serves a normal request.
    if !record.stop.load(Ordering::SeqCst) {
        for listener in [
            "default",
            "strict",
            "models",
            "scheduled",
            "decode_only",
            "no_hosts_held",
            "no_hosts_passed",
            "tight_buffer",
        ] {
            let id = format!("pdfuzz-{seed}-final-{listener}");
            let body = format!(r#"{{"prompt":"{id} still served","max_tokens":3}}"#);
            let outcome = raw_http::post_raw(
                env.ports[listener],
                "/v1/completions",
                &id,
                &[],
                body.as_bytes(),
            )
            .await;
            match outcome {
                Outcome::Response(response) if response.status == 200 => {}
                other => record.violation(
                    format!("final {listener}"),
                    format!(
                        "a normal request on {listener} after the fuzzing: {}",
                        other.describe()
                    ),
                ),
            }
        }
    }

    let outcomes = record.outcomes.lock().unwrap().clone();
    let total: u64 = outcomes.values().sum();
    eprintln!(
        "http_fuzz: seed {seed}: {total} requests in {:.1} s; outcomes: {outcomes:?}",
        started.elapsed().as_secs_f64()
    );
    let codec: Vec<(String, u64)> = envoy_stats("http2.")
        .into_iter()
        .chain(envoy_stats("downstream_cx_protocol_error"))
        .filter(|(_, value)| *value > 0)
        .collect();
    eprintln!("http_fuzz: Envoy's codec stats: {codec:?}");
    let violations = record.violations.lock().unwrap().clone();
    assert!(
        violations.is_empty(),
        "http_fuzz seed {seed} (replay with PD_HTTP_FUZZ_SEED={seed}): {} violation(s) in {total} requests:\n{}",
        violations.len(),
        violations.iter().take(25).cloned().collect::<Vec<_>>().join("\n")
    );
}
