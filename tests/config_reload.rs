//! The plugin while Envoy replaces it: an Envoy of its own whose listener comes from a watched
//! file (LDS), so that a test can push a new configuration, or remove the listener, with KV
//! releases still to send. Decode cannot be reached here, so a release of a client that left
//! during prefill waits to be sent again when the change comes.
//!
//! Where the VM outlives the change (a new configuration on the same `vm_config`), the old
//! root finishes its releases (README, "Releasing KV"). Where Envoy ends the VM with it (the
//! listener removed, or a new `vm_config`: another `vm_id`, or new code, as an Istio
//! `WasmPlugin` image update), nothing can send them: the filter must say so, in its log and in
//! `pd_filter_kv_releases{outcome="dropped"}`, rather than lose them silently.
//!
//! Ports: the Envoy and the mock take free ports, or, with `PD_RELOAD_TEST_PORT=N`, the ports N
//! to N+3 (admin, listener, prefill, a closed decode port).

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{envoy_binary, http_get, repo_root, wasm_path};
use mock_vllm::{MockServer, Role};

/// What the filter logs when Envoy ends its VM with releases still to send.
const LOST_LINE: &str = "KV releases still to send are lost";

/// One Envoy with a dynamic listener and a mock prefill; decode cannot be reached.
struct Dynamic {
    dir: PathBuf,
    child: Child,
    admin_port: u16,
    /// The port of `openai`, the first listener.
    listener_port: u16,
    listener_ports: Vec<(String, u16)>,
    prefill: MockServer,
    /// A decode that answers, where the test asks for one; else decode's port is closed.
    _decode: Option<MockServer>,
}

impl Drop for Dynamic {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn fixed_ports() -> Option<u16> {
    std::env::var("PD_RELOAD_TEST_PORT").ok()?.parse().ok()
}

/// A port nothing listens on. Not one the kernel hands out: bound and let go, an ephemeral
/// port can become this Envoy's own listener, and releases sent to "decode" then came back
/// into the filter as requests of their own (one CI run counted 579 releases for two).
fn closed_port() -> u16 {
    fixed_ports().map_or_else(common::closed_port, |base| base + 3)
}

fn listener_yaml(port: u16, vm_id: &str, plugin_config: &str) -> String {
    lds_yaml(&[("openai", port, plugin_config)], vm_id)
}

/// Listeners, each running the filter with its own plugin configuration, in VMs of `vm_id`
/// (one VM per worker, shared by the listeners; Envoy gives each configuration a root of
/// its own there, and one root to listeners whose configurations are the same).
fn lds_yaml(listeners: &[(&str, u16, &str)], vm_id: &str) -> String {
    let wasm = wasm_path();
    let ports: Vec<String> = listeners
        .iter()
        .map(|(_, port, _)| port.to_string())
        .collect();
    let mut text = format!(
        "version_info: \"{vm_id}-{}\"\nresources:\n",
        ports.join("-")
    );
    for (name, port, plugin_config) in listeners {
        text.push_str(&format!(
            r#"  - "@type": type.googleapis.com/envoy.config.listener.v3.Listener
    name: {name}
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }}
    filter_chains:
      - filters:
          - name: envoy.filters.network.http_connection_manager
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
              stat_prefix: openai
              route_config:
                virtual_hosts:
                  - name: vllm
                    domains: ["*"]
                    routes:
                      - match: {{ prefix: "/" }}
                        route: {{ cluster: decode, timeout: 0s }}
              http_filters:
                - name: envoy.filters.http.wasm
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
                    config:
                      name: pd-filter
                      root_id: pd-filter
                      allow_on_headers_stop_iteration: true
                      configuration:
                        "@type": type.googleapis.com/google.protobuf.StringValue
                        value: '{plugin_config}'
                      failure_policy: FAIL_RELOAD
                      vm_config:
                        vm_id: {vm_id}
                        runtime: envoy.wasm.runtime.v8
                        code: {{ local: {{ filename: {wasm} }} }}
                - name: envoy.filters.http.router
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#,
            wasm = wasm.display()
        ));
    }
    text
}

/// Replaces the listener file at once (a rename), as the watched directory wants.
fn write_lds(dir: &Path, text: &str) {
    let staged = dir.join("lds/.lds.yaml.new");
    std::fs::write(&staged, text).expect("write lds");
    std::fs::rename(&staged, dir.join("lds/lds.yaml")).expect("rename lds");
}

fn cluster(name: &str, port: u16) -> String {
    format!(
        r#"    - name: {name}
      type: STATIC
      connect_timeout: 0.25s
      load_assignment:
        cluster_name: {name}
        endpoints:
          - lb_endpoints:
              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }} }}
"#
    )
}

impl Dynamic {
    async fn start(label: &str, vm_id: &str, plugin_config: &str) -> Dynamic {
        Dynamic::start_with(label, &[("openai", plugin_config)], vm_id, false).await
    }

    /// `listeners`, each with its plugin configuration, share the VMs of `vm_id`; with
    /// `decode_up` a mock decode answers.
    async fn start_with(
        label: &str,
        listeners: &[(&str, &str)],
        vm_id: &str,
        decode_up: bool,
    ) -> Dynamic {
        let ports = fixed_ports();
        let prefill_addr = format!("127.0.0.1:{}", ports.map_or(0, |base| base + 2));
        let prefill = MockServer::start(Role::Prefill, &prefill_addr)
            .await
            .expect("mock prefill");
        let dir = repo_root()
            .join("target/envoy-test")
            .join(format!("reload-{label}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("lds")).expect("test dir");
        // Listener ports: N+1 for the first, N+4 and up for the others.
        let named: Vec<(&str, u16, &str)> = listeners
            .iter()
            .enumerate()
            .map(|(i, (name, plugin_config))| {
                let port = ports.map_or(0, |base| match i {
                    0 => base + 1,
                    i => base + 3 + i as u16,
                });
                (*name, port, *plugin_config)
            })
            .collect();
        write_lds(&dir, &lds_yaml(&named, vm_id));
        let decode = if decode_up {
            let addr = format!("127.0.0.1:{}", ports.map_or(0, |base| base + 3));
            Some(
                MockServer::start(Role::Decode, &addr)
                    .await
                    .expect("mock decode"),
            )
        } else {
            None
        };
        let decode_port = decode.as_ref().map_or_else(closed_port, MockServer::port);
        let bootstrap = format!(
            r#"admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}
node: {{ id: reload-test, cluster: reload-test }}
static_resources:
  clusters:
{prefill}{decode}dynamic_resources:
  lds_config:
    resource_api_version: V3
    path_config_source:
      path: {lds}
      watched_directory: {{ path: {lds_dir} }}
"#,
            admin = ports.unwrap_or(0),
            prefill = cluster("prefill", prefill.port()),
            decode = cluster("decode", decode_port),
            lds = dir.join("lds/lds.yaml").display(),
            lds_dir = dir.join("lds").display(),
        );
        let config_path = dir.join("envoy.yaml");
        std::fs::write(&config_path, bootstrap).expect("write bootstrap");
        let admin_path = dir.join("admin-address");
        let log_path = dir.join("envoy.log");
        let log = std::fs::File::create(&log_path).expect("envoy log");
        let mut command = Command::new(envoy_binary());
        command
            .arg("-c")
            .arg(&config_path)
            .args(["--concurrency", "1", "--use-dynamic-base-id", "-l", "info"])
            .args(["--drain-time-s", "1", "--drain-strategy", "immediate"])
            .arg("--admin-address-path")
            .arg(&admin_path)
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        // SAFETY: prctl is async-signal-safe; Envoy goes when the test process does.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .expect("start envoy (make envoy, or ENVOY_BIN)");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "envoy exited with {status}:\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                );
            }
            if let Some((admin_port, listener_ports)) = ports_of(&admin_path, listeners.len()) {
                let listener_port = listener_ports
                    .iter()
                    .find(|(name, _)| name == "openai")
                    .map_or(0, |(_, port)| *port);
                return Dynamic {
                    dir,
                    child,
                    admin_port,
                    listener_port,
                    listener_ports,
                    prefill,
                    _decode: decode,
                };
            }
            assert!(Instant::now() < deadline, "envoy did not come up");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn url(&self, listener: &str, path: &str) -> String {
        let port = self
            .listener_ports
            .iter()
            .find(|(name, _)| name == listener)
            .map(|(_, port)| *port)
            .unwrap_or_else(|| panic!("no listener {listener}"));
        format!("http://127.0.0.1:{port}{path}")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }

    fn stat(&self, name: &str) -> u64 {
        let text = http_get(self.admin_port, "/stats").unwrap_or_default();
        text.lines()
            .filter_map(|line| line.split_once(": "))
            .find(|(stat, _)| *stat == name)
            .and_then(|(_, value)| value.trim().parse().ok())
            .unwrap_or(0)
    }

    fn dropped(&self) -> u64 {
        self.stat("wasmcustom.pd_filter.outcome=.=dropped;.;kv_releases")
    }

    /// Pushes a listener file and waits until Envoy has taken it.
    async fn push(&self, text: &str) {
        let before = self.stat("listener_manager.lds.update_success");
        write_lds(&self.dir, text);
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.stat("listener_manager.lds.update_success") == before {
            assert!(Instant::now() < deadline, "Envoy did not take the update");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `count` clients that leave 150 ms into a prefill of 400 ms; waits until prefill has
    /// issued their KV and their releases' first attempts have failed (decode cannot be
    /// reached).
    async fn clients_leave_during_prefill(&self, count: usize) {
        let issued_before = self.prefill.kv_ledger().issued as usize;
        let client = reqwest::Client::new();
        let url = format!("http://127.0.0.1:{}/v1/completions", self.listener_port);
        let mut left = Vec::new();
        for i in 0..count {
            let body = format!(
                r#"{{"model":"m","prompt":"leaves {i} mock:prefill_delay_ms=400","max_tokens":3}}"#
            );
            let request = client
                .post(&url)
                .header("content-type", "application/json")
                .header("x-request-id", format!("reload-{i}"))
                .body(body)
                .timeout(Duration::from_millis(150))
                .send();
            left.push(tokio::spawn(request));
        }
        for client in left {
            let answer = client.await.expect("client");
            assert!(
                answer.is_err(),
                "answered at once: {answer:?}\n{}",
                self.log()
            );
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while (self.prefill.kv_ledger().issued as usize) < issued_before + count {
            assert!(
                Instant::now() < deadline,
                "prefill issued no KV:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The first attempts have failed: each release now waits to be sent again.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The admin port and the listeners' ports, once `count` listeners are up.
fn ports_of(admin_path: &Path, count: usize) -> Option<(u16, Vec<(String, u16)>)> {
    let admin = std::fs::read_to_string(admin_path).ok()?;
    let admin_port: u16 = admin.trim().rsplit(':').next()?.parse().ok()?;
    let text = http_get(admin_port, "/listeners?format=json")?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    let mut ports = Vec::new();
    for status in value["listener_statuses"].as_array()? {
        let name = status["name"].as_str()?.to_owned();
        let port = status["local_address"]["socket_address"]["port_value"].as_u64()?;
        ports.push((name, u16::try_from(port).ok()?));
    }
    (ports.len() == count).then_some((admin_port, ports))
}

/// Waits until the log shows `line`, or the time is up.
async fn wait_for_line(envoy: &Dynamic, line: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if envoy.log().contains(line) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Headers held until prefill has answered, as shipped: no decode stream for a request in
/// prefill.
const CONFIG: &str = r#"{"decode_cluster":"decode","hold_request_headers":true}"#;

/// A new `vm_config` (here another `vm_id`) ends the old VM once the old listener has
/// drained: its waiting releases are lost, and said to be.
#[tokio::test]
async fn releases_lost_with_a_replaced_vm_are_logged_and_counted() {
    let envoy = Dynamic::start("new-vm", "pd-filter-a", CONFIG).await;
    envoy.clients_leave_during_prefill(3).await;
    let port = envoy.listener_port;
    envoy
        .push(&listener_yaml(port, "pd-filter-b", CONFIG))
        .await;
    assert!(
        wait_for_line(&envoy, LOST_LINE, Duration::from_secs(5)).await,
        "no line says the releases were lost with the VM:\n{}",
        envoy.log()
    );
    let ledger = envoy.prefill.kv_ledger();
    assert_eq!((ledger.issued, ledger.stranded), (3, 3), "{ledger:?}");
    // The new VM's counters are the same stats as the old one's.
    assert_eq!(
        envoy.dropped(),
        3,
        "the lost releases are counted as dropped"
    );
    assert!(!envoy.log().contains("panicked"), "{}", envoy.log());
}

/// The listener removed: the VM goes with it, and the log says what was lost.
#[tokio::test]
async fn releases_lost_with_a_removed_listener_are_logged() {
    let envoy = Dynamic::start("removed", "pd-filter", CONFIG).await;
    envoy.clients_leave_during_prefill(2).await;
    envoy.push("version_info: removed\nresources: []\n").await;
    assert!(
        wait_for_line(&envoy, LOST_LINE, Duration::from_secs(5)).await,
        "no line says the releases were lost with the VM:\n{}",
        envoy.log()
    );
    let line = envoy
        .log()
        .lines()
        .find(|line| line.contains(LOST_LINE))
        .map(str::to_owned)
        .unwrap_or_default();
    assert!(line.contains("2 KV releases"), "{line}");
}

/// A new configuration on the same VM: the old root stays until its releases are done, and
/// nothing is said to be lost.
#[tokio::test]
async fn a_new_configuration_on_the_same_vm_keeps_its_releases() {
    let envoy = Dynamic::start("same-vm", "pd-filter", CONFIG).await;
    envoy.clients_leave_during_prefill(2).await;
    let port = envoy.listener_port;
    envoy
        .push(&listener_yaml(
            port,
            "pd-filter",
            r#"{"decode_cluster":"decode","hold_request_headers":true,"prefill_timeout_ms":60000}"#,
        ))
        .await;
    assert!(
        wait_for_line(
            &envoy,
            "finishing its KV releases first",
            Duration::from_secs(5)
        )
        .await,
        "{}",
        envoy.log()
    );
    assert!(!envoy.log().contains(LOST_LINE), "{}", envoy.log());
    assert_eq!(envoy.dropped(), 0);
}

/// A root still finishing its releases after a new configuration on the same VM goes with
/// the VM when the next configuration needs another: its releases are counted too.
#[tokio::test]
async fn releases_of_a_finishing_root_lost_with_the_vm_are_counted() {
    let envoy = Dynamic::start("finishing", "pd-filter-a", CONFIG).await;
    envoy.clients_leave_during_prefill(2).await;
    let port = envoy.listener_port;
    let same_vm =
        r#"{"decode_cluster":"decode","hold_request_headers":true,"prefill_timeout_ms":60000}"#;
    envoy
        .push(&listener_yaml(port, "pd-filter-a", same_vm))
        .await;
    assert!(
        wait_for_line(
            &envoy,
            "finishing its KV releases first",
            Duration::from_secs(5)
        )
        .await,
        "{}",
        envoy.log()
    );
    envoy.clients_leave_during_prefill(2).await;
    envoy
        .push(&listener_yaml(port, "pd-filter-b", same_vm))
        .await;
    assert!(
        wait_for_line(&envoy, LOST_LINE, Duration::from_secs(5)).await,
        "{}",
        envoy.log()
    );
    let ledger = envoy.prefill.kv_ledger();
    assert_eq!((ledger.issued, ledger.stranded), (4, 4), "{ledger:?}");
    assert_eq!(envoy.dropped(), 4, "{}", envoy.log());
}

/// `max_vm_held_bytes` bounds what a worker's VM holds, whatever the roots in it: two
/// listeners whose filters share a VM (one `vm_id`), or a listener and the one it replaces
/// while the old drains, each have a root, and each root counted only its own requests, so
/// that the VM could hold the budget once per root (README: "what the requests of one Envoy
/// worker may hold in the filter's wasm VM at once").
#[tokio::test]
async fn the_vms_budget_holds_for_every_root_in_the_vm() {
    // Two configurations (the same budget), so two roots in the one worker's VM.
    let config = r#"{"max_request_body_bytes":1048576,"max_vm_held_bytes":2097152}"#;
    let other = r#"{"max_request_body_bytes":1048576,"max_vm_held_bytes":2097152,"prefill_timeout_ms":60000}"#;
    let envoy = Dynamic::start_with(
        "budget",
        &[("openai", config), ("openai-b", other)],
        "pd-filter",
        true,
    )
    .await;
    // Prompt logprobs of a 14,000-token prompt (about 0.9 MB), held in the VM until decode
    // answers: large holdings may fill three quarters of a worker's 2 MiB, room for one.
    let words: Vec<String> = (0..14_000).map(|i| format!("w{i}")).collect();
    let prompt = format!("{} mock:decode_delay_ms=1500", words.join(" "));
    let body =
        serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 3, "prompt_logprobs": 1})
            .to_string();
    let client = reqwest::Client::new();
    let mut replies = Vec::new();
    for listener in [
        "openai", "openai", "openai", "openai-b", "openai-b", "openai-b",
    ] {
        let request = client
            .post(envoy.url(listener, "/v1/completions"))
            .header("content-type", "application/json")
            .body(body.clone())
            .timeout(Duration::from_secs(20))
            .send();
        replies.push(tokio::spawn(async move {
            let reply = request.await.expect("an answer");
            let status = reply.status().as_u16();
            (status, reply.text().await.unwrap_or_default())
        }));
    }
    let mut served = 0;
    for reply in replies {
        let (status, text) = reply.await.expect("client");
        match status {
            200 => served += 1,
            503 => assert!(text.contains("max_vm_held_bytes"), "{text}"),
            status => panic!("{status}: {}", &text[..text.len().min(300)]),
        }
    }
    assert_eq!(served, 1, "one worker's VM held more than its budget");
}

/// A POST of `prompt` to `listener` from `id`: its status, or `None` when the client left
/// after `patience`.
async fn post(
    envoy: &Dynamic,
    listener: &str,
    id: &str,
    prompt: &str,
    patience: Duration,
) -> Option<u16> {
    let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 3}).to_string();
    reqwest::Client::new()
        .post(envoy.url(listener, "/v1/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", id)
        .body(body)
        .timeout(patience)
        .send()
        .await
        .ok()
        .map(|reply| reply.status().as_u16())
}

/// `max_abandoned_prefills_per_client` counts a client's prefills on the worker, whichever
/// root (listener configuration) they came through.
#[tokio::test]
async fn abandoned_prefills_count_for_every_root_in_the_vm() {
    let config = r#"{"max_abandoned_prefills_per_client":2,"hold_request_headers":true}"#;
    let other = r#"{"max_abandoned_prefills_per_client":2,"hold_request_headers":true,"prefill_timeout_ms":60000}"#;
    let envoy = Dynamic::start_with(
        "abandoned",
        &[("openai", config), ("openai-b", other)],
        "pd-filter",
        false,
    )
    .await;
    for i in 0..2 {
        let id = format!("abandons-{i}");
        let left = post(
            &envoy,
            "openai",
            &id,
            "mock:prefill_delay_ms=4000",
            Duration::from_millis(200),
        )
        .await;
        assert_eq!(left, None, "answered within 200 ms");
    }
    let status = post(
        &envoy,
        "openai-b",
        "after-abandons",
        "hello",
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(
        status,
        Some(429),
        "two prefills of this client run on the worker"
    );
    assert!(envoy.prefill.requests_with_id("after-abandons").is_empty());
}

/// A decode pool Envoy cannot connect to is refused before prefill for the worker,
/// whichever root (listener configuration) saw the failures.
#[tokio::test]
async fn a_decode_outage_holds_for_every_root_in_the_vm() {
    let config = r#"{"hold_request_headers":true}"#;
    let other = r#"{"hold_request_headers":true,"prefill_timeout_ms":60000}"#;
    let envoy = Dynamic::start_with(
        "outage",
        &[("openai", config), ("openai-b", other)],
        "pd-filter",
        false,
    )
    .await;
    for i in 0..3 {
        let status = post(
            &envoy,
            "openai",
            &format!("outage-{i}"),
            "hello",
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(status, Some(503), "decode cannot be reached");
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    let status = post(
        &envoy,
        "openai-b",
        "after-outage",
        "hello",
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(status, Some(503));
    assert!(
        envoy.prefill.requests_with_id("after-outage").is_empty(),
        "a prefill spent on a request for a decode pool the worker cannot reach"
    );
}

/// A configuration's summary and warnings are written once for the process when it is
/// pushed, not once per worker, and again when it is pushed again after another.
#[tokio::test]
async fn a_configuration_pushed_again_is_announced_again() {
    const WARNING: &str = "paths lists none of vLLM's own paths";
    let warned =
        r#"{"decode_cluster":"decode","hold_request_headers":true,"paths":["/x/v1/completions"]}"#;
    let envoy = Dynamic::start("announce", "pd-filter", warned).await;
    let count = |envoy: &Dynamic| envoy.log().matches(WARNING).count();
    assert!(
        wait_for_line(&envoy, WARNING, Duration::from_secs(5)).await,
        "{}",
        envoy.log()
    );
    let port = envoy.listener_port;
    envoy.push(&listener_yaml(port, "pd-filter", CONFIG)).await;
    // Past the window in which the workers of one push stay quiet.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        count(&envoy),
        1,
        "once for the first push:\n{}",
        envoy.log()
    );
    envoy.push(&listener_yaml(port, "pd-filter", warned)).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while count(&envoy) < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        count(&envoy),
        2,
        "once again for the second:\n{}",
        envoy.log()
    );
}
