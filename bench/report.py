#!/usr/bin/env python3
"""Helper of scripts/bench.sh.

  report.py memory PID   Envoy's memory: "RSS_KB HWM_KB WASM_KB", where WASM_KB is the size of
                         the wasm linear memories (V8 reserves 8 GiB per memory and makes the
                         used part read-write: the rw mapping right below each reservation).
                         Linear memory never shrinks: it is the filter heap's high-water mark.
  report.py report DIR   the tables and ratios from DIR/results.tsv, micro.tsv, memory.tsv.
"""

import csv
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

TARGETS = [("direct", "backend directly"), ("plain", "Envoy, plain route"), ("filter", "Envoy + pd-filter"),
           ("merge_off", "Envoy + pd-filter, usage: decode"),
           ("release_off", "Envoy + pd-filter, release_kv_on_abandon: false"),
           ("router", "vllm-router (P/D)")]
# Targets that do prefill/decode: the backend sees one prefill and one decode with KV per request.
PD_TARGETS = ("filter", "merge_off", "release_off", "router")
# filter CPU / (2 x plain CPU), per body size; none for the streamed workload.
CPU_TARGET = {"1KB": 1.15, "64KB": 1.15, "1MB": 1.3}
# What a feature may add to the filter's CPU per request: feature on / feature off.
FEATURE_TARGET = 1.05
MIB = 1024 * 1024


def memory(pid):
    maps = []
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+)", line)
            if m:
                maps.append((int(m.group(1), 16), int(m.group(2), 16), m.group(3)))
    wasm = 0
    for below, above in zip(maps, maps[1:]):
        reserved = above[1] - above[0]
        if above[2] == "---p" and reserved >= 4 << 30 and below[1] == above[0] and below[2] == "rw-p":
            wasm += (below[1] - below[0]) // 1024
    print(rss, hwm, wasm, sep="\t")


def median(values):
    return statistics.median(values) if values else float("nan")


def cell(values, fmt):
    """Every repetition's value, then their median when there are several."""
    shown = " / ".join(fmt.format(v) for v in values)
    if len(values) > 1:
        shown += " (med " + fmt.format(median(values)) + ")"
    return shown or "-"


def load_memory(out):
    """memory.tsv: snapshot name -> {rss_kb, hwm_kb, wasm_kb}; empty when there is none."""
    path = out / "memory.tsv"
    if not path.exists():
        return {}
    return {r["when"]: {k: int(v) for k, v in r.items() if k != "when"}
            for r in csv.DictReader(open(path), delimiter="\t")}


def wasm_growth(mem, target, conns):
    """MiB of wasm linear memory per in-flight request over `target`'s first 1 MB load: its
    snapshot after that load against the one just before it (only its own VM was busy)."""
    before, after = mem.get(f"before_warmup_1MB_{target}"), mem.get(f"after_warmup_1MB_{target}")
    if not before or not after:
        return None
    return (after["wasm_kb"] - before["wasm_kb"]) / 1024 / conns


def feature_costs(rows, sizes, mem, conns, pick):
    """The section on what usage merging and KV release tracking cost: the filter with its
    defaults against the listener with the one feature off, ratio within each repetition.
    Returns the lines for "Against the targets"."""
    features = [
        ("Usage merge", "merge_off",
         "`\"usage\":\"merge\"` (the default) against `\"usage\":\"decode\"` (decode's answer goes on unchanged)",
         "workload"),
        ("KV release tracking", "release_off",
         "`\"release_kv_on_abandon\":true` (the default) against `false`, on requests whose clients stay",
         "body"),
    ]
    present = [f for f in features if any(r["target"] == f[1] for r in rows)]
    if not present:
        return []
    verdicts = []
    print("### What the features cost (ratios within each repetition, then the median)\n")
    print(f"The filter with its defaults (`filter`) over the same filter with one feature off, both in the same Envoy,"
          f" each in its own VM; CPU is the proxy's CPU-seconds per request at {conns} connections. The target: at most"
          f" {FEATURE_TARGET} on CPU.\n")
    for title, off, what, column in present:
        print(f"**{title}**: {what}.\n")
        print(f"| {column} | CPU per request: filter / {off} | 1 conn p50: filter / {off} | target (CPU) | met |")
        print("| --- | --- | --- | --- | --- |")
        for size in [s for s in sizes if pick("c32", off, s, "cpu_per_1000")]:
            cpu = [f / o for f, o in zip(pick("c32", "filter", size, "cpu_per_1000"),
                                          pick("c32", off, size, "cpu_per_1000")) if o > 0]
            p50 = [f / o for f, o in zip(pick("c1", "filter", size, "p50_us"), pick("c1", off, size, "p50_us")) if o > 0]
            met = bool(cpu) and median(cpu) <= FEATURE_TARGET
            print(f"| {size} | {cell(cpu, '{:.3f}')} | {cell(p50, '{:.3f}')} | <= {FEATURE_TARGET} | {'met' if met else 'MISSED'} |")
            verdicts.append(f"{title} at {size}: CPU per request {median(cpu):.3f} x without it"
                            f" (target <= {FEATURE_TARGET}): {'met' if met else 'MISSED'}")
        print()
        if off == "release_off":
            grown = {t: wasm_growth(mem, t, conns) for t in ("filter", off)}
            if all(v is not None for v in grown.values()):
                print(f"Wasm linear memory grown over each listener's first 1 MB load at {conns} connections, per in-flight"
                      f" 1 MiB request (after that load against just before it; each listener has its own VM): filter"
                      f" {grown['filter']:.2f} MiB, {off} {grown[off]:.2f} MiB.\n")
    return verdicts


def report(directory):
    out = Path(directory)
    rows = list(csv.DictReader(open(out / "results.tsv"), delimiter="\t"))
    for row in rows:
        for key, value in row.items():
            if key not in ("phase", "target", "size"):
                row[key] = float(value)
        row["rps"] = row["requests"] / (row["duration_us"] / 1e6) if row["duration_us"] else 0.0
        proxy_cpu = row.get("proxy_cpu_s", row.get("envoy_cpu_s", 0.0))  # older files: envoy_cpu_s
        row["cpu_per_1000"] = proxy_cpu * 1000 / row["requests"] if row["requests"] else float("nan")
        row["backend_cpu_per_1000"] = (
            row["backend_cpu_s"] * 1000 / row["requests"] if row["requests"] else float("nan")
        )
    sizes = []
    for row in rows:
        if row["phase"] in ("c1", "c32") and row["size"] not in sizes:
            sizes.append(row["size"])
    conns = int(next((r["conns"] for r in rows if r["phase"] == "c32"), 32))

    def pick(phase, target, size, key):
        found = [r for r in rows if r["phase"] == phase and r["target"] == target and r["size"] == size]
        found.sort(key=lambda r: r["rep"])
        return [r[key] for r in found]

    setup = (out / "setup.txt").read_text().strip() if (out / "setup.txt").exists() else ""
    print("## pd-filter benchmark (`make bench`)\n")
    for line in setup.splitlines():
        print(f"- {line}")
    print("- each cell: the value of every repetition (run 1 / run 2 / …) and their median; CPU is the proxy's whole"
          " process, Envoy's or vllm-router's (utime+stime of all its threads from /proc), over the 32-connection run\n")

    # Native micro-benchmark.
    micro = defaultdict(list)
    micro_path = out / "micro.tsv"
    if micro_path.exists():
        for rep, size, size_bytes, fn, ns in csv.reader(open(micro_path), delimiter="\t"):
            micro[(size, fn)].append(int(size_bytes) / float(ns) * 1000.0)  # bytes/ns -> MB/s
    if micro:
        print("### Native rewrite and injection (criterion, MB/s of client body, 1 MB = 10^6 B)\n")
        print("| body | scan (validate + index) | prepare (scan + prefill rewrite) | inject (decode body edit) | whole request (prepare + read prefill answer + inject) |")
        print("| --- | --- | --- | --- | --- |")
        for size in [s for s in ("1KB", "64KB", "1MB") if (s, "prepare") in micro]:
            print(f"| {size} | {cell(micro.get((size, 'scan'), []), '{:,.0f}')} | {cell(micro[(size, 'prepare')], '{:,.0f}')} | "
                  f"{cell(micro[(size, 'inject')], '{:,.0f}')} | {cell(micro[(size, 'pd_request')], '{:,.0f}')} |")
        print()

    # The same code natively and as wasm32 under Node (src/timing.rs).
    timing = defaultdict(list)
    timing_us = defaultdict(list)
    timing_path = out / "timing.tsv"
    if timing_path.exists():
        for rep, target, size, step, size_bytes, ns in csv.reader(open(timing_path), delimiter="\t"):
            timing[(target, size, step)].append(int(size_bytes) / float(ns) * 1000.0)
            timing_us[(target, size, step)].append(float(ns) / 1000.0)
    if timing:
        print("### Native and wasm32 (src/timing.rs; wasm32 under Node's WASI, V8; MB/s of client body; wasm/native time)\n")
        print("| body | step | native | wasm32 | wasm32 time / native time |")
        print("| --- | --- | --- | --- | --- |")
        for size in ("1KB", "64KB", "1MB"):
            for step in ("scan", "prepare", "inject", "pd_request"):
                nat, wasm = timing.get(("native", size, step)), timing.get(("wasm32", size, step))
                if not nat or not wasm:
                    continue
                ratios = [n / w for n, w in zip(nat, wasm)]
                print(f"| {size} | {step} | {cell(nat, '{:,.0f}')} | {cell(wasm, '{:,.0f}')} | {cell(ratios, '{:.2f}')} |")
        print()
        usage_steps = [("usage_json", "a JSON answer"), ("usage_stream", "a 16-event stream in one chunk"),
                       ("usage_long_event", "a 1 MB event in 1 KiB chunks")]
        if any(timing_us.get(("wasm32", "answer", step)) for step, _ in usage_steps):
            print("Usage merging of decode's answer (src/timing.rs; µs per answer):\n")
            print("| answer | native µs | wasm32 µs |")
            print("| --- | --- | --- |")
            for step, name in usage_steps:
                nat, wasm = timing_us.get(("native", "answer", step), []), timing_us.get(("wasm32", "answer", step), [])
                print(f"| {name} | {cell(nat, '{:.1f}')} | {cell(wasm, '{:.1f}')} |")
            print()

    targets = [(t, n) for t, n in TARGETS if any(r["target"] == t for r in rows)]
    print(f"### Loopback load (wrk; latency in ms; CPU in the proxy's CPU-seconds per 1,000 requests)\n")
    print(f"| body | target | 1 conn p50 | 1 conn p99 | {conns} conn req/s | {conns} conn p99 | {conns} conn CPU-s/1000 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for size in sizes:
        for target, name in targets:
            if not any(r["target"] == target and r["size"] == size and r["phase"] in ("c1", "c32") for r in rows):
                continue
            cpu = "-" if target == "direct" else cell(pick("c32", target, size, "cpu_per_1000"), "{:.3f}")
            print(f"| {size} | {name} | {cell([v / 1000 for v in pick('c1', target, size, 'p50_us')], '{:.2f}')} "
                  f"| {cell([v / 1000 for v in pick('c1', target, size, 'p99_us')], '{:.2f}')} "
                  f"| {cell(pick('c32', target, size, 'rps'), '{:,.0f}')} "
                  f"| {cell([v / 1000 for v in pick('c32', target, size, 'p99_us')], '{:.2f}')} | {cpu} |")
    print()

    print("### Ratios (within each repetition)\n")
    print("| body | filter CPU / (2 x plain CPU) | target | met | added p50 latency: filter - plain (ms) | of which beyond one extra backend leg: filter - plain - direct (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    verdicts = []
    for size in sizes:
        fcpu, pcpu = pick("c32", "filter", size, "cpu_per_1000"), pick("c32", "plain", size, "cpu_per_1000")
        ratios = [f / (2 * p) for f, p in zip(fcpu, pcpu) if p > 0]
        f50, p50, d50 = (pick("c1", t, size, "p50_us") for t in ("filter", "plain", "direct"))
        added = [(f - p) / 1000 for f, p in zip(f50, p50)]
        beyond = [(f - p - d) / 1000 for f, p, d in zip(f50, p50, d50)]
        target = CPU_TARGET.get(size)
        if target is None:  # the streamed workload: shown, no target
            print(f"| {size} | {cell(ratios, '{:.2f}')} | - | - | {cell(added, '{:.2f}')} | {cell(beyond, '{:.2f}')} |")
            continue
        met = "yes" if ratios and median(ratios) <= target else "NO"
        verdicts.append((size, median(ratios) if ratios else float("nan"), target, met))
        print(f"| {size} | {cell(ratios, '{:.2f}')} | <= {target} | {met} | {cell(added, '{:.2f}')} | {cell(beyond, '{:.2f}')} |")
    print()

    mem = load_memory(out)
    feature_verdicts = feature_costs(rows, sizes, mem, conns, pick)

    # pd-filter against vllm-router, both doing P/D against the same backend.
    if any(t == "router" for t, _ in targets):
        print("### pd-filter / vllm-router (ratios within each repetition, then their median)\n")
        print("Below 1 is better for pd-filter in every column but req/s, where above 1 is.\n")
        print(f"| body | CPU per request | {conns} conn req/s | {conns} conn p99 | 1 conn p50 | 1 conn p99 | pd-filter ahead on all five |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for size in [s for s in sizes if pick("c32", "router", s, "rps")]:
            columns = [("c32", "cpu_per_1000", False), ("c32", "rps", True), ("c32", "p99_us", False),
                       ("c1", "p50_us", False), ("c1", "p99_us", False)]
            shown, ahead = [], True
            for phase, key, higher_is_better in columns:
                ours, theirs = pick(phase, "filter", size, key), pick(phase, "router", size, key)
                ratios = [o / t for o, t in zip(ours, theirs) if t > 0]
                shown.append(cell(ratios, "{:.2f}"))
                if not ratios:
                    ahead = False
                elif higher_is_better:
                    ahead = ahead and median(ratios) > 1
                else:
                    ahead = ahead and median(ratios) < 1
            print(f"| {size} | {' | '.join(shown)} | {'yes' if ahead else 'NO'} |")
        print()

    # Sanity: errors and the prefill/decode counts seen by the backend.
    problems = []
    for row in rows:
        if row["errors"] > 0:
            problems.append(f"{row['phase']} {row['target']} {row['size']} c{int(row['conns'])}: {int(row['errors'])} errors")
        if row["target"] in PD_TARGETS and row["phase"] != "warmup":
            slack = row["conns"] + 1
            if (abs(row["prefill"] - row["requests"]) > slack or abs(row["decode_kv"] - row["requests"]) > slack
                    or row["decode_plain"] > 0):
                problems.append(f"{row['phase']} {row['target']} {row['size']} c{int(row['conns'])}: {int(row['requests'])} requests, "
                                f"backend saw {int(row['prefill'])} prefill, {int(row['decode_kv'])} decode with kv, "
                                f"{int(row['decode_plain'])} without")
    print("### Checks\n")
    if problems:
        for p in problems:
            print(f"- PROBLEM: {p}")
    else:
        print("- no errors (non-2xx, resets, timeouts) in any run; through each filter listener (and vllm-router) the"
              " backend saw one prefill and one decode carrying prefill's kv_transfer_params per request")
    backend = [r["backend_cpu_per_1000"] for r in rows if r["phase"] == "c32" and r["target"] == "direct"]
    if backend:
        by_size = ", ".join(
            f"{s} {cell(pick('c32', 'direct', s, 'backend_cpu_per_1000'), '{:.3f}')}" for s in sizes
            if pick("c32", "direct", s, "backend_cpu_per_1000"))
        print(f"- bench backend CPU-s per 1,000 requests when hit directly: {by_size}")
    print()

    # Memory.
    if mem:
        print("### Memory\n")
        # Older files have no before_warmup_* snapshots: the plain route's came right before.
        before = mem.get("before_warmup_1MB_filter", mem.get("after_warmup_1MB_plain"))
        after = mem.get("after_warmup_1MB_filter")
        hwm_plain = pick("c32", "plain", "1MB", "hwm_kb")
        hwm_filter = pick("c32", "filter", "1MB", "hwm_kb")
        if "start" in mem:
            print(f"- Envoy at start: RSS {mem['start']['rss_kb'] / 1024:.0f} MiB, wasm linear memory "
                  f"{mem['start']['wasm_kb'] / 1024:.1f} MiB (all VMs)")
        if before and after:
            grown = (after["wasm_kb"] - before["wasm_kb"]) / 1024
            print(f"- wasm linear memory (the filter's heap high-water mark) before / after the first 1 MB load at "
                  f"{conns} connections through the filter: {before['wasm_kb'] / 1024:.1f} / {after['wasm_kb'] / 1024:.1f} MiB,"
                  f" i.e. {grown / conns:.2f} MiB per in-flight 1 MiB request")
        if hwm_plain and hwm_filter:
            print(f"- Envoy peak RSS during the 1 MB, {conns}-connection runs: plain {cell([v / 1024 for v in hwm_plain], '{:.0f}')} MiB,"
                  f" filter {cell([v / 1024 for v in hwm_filter], '{:.0f}')} MiB"
                  + "".join(f", {t} {cell([v / 1024 for v in pick('c32', t, '1MB', 'hwm_kb')], '{:.0f}')} MiB"
                            for t in ("release_off",) if pick("c32", t, "1MB", "hwm_kb")))
        hwm_router = pick("c32", "router", "1MB", "hwm_kb")
        if hwm_router:
            print(f"- vllm-router peak RSS during the 1 MB, {conns}-connection runs: {cell([v / 1024 for v in hwm_router], '{:.0f}')} MiB")
        soak = [k for k in mem if k.startswith("soak_") and k != "soak_before"]
        if "soak_before" in mem and soak:
            soak_rows = [r for r in rows if r["phase"] == "soak"]
            total = sum(r["requests"] for r in soak_rows)
            secs = sum(r["secs"] for r in soak_rows)
            size = soak_rows[0]["size"] if soak_rows else "?"
            series = " -> ".join(f"{mem[k]['rss_kb'] / 1024:.0f}" for k in ["soak_before"] + soak)
            wasm_series = " -> ".join(f"{mem[k]['wasm_kb'] / 1024:.1f}" for k in ["soak_before"] + soak)
            first, last = mem["soak_before"], mem[soak[-1]]
            print(f"- long run: {total:,.0f} requests ({size}, {conns} connections, {secs:.0f} s) through the filter after"
                  f" all the runs above: Envoy RSS {series} MiB (before -> after each quarter), "
                  f"{(last['rss_kb'] - first['rss_kb']) / 1024:+.1f} MiB; wasm linear memory {wasm_series} MiB")
        print()

    print("### Against the targets\n")
    for size, ratio, target, met in verdicts:
        print(f"- CPU per P/D request at {size}: {ratio:.2f} x the floor (target <= {target}): {'met' if met == 'yes' else 'MISSED'}")
    for line in feature_verdicts:
        print(f"- {line}")
    for step, name in (("scan", "scan"), ("pd_request", "scan, rewrite and injection (whole request)")):
        if micro.get(("1MB", step)):
            rate = median(micro[("1MB", step)])
            print(f"- native {name} of a 1 MB body: {rate:,.0f} MB/s (target >= 4,000): "
                  f"{'met' if rate >= 4000 else 'MISSED'}")
    if timing.get(("native", "1MB", "pd_request")) and timing.get(("wasm32", "1MB", "pd_request")):
        ratio = median([n / w for n, w in zip(timing[("native", "1MB", "pd_request")],
                                               timing[("wasm32", "1MB", "pd_request")])])
        print(f"- wasm32 (Node) whole request on a 1 MB body: {ratio:.2f} x native time (target <= 1.5): "
              f"{'met' if ratio <= 1.5 else 'MISSED'}")
    router_rows = [r for r in rows if r["target"] == "router"]
    if router_rows:
        for size in [s for s in sizes if pick("c32", "router", s, "rps")]:
            checks = []
            for phase, key, higher in (("c32", "cpu_per_1000", False), ("c32", "rps", True), ("c32", "p99_us", False),
                                       ("c1", "p50_us", False), ("c1", "p99_us", False)):
                ours, theirs = pick(phase, "filter", size, key), pick(phase, "router", size, key)
                ratios = [o / t for o, t in zip(ours, theirs) if t > 0]
                ok = bool(ratios) and (median(ratios) > 1 if higher else median(ratios) < 1)
                checks.append(ok)
            print(f"- ahead of vllm-router at {size} (CPU, req/s, p99 at {conns} connections; p50, p99 at 1): "
                  f"{'yes' if all(checks) else 'NO'} ({sum(checks)} of {len(checks)})")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "memory":
        memory(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "report":
        report(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
