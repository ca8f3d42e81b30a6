#!/usr/bin/env python3
"""A/B of two filter builds under the same load, in one run (`make bench-ab BASE=rev`).

Two Envoys, each with bench/envoy-bench.yaml and one of the two .wasm files, run side by
side on the same core with one bench backend. Each round loads the same listener of each
Envoy in turn (the order alternates between rounds) with wrk for a few seconds, and takes
that Envoy's CPU time per request (utime + stime of the whole process, from /proc) and the
latency percentiles wrk reports. Only the Envoy under load works; the other is idle. The
report gives, per measure, the ratio B / A within each round, then the median and
quartiles over rounds: the machine's noise shows in the quartiles.

Usage: bench/ab.py A.wasm B.wasm [--listener filter] [--size 1024] [--stream]
                   [--rounds 12] [--secs 2] [--conns 32]
Environment: ENVOY (the envoy binary), BENCH_PORT_BASE (19500; +0..+4 and +901 for A,
+100..+104 and +1001 for B, +200/+201 for the backend).
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTENERS = {"plain": 0, "filter": 1, "merge_off": 3, "release_off": 4}


def ticks_per_second():
    return os.sysconf(os.sysconf_names["SC_CLK_TCK"])


def process_cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    return (int(fields[11]) + int(fields[12])) / ticks_per_second()


def wait_ready(port, deadline=30.0):
    start = time.time()
    while time.time() - start < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"ab: Envoy's admin on {port} did not become ready")


def envoy_config(template, wasm, base, backend, prefill):
    text = template
    for key, value in {
        "ADMIN_PORT": base + 901,
        "PLAIN_PORT": base + LISTENERS["plain"],
        "FILTER_PORT": base + LISTENERS["filter"],
        "MERGE_OFF_PORT": base + LISTENERS["merge_off"],
        "RELEASE_OFF_PORT": base + LISTENERS["release_off"],
        "BACKEND_PORT": backend,
        "PREFILL_PORT": prefill,
        "WASM": wasm,
    }.items():
        text = text.replace(f"@{key}@", str(value))
    leftover = re.findall(r"@[A-Z_]+@", text)
    if leftover:
        sys.exit(f"ab: placeholders left in the Envoy configuration: {leftover}")
    return text


def run_wrk(port, body_file, path, conns, secs, pin):
    command = pin + [
        "wrk", "-t1", f"-c{conns}", f"-d{secs}s", "--timeout", "30s",
        "-s", os.path.join(ROOT, "bench/post.lua"), f"http://127.0.0.1:{port}",
    ]
    env = dict(os.environ, BENCH_BODY=body_file, BENCH_PATH=path)
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    line = next((l for l in out.splitlines() if l.startswith("BENCH ")), None)
    if line is None:
        sys.exit(f"ab: wrk printed no result:\n{out}")
    fields = dict(item.split("=") for item in line.split()[1:])
    errors = sum(int(v) for k, v in fields.items() if k.startswith("err_"))
    if errors:
        sys.exit(f"ab: wrk saw errors against port {port}: {line}")
    return int(fields["requests"]), int(fields["p50_us"]), int(fields["p99_us"])


def quartiles(values):
    values = sorted(values)
    if len(values) < 4:
        return values[0], statistics.median(values), values[-1]
    q = statistics.quantiles(values, n=4)
    return q[0], q[1], q[2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--listener", default="filter", choices=sorted(LISTENERS))
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--secs", type=int, default=2)
    parser.add_argument("--conns", type=int, default=32)
    args = parser.parse_args()

    envoy = os.environ.get("ENVOY", "envoy")
    base = int(os.environ.get("BENCH_PORT_BASE", "19500"))
    backend_port, prefill_port = base + 200, base + 201
    backend_bin = os.path.join(ROOT, "target/release/bench-backend")
    pin_envoy, pin_load = (
        (["taskset", "-c", "1"], ["taskset", "-c", "0"]) if os.cpu_count() >= 2 else ([], [])
    )
    with open(os.path.join(ROOT, "bench/envoy-bench.yaml")) as f:
        template = f.read()

    work = tempfile.mkdtemp(prefix="pd-filter-ab-")
    body = os.path.join(work, "body.json")
    subprocess.run(
        [backend_bin, "body", str(args.size), body] + (["stream"] if args.stream else []),
        check=True,
    )
    processes = []

    def stop(*_):
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait()

    signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(1)))
    try:
        processes.append(subprocess.Popen(
            pin_load + [backend_bin, "serve", f"127.0.0.1:{backend_port},127.0.0.1:{prefill_port}", "1"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "backend.log"), "w"),
        ))
        envoys = {}
        for name, wasm, offset in (("A", args.a, 0), ("B", args.b, 100)):
            config = os.path.join(work, f"envoy-{name}.yaml")
            with open(config, "w") as f:
                f.write(envoy_config(template, os.path.abspath(wasm), base + offset,
                                     backend_port, prefill_port))
            process = subprocess.Popen(
                pin_envoy + [envoy, "-c", config, "--concurrency", "1",
                             "--use-dynamic-base-id", "-l", "warn"],
                stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(work, f"envoy-{name}.log"), "w"),
            )
            processes.append(process)
            wait_ready(base + offset + 901)
            envoys[name] = (process.pid, base + offset + LISTENERS[args.listener])

        path = "/v1/chat/completions"
        for name, (_, port) in envoys.items():  # warm-up, and a check that both answer
            run_wrk(port, body, path, args.conns, 1, pin_load)
        ratios = {"cpu": [], "p50": [], "p99": []}
        print(f"round  cpu_us/req A  B   p50_us A  B   (listener {args.listener}, "
              f"{args.size} B{' streamed' if args.stream else ''}, c{args.conns}, {args.secs} s)")
        for round_number in range(args.rounds):
            order = ("A", "B") if round_number % 2 == 0 else ("B", "A")
            got = {}
            for name in order:
                pid, port = envoys[name]
                before = process_cpu_seconds(pid)
                requests, p50, p99 = run_wrk(port, body, path, args.conns, args.secs, pin_load)
                cpu = (process_cpu_seconds(pid) - before) / requests * 1e6
                got[name] = (cpu, p50, p99)
            ratios["cpu"].append(got["B"][0] / got["A"][0])
            ratios["p50"].append(got["B"][1] / got["A"][1])
            ratios["p99"].append(got["B"][2] / got["A"][2])
            print(f"{round_number + 1:5}  {got['A'][0]:7.1f} {got['B'][0]:7.1f}   "
                  f"{got['A'][1]:6} {got['B'][1]:6}")
        print(f"\nB / A over {args.rounds} rounds (q1 / median / q3):")
        for measure, values in ratios.items():
            q1, median, q3 = quartiles(values)
            print(f"  {measure:4} {q1:.3f} / {median:.3f} / {q3:.3f}")
    finally:
        stop()


if __name__ == "__main__":
    main()
