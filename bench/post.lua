-- wrk script of scripts/bench.sh: POST the body in $BENCH_BODY to $BENCH_PATH and print one
-- machine-readable line (latencies in microseconds) when the run is done.
local path = os.getenv("BENCH_PATH") or "/v1/chat/completions"
local file = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
local body = file:read("*a")
file:close()

wrk.method = "POST"
wrk.path = path
wrk.body = body
wrk.headers["Content-Type"] = "application/json"
-- BENCH_HEADER, "name: value": one more request header (the tokens workload's event gap).
local extra = os.getenv("BENCH_HEADER")
if extra then
  local name, value = extra:match("^([^:]+):%s*(.*)$")
  if name then
    wrk.headers[name] = value
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH requests=%d duration_us=%d p50_us=%d p99_us=%d mean_us=%.1f " ..
    "err_connect=%d err_read=%d err_write=%d err_status=%d err_timeout=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency.mean, e.connect, e.read, e.write, e.status, e.timeout))
end
