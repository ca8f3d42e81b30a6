#!/usr/bin/env python3
"""Draws docs/dashboard.png: the panels of deploy/grafana/pd-filter.json from real numbers.

Sends mixed traffic (the three APIs, prefill faults, refused requests, clients that leave
during prefill) to a running Envoy with pd-filter in front of the mock vLLM servers, scrapes
its /stats/prometheus every few seconds, computes what each panel's PromQL would show (rates
over a window, histogram_quantile over the _bucket series) and draws the panels with
matplotlib. Loopback only; it stops by itself.

    target/debug/mock-vllm --prefill 127.0.0.1:8100 --decode 127.0.0.1:8200 &
    envoy -c envoy/envoy.yaml &
    python3 scripts/dashboard-picture.py --seconds 180   # needs matplotlib (pip)
"""

import argparse
import json
import math
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(admin):
    """Every sample of /stats/prometheus: {(name, ((label, value), ...)): value}."""
    text = urllib.request.urlopen(f"{admin}/stats/prometheus", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        pairs = re.findall(r'(\w+)="([^"]*)"', labels or "")
        samples[(name, tuple(sorted(pairs)))] = float(value)
    return samples


def post(url, path, body, timeout):
    request = urllib.request.Request(
        url + path, data=body.encode(), headers={"content-type": "application/json"}
    )
    try:
        urllib.request.urlopen(request, timeout=timeout).read()
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
        pass


def one_request(url, rng):
    """One client request, drawn from a mix that shows every panel something."""
    delay = int(rng.lognormvariate(math.log(40), 0.8))
    words = f"mock:prefill_delay_ms={delay}"
    roll = rng.random()
    if roll < 0.03:
        words += " mock:prefill_status=500"
    elif roll < 0.05:
        words += " mock:prefill_status=400"
    elif roll < 0.07:
        words += " mock:prefill_no_kv"
    elif roll < 0.08:
        words += " mock:prefill_reset_mid_answer"
    elif roll < 0.10:
        urllib.request.urlopen(url + "/v1/models", timeout=10).read()
        return
    elif roll < 0.12:
        post(url, "/v1/completions", "[]", 10)
        return
    elif roll < 0.14:
        # A client that gives up during a slow prefill: its KV is released.
        slow = f'{{"prompt":"bye mock:prefill_delay_ms=800","max_tokens":4}}'
        post(url, "/v1/completions", slow, 0.2)
        return
    api = rng.choices(["completions", "chat", "responses"], [5, 4, 1])[0]
    if api == "completions":
        body = json.dumps({"prompt": f"hello {words}", "max_tokens": 8})
        post(url, "/v1/completions", body, 30)
    elif api == "chat":
        message = {"role": "user", "content": f"hello {words}"}
        body = json.dumps({"messages": [message], "max_tokens": 8})
        post(url, "/v1/chat/completions", body, 30)
    else:
        body = json.dumps({"input": f"hello {words}", "max_output_tokens": 8})
        post(url, "/v1/responses", body, 30)


def traffic(url, until, seed, rate):
    rng = random.Random(seed)
    while time.time() < until:
        # The load rises and falls over the run.
        phase = (time.time() % 120) / 120
        one_request(url, rng)
        time.sleep(max(0.0, rng.expovariate(rate * (0.6 + 0.8 * math.sin(math.pi * phase)))))


def total(samples, name, group=(), where=None):
    """sum by (group) of the series `name` whose labels include `where`."""
    sums = defaultdict(float)
    for (sample_name, labels), value in samples.items():
        if sample_name != name:
            continue
        labels = dict(labels)
        if where and any(labels.get(k) != v for k, v in where.items()):
            continue
        sums[tuple(labels.get(g, "") for g in group)] += value
    return sums


def rates(series, name, group=(), where=None, window=30.0):
    """{key: [(t, rate)]}: what rate(name[window]) summed by group shows over the run."""
    out = defaultdict(list)
    for i, (t, samples) in enumerate(series):
        j = i
        while j > 0 and t - series[j - 1][0] <= window:
            j -= 1
        if j == i:
            continue
        t0, old = series[j]
        now, before = total(samples, name, group, where), total(old, name, group, where)
        for key in set(now) | set(before):
            out[key].append((t, max(0.0, now.get(key, 0) - before.get(key, 0)) / (t - t0)))
    return out


def quantile(q, buckets):
    """histogram_quantile over [(le, cumulative count)]."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    previous_le, previous_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return previous_le
            span = count - previous_count
            return previous_le + (le - previous_le) * ((rank - previous_count) / span if span else 0)
        previous_le, previous_count = le, count
    return previous_le


def quantiles(series, name, q, group=(), where=None, window=30.0):
    """{key: [(t, value)]}: histogram_quantile(q, sum by (le, group) (rate(name_bucket[window])))."""
    by_le = rates(series, name + "_bucket", ("le",) + tuple(group), where, window)
    points = defaultdict(lambda: defaultdict(list))
    for (le, *key), values in by_le.items():
        for t, value in values:
            points[tuple(key)][t].append((float(le), value))
    out = defaultdict(list)
    for key, at in points.items():
        for t in sorted(at):
            value = quantile(q, at[t])
            if value is not None:
                out[key].append((t, value))
    return out


def draw(series, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = series[0][0]
    plt.rcParams.update(
        {
            "figure.facecolor": "#111217",
            "axes.facecolor": "#181b1f",
            "axes.edgecolor": "#2c3235",
            "axes.labelcolor": "#ccccdc",
            "text.color": "#ccccdc",
            "xtick.color": "#8e8e98",
            "ytick.color": "#8e8e98",
            "grid.color": "#2c3235",
            "font.size": 8,
        }
    )
    panels = [
        ("Requests by API (req/s)", rates(series, "pd_filter_requests", ("api",)), "{0}"),
        ("Requests by outcome (req/s)", rates(series, "pd_filter_requests", ("outcome",)), "{0}"),
        (
            "Prefill latency, answered with KV (ms)",
            {
                (f"p{int(q * 100)}",): quantiles(
                    series, "pd_filter_prefill_latency_ms", q, (), {"outcome": "kv"}
                ).get((), [])
                for q in (0.5, 0.9, 0.99)
            },
            "{0}",
        ),
        (
            "Prefill failures by kind (/s)",
            rates(series, "pd_filter_prefill_failures", ("kind",)),
            "{0}",
        ),
        (
            "Fallbacks and refusals (/s)",
            {
                ("decode-only fallbacks",): rates(series, "pd_filter_decode_only_fallbacks").get((), []),
                ("refused by the filter",): rates(series, "pd_filter_bad_requests").get((), []),
                ("passed through",): rates(series, "pd_filter_requests_passed_through").get((), []),
            },
            "{0}",
        ),
        ("KV releases (/s)", rates(series, "pd_filter_kv_releases", ("outcome",)), "{0}"),
        (
            "Upstream requests by cluster (req/s)",
            rates(series, "envoy_cluster_upstream_rq_total", ("envoy_cluster_name",)),
            "{0}",
        ),
        (
            "Downstream responses by class (/s)",
            rates(series, "envoy_http_downstream_rq_xx", ("envoy_response_code_class",),
                  {"envoy_http_conn_manager_prefix": "openai"}),
            "{0}xx",
        ),
        (
            "Upstream p99 by cluster (ms)",
            quantiles(series, "envoy_cluster_upstream_rq_time", 0.99, ("envoy_cluster_name",)),
            "{0}",
        ),
    ]
    figure, axes = plt.subplots(3, 3, figsize=(15, 9.5))
    figure.suptitle("pd-filter  (deploy/grafana/pd-filter.json, drawn from a real Envoy's /stats/prometheus)",
                    fontsize=11, x=0.01, ha="left")
    for axis, (title, lines, legend) in zip(axes.flat, panels):
        axis.set_title(title, loc="left", fontsize=9)
        axis.grid(True, linewidth=0.5)
        for key, points in sorted(lines.items()):
            if not points or max(v for _, v in points) <= 0:
                continue
            xs = [(t - start) / 60 for t, _ in points]
            axis.plot(xs, [v for _, v in points], linewidth=1.2, label=legend.format(*key))
        axis.set_xlabel("minutes")
        axis.set_ylim(bottom=0)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7, frameon=False, loc="upper left", ncol=2)
    figure.tight_layout(rect=(0, 0, 1, 0.96))
    figure.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:10000")
    parser.add_argument("--admin", default="http://127.0.0.1:9901")
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rate", type=float, default=8, help="requests/s per client, on average")
    parser.add_argument("--out", default="docs/dashboard.png")
    args = parser.parse_args()
    until = time.time() + args.seconds
    clients = [
        threading.Thread(target=traffic, args=(args.url, until, seed, args.rate), daemon=True)
        for seed in range(args.clients)
    ]
    for client in clients:
        client.start()
    series = []
    while time.time() < until + 2:
        series.append((time.time(), scrape(args.admin)))
        time.sleep(5)
    for client in clients:
        client.join(timeout=35)
    draw(series, args.out)
    print(f"wrote {args.out} from {len(series)} scrapes")


if __name__ == "__main__":
    main()
