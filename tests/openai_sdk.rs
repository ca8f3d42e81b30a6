//! The OpenAI Python SDK (from PyPI, installed into `.venv` by `make python-deps`) drives all
//! three OpenAI APIs through the filter, streamed and not, and gets typed errors
//! (scripts/openai_sdk_check.py); the Anthropic SDK does the same with vLLM's `/v1/messages`
//! (scripts/anthropic_sdk_check.py). Other clients users run (vLLM's benchmark client's
//! stream reading over aiohttp, httpx over HTTP/2, the SDK's retries and timeouts) are
//! driven by scripts/clients_check.py.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{harness, repo_root};

/// `PD_PYTHON`, else the repository's `.venv`, where `make python-deps` puts the SDK.
fn python() -> PathBuf {
    std::env::var_os("PD_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/python"))
}

/// Runs a check script of `scripts/` with `args` (the base URL first); every line it prints
/// must be an `ok`.
fn run_check(script: &str, args: &[&str]) {
    let output = Command::new(python())
        .arg(repo_root().join("scripts").join(script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {:?} ({e}); run `make python-deps`", python()));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{script} failed:\n{stdout}\n{stderr}"
    );
    assert!(
        !stdout.trim().is_empty() && stdout.lines().all(|line| line.starts_with("ok ")),
        "{stdout}"
    );
}

#[test]
fn the_openai_sdk_sees_one_vllm() {
    run_check("openai_sdk_check.py", &[&harness().url("default", "/v1")]);
}

#[test]
fn the_anthropic_sdk_sees_one_vllm() {
    run_check("anthropic_sdk_check.py", &[&harness().url("default", "")]);
}

#[test]
fn other_clients_see_one_vllm_and_leave_no_kv_behind() {
    let harness = harness();
    let prefill = format!("http://127.0.0.1:{}", harness.prefill.port());
    let decode = format!("http://127.0.0.1:{}", harness.decode.port());
    run_check(
        "clients_check.py",
        &[&harness.url("default", ""), &prefill, &decode],
    );
}
