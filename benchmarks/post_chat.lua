-- wrk: POST a small OpenAI-shaped chat body; print one machine-readable summary line.
wrk.method = "POST"
wrk.body = '{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer caller-key-the-gateway-strips"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK requests=%d duration_us=%d p50_us=%d p99_us=%d status=%d connect=%d read=%d write=%d timeout=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.status, e.connect, e.read, e.write, e.timeout))
end
