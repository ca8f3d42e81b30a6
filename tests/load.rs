//! Many concurrent clients through a real Envoy running the built filter: every request must
//! get its own answer, built from the KV cache prefill produced for that same request, and
//! none may be lost, hang or leak into another. The second test injects prefill faults into
//! a fifth of the requests; each of those must get its documented error and no decode.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use common::{
    answer_text, assert_filter_healthy, check_decode, check_prefill, expected_decode_text, harness,
    unique_id, Connections, Reply, Request,
};
use mock_vllm::RecordedRequest;
use serde_json::{json, Value};

/// Concurrent clients, each with its own connection pool.
const CLIENTS: usize = 64;
/// A request that takes longer than this counts as hung.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest prompt, in bytes.
const HUGE_PROMPT: usize = 200_000;

/// The two load tests share one Envoy: run them one after the other so that each measures
/// its own load.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Fault {
    /// Prefill answers 500: the client gets 502.
    Status500,
    /// Prefill answers 503: the client gets 503.
    Status503,
    /// Prefill closes the connection without answering: 503.
    Reset,
    /// Prefill answers after the strict listener's 1.5 s timeout: 504.
    Timeout,
    /// Prefill answers 200 without kv_transfer_params; the strict listener answers 502.
    NoKv,
}

impl Fault {
    const ALL: [Fault; 5] = [
        Fault::Status500,
        Fault::Status503,
        Fault::Reset,
        Fault::Timeout,
        Fault::NoKv,
    ];

    fn directive(self) -> &'static str {
        match self {
            Fault::Status500 => "mock:prefill_status=500",
            Fault::Status503 => "mock:prefill_status=503",
            Fault::Reset => "mock:prefill_reset",
            Fault::Timeout => "mock:prefill_delay_ms=2500",
            Fault::NoKv => "mock:prefill_no_kv",
        }
    }

    /// Prefill requests the filter makes: connection failures and 503s are retried once.
    fn prefill_attempts(self) -> usize {
        match self {
            Fault::Status503 | Fault::Reset => 2,
            Fault::Status500 | Fault::Timeout | Fault::NoKv => 1,
        }
    }

    /// The status and a part of the message the client must get.
    fn expected(self) -> (u16, &'static str) {
        match self {
            Fault::Status500 => (502, "prefill failed (500)"),
            Fault::Status503 => (503, "prefill is unavailable (503)"),
            Fault::Reset => (503, "reset"),
            Fault::Timeout => (504, "prefill timed out"),
            Fault::NoKv => (502, "no kv_transfer_params"),
        }
    }
}

/// One client request and what it must get.
struct Case {
    id: String,
    listener: &'static str,
    path: &'static str,
    stream: bool,
    /// The prompt text as the mocks see it; its first word is unique to this request.
    prompt: String,
    /// Tokens the client asks for.
    limit: usize,
    body: String,
    fault: Option<Fault>,
}

/// A small deterministic generator (xorshift64*), so a failure can be reproduced.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Filler text for long prompts: ASCII and multi-byte words, escapes, punctuation.
fn filler() -> &'static str {
    static FILLER: OnceLock<String> = OnceLock::new();
    FILLER.get_or_init(|| {
        const WORDS: &[&str] = &[
            "lorem",
            "ipsum",
            "café",
            "naïve",
            "日本語",
            "🦀",
            "\"quoted\"",
            "back\\slash",
            "tab\there",
            "dolor",
            "sit",
            "amet",
            "κόσμε",
            "1.50E0",
            "{brace}",
            "[bracket]",
            "newline\nword",
            "end.",
        ];
        let mut rng = Rng::new(7);
        let mut text = String::with_capacity(HUGE_PROMPT + 64);
        while text.len() < HUGE_PROMPT + 32 {
            text.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
            text.push(' ');
        }
        text
    })
}

/// About `bytes` bytes of filler, ending at a word boundary.
fn filler_of(bytes: usize) -> &'static str {
    let text = filler();
    let mut start = bytes.min(text.len() - 1);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    let end = text[start..].find(' ').map_or(text.len(), |i| start + i);
    &text[..end]
}

/// A prompt size in bytes: mostly a few words, some kilobytes, a few tens of kilobytes and
/// a few up to `HUGE_PROMPT`.
fn prompt_size(rng: &mut Rng, allow_huge: bool) -> usize {
    match rng.below(100) {
        0..=54 => rng.below(60) as usize,
        55..=84 => 200 + rng.below(8_000) as usize,
        85..=95 => 20_000 + rng.below(40_000) as usize,
        _ if allow_huge => 100_000 + rng.below((HUGE_PROMPT - 100_000) as u64) as usize,
        _ => 30_000 + rng.below(25_000) as usize,
    }
}

/// A request with a unique id and first prompt word; on the strict listener when it has a
/// fault, or when `mix_listeners` and every other time its body fits there.
fn build_case(
    rng: &mut Rng,
    tag: &str,
    index: usize,
    fault: Option<Fault>,
    mix_listeners: bool,
) -> Case {
    let id = unique_id(&format!("load-{tag}"));
    // Unique first word: the decode mock's answer names it.
    let word = format!("{tag}{}w{index}", std::process::id());
    let size = prompt_size(rng, fault.is_none());
    let mut prompt = word;
    if let Some(fault) = fault {
        prompt.push(' ');
        prompt.push_str(fault.directive());
    }
    if size > 0 {
        prompt.push(' ');
        prompt.push_str(filler_of(size));
    }
    let prompt = prompt.trim_end().to_owned();
    let limit = 5 + rng.below(8) as usize;
    let stream = rng.below(2) == 0;
    let path = ["/v1/completions", "/v1/chat/completions", "/v1/responses"][index % 3];
    let mut body = match path {
        "/v1/completions" => json!({"model": "m", "prompt": prompt, "max_tokens": limit}),
        "/v1/chat/completions" if rng.below(2) == 0 => json!({"model": "m",
            "messages": [{"role": "user", "content": prompt}], "max_completion_tokens": limit}),
        "/v1/chat/completions" => json!({"model": "m",
            "messages": [{"role": "user", "content": prompt}], "max_tokens": limit}),
        _ => json!({"model": "m", "input": prompt, "max_output_tokens": limit}),
    };
    if stream {
        body["stream"] = json!(true);
        if path != "/v1/responses" && rng.below(2) == 0 {
            body["stream_options"] = json!({"include_usage": true});
        }
    }
    let body = body.to_string();
    // Faults need the strict listener (prefill timeout, no fallback to recomputing); its
    // body limit is 64 KiB.
    let listener = if fault.is_some() || (mix_listeners && body.len() <= 65_536 && index % 2 == 1) {
        "strict"
    } else {
        "default"
    };
    assert!(listener == "default" || body.len() <= 65_536);
    Case {
        id,
        listener,
        path,
        stream,
        prompt,
        limit,
        body,
        fault,
    }
}

/// Sends every case from `CLIENTS` concurrent clients; returns the outcomes (by case index),
/// the highest number of requests in flight and the wall time.
async fn run(cases: Arc<Vec<Case>>) -> (Vec<Result<Reply, String>>, usize, Duration) {
    let next = Arc::new(AtomicUsize::new(0));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let most_in_flight = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..CLIENTS {
        let (cases, next) = (cases.clone(), next.clone());
        let (in_flight, most_in_flight) = (in_flight.clone(), most_in_flight.clone());
        workers.push(tokio::spawn(async move {
            let connections = Connections::new();
            let mut results = Vec::new();
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(case) = cases.get(index) else {
                    return results;
                };
                let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                most_in_flight.fetch_max(now, Ordering::SeqCst);
                let request = Request::post(case.listener, case.path)
                    .id(&case.id)
                    .body(&case.body)
                    .over(&connections)
                    .try_send();
                let outcome = tokio::time::timeout(REQUEST_TIMEOUT, request).await;
                in_flight.fetch_sub(1, Ordering::SeqCst);
                let outcome = outcome.unwrap_or_else(|_| {
                    Err(format!("no complete answer within {REQUEST_TIMEOUT:?}"))
                });
                results.push((index, outcome));
            }
        }));
    }
    let mut outcomes: Vec<Option<Result<Reply, String>>> = (0..cases.len()).map(|_| None).collect();
    for worker in workers {
        for (index, outcome) in worker.await.expect("client task") {
            outcomes[index] = Some(outcome);
        }
    }
    let wall = started.elapsed();
    let outcomes = outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(|| Err("never sent".to_owned())))
        .collect();
    (outcomes, most_in_flight.load(Ordering::SeqCst), wall)
}

/// The recorded requests of one mock, by request id.
fn by_id(requests: Vec<RecordedRequest>) -> HashMap<String, Vec<RecordedRequest>> {
    let mut map: HashMap<String, Vec<RecordedRequest>> = HashMap::new();
    for request in requests {
        let id = request
            .header("x-request-id")
            .unwrap_or_default()
            .to_owned();
        map.entry(id).or_default().push(request);
    }
    map
}

/// Cross-request checks: each kv_transfer_params issued once, blocks never shared.
#[derive(Default)]
struct Issued {
    remote_request_ids: HashMap<String, String>,
    blocks: HashMap<u64, String>,
}

/// Checks one served request end to end; returns what is wrong with it.
fn check_served(
    case: &Case,
    outcome: &Reply,
    prefill: &[RecordedRequest],
    decode: &[RecordedRequest],
    issued: &mut Issued,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut problem = |text: String| problems.push(text);
    if outcome.status != 200 {
        problem(format!("status {}: {}", outcome.status, outcome.body));
        return problems;
    }
    let kv_outcome = outcome.header("x-mock-kv");
    if kv_outcome != Some("reused") {
        problem(format!("x-mock-kv {kv_outcome:?}"));
    }
    let (text, _, ended) = answer_text(&outcome.body);
    let expected = expected_decode_text(&case.prompt, case.limit);
    if text != expected {
        problem(format!("answer {text:?}, expected {expected:?}"));
    }
    if outcome.body.contains("GARBAGE") {
        problem("GARBAGE in the answer".to_owned());
    }
    if !ended {
        problem(format!("the stream did not end: {}", outcome.body));
    }
    let content_type = outcome.header("content-type");
    let sse = content_type.is_some_and(|t| t.starts_with("text/event-stream"));
    if sse != case.stream {
        problem(format!("content-type {content_type:?}"));
    }

    if prefill.len() != 1 || decode.len() != 1 {
        problem(format!(
            "{} prefill and {} decode requests recorded",
            prefill.len(),
            decode.len()
        ));
        return problems;
    }
    // Prefill: the client's body capped; decode: the client's own bytes, plus the
    // kv_transfer_params prefill issued for this very prompt.
    if let Err(wrong) = check_prefill(case.path, case.body.as_bytes(), &prefill[0]) {
        problem(wrong);
    }
    let kv = match check_decode(case.path, case.body.as_bytes(), &decode[0]) {
        Ok(kv) => kv,
        Err(wrong) => {
            problem(wrong);
            return problems;
        }
    };
    let engine = format!("mock-prefill-{}", harness().prefill.port());
    if kv["remote_engine_id"] != json!(engine) {
        problem(format!(
            "decode got kv_transfer_params of another engine: {kv}"
        ));
    }
    let remote_id = kv["remote_request_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if let Some(other) = issued
        .remote_request_ids
        .insert(remote_id.clone(), case.id.clone())
    {
        problem(format!(
            "remote_request_id {remote_id} also went to {other}"
        ));
    }
    for block in kv["remote_block_ids"].as_array().into_iter().flatten() {
        let block = block.as_u64().unwrap_or(u64::MAX);
        if let Some(other) = issued.blocks.insert(block, case.id.clone()) {
            problem(format!("KV block {block} also went to {other}"));
        }
    }
    problems
}

/// A request on the strict listener whose prefill was slowed by the machine's load past the
/// listener's 1.5 s timeout: the documented 504, after the timeout, and no decode. Not
/// cross-talk: a neighbour's fault could only make it fail sooner or differently.
fn timed_out_under_load(
    case: &Case,
    outcome: &Reply,
    prefill: &[RecordedRequest],
    decode: &[RecordedRequest],
) -> bool {
    case.listener == "strict"
        && case.fault.is_none()
        && outcome.status == 504
        && outcome.body.contains("prefill timed out")
        && outcome.latency >= Duration::from_millis(1450)
        && prefill.len() == 1
        && decode.is_empty()
}

/// Checks one request with an injected prefill fault.
fn check_faulty(
    fault: Fault,
    case: &Case,
    outcome: &Reply,
    prefill: &[RecordedRequest],
    decode: &[RecordedRequest],
) -> Vec<String> {
    let mut problems = Vec::new();
    let (status, text) = fault.expected();
    let error: Value = serde_json::from_str(&outcome.body).unwrap_or_default();
    let message = error["error"]["message"].as_str().unwrap_or_default();
    if outcome.status != status
        || error["error"]["code"] != json!(status)
        || !error["error"]["type"].is_string()
        || !message.contains(text)
    {
        problems.push(format!(
            "{fault:?}: expected {status} {text:?}, got {} {}",
            outcome.status, outcome.body
        ));
    }
    let request_id = outcome.header("x-request-id");
    if request_id != Some(case.id.as_str()) {
        problems.push(format!("x-request-id {request_id:?}"));
    }
    if prefill.len() != fault.prefill_attempts() {
        problems.push(format!(
            "{fault:?}: {} prefill requests recorded",
            prefill.len()
        ));
    }
    if !decode.is_empty() {
        problems.push(format!("{fault:?}: decode was called"));
    }
    problems
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

/// Runs the cases and checks every outcome against what the mocks recorded.
async fn run_and_check(label: &str, cases: Vec<Case>) {
    let h = harness();
    let cases = Arc::new(cases);
    let (outcomes, most_in_flight, wall) = run(cases.clone()).await;
    if cases.iter().any(|c| c.fault == Some(Fault::Timeout)) {
        // Let the abandoned slow prefills answer: their answers must go nowhere.
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }
    let checking = Instant::now();
    let prefill = by_id(h.prefill.requests());
    let decode = by_id(h.decode.requests());

    let mut issued = Issued::default();
    let mut failures = Vec::new();
    let mut served = 0;
    let mut slow = Vec::new();
    let mut fault_counts: HashMap<Fault, usize> = HashMap::new();
    let mut latencies: HashMap<String, Vec<Duration>> = HashMap::new();
    let mut bytes = 0;
    let mut per_endpoint: HashMap<(&str, bool), usize> = HashMap::new();
    for (case, outcome) in cases.iter().zip(&outcomes) {
        bytes += case.body.len();
        *per_endpoint.entry((case.path, case.stream)).or_default() += 1;
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(error) => {
                failures.push(format!("{} {}: {error}", case.id, case.path));
                continue;
            }
        };
        let kind = match case.fault {
            Some(_) => "faulty".to_owned(),
            None => format!("{} normal", case.listener),
        };
        latencies.entry(kind).or_default().push(outcome.latency);
        let prefill = prefill.get(&case.id).map_or(&[][..], Vec::as_slice);
        let decode = decode.get(&case.id).map_or(&[][..], Vec::as_slice);
        if timed_out_under_load(case, outcome, prefill, decode) {
            slow.push(case.id.clone());
            continue;
        }
        let problems = match case.fault {
            None => check_served(case, outcome, prefill, decode, &mut issued),
            Some(fault) => check_faulty(fault, case, outcome, prefill, decode),
        };
        if problems.is_empty() {
            match case.fault {
                None => served += 1,
                Some(fault) => *fault_counts.entry(fault).or_default() += 1,
            }
        }
        for problem in problems {
            failures.push(format!(
                "{} {} {} stream={} ({} bytes): {problem}",
                case.id,
                case.listener,
                case.path,
                case.stream,
                case.body.len()
            ));
        }
    }
    let faulty = cases.iter().filter(|c| c.fault.is_some()).count();
    let largest = cases.iter().map(|c| c.body.len()).max().unwrap_or(0);
    println!(
        "{label}: {} requests ({} normal, {faulty} with prefill faults) from {CLIENTS} clients \
         ({most_in_flight} in flight at most), {:.1} MB of request bodies (largest {} KB), \
         in {:.2} s ({:.0} requests/s)",
        cases.len(),
        cases.len() - faulty,
        bytes as f64 / 1e6,
        largest / 1000,
        wall.as_secs_f64(),
        cases.len() as f64 / wall.as_secs_f64()
    );
    let mut mix: Vec<String> = per_endpoint
        .iter()
        .map(|((path, stream), n)| format!("{path}{}: {n}", if *stream { " (stream)" } else { "" }))
        .collect();
    mix.sort();
    println!("{label}: mix {}", mix.join(", "));
    let mut kinds: Vec<_> = latencies.into_iter().collect();
    kinds.sort();
    for (kind, mut latencies) in kinds {
        latencies.sort();
        println!(
            "{label}: latency of {} {kind}: p50 {:?}, p90 {:?}, p99 {:?}, max {:?}",
            latencies.len(),
            percentile(&latencies, 50),
            percentile(&latencies, 90),
            percentile(&latencies, 99),
            latencies.last().copied().unwrap_or_default()
        );
    }
    let mut faults: Vec<String> = fault_counts
        .iter()
        .map(|(fault, n)| format!("{fault:?} {n}"))
        .collect();
    faults.sort();
    println!(
        "{label}: checked against the mocks' records in {:.2} s",
        checking.elapsed().as_secs_f64()
    );
    let strict_normal = cases
        .iter()
        .filter(|c| c.listener == "strict" && c.fault.is_none())
        .count();
    println!(
        "{label}: {served} served correctly, faults answered as documented: [{}], \
         {} of {strict_normal} normal requests on the strict listener answered 504 because the \
         loaded machine made their prefill exceed 1.5 s, {} problems",
        faults.join(", "),
        slow.len(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{label}: {} problems, the first ones:\n{}",
        failures.len(),
        failures
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    // A few slow prefills on a loaded 2-core machine are tolerated, not more.
    assert!(
        slow.len() * 50 <= strict_normal.max(1),
        "{label}: too many prefill timeouts under load: {slow:?}"
    );
    assert_eq!(served + faulty + slow.len(), cases.len());
    assert!(
        most_in_flight >= CLIENTS * 3 / 4,
        "only {most_in_flight} in flight"
    );
    assert_filter_healthy();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_each_get_their_own_answer() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut rng = Rng::new(1);
    let cases: Vec<Case> = (0..2_100)
        .map(|i| build_case(&mut rng, "a", i, None, false))
        .collect();
    assert!(cases.iter().any(|c| c.body.len() > 150_000));
    run_and_check("load", cases).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_faults_in_a_fifth_of_the_requests_touch_no_other_request() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut rng = Rng::new(2);
    let cases: Vec<Case> = (0..1_200)
        .map(|i| {
            // Every fifth request is faulty, the kinds taking turns.
            let fault = (i % 5 == 2).then(|| Fault::ALL[(i / 5) % Fault::ALL.len()]);
            build_case(&mut rng, "b", i, fault, true)
        })
        .collect();
    run_and_check("faults", cases).await;
}
