//! The README's first command, `make run` (`scripts/run-local.sh` once the filter and the mock
//! servers are built): the stack it starts serves every `curl` command it prints, each with
//! the status the script says. Run on ports of its own (`PD_*_PORT`), so that it never meets
//! a `make run` of the user's or another test.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{closed_port, envoy_binary, repo_root, wasm_path};

/// The script and what it started (its process group), stopped when the test ends.
struct RunLocal(Child);

impl Drop for RunLocal {
    fn drop(&mut self) {
        let group = format!("-{}", self.0.id());
        let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.0.wait();
    }
}

/// The mock servers' binary, as `make run` builds it before it starts the script.
fn build_mock_binary(root: &Path) {
    let status = Command::new(env!("CARGO"))
        .args(["build", "-q", "-p", "mock-vllm"])
        .env("CARGO_TARGET_DIR", root.join("target"))
        .current_dir(root)
        .status()
        .expect("cargo build -p mock-vllm");
    assert!(status.success(), "cargo build -p mock-vllm failed");
}

/// The shell commands the script printed: each `curl` line with its continuation lines.
fn printed_commands(banner: &str) -> Vec<String> {
    let mut commands: Vec<String> = Vec::new();
    let mut continues = false;
    for line in banner.lines() {
        let line = line.trim();
        if continues {
            if let Some(command) = commands.last_mut() {
                command.push(' ');
                command.push_str(line.trim_end_matches('\\'));
            }
        } else if line.starts_with("curl ") {
            commands.push(line.trim_end_matches('\\').to_string());
        } else {
            continue;
        }
        continues = line.ends_with('\\');
    }
    commands
}

#[test]
fn make_run_serves_every_command_it_prints_on_ports_of_its_own() {
    let root = repo_root();
    wasm_path();
    build_mock_binary(&root);
    let [listen, admin, prefill, decode] = [(); 4].map(|()| closed_port());

    let mut child = Command::new("bash")
        .arg(root.join("scripts/run-local.sh"))
        .current_dir(&root)
        .env("ENVOY", envoy_binary())
        .env("PD_LISTEN_PORT", listen.to_string())
        .env("PD_ADMIN_PORT", admin.to_string())
        .env("PD_PREFILL_PORT", prefill.to_string())
        .env("PD_DECODE_PORT", decode.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("scripts/run-local.sh");
    let stdout = child.stdout.take().expect("the script's output");
    let _stack = RunLocal(child);

    // The banner ends with the hint about prefill's KV ledger. The output is read to its end
    // meanwhile: the mocks print to it after the banner, and die if nobody reads it.
    let (lines, received) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let mut banner = String::new();
    while let Ok(line) = received.recv_timeout(Duration::from_secs(60)) {
        banner.push_str(&line);
        banner.push('\n');
        if line.contains("/mock/kv") {
            break;
        }
    }
    for default in [":10000", ":9901", ":8100", ":8200"] {
        assert!(
            !banner.contains(default),
            "the script printed a default port ({default}) though others were asked for:\n{banner}"
        );
    }
    assert!(
        banner.contains(&format!("http://127.0.0.1:{listen}/v1/")),
        "{banner}"
    );

    let ready = format!("http://127.0.0.1:{admin}/ready");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let answer = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", &ready])
            .output()
            .expect("curl (the README's commands use it)");
        if answer.stdout == b"200" {
            break;
        }
        assert!(Instant::now() < deadline, "Envoy was not ready within 60 s");
        std::thread::sleep(Duration::from_millis(200));
    }

    let commands = printed_commands(&banner);
    assert_eq!(commands.len(), 8, "the script's curl commands:\n{banner}");
    for command in &commands {
        let answer = Command::new("bash")
            .arg("-c")
            .arg(format!("{command} -w '\\n%{{http_code}}'"))
            .output()
            .expect("bash");
        let output = String::from_utf8_lossy(&answer.stdout);
        let status = output.rsplit('\n').next().unwrap_or_default();
        // The last command is the script's example of an error: prefill refuses it.
        let expected = if command.contains("mock:prefill_status=400") {
            "400"
        } else {
            "200"
        };
        assert_eq!(status, expected, "{command}\n{output}");
    }

    let ledger = Command::new("curl")
        .args(["-s", &format!("http://127.0.0.1:{prefill}/mock/kv")])
        .output()
        .expect("curl");
    let ledger: serde_json::Value =
        serde_json::from_slice(&ledger.stdout).expect("prefill's KV ledger as JSON");
    // Seven commands ran as P/D; the refused one issued no KV.
    assert_eq!(ledger["issued"], 7, "{ledger}");
    assert_eq!(ledger["read"], 7, "{ledger}");
    assert_eq!(ledger["stranded"], 0, "{ledger}");
}
