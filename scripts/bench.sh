#!/usr/bin/env bash
# make bench: the cost of the filter, on loopback, in one go (a full run takes about 15 minutes).
#
#   1. native micro-benchmark of the rewrite and the injection (benches/rewrite.rs), MB/s;
#   2. one bench backend (mock-vllm/src/bin/bench-backend.rs: reads the whole body, then
#      answers as prefill or decode, decode with server-sent events when the body asks for a
#      stream; a decode port and a prefill port), one Envoy (bench/envoy-bench.yaml) with a
#      plain-route listener and three filter listeners (the defaults, `filter`; "usage":"decode",
#      `merge_off`; "release_kv_on_abandon":false, `release_off`), and vllm-router (PyPI
#      `vllm-router`, in its own venv) in P/D mode, all routed to that backend;
#   3. for each workload and each of its targets (targets_for below): wrk at 1 connection
#      (p50, p99) and at 32 connections (requests/s, p99, CPU seconds per 1,000 requests of the
#      proxy process, Envoy or vllm-router, from /proc); all of it BENCH_REPS times,
#      interleaved, so ratios are taken within one repetition and medians over the repetitions.
#      The workloads: the chat body at each size of BENCH_SIZES (1 KB, 64 KB, 1 MB) against the
#      backend directly, Envoy's plain route, `filter`, `release_off` and vllm-router, plus
#      `merge_off` at 1 KB; and, when 1 KB is among the sizes, `1KB-stream` (the 1 KB body with
#      "stream":true and the usage chunk asked for, its answer in one piece) and `1KB-tokens`
#      (the same, its 16 events 2 ms apart, each a chunk of its own as tokens come) against the
#      plain route, `filter` and `merge_off`;
#   4. memory: Envoy's RSS and the filter's wasm linear memory before and after each target's
#      first 1 MB load, then before and after a long run (BENCH_SOAK_SECS);
#   5. the table, the ratios against the targets and what usage merging and KV release
#      tracking cost (bench/report.py).
#
# Environment (all optional): ENVOY (binary), BENCH_REPS (3), BENCH_C1_SECS (3),
# BENCH_C32_SECS (5), BENCH_SOAK_SECS (120), BENCH_CONNS (32), BENCH_CONCURRENCY (Envoy
# workers, 1), BENCH_PIN (1: Envoy on CPU 1, backend and wrk on CPU 0), BENCH_MICRO (1),
# BENCH_SIZES ("1KB:1024 64KB:65536 1MB:1048576"; LABEL:BYTES; without a 1KB entry there is
# neither `merge_off` nor `1KB-stream`), BENCH_PORT_BASE (19000; it and the next four ports,
# +100, +101, +901 and +902 are used), BENCH_OUT
# (target/bench), BENCH_ROUTER (1: measure vllm-router too), BENCH_ROUTER_VERSION (0.1.17),
# BENCH_VENV (target/bench-venv: where pip installs vllm-router). Raw figures land in
# $BENCH_OUT/*.tsv.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

envoy_bin=${ENVOY:-$(command -v envoy || echo "$root/.venv/bin/envoy")}
reps=${BENCH_REPS:-3}
c1_secs=${BENCH_C1_SECS:-3}
c32_secs=${BENCH_C32_SECS:-5}
soak_secs=${BENCH_SOAK_SECS:-120}
conns=${BENCH_CONNS:-32}
concurrency=${BENCH_CONCURRENCY:-1}
pin=${BENCH_PIN:-1}
micro=${BENCH_MICRO:-1}
sizes=${BENCH_SIZES:-"1KB:1024 64KB:65536 1MB:1048576"}
port_base=${BENCH_PORT_BASE:-19000}
out=${BENCH_OUT:-$root/target/bench}
router=${BENCH_ROUTER:-1}
router_version=${BENCH_ROUTER_VERSION:-0.1.17}
venv=${BENCH_VENV:-$root/target/bench-venv}
wasm=$root/target/wasm32-wasip1/release/pd_filter.wasm
path=/v1/chat/completions

plain_port=$port_base
filter_port=$((port_base + 1))
router_port=$((port_base + 2))
merge_off_port=$((port_base + 3))
release_off_port=$((port_base + 4))
backend_port=$((port_base + 100))
prefill_port=$((port_base + 101))
admin_port=$((port_base + 901))
router_metrics_port=$((port_base + 902))

say() { printf '[bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 1; }

# --- prerequisites --------------------------------------------------------------------------
if ! command -v wrk >/dev/null; then
    say "wrk not found: installing it (apt-get install wrk)"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq wrk >/dev/null
    else
        die "install wrk (Debian/Ubuntu: sudo apt-get install wrk)"
    fi
fi
[ -x "$envoy_bin" ] || die "no envoy at $envoy_bin (make envoy)"
[ -f "$wasm" ] || die "no filter at $wasm (make build)"
command -v python3 >/dev/null || die "python3 is needed for the report"
for port in $plain_port $filter_port $router_port $merge_off_port $release_off_port \
    $backend_port $prefill_port $admin_port $router_metrics_port; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        die "port $port is in use (set BENCH_PORT_BASE)"
    fi
done
if [ "$pin" = 1 ] && [ "$(nproc)" -ge 2 ] && command -v taskset >/dev/null; then
    on_envoy_cpu=(taskset -c 1)
    on_load_cpu=(taskset -c 0)
    placement="Envoy and vllm-router pinned to CPU 1; backend and wrk pinned to CPU 0"
else
    on_envoy_cpu=()
    on_load_cpu=()
    placement="no CPU pinning"
fi

rm -rf "$out"
mkdir -p "$out"

# vllm-router, the peer: its own venv, so that nothing else on the machine changes. When it
# cannot be installed or started, the bench goes on without it and the report says why.
router_note=""
router_bin=$venv/bin/vllm-router
if [ "$router" = 1 ]; then
    if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm-router") != sys.argv[1])' \
        "$router_version" 2>/dev/null; then
        say "installing vllm-router $router_version into $venv"
        { [ -x "$venv/bin/python" ] || python3 -m venv "$venv"; } >"$out/router-install.log" 2>&1 &&
            "$venv/bin/pip" install --quiet "vllm-router==$router_version" >>"$out/router-install.log" 2>&1 ||
            router_note="vllm-router $router_version could not be installed: $(tail -n1 "$out/router-install.log")"
    fi
    if [ -z "$router_note" ] && ! [ -x "$router_bin" ]; then
        router_note="no vllm-router executable in $venv/bin"
    fi
else
    router_note="not measured (BENCH_ROUTER=0)"
fi
[ -z "$router_note" ] || say "vllm-router: $router_note"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
say "building the bench backend"
cargo build --quiet --release -p mock-vllm --bin bench-backend
backend_bin=$root/target/release/bench-backend

# --- 1. native micro-benchmark ----------------------------------------------------------------
: >"$out/micro.tsv"
: >"$out/timing.tsv"
if [ "$micro" = 1 ]; then
    for rep in $(seq 1 "$reps"); do
        say "micro-benchmark, repetition $rep/$reps (cargo bench --bench rewrite)"
        "${on_envoy_cpu[@]}" cargo bench --quiet --bench rewrite -- \
            --warm-up-time 0.5 --measurement-time 2 --sample-size 30 \
            >"$out/criterion-$rep.log" 2>&1 || die "cargo bench failed: $out/criterion-$rep.log"
        for entry in $sizes; do
            label=${entry%%:*}
            bytes=${entry##*:}
            for fn in scan prepare inject pd_request; do
                est=$root/target/criterion/$label/$fn/new/estimates.json
                [ -f "$est" ] || continue
                ns=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["median"]["point_estimate"])' "$est")
                printf '%s\t%s\t%s\t%s\t%s\n' "$rep" "$label" "$bytes" "$fn" "$ns" >>"$out/micro.tsv"
            done
        done
        # The same work natively and as wasm32 under Node's WASI (src/timing.rs).
        say "native and wasm32 timing, repetition $rep/$reps (src/timing.rs)"
        for runner in native wasm32; do
            if [ "$runner" = native ]; then
                cmd=(cargo test --release -p pd-filter --lib timing)
            else
                cmd=(env "CARGO_TARGET_WASM32_WASIP1_RUNNER=node --no-warnings $root/scripts/wasi-runner.mjs"
                    cargo test --release --target wasm32-wasip1 -p pd-filter --lib timing)
            fi
            "${on_envoy_cpu[@]}" "${cmd[@]}" -- --ignored --nocapture --test-threads 1 \
                >"$out/timing-$runner-$rep.log" 2>&1 || die "timing harness failed: $out/timing-$runner-$rep.log"
            awk -v rep="$rep" 'sub(/^.*TIMING /, "TIMING ") { printf "%s\t%s\t%s\t%s\t%s\t%s\n", rep, $2, $3, $4, $5, $6 }' \
                "$out/timing-$runner-$rep.log" >>"$out/timing.tsv"
        done
    done
fi

# --- 2. backend and Envoy ---------------------------------------------------------------------
# The workloads, LABEL:BYTES: the sizes, and the 1 KB body streamed right after the 1 KB one,
# in one piece (1KB-stream) and one event per chunk as tokens come (1KB-tokens).
workloads=""
for entry in $sizes; do
    workloads="$workloads $entry"
    [ "${entry%%:*}" = 1KB ] && workloads="$workloads 1KB-stream:${entry##*:} 1KB-tokens:${entry##*:}"
done
workloads=${workloads# }
for entry in $workloads; do
    label=${entry%%:*}
    case $label in
        *-stream | *-tokens) "$backend_bin" body "${entry##*:}" "$out/body-$label.json" stream ;;
        *) "$backend_bin" body "${entry##*:}" "$out/body-$label.json" ;;
    esac
done

pids=()
cleanup() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT

"${on_load_cpu[@]}" "$backend_bin" serve "127.0.0.1:$backend_port,127.0.0.1:$prefill_port" 1 \
    >"$out/backend.log" 2>&1 &
backend_pid=$!
pids+=("$backend_pid")

sed -e "s|@ADMIN_PORT@|$admin_port|" -e "s|@PLAIN_PORT@|$plain_port|" \
    -e "s|@FILTER_PORT@|$filter_port|" -e "s|@MERGE_OFF_PORT@|$merge_off_port|" \
    -e "s|@RELEASE_OFF_PORT@|$release_off_port|" -e "s|@BACKEND_PORT@|$backend_port|" \
    -e "s|@PREFILL_PORT@|$prefill_port|" \
    -e "s|@WASM@|$wasm|" bench/envoy-bench.yaml >"$out/envoy.yaml"
"${on_envoy_cpu[@]}" "$envoy_bin" -c "$out/envoy.yaml" --concurrency "$concurrency" \
    --use-dynamic-base-id -l warn >"$out/envoy.log" 2>&1 &
envoy_pid=$!
pids+=("$envoy_pid")

for _ in $(seq 1 100); do
    if [ "$(curl -s "http://127.0.0.1:$admin_port/ready" 2>/dev/null)" = LIVE ] &&
        curl -s -o /dev/null "http://127.0.0.1:$backend_port/stats" 2>/dev/null; then
        break
    fi
    kill -0 "$envoy_pid" 2>/dev/null || die "envoy exited: $out/envoy.log"
    sleep 0.2
done
[ "$(curl -s "http://127.0.0.1:$admin_port/ready")" = LIVE ] || die "envoy is not ready: $out/envoy.log"

# vllm-router in P/D mode against the same backend: prefill and decode on distinct ports
# (it keys workers by URL), round-robin (the cheapest policy; the default, cache_aware, keeps
# a prefix tree of every prompt), warnings only (Envoy runs at -l warn), its Prometheus
# listener moved off the default port.
router_pid=""
if [ -z "$router_note" ]; then
    "${on_envoy_cpu[@]}" "$router_bin" --vllm-pd-disaggregation \
        --prefill "http://127.0.0.1:$prefill_port" --decode "http://127.0.0.1:$backend_port" \
        --host 127.0.0.1 --port "$router_port" --policy round_robin --log-level warning \
        --prometheus-host 127.0.0.1 --prometheus-port "$router_metrics_port" \
        >"$out/router.log" 2>&1 &
    router_pid=$!
    pids+=("$router_pid")
    for _ in $(seq 1 150); do
        code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$router_port/health" 2>/dev/null) || true
        [ "$code" = 200 ] && break
        kill -0 "$router_pid" 2>/dev/null || break
        sleep 0.2
    done
    if [ "${code:-}" != 200 ]; then
        router_note="vllm-router did not start: $(grep -v '^\s*$' "$out/router.log" | tail -n1)"
        say "vllm-router: $router_note"
        kill "$router_pid" 2>/dev/null || true
        router_pid=""
    fi
fi

stats() { curl -s "http://127.0.0.1:$backend_port/stats"; }
stat_field() { python3 -c 'import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"; }
# utime + stime of the whole process (all threads), in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
memory() { python3 "$root/bench/report.py" memory "${1:-$envoy_pid}"; }
clk_tck=$(getconf CLK_TCK)

port_of() {
    case $1 in
        direct) echo "$backend_port" ;;
        plain) echo "$plain_port" ;;
        filter) echo "$filter_port" ;;
        merge_off) echo "$merge_off_port" ;;
        release_off) echo "$release_off_port" ;;
        router) echo "$router_port" ;;
    esac
}
# The targets of a workload, in the order they run. The filter's variants run next to it, so
# that each A/B pair is measured minutes apart at most. release_off (no KV release tracking)
# at every size: what tracking costs requests whose clients stay. merge_off (decode's usage
# as it is) at 1 KB, JSON and streamed: what the usage merge costs. The stream goes through
# the proxies only.
targets_for() {
    local router_target=""
    [ -n "$router_pid" ] && router_target=" router"
    case $1 in
        1KB) echo "direct plain filter merge_off release_off$router_target" ;;
        *-stream | *-tokens) echo "plain filter merge_off" ;;
        *) echo "direct plain filter release_off$router_target" ;;
    esac
}
# The milliseconds between a tokens workload's events (the bench backend's
# x-bench-event-gap-ms): each reaches Envoy as a chunk of its own, as from a generating vLLM.
event_gap_ms=2
# The request header that asks for it, for a workload that does; none for the others.
gap_header_of() {
    case $1 in *-tokens) echo "x-bench-event-gap-ms: $event_gap_ms" ;; *) echo "" ;; esac
}
# Targets doing P/D: the backend must see one prefill and one decode with its KV per request.
is_pd() {
    case $1 in filter | merge_off | release_off | router) return 0 ;; *) return 1 ;; esac
}
# The process whose CPU a target costs: Envoy, or vllm-router; none for the backend.
proxy_pid_of() {
    case $1 in
        router) echo "$router_pid" ;;
        *) echo "$envoy_pid" ;;
    esac
}

# "prompt_tokens cached_tokens" of the usage chunk in a file of server-sent events.
usage_of() {
    python3 -c 'import json, sys
for line in open(sys.argv[1]):
    if line.startswith("data: {") and "\"usage\"" in line:
        u = json.loads(line[6:])["usage"]
        print(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])' "$1"
}

# Sanity: each target answers 200 for each workload, and through the filters and the router
# decode gets the KV parameters prefill issued. A streamed request comes back as server-sent
# events to the end, and the usage chunk through `filter` carries prefill's prompt counts,
# through `merge_off` decode's.
for entry in $workloads; do
    label=${entry%%:*}
    for target in $(targets_for "$label"); do
        port=$(port_of "$target")
        before=$(stats)
        answer=$out/sanity-$label-$target.txt
        extra_header=()
        [ -n "$(gap_header_of "$label")" ] && extra_header=(-H "$(gap_header_of "$label")")
        reply=$(curl -s -m 60 -o "$answer" -w '%{http_code} %{content_type}' "http://127.0.0.1:$port$path" \
            -H 'content-type: application/json' "${extra_header[@]}" \
            --data-binary "@$out/body-$label.json") && rc=0 || rc=$?
        [ "$rc" = 0 ] || die "$label to $target (port $port): curl exit status $rc (28: no complete answer in 60 s)"
        [ "${reply%% *}" = 200 ] || die "$label to $target (port $port) answered ${reply%% *}: $(head -c 300 "$answer")"
        if is_pd "$target"; then
            after=$(stats)
            kv=$(($(stat_field "$after" decode_with_kv) - $(stat_field "$before" decode_with_kv)))
            pf=$(($(stat_field "$after" prefill) - $(stat_field "$before" prefill)))
            [ "$kv" = 1 ] && [ "$pf" = 1 ] || die "$label through $target: prefill $pf, decode with kv $kv"
        fi
        case $label in
            *-stream | *-tokens)
                case ${reply#* } in
                    text/event-stream*) ;;
                    *) die "$label through $target: content-type ${reply#* }, not text/event-stream" ;;
                esac
                [ "$(tail -c 14 "$answer")" = "data: [DONE]" ] ||
                    die "$label through $target: no [DONE] at the end: $(tail -c 300 "$answer")"
                ;;
        esac
    done
    case $label in
        *-stream | *-tokens)
            merged=$(usage_of "$out/sanity-$label-filter.txt")
            unmerged=$(usage_of "$out/sanity-$label-merge_off.txt")
            [ -n "$merged" ] && [ -n "$unmerged" ] && [ "$merged" != "$unmerged" ] ||
                die "$label: usage (prompt_tokens cached_tokens) through filter '$merged', through merge_off '$unmerged': no merge seen"
            say "$label usage chunk (prompt_tokens cached_tokens): filter $merged, merge_off $unmerged"
            ;;
    esac
done
say "sanity checks passed; Envoy $("$envoy_bin" --version | grep -o '[0-9]*\.[0-9]*\.[0-9]*/[A-Za-z]*' | head -1), --concurrency $concurrency; $placement"
for entry in $workloads; do
    say "  ${entry%%:*}: $(targets_for "${entry%%:*}")"
done

# One wrk run: target size conns secs rep phase -> a line of results.tsv
printf 'phase\trep\ttarget\tsize\tconns\tsecs\trequests\tduration_us\tp50_us\tp99_us\tmean_us\terrors\tproxy_cpu_s\tbackend_cpu_s\tprefill\tdecode_kv\tdecode_plain\trss_kb\thwm_kb\twasm_kb\n' >"$out/results.tsv"
run() {
    local target=$1 label=$2 nconns=$3 secs=$4 rep=$5 phase=$6 port proxy_pid
    port=$(port_of "$target")
    proxy_pid=$(proxy_pid_of "$target")
    echo 5 >"/proc/$proxy_pid/clear_refs" 2>/dev/null || true # reset VmHWM
    local s0 e0 b0 line s1 e1 b1 mem
    s0=$(stats)
    e0=$(cpu_ticks "$proxy_pid")
    b0=$(cpu_ticks "$backend_pid")
    line=$(BENCH_BODY="$out/body-$label.json" BENCH_PATH=$path BENCH_HEADER="$(gap_header_of "$label")" \
        "${on_load_cpu[@]}" \
        wrk -t1 -c"$nconns" -d"${secs}s" --timeout 30s -s bench/post.lua \
        "http://127.0.0.1:$port" | grep '^BENCH ') || die "wrk failed ($target $label c$nconns)"
    e1=$(cpu_ticks "$proxy_pid")
    b1=$(cpu_ticks "$backend_pid")
    s1=$(stats)
    mem=$(memory "$proxy_pid")
    python3 - "$phase" "$rep" "$target" "$label" "$nconns" "$secs" "$line" "$e0" "$e1" "$b0" "$b1" \
        "$clk_tck" "$s0" "$s1" "$mem" >>"$out/results.tsv" <<'PY'
import json, sys
phase, rep, target, label, conns, secs, line, e0, e1, b0, b1, tck, s0, s1, mem = sys.argv[1:]
f = dict(kv.split("=") for kv in line.split()[1:])
s0, s1 = json.loads(s0), json.loads(s1)
d = {k: s1[k] - s0[k] for k in ("prefill", "decode_with_kv", "decode_without_kv")}
errors = sum(int(f[k]) for k in f if k.startswith("err_"))
rss, hwm, wasm = mem.split()
row = [phase, rep, target, label, conns, secs, f["requests"], f["duration_us"], f["p50_us"],
       f["p99_us"], f["mean_us"], errors, (int(e1) - int(e0)) / int(tck),
       (int(b1) - int(b0)) / int(tck), d["prefill"], d["decode_with_kv"], d["decode_without_kv"],
       rss, hwm, wasm]
print("\t".join(str(x) for x in row))
PY
    tail -n1 "$out/results.tsv" | awk -F'\t' -v t="$target" -v s="$label" -v c="$nconns" \
        '{ printf "  %-11s %-10s c%-3s %7.0f req/s  p50 %8.2f ms  p99 %8.2f ms  proxy %.2f CPU-s/1000  errors %s\n",
           t, s, c, $7 / ($8 / 1e6), $9 / 1000, $10 / 1000, ($7 > 0 ? $13 * 1000 / $7 : 0), $12 }' >&2
}

# --- 3. latency and throughput ----------------------------------------------------------------
printf 'when\trss_kb\thwm_kb\twasm_kb\n' >"$out/memory.tsv"
echo "start	$(memory)" >>"$out/memory.tsv"
for rep in $(seq 1 "$reps"); do
    for entry in $workloads; do
        label=${entry%%:*}
        say "repetition $rep/$reps, $label"
        for target in $(targets_for "$label"); do
            if [ "$rep" = 1 ]; then
                # The first 1 MB load of each target: Envoy's memory just before and just
                # after it, so that each target's growth is its own (linear memory is per VM
                # and the other VMs are idle meanwhile).
                if [ "$label" = 1MB ]; then
                    echo "before_warmup_1MB_$target	$(memory)" >>"$out/memory.tsv"
                fi
                run "$target" "$label" "$conns" 1 "$rep" warmup 2>/dev/null
                if [ "$label" = 1MB ]; then
                    echo "after_warmup_1MB_$target	$(memory)" >>"$out/memory.tsv"
                fi
            fi
            run "$target" "$label" 1 "$c1_secs" "$rep" c1
            run "$target" "$label" "$conns" "$c32_secs" "$rep" c32
        done
    done
done

# --- 4. memory over a long run ----------------------------------------------------------------
if [ "$soak_secs" -gt 0 ]; then
    soak_size=64KB
    case " $sizes " in *" 64KB:"*) ;; *) soak_size=${sizes%%:*} ;; esac
    echo "soak_before	$(memory)" >>"$out/memory.tsv"
    segments=4
    for segment in $(seq 1 $segments); do
        say "long run through the filter, $soak_size at $conns connections: part $segment/$segments"
        run filter "$soak_size" "$conns" $((soak_secs / segments)) "$segment" soak
        echo "soak_$segment	$(memory)" >>"$out/memory.tsv"
    done
fi
kill -0 "$envoy_pid" 2>/dev/null || die "envoy died during the bench: $out/envoy.log"
if [ -n "$router_pid" ] && ! kill -0 "$router_pid" 2>/dev/null; then
    die "vllm-router died during the bench: $out/router.log"
fi

# --- 5. report --------------------------------------------------------------------------------
{
    echo "machine: $(nproc) CPUs, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(uname -sr)"
    echo "envoy: $("$envoy_bin" --version 2>/dev/null | grep -o 'version: .*' | head -1), --concurrency $concurrency, wasm runtime v8; $placement"
    echo "other load on the machine (1/5/15-min load average, this bench included): $load_before at the start, $(cut -d' ' -f1-3 /proc/loadavg) at the end"
    echo "load: wrk -t1, $c1_secs s at 1 connection, $c32_secs s at $conns connections, $reps repetitions; backend: bench-backend (1 thread)"
    if [ -n "$router_pid" ]; then
        echo "vllm-router $router_version (PyPI), --vllm-pd-disaggregation, --policy round_robin, --log-level warning, $(ls "/proc/$router_pid/task" | wc -l) threads"
    else
        echo "vllm-router: $router_note"
    fi
} >"$out/setup.txt"
python3 bench/report.py report "$out" | tee "$out/report.md"
