//! The filter's stats on Envoy's `/stats/prometheus` (with the labels the shipped
//! configurations make), its log lines and the prefill-time header; the README's table of
//! stats and the Grafana dashboard against what a running Envoy exposes.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::{
    assert_recomputed, assert_refused, assert_served, harness, repo_root, unique_id, Prometheus,
    Request,
};

const COMPLETIONS: &str = "/v1/completions";

/// The counters move only by what one test does: one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `pd_filter_requests{api="…",outcome="…"}`.
fn requests(api: &str, outcome: &str) -> String {
    format!(r#"pd_filter_requests{{api="{api}",outcome="{outcome}"}}"#)
}

/// The number of prefill times recorded with this outcome. Envoy merges histograms at each
/// stats flush (every second in the test Envoy), so this waits for `at_least` a little while.
fn prefill_times(outcome: &str, at_least: u64) -> u64 {
    let series = format!(r#"pd_filter_prefill_latency_ms_count{{outcome="{outcome}"}}"#);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let count = harness().counter(&series);
        if count >= at_least || Instant::now() > deadline {
            return count;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[tokio::test]
async fn stats_logs_and_prefill_time_header() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let counters: Vec<String> = [
        requests("completions", "decoded"),
        requests("chat_completions", "decoded"),
        requests("responses", "decoded"),
        requests("completions", "decode_only"),
        requests("completions", "client_error"),
        requests("completions", "prefill_failed"),
        r#"pd_filter_requests_orchestrated{api="completions"}"#.to_owned(),
        r#"pd_filter_requests_orchestrated{api="chat_completions"}"#.to_owned(),
        r#"pd_filter_requests_orchestrated{api="responses"}"#.to_owned(),
        "pd_filter_requests_passed_through".to_owned(),
        r#"pd_filter_prefill_failures{kind="status"}"#.to_owned(),
        r#"pd_filter_prefill_failures{kind="timeout"}"#.to_owned(),
        r#"pd_filter_prefill_failures{kind="reset"}"#.to_owned(),
        r#"pd_filter_prefill_failures{kind="unreachable"}"#.to_owned(),
        r#"pd_filter_prefill_failures{kind="no_kv_transfer_params"}"#.to_owned(),
        "pd_filter_decode_only_fallbacks".to_owned(),
        "pd_filter_bad_requests".to_owned(),
    ]
    .into();
    let before: Vec<u64> = counters.iter().map(|series| h.counter(series)).collect();
    // What an earlier test recorded reaches the histograms at the next flush (every second).
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let times_before = ["kv", "no_kv", "failed"].map(|outcome| prefill_times(outcome, 0));

    let happy_id = unique_id("stats-happy");
    let happy = r#"{"prompt":"a","max_tokens":1}"#;
    let (reply, _) = assert_served("default", COMPLETIONS, &happy_id, happy).await;
    // Off by default.
    assert_eq!(reply.header("x-pd-prefill-ms"), None);
    let id = unique_id("stats-chat");
    let chat = r#"{"messages":[{"role":"user","content":"a"}]}"#;
    assert_served("default", "/v1/chat/completions", &id, chat).await;
    let id = unique_id("stats-responses");
    let input = r#"{"input":"a"}"#;
    let (reply, _) = assert_served("strict", "/v1/responses", &id, input).await;
    let millis: u64 = reply
        .header("x-pd-prefill-ms")
        .expect("prefill time header")
        .parse()
        .unwrap();
    assert!(millis < 5_000);

    Request::get("default", "/v1/models").send().await;

    // One request per kind of prefill failure, then requests refused for what they are.
    let mut failures = Vec::new();
    for (kind, listener, body) in [
        (
            "status",
            "default",
            r#"{"prompt":"mock:prefill_status=500"}"#,
        ),
        (
            "timeout",
            "strict",
            r#"{"prompt":"mock:prefill_delay_ms=3000"}"#,
        ),
        (
            "reset",
            "default",
            r#"{"prompt":"mock:prefill_reset_mid_answer"}"#,
        ),
        ("unreachable", "unreachable", r#"{"prompt":"a"}"#),
        (
            "no_kv_transfer_params",
            "default",
            r#"{"prompt":"mock:prefill_no_kv"}"#,
        ),
    ] {
        let id = unique_id(&format!("stats-{kind}"));
        if kind == "no_kv_transfer_params" {
            // Decode recomputes from the client's body.
            assert_recomputed(listener, COMPLETIONS, &id, body).await;
        } else {
            let request = Request::post(listener, COMPLETIONS).id(&id);
            request.body(body).send().await;
        }
        failures.push((id, kind));
    }
    // Prefill refuses the request: the client's mistake, not a prefill failure.
    let id = unique_id("stats-prefill-400");
    let refused = r#"{"prompt":"mock:prefill_status=400"}"#;
    let reply = Request::post("default", COMPLETIONS)
        .id(&id)
        .body(refused)
        .send()
        .await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    let bad_id = unique_id("stats-bad");
    assert_refused(
        "default",
        COMPLETIONS,
        &bad_id,
        "[]",
        400,
        "not a JSON object",
    )
    .await;

    let deltas: Vec<(&str, u64)> = counters
        .iter()
        .zip(&before)
        .map(|(series, before)| (series.as_str(), h.counter(series) - before))
        .collect();
    let expected: Vec<(String, u64)> = vec![
        (requests("completions", "decoded"), 1),
        (requests("chat_completions", "decoded"), 1),
        (requests("responses", "decoded"), 1),
        (requests("completions", "decode_only"), 1),
        // Prefill's 400 and the filter's own.
        (requests("completions", "client_error"), 2),
        (requests("completions", "prefill_failed"), 4),
        (
            r#"pd_filter_requests_orchestrated{api="completions"}"#.into(),
            7,
        ),
        (
            r#"pd_filter_requests_orchestrated{api="chat_completions"}"#.into(),
            1,
        ),
        (
            r#"pd_filter_requests_orchestrated{api="responses"}"#.into(),
            1,
        ),
        ("pd_filter_requests_passed_through".into(), 1),
        (r#"pd_filter_prefill_failures{kind="status"}"#.into(), 1),
        (r#"pd_filter_prefill_failures{kind="timeout"}"#.into(), 1),
        (r#"pd_filter_prefill_failures{kind="reset"}"#.into(), 1),
        (
            r#"pd_filter_prefill_failures{kind="unreachable"}"#.into(),
            1,
        ),
        (
            r#"pd_filter_prefill_failures{kind="no_kv_transfer_params"}"#.into(),
            1,
        ),
        ("pd_filter_decode_only_fallbacks".into(), 1),
        ("pd_filter_bad_requests".into(), 1),
    ];
    let expected: Vec<(&str, u64)> = expected.iter().map(|(s, n)| (s.as_str(), *n)).collect();
    assert_eq!(deltas, expected);

    // Prefill times by what prefill came to: three with KV, one without, five failed
    // (the four failures and the 400).
    let times: Vec<(&str, u64)> = ["kv", "no_kv", "failed"]
        .iter()
        .zip([3, 1, 5])
        .zip(times_before)
        .map(|((outcome, want), before)| (*outcome, prefill_times(outcome, before + want) - before))
        .collect();
    assert_eq!(times, [("kv", 3), ("no_kv", 1), ("failed", 5)]);

    // One warning line per failure, naming the request and the kind; nothing about the
    // request that went well.
    let log = h.envoy_log_text();
    for (id, kind) in &failures {
        let lines: Vec<&str> = log
            .lines()
            .filter(|line| line.contains(id.as_str()) && line.contains("prefill failure"))
            .collect();
        assert_eq!(lines.len(), 1, "{id}: {lines:#?}");
        assert!(
            lines[0].contains(&format!("prefill failure ({kind})")),
            "{}",
            lines[0]
        );
    }
    assert!(!log.contains(&happy_id), "happy path logged at info level");
    // A request prefill refused is the client's: an info line, no warning.
    let refusal: Vec<&str> = log
        .lines()
        .filter(|line| line.contains(id.as_str()))
        .collect();
    assert_eq!(refusal.len(), 1, "{refusal:#?}");
    assert!(
        refusal[0].contains("[info]") && refusal[0].contains("prefill refused the request"),
        "{}",
        refusal[0]
    );
}

/// Decode counting another prompt than prefill (two workers that render the request
/// differently) is counted and logged with both counts, streamed or not; the client's
/// answer still goes, with prefill's counts.
#[tokio::test]
async fn a_client_that_leaves_during_its_upload_is_counted_as_abandoned() {
    use tokio::io::AsyncWriteExt;
    let _serial = SERIAL.lock().await;
    let h = harness();
    let abandoned = requests("completions", "abandoned");
    let before = h.counter(&abandoned);
    for _ in 0..3 {
        let mut client = tokio::net::TcpStream::connect(("127.0.0.1", h.port("default")))
            .await
            .unwrap();
        let head = "POST /v1/completions HTTP/1.1\r\nhost: pd\r\n\
                    content-type: application/json\r\ncontent-length: 100\r\n\r\n";
        client.write_all(head.as_bytes()).await.unwrap();
        client.write_all(br#"{"prompt":"never"#).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(client);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while h.counter(&abandoned) < before + 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(h.counter(&abandoned), before + 3, "each counted once");
}

#[tokio::test]
async fn a_decode_that_counted_another_prompt_is_counted_and_logged() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let series = "pd_filter_prompt_mismatches";
    let before = h.counter(series);
    let mut ids = Vec::new();
    for (path, body) in [
        (
            COMPLETIONS,
            r#"{"prompt":"mock:decode_extra_prompt_tokens=5","max_tokens":2}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"mock:decode_extra_prompt_tokens=5"}],"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}"#,
        ),
    ] {
        let id = unique_id("prompt-mismatch");
        let reply = Request::post("default", path)
            .id(&id)
            .body(body)
            .send()
            .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        ids.push(id);
    }
    // Same prompts on both legs: nothing to say, on the Messages API either, whose decode
    // counts the KV it pulled as cache reads.
    let same = unique_id("prompt-same");
    assert_served(
        "default",
        COMPLETIONS,
        &same,
        r#"{"prompt":"a","max_tokens":2}"#,
    )
    .await;
    for stream in [false, true] {
        let id = unique_id("prompt-same-messages");
        let body = serde_json::json!({
            "model": "m",
            "messages": [{"role": "user", "content": "same prompt"}],
            "max_tokens": 3,
            "stream": stream,
        });
        let reply = Request::post("default", "/v1/messages")
            .id(&id)
            .body(body.to_string())
            .send()
            .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    assert_eq!(h.counter(series) - before, 2);
    let log = h.envoy_log_text();
    for id in &ids {
        let lines: Vec<&str> = log
            .lines()
            .filter(|line| {
                line.contains(id.as_str()) && line.contains("rendered different prompts")
            })
            .collect();
        assert_eq!(lines.len(), 1, "{id}: {lines:#?}");
        assert!(lines[0].contains("[warning]"), "{}", lines[0]);
    }
    assert!(!log.contains(&format!("[{same}] prefill counted")));
}

/// One row of the README's table of stats.
#[derive(Debug)]
struct DocumentedStat {
    name: String,
    kind: String,
    /// Each label with the values the README lists for it.
    labels: BTreeMap<String, BTreeSet<String>>,
}

/// The `code spans` of a piece of Markdown, in order.
fn code_spans(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The table of stats under the README's "## Observability": the series as on
/// `/stats/prometheus`, its labels as "`label`: `value`, `value`; `label`: …", its type.
fn readme_stats_table() -> Vec<DocumentedStat> {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let section = readme
        .split("\n## Observability")
        .nth(1)
        .expect("README has an Observability section");
    let section = section.split("\n## ").next().unwrap_or(section);
    let rows: Vec<&str> = section
        .lines()
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .collect();
    assert!(rows.len() > 2, "no stats table under Observability");
    let header: Vec<&str> = rows[0].split('|').map(str::trim).collect();
    assert_eq!(
        header.get(1..4),
        Some(&["series on `/stats/prometheus`", "labels", "type"][..]),
        "the stats table's columns changed: {}",
        rows[0]
    );
    rows[2..]
        .iter()
        .map(|row| {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let names = code_spans(cells[1]);
            assert_eq!(names.len(), 1, "one series per row: {row}");
            let mut labels = BTreeMap::new();
            for part in cells[2].split(';').filter(|part| !part.trim().is_empty()) {
                let (label, values) = part.split_once(':').expect("`label`: `value`, …");
                let label = code_spans(label);
                assert_eq!(label.len(), 1, "{row}");
                let values: BTreeSet<String> = code_spans(values).into_iter().collect();
                assert!(!values.is_empty(), "{row}: no values for {label:?}");
                labels.insert(label[0].clone(), values);
            }
            DocumentedStat {
                name: names[0].clone(),
                kind: cells[3].to_owned(),
                labels,
            }
        })
        .collect()
}

/// Every `pd_filter_*` family a running Envoy exposes, with its type and each label's values
/// (for a histogram, of its series but `le`).
fn exposed_stats(prometheus: &Prometheus) -> BTreeMap<String, (String, Vec<Vec<String>>)> {
    let mut exposed = BTreeMap::new();
    for (family, kind) in &prometheus.types {
        if !family.starts_with("pd_filter_") {
            continue;
        }
        let label_sets: BTreeSet<Vec<String>> = prometheus
            .family(family)
            .iter()
            .map(|sample| {
                let mut keys: Vec<String> = sample
                    .labels
                    .iter()
                    .filter(|(key, _)| key != "le")
                    .map(|(key, _)| key.clone())
                    .collect();
                keys.sort();
                keys
            })
            .collect();
        exposed.insert(
            family.clone(),
            (kind.clone(), label_sets.into_iter().collect()),
        );
    }
    exposed
}

/// The README says what Envoy shows: every stat in its table is a family of that name and
/// type on `/stats/prometheus` with exactly those labels and values, and Envoy shows no other.
/// The filter defines every series when it starts, so all of them are there, at 0 or more.
#[test]
fn the_readme_lists_the_stats_envoy_exposes() {
    let documented = readme_stats_table();
    let prometheus = harness().prometheus();
    let exposed = exposed_stats(&prometheus);

    let documented_names: BTreeSet<&str> = documented.iter().map(|s| s.name.as_str()).collect();
    let exposed_names: BTreeSet<&str> = exposed.keys().map(String::as_str).collect();
    assert_eq!(
        documented_names, exposed_names,
        "README's stats (left) and Envoy's pd_filter_* families (right)"
    );
    for stat in &documented {
        let (kind, label_sets) = &exposed[&stat.name];
        assert_eq!(&stat.kind, kind, "{}: type", stat.name);
        let keys: Vec<String> = stat.labels.keys().cloned().collect();
        assert_eq!(label_sets, &vec![keys], "{}: label keys", stat.name);
        for (label, values) in &stat.labels {
            let seen: BTreeSet<String> = prometheus
                .family(&stat.name)
                .iter()
                .filter_map(|sample| {
                    let (_, value) = sample.labels.iter().find(|(key, _)| key == label)?;
                    Some(value.clone())
                })
                .collect();
            assert_eq!(&seen, values, "{}: values of {label}", stat.name);
        }
    }
}

/// A selector in a PromQL expression: a series name and the labels it matches on.
#[derive(Debug)]
struct Selector {
    name: String,
    labels: Vec<String>,
}

/// What a PromQL expression reads: its selectors, and the labels it groups or joins by.
/// Enough PromQL for a dashboard: functions, aggregations with `by`/`without`, label
/// matchers, ranges, numbers, binary operators.
fn promql_reads(expr: &str) -> (Vec<Selector>, Vec<String>) {
    const KEYWORDS: [&str; 10] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut selectors: Vec<Selector> = Vec::new();
    let mut grouping = Vec::new();
    let mut i = 0;
    let word_at = |mut j: usize| {
        let start = j;
        while j < chars.len()
            && (chars[j].is_ascii_alphanumeric() || chars[j] == '_' || chars[j] == ':')
        {
            j += 1;
        }
        (chars[start..j].iter().collect::<String>(), j)
    };
    let skip_space = |mut j: usize| {
        while j < chars.len() && chars[j].is_whitespace() {
            j += 1;
        }
        j
    };
    // Label names of a `{…}` matcher list or a `(…)` label list starting at `open`.
    let label_list = |open: usize, close: char| {
        let mut labels = Vec::new();
        let mut j = open + 1;
        loop {
            j = skip_space(j);
            match chars.get(j) {
                None => panic!("unclosed {close} in {expr}"),
                Some(c) if *c == close => return (labels, j + 1),
                Some(',') => j += 1,
                Some('"') => {
                    j += 1;
                    while chars.get(j).is_some_and(|c| *c != '"') {
                        j += if chars[j] == '\\' { 2 } else { 1 };
                    }
                    j += 1;
                }
                Some(c) if c.is_ascii_alphabetic() || *c == '_' => {
                    let (label, next) = word_at(j);
                    labels.push(label);
                    j = skip_space(next);
                    // Skip the operator; the value is a string handled above.
                    while chars.get(j).is_some_and(|c| matches!(c, '=' | '!' | '~')) {
                        j += 1;
                    }
                }
                Some(other) => panic!("unexpected {other:?} in a label list of {expr}"),
            }
        }
    };
    while i < chars.len() {
        let c = chars[i];
        if c == '[' {
            // A range or subquery: `[5m]`, `[$__rate_interval]`.
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c == '{' {
            let (labels, next) = label_list(i, '}');
            let selector = selectors.last_mut().expect("a matcher list follows a name");
            selector.labels.extend(labels);
            i = next;
        } else if c.is_ascii_digit() || c == '.' {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let (word, next) = word_at(i);
            let after = skip_space(next);
            if KEYWORDS.contains(&word.as_str()) {
                if chars.get(after) == Some(&'(') {
                    let (labels, next) = label_list(after, ')');
                    grouping.extend(labels);
                    i = next;
                } else {
                    i = next;
                }
            } else if chars.get(after) == Some(&'(')
                || ["by", "without"].contains(&word_at(after).0.as_str())
            {
                // A function, or an aggregation (`sum (…)`, `sum by (…) (…)`).
                i = next;
            } else {
                selectors.push(Selector {
                    name: word,
                    labels: Vec::new(),
                });
                i = next;
            }
        } else {
            i += 1;
        }
    }
    (selectors, grouping)
}

/// Every `expr` in a Grafana dashboard, anywhere in it.
fn dashboard_exprs(value: &serde_json::Value, found: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr", serde_json::Value::String(expr)) => found.push(expr.clone()),
                    _ => dashboard_exprs(value, found),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| dashboard_exprs(v, found)),
        _ => {}
    }
}

/// The dashboard's queries read only series a running Envoy exposes (after one served
/// request, so that Envoy has written its per-status counters), with labels those series
/// have.
#[tokio::test]
async fn the_grafana_dashboard_reads_only_exposed_series() {
    let _serial = SERIAL.lock().await;
    let path = repo_root().join("deploy/grafana/pd-filter.json");
    let text = std::fs::read_to_string(&path).expect("deploy/grafana/pd-filter.json");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut exprs = Vec::new();
    dashboard_exprs(&dashboard, &mut exprs);
    assert!(exprs.len() >= 10, "only {} queries", exprs.len());

    let id = unique_id("dashboard");
    assert_served("default", COMPLETIONS, &id, r#"{"prompt":"a"}"#).await;
    let prometheus = harness().prometheus();
    // Each series name with every label any of its samples has.
    let mut series: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for sample in &prometheus.samples {
        let labels = series.entry(sample.name.as_str()).or_default();
        labels.extend(sample.labels.iter().map(|(key, _)| key.as_str()));
    }

    let mut problems = Vec::new();
    let mut read = BTreeSet::new();
    for expr in &exprs {
        let (selectors, grouping) = promql_reads(expr);
        if selectors.is_empty() {
            problems.push(format!("{expr}: reads no series"));
        }
        let mut available: BTreeSet<&str> = BTreeSet::new();
        for selector in &selectors {
            read.insert(selector.name.clone());
            let Some(labels) = series.get(selector.name.as_str()) else {
                problems.push(format!("{expr}: Envoy exposes no {}", selector.name));
                continue;
            };
            available.extend(labels);
            for label in &selector.labels {
                if !labels.contains(label.as_str()) {
                    problems.push(format!("{expr}: {} has no label {label}", selector.name));
                }
            }
        }
        for label in &grouping {
            if !available.contains(label.as_str()) {
                problems.push(format!("{expr}: no series it reads has the label {label}"));
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
    // It shows every family of the filter's.
    let families: BTreeSet<String> = prometheus
        .types
        .iter()
        .map(|(family, _)| family.clone())
        .filter(|family| family.starts_with("pd_filter_"))
        .collect();
    let unread: Vec<&String> = families
        .iter()
        .filter(|family| {
            !["", "_bucket", "_sum", "_count"]
                .iter()
                .any(|suffix| read.contains(&format!("{family}{suffix}")))
        })
        .collect();
    assert!(
        unread.is_empty(),
        "the dashboard shows nothing of {unread:?}"
    );
}

#[test]
fn promql_reads_names_labels_and_groupings() {
    let (selectors, grouping) = promql_reads(
        r#"histogram_quantile(0.99, sum by (le, envoy_cluster_name) (rate(envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name=~"prefill.*"}[$__rate_interval]))) / on (x) sum(rate(pd_filter_requests{outcome!="decoded", api="a,b"}[5m]))"#,
    );
    let names: Vec<(&str, Vec<&str>)> = selectors
        .iter()
        .map(|s| {
            (
                s.name.as_str(),
                s.labels.iter().map(String::as_str).collect(),
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            (
                "envoy_cluster_upstream_rq_time_bucket",
                vec!["envoy_cluster_name"]
            ),
            ("pd_filter_requests", vec!["outcome", "api"]),
        ]
    );
    assert_eq!(grouping, ["le", "envoy_cluster_name", "x"]);
}

#[tokio::test]
async fn under_a_flood_of_failures_a_worker_writes_a_bounded_number_of_log_lines() {
    // Each failed prefill has its warning; a worker writes max_log_lines_per_second (2 on
    // this listener) and says, with its next line, how many it left out.
    let _serial = SERIAL.lock().await;
    let h = harness();
    let fail = |id: &str| {
        Request::post("quiet_log", "/v1/completions")
            .id(id)
            .body(r#"{"prompt":"x mock:prefill_status=500","max_tokens":2}"#)
            .send()
    };
    let ids: Vec<String> = (0..12).map(|_| unique_id("quiet-log")).collect();
    let started = Instant::now();
    for id in &ids {
        let reply = fail(id).await;
        assert_eq!(reply.status, 502, "{}", reply.body);
    }
    let seconds = started.elapsed().as_secs() + 1;
    let log = h.envoy_log_text();
    let written = ids.iter().filter(|id| log.contains(id.as_str())).count() as u64;
    // Two workers, two lines a second each, over the seconds the flood took.
    assert!(written <= 2 * 2 * (seconds + 1), "{written} in {seconds} s");
    // A later line on a worker that left some out carries their count; either worker may
    // take the next request.
    let deadline = Instant::now() + Duration::from_secs(10);
    let summary = "log lines not written (max_log_lines_per_second)";
    while !h.envoy_log_text().contains(summary) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(600)).await;
        fail(&unique_id("quiet-log-after")).await;
    }
    assert!(
        h.envoy_log_text().contains(summary),
        "the count of those left out is written"
    );
}

#[tokio::test]
async fn one_clients_refusals_do_not_crowd_another_clients_failure_out_of_the_log() {
    // A client whose requests prefill refuses (400: an info line each, as cheap for it to
    // send as it likes) uses up every second's budget of such lines on both workers. The
    // warning about another client's failed prefill, an operator's business, is written all
    // the same.
    let _serial = SERIAL.lock().await;
    let h = harness();
    let refused = |id: String| async move {
        Request::post("quiet_log", "/v1/completions")
            .id(&id)
            .body(r#"{"prompt":"x mock:prefill_status=400","max_tokens":2}"#)
            .send()
            .await
    };
    let flood = async {
        for _ in 0..6 {
            let round = (0..16).map(|_| refused(unique_id("quiet-log-refused")));
            for reply in futures_util::future::join_all(round).await {
                assert_eq!(reply.status, 400, "{}", reply.body);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let bystanders: Vec<String> = (0..2).map(|_| unique_id("quiet-log-bystander")).collect();
    let failed = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        for id in &bystanders {
            let reply = Request::post("quiet_log", "/v1/completions")
                .id(id)
                .body(r#"{"prompt":"x mock:prefill_status=500","max_tokens":2}"#)
                .send()
                .await;
            assert_eq!(reply.status, 502, "{}", reply.body);
        }
    };
    tokio::join!(flood, failed);
    let log = h.envoy_log_text();
    for id in &bystanders {
        assert!(
            log.contains(&format!("[{id}] prefill failure")),
            "{id}: the failure's warning was crowded out"
        );
    }
}
