#!/usr/bin/env bash
# Ray Serve's own overhead vs the local fleet, side by side (issue 19, item 5).
#
# Starts `carpool serve --replicas 2` on the tiny random-weight model, once
# with --backend ray and once with --backend local, each on a free
# 127.0.0.1 port, and drives it sequentially (one request at a time, so
# the model's own cost is the same and small): N_REQ 1-token completions
# (per-request latency p50/p99) and N_STREAMS streams of STREAM_TOKENS
# tokens (time per token after the first, p50/p99 over the streams).
# The difference between the two rows is what Ray adds (proxy -> ingress
# -> handle routing -> replica -> stream back).
#
# Usage: scripts/ray_overhead.sh [ray local]   (env: N_REQ, N_STREAMS,
# STREAM_TOKENS, WORK). Every server is stopped on exit (trap), each stage
# is bounded by `timeout`. Run it alone: both backends share the cores.
set -euo pipefail
cd "$(dirname "$0")/.."
if (($#)); then BACKENDS=("$@"); else BACKENDS=(ray local); fi
N_REQ=${N_REQ:-60}
N_STREAMS=${N_STREAMS:-12}
STREAM_TOKENS=${STREAM_TOKENS:-32}
WORK=${WORK:-$(mktemp -d /tmp/ray_overhead.XXXXXX)}
mkdir -p "$WORK"
PID=""

stop() {
  if [[ -n "$PID" ]] && kill -0 "$PID" 2>/dev/null; then
    kill -TERM "$PID" 2>/dev/null || true
    timeout 60 tail --pid="$PID" -f /dev/null || kill -KILL "$PID" 2>/dev/null || true
  fi
  PID=""
}
trap stop EXIT INT TERM

if [[ ! -f "$WORK/tiny/config.json" ]]; then
  timeout 120 python - "$WORK/tiny" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from conftest import _write_tiny_model
_write_tiny_model(Path(sys.argv[1]))
PY
fi

free_port() {
  python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

measure() {  # measure URL LABEL
  timeout 300 python - "$1" "$2" "$N_REQ" "$N_STREAMS" "$STREAM_TOKENS" <<'PY'
import statistics, sys, time
import httpx
url, label, n_req, n_streams, tokens = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
deadline = time.monotonic() + 240
while True:
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        sys.exit(f"{label}: the server never became healthy")
    time.sleep(0.5)

def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] * 1000

one = {"prompt": "hi", "max_tokens": 1}
stream = {"prompt": "hi", "max_tokens": tokens, "ignore_eos": True, "stream": True}
with httpx.Client(base_url=url, timeout=60) as http:
    for _ in range(8):  # warm-up: both replicas, the tokenizer, the routers
        http.post("/v1/completions", json=one).raise_for_status()
    latency = []
    for _ in range(n_req):
        start = time.perf_counter()
        http.post("/v1/completions", json=one).raise_for_status()
        latency.append(time.perf_counter() - start)
    per_token, firsts = [], []
    for _ in range(n_streams):
        start = time.perf_counter()
        first = None
        with http.stream("POST", "/v1/completions", json=stream) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
        firsts.append(first - start)
        per_token.append((end - first) / (tokens - 1))
print(f"{label:6s} 1-token request p50 {pct(latency, .5):6.1f} ms  p99 {pct(latency, .99):6.1f} ms"
      f" | stream first chunk p50 {pct(firsts, .5):6.1f} ms"
      f" | per token p50 {pct(per_token, .5):5.2f} ms  p99 {pct(per_token, .99):5.2f} ms",
      flush=True)
PY
}

for backend in "${BACKENDS[@]}"; do
  port=$(free_port)
  carpool serve "$WORK/tiny" --backend "$backend" --replicas 2 --attention-backend torch \
    --adaptive false --served-model-name tiny --host 127.0.0.1 --port "$port" \
    >"$WORK/$backend.log" 2>&1 &
  PID=$!
  measure "http://127.0.0.1:$port" "$backend" || { tail -20 "$WORK/$backend.log"; exit 1; }
  stop
done
echo "(logs in $WORK)"
