#!/usr/bin/env bash
# Starts the mock vLLM servers in the background and Envoy with the filter in the foreground
# (envoy/envoy.yaml). Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
envoy_bin=${ENVOY:-envoy}

target/debug/mock-vllm --prefill 127.0.0.1:8100 --decode 127.0.0.1:8200 &
mock_pid=$!
trap 'kill $mock_pid 2>/dev/null || true' EXIT

cat <<'MSG'

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
"$envoy_bin" -c envoy/envoy.yaml --concurrency 2 --use-dynamic-base-id -l warn --component-log-level wasm:info
