#!/usr/bin/env bash
# Starts the mock vLLM servers in the background and Envoy with the filter in the foreground
# (envoy/envoy.yaml). Ctrl-C stops both.
#
# Ports: PD_LISTEN_PORT (10000), PD_ADMIN_PORT (9901), PD_PREFILL_PORT (8100) and
# PD_DECODE_PORT (8200) move them, for a machine where one is taken; Envoy then runs a copy
# of envoy/envoy.yaml with those ports.
set -euo pipefail
cd "$(dirname "$0")/.."
envoy_bin=${ENVOY:-envoy}
listen=${PD_LISTEN_PORT:-10000}
admin=${PD_ADMIN_PORT:-9901}
prefill=${PD_PREFILL_PORT:-8100}
decode=${PD_DECODE_PORT:-8200}
for port in "$listen" "$admin" "$prefill" "$decode"; do
  [[ $port =~ ^[1-9][0-9]{0,4}$ && $port -le 65535 ]] || {
    echo "run-local.sh: \"$port\" is not a port number" >&2
    exit 2
  }
done

# Writes stdin with the default ports (after `prefix`) replaced, in one pass, so that a
# chosen port that is another's default is not replaced again.
with_ports() {
  local prefix=$1
  sed -e "s/${prefix}10000\b/${prefix}@listen@/g" -e "s/${prefix}9901\b/${prefix}@admin@/g" \
    -e "s/${prefix}8100\b/${prefix}@prefill@/g" -e "s/${prefix}8200\b/${prefix}@decode@/g" |
    sed -e "s/@listen@/$listen/g" -e "s/@admin@/$admin/g" -e "s/@prefill@/$prefill/g" \
      -e "s/@decode@/$decode/g"
}

config=envoy/envoy.yaml
cleanup() { kill "${mock_pid:-}" 2>/dev/null || true; }
if [[ $listen != 10000 || $admin != 9901 || $prefill != 8100 || $decode != 8200 ]]; then
  # Envoy reads a configuration's format from its extension: a directory holds the .yaml
  # (BSD mktemp has no --suffix).
  config_dir=$(mktemp -d "${TMPDIR:-/tmp}/pd-filter-envoy-XXXXXX")
  config=$config_dir/envoy.yaml
  cleanup() { kill "${mock_pid:-}" 2>/dev/null || true; rm -rf "$config_dir"; }
  with_ports "port_value: " <envoy/envoy.yaml >"$config"
fi
trap cleanup EXIT

target/debug/mock-vllm --prefill "127.0.0.1:$prefill" --decode "127.0.0.1:$decode" &
mock_pid=$!

with_ports ":" <<'MSG'

pd-filter is starting: clients talk to Envoy on http://127.0.0.1:10000 (admin on :9901).
Try, from another terminal:

  curl -si http://127.0.0.1:10000/v1/completions -H 'content-type: application/json' \
    -d '{"model":"mock-model","prompt":"Once upon a time","max_tokens":8}'

  curl -s http://127.0.0.1:10000/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model":"mock-model","messages":[{"role":"user","content":"Hello there"}],"max_tokens":8}'

  curl -sN http://127.0.0.1:10000/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model":"mock-model","messages":[{"role":"user","content":"Stream it"}],"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}'

  curl -s http://127.0.0.1:10000/v1/responses -H 'content-type: application/json' \
    -d '{"model":"mock-model","input":"Tell me a story","max_output_tokens":8}'

  curl -s http://127.0.0.1:10000/v1/messages -H 'content-type: application/json' \
    -d '{"model":"mock-model","messages":[{"role":"user","content":"Hi from Anthropic style"}],"max_tokens":8}'

  curl -s http://127.0.0.1:10000/inference/v1/generate -H 'content-type: application/json' \
    -d '{"token_ids":[101,2023,2003],"sampling_params":{"max_tokens":8}}'

  curl -s http://127.0.0.1:10000/cohere/v2/chat -H 'content-type: application/json' \
    -d '{"model":"mock-model","messages":[{"role":"user","content":"Hi from Cohere style"}],"max_tokens":8}'

  # An error: prefill refuses (the mocks obey mock:* directives in the body, see README)
  curl -s http://127.0.0.1:10000/v1/completions -H 'content-type: application/json' \
    -d '{"model":"mock-model","prompt":"fail mock:prefill_status=400","max_tokens":8}'

The x-mock-kv response header (the first command shows the headers) says whether decode
reused prefill's KV ("reused").
What each mock received: curl -s http://127.0.0.1:8100/mock/requests (prefill), :8200 (decode);
prefill's KV issued and read: curl -s http://127.0.0.1:8100/mock/kv.

MSG
"$envoy_bin" -c "$config" --concurrency 2 --use-dynamic-base-id -l warn --component-log-level wasm:info
