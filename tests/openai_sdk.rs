//! The OpenAI Python SDK (from PyPI, installed into `.venv` by `make python-deps`) drives all
//! three APIs through the filter, streamed and not, and gets typed errors
//! (scripts/openai_sdk_check.py).

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

#[test]
fn the_openai_sdk_sees_one_vllm() {
    let h = harness();
    let base_url = h.url("default", "/v1");
    let output = Command::new(python())
        .arg(repo_root().join("scripts/openai_sdk_check.py"))
        .arg(&base_url)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {:?} ({e}); run `make python-deps`", python()));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the SDK check failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.lines().all(|line| line.starts_with("ok ")),
        "{stdout}"
    );
}
