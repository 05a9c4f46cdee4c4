#!/usr/bin/env bash
# Issue 19 item 5: one replica vs two with round-robin vs two with carpool's
# router (predicted-ttft), each served for real (`carpool serve`, measured
# by `carpool bench serve`) and simulated (`carpool simulate`) on the same
# Mooncake conversation window; prints the prefix hit rate, TTFT p50/p99
# and goodput of each side and the simulator's TTFT error.
#
# The window follows scripts/fidelity_windows.sh's rule, fixed before
# measuring: COUNT requests from START seconds into the trace, token scale
# min(1/8, 128 / the window's mean prompt tokens), time scale the window's
# own mean arrival rate / 1 req/s (offered at 1 req/s on average, its
# burstiness kept). TOKEN_SCALE / TIME_SCALE override the rule. For
# mooncake-* traces the token scale is 16/512 instead: their prefix sharing
# comes as 512-token hash blocks, which then become exactly the server's
# 16-token KV blocks (at the rule's ~1/85 a trace block is 6 tokens and
# whole-block caching loses most of the sharing the comparison is about).
#
# Threads: one replica gets every core (THREADS, default nproc); each of
# two replicas half of them, as `carpool serve --replicas 2` splits the
# cores itself (carpool/fleet/local.py); both are passed explicitly, and
# the simulator prices each case with a cost model measured at that thread
# count (`carpool measure --grid GRID --threads N`, just before its runs).
#
# Two cost models price each case: the grid's (measured alone, in one
# process) and the server's own (`carpool measure --from URL`: fitted on the
# steps the live server ran while replaying a calibration window, CAL_COUNT
# requests from CAL_START s, then a fresh server of the same configuration
# serves the measured window, its cache cold as the simulator's: a
# prediction, not a fit of the run it predicts). The live one includes what serving adds to
# a step on a small machine: the API process, the benchmark client and (two
# replicas) the other replica on the same cores.
#
# The front: the live prediction also gets `carpool simulate --front-seconds`,
# the API process's CPU seconds per request over the calibration window
# (from /proc; its workers not counted). A burst of requests reaches a live
# engine one after another, so an idle engine starts a step on the first and
# the rest wait for it; without it the simulator served every burst in one
# step and predicted TTFT p50 ~20% low for two replicas (README).
#
# SLO (goodput): ttft=2s,tpot=200ms by default: the targets of the
# README's tuning examples on this 2-core CPU, a few times the unloaded
# TTFT/TPOT of the default model here, so goodput separates a fleet that
# keeps up from one whose queue grows.
#
# REAL_ONLY=1 serves every case for real and simulates none.
# CASES picks the configurations (default: one-replica two-round-robin
# two-router); two-round-robin-store and two-router-store are the same
# two-replica fleets with a shared KV store (`--kv-store local`: the API
# process serves it), served for real only (the simulator's KV tier is
# not priced from this machine's transfers yet). pd-1-1 is P/D serving:
# one prefill and one decode replica of one thread each (`--prefill 1
# --decode 1`, the prompt's KV streamed through the front's store), real only;
# pd-1-1-conditional the same fleet whose planner keeps a request on the
# decode replica where the transfer does not pay (`--pd-mode conditional`);
# pd-1-1-conditional-stall weighs what a colocated prefill stalls of the
# decode replica's running requests (`--pd-stall-weight 1`).
#
#   scripts/fleet_compare.sh                          # ~25 min on 2 cores, alone
#   COUNT=12 GRID=smoke OUT=/tmp/fc scripts/fleet_compare.sh   # a smoke run
#   CASES="two-round-robin two-round-robin-store" CAL_COUNT=0 scripts/fleet_compare.sh
#
# Needs the machine alone and the whole trace (../shared/traces or
# $CARPOOL_TRACES). Servers listen on 127.0.0.1 only and are always stopped.
set -euo pipefail

TRACE=${TRACE:-mooncake-conv}
START=${START:-1800}
COUNT=${COUNT:-200}
DTYPE=${DTYPE:-bfloat16}
GRID=${GRID:-quick}
SLO=${SLO:-ttft=2s,tpot=200ms}
OUT=${OUT:-fleet-compare}
THREADS=${THREADS:-$(nproc)}
WARMUP=${WARMUP:-8}               # requests before each real run (even: keeps round-robin's turn)
CAL_START=${CAL_START:-600}       # the calibration window (the live cost model's steps)
CAL_COUNT=${CAL_COUNT:-100}       # 0: no live cost model
RUN_TIMEOUT=${RUN_TIMEOUT:-1800}  # seconds one bench run may take at most
START_TIMEOUT=${START_TIMEOUT:-300}  # seconds a server may take to become healthy
HALF=$(( THREADS / 2 > 0 ? THREADS / 2 : 1 ))
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

read -r RULE_TOKEN RULE_TIME MEAN_PROMPT RATE < <(python - "$TRACE" "$START" "$COUNT" <<'EOF'
import sys
from carpool.workload.traces import load_trace, select_window

# The rule of scripts/fidelity_windows.sh, kept in step with it.
name, start, count = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
window = select_window(load_trace(name), start_s=start, max_requests=count)
if len(window) < max(count, 2):
    sys.exit(f"{name}: only {len(window)} requests from {start} s")
mean_prompt = sum(r.input_len for r in window) / len(window)
rate = (len(window) - 1) / (window[-1].arrival - window[0].arrival)
print(f"{min(1 / 8, 128 / mean_prompt):.5f} {rate / 1.0:.4f} {mean_prompt:.0f} {rate:.3f}")
EOF
)
case "$TRACE" in mooncake*) RULE_TOKEN=0.03125 ;; esac  # 512-token trace blocks -> 16
TOKEN_SCALE=${TOKEN_SCALE:-$RULE_TOKEN}
TIME_SCALE=${TIME_SCALE:-$RULE_TIME}
WORKLOAD=(--workload "$TRACE" --arrival trace --trace-start "$START" --num-requests "$COUNT"
          --token-scale "$TOKEN_SCALE" --time-scale "$TIME_SCALE")
echo "== $TRACE: $COUNT requests from ${START} s (mean prompt $MEAN_PROMPT tokens, $RATE req/s):" \
     "token scale $TOKEN_SCALE, time scale $TIME_SCALE | SLO $SLO | threads $THREADS / $HALF"

SERVER_PID=""
stop_server() {  # SIGTERM drains the fleet; SIGKILL only if it hangs
  [ -n "$SERVER_PID" ] || return 0
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

free_port() {
  python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

measure() {  # $1: threads -> $OUT/cost-model-t$1.json
  local began=$SECONDS
  carpool measure --dtype "$DTYPE" --threads "$1" --grid "$GRID" \
    --out "$OUT/cost-model-t$1.json" >"$OUT/measure-t$1.txt" 2>"$OUT/measure-t$1.err"
  echo "   carpool measure --grid $GRID --threads $1 took $((SECONDS - began)) s"
}

serve() {  # $1: dir, $2: threads, rest: serve flags -> $SERVER_PID, $URL
  local dir=$1 threads=$2 port
  shift 2
  port=$(free_port)
  carpool serve --host 127.0.0.1 --port "$port" --dtype "$DTYPE" --threads "$threads" \
    --adaptive false "$@" >"$dir/server.log" 2>&1 &
  SERVER_PID=$!
  URL="http://127.0.0.1:$port"
  for _ in $(seq 1 "$START_TIMEOUT"); do
    curl -sf "$URL/health" >/dev/null 2>&1 && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server died; see $dir/server.log" >&2; exit 1; }
    sleep 1
  done
  echo "server not healthy after $START_TIMEOUT s; see $dir/server.log" >&2
  exit 1
}

front_cpu() {  # CPU seconds the API process (the front, not its workers) has used so far
  python - "$SERVER_PID" <<'PY'
import os, sys
fields = open(f"/proc/{sys.argv[1]}/stat").read().rsplit(")", 1)[1].split()
print((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
PY
}

per_request() {  # $1, $2: front CPU seconds before and after $3 requests -> seconds each
  python -c "import sys; print(f'{(float(sys.argv[2]) - float(sys.argv[1])) / int(sys.argv[3]):.5f}')" "$@"
}

warm_up() {  # $1: dir. First-use costs (kernels, the router's step fit), not recorded.
  [ "$WARMUP" -gt 0 ] || return 0
  timeout "$RUN_TIMEOUT" carpool bench serve --base-url "$URL/v1" --num-requests "$WARMUP" \
    --input-len 128 --output-len 8 --rate 1000 --max-concurrency 4 --no-progress \
    >"$1/warmup.txt" 2>&1
}

simulate() {  # $1: dir, $2: cost model, $3: result name, $4: replicas, $5: routing, $6: label
  # $7: the front's seconds per request (default 0: the grid's offline prediction has no front)
  carpool simulate --cost-model "$2" "${WORKLOAD[@]}" --replicas "$4" --routing "$5" \
    --front-seconds "${7:-0}" --slo "$SLO" --label "$6" --json "$1/$3.json" \
    >"$1/$3.txt" 2>"$1/$3.err"
}

run_case() {  # $1: name, $2: replicas, $3: routing, $4: threads, $5: cost model, $6: store?,
  # $7: real only (no simulation)?
  local name=$1 replicas=$2 routing=$3 threads=$4 cost=$5 store=${6:-} real_only=${7:-}
  local dir="$OUT/$1"
  local began=$SECONDS fleet=()
  if [ "$replicas" = pd ]; then fleet=(--prefill 1 --decode 1)
  elif [ "$replicas" = pd-conditional ]; then
    fleet=(--prefill 1 --decode 1 --pd-mode conditional)
  elif [ "$replicas" = pd-conditional-stall ]; then
    fleet=(--prefill 1 --decode 1 --pd-mode conditional --pd-stall-weight 1)
  elif [ "$replicas" -gt 1 ]; then fleet=(--replicas "$replicas" --routing "$routing"); fi
  if [ -n "$store" ]; then fleet+=(--kv-store local); fi
  mkdir -p "$dir"
  serve "$dir" "$threads" "${fleet[@]}"
  warm_up "$dir"
  if [ "$CAL_COUNT" -gt 0 ]; then  # the live cost model: this server's steps on another window
    local cpu_before
    cpu_before=$(front_cpu)
    timeout "$RUN_TIMEOUT" carpool bench serve --base-url "$URL/v1" --workload "$TRACE" \
      --arrival trace --trace-start "$CAL_START" --num-requests "$CAL_COUNT" \
      --token-scale "$TOKEN_SCALE" --time-scale "$TIME_SCALE" --no-progress \
      >"$dir/calibration.txt" 2>&1
    # The front's CPU per request on that window: what it does for each
    # request one after another (HTTP, tokenizing, routing, streaming it
    # back), the simulator's --front-seconds for the live prediction.
    per_request "$cpu_before" "$(front_cpu)" "$CAL_COUNT" >"$dir/front-seconds-live.txt"
    carpool measure --from "$URL" --out "$dir/cost-model-live.json" >"$dir/measure-live.txt" 2>&1
    # A fresh server for the measured window: the calibration's prefixes
    # must not warm its cache (the simulator starts empty too).
    stop_server
    serve "$dir" "$threads" "${fleet[@]}"
    warm_up "$dir"
  fi
  local measured_cpu
  measured_cpu=$(front_cpu)
  timeout "$RUN_TIMEOUT" carpool bench serve --base-url "$URL/v1" "${WORKLOAD[@]}" \
    --slo "$SLO" --label "real: $name" --no-progress --json "$dir/real.json" \
    >"$dir/real.txt" 2>"$dir/real.err"
  per_request "$measured_cpu" "$(front_cpu)" "$COUNT" >"$dir/front-seconds-insample.txt"
  # Diagnostic, not a prediction: the cost model fitted on the measured run's
  # own steps. Its error is what the simulator misses besides step costs
  # (the front, transport and scheduling between steps); the live model's
  # error beyond it is the calibration window's (step costs that do not carry
  # over from one window of the trace to another).
  carpool measure --from "$URL" --out "$dir/cost-model-insample.json" \
    >"$dir/measure-insample.txt" 2>&1 || true
  curl -sf "$URL/metrics" >"$dir/metrics.txt" || true  # KV store and handoff counters
  stop_server
  if [ -n "$real_only" ]; then echo "   $name: real in $((SECONDS - began)) s"; return 0; fi
  simulate "$dir" "$cost" sim "$replicas" "$routing" "simulated: $name"
  if [ "$CAL_COUNT" -gt 0 ]; then
    simulate "$dir" "$dir/cost-model-live.json" sim-live "$replicas" "$routing" \
      "simulated (live cost model and front): $name" "$(cat "$dir/front-seconds-live.txt")"
  fi
  if [ -f "$dir/cost-model-insample.json" ]; then
    simulate "$dir" "$dir/cost-model-insample.json" sim-insample "$replicas" "$routing" \
      "simulated (cost model and front of this very run; a diagnostic): $name" \
      "$(cat "$dir/front-seconds-insample.txt")"
  fi
  echo "   $name: real and simulated in $((SECONDS - began)) s"
}

BEGAN=$SECONDS
read -r -a CASES <<<"${CASES:-one-replica two-round-robin two-router}"
measured=""
for name in "${CASES[@]}"; do
  case "$name" in
    one-replica) threads=$THREADS; replicas=1; routing=round-robin; store="" ;;
    two-round-robin*) threads=$HALF; replicas=2; routing=round-robin ;;
    two-router*) threads=$HALF; replicas=2; routing=predicted-ttft ;;
    pd-1-1) threads=$HALF; replicas=pd; routing=predicted-ttft ;;
    pd-1-1-conditional) threads=$HALF; replicas=pd-conditional; routing=predicted-ttft ;;
    pd-1-1-conditional-stall) threads=$HALF; replicas=pd-conditional-stall; routing=predicted-ttft ;;
    *) echo "unknown case $name" >&2; exit 2 ;;
  esac
  case "$name" in *-store|pd-*) store=1 ;; *) store="" ;; esac  # real only
  if [ -n "${REAL_ONLY:-}" ]; then real_only=1; else real_only=$store; fi
  if [ -z "$real_only" ] && [[ " $measured " != *" $threads "* ]]; then
    measure "$threads"; measured="$measured $threads"
  fi
  run_case "$name" "$replicas" "$routing" "$threads" "$OUT/cost-model-t$threads.json" "$store" \
    "$real_only"
done

echo
echo "## real vs simulated, per configuration"
for name in "${CASES[@]}"; do
  echo
  echo "### $name"
  carpool bench compare --markdown "$OUT/$name/real.json" "$OUT/$name"/sim*.json 2>/dev/null \
    || echo "(real only)"
done
echo
echo "## the real runs side by side (A: one replica)"
REALS=()
for name in "${CASES[@]}"; do REALS+=("$OUT/$name/real.json"); done
carpool bench compare --markdown "${REALS[@]}" 2>/dev/null
echo
python - "$OUT" "${CASES[@]}" <<'EOF'
import json
import sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]


def pct(value):
    return "-" if value is None else f"{value:.1%}"


def ms(value):
    return "-" if value is None else f"{value * 1000:.0f}"


def error(real, sim):
    return "-" if not real or sim is None else f"{sim / real - 1:+.1%}"


print("## summary (real / simulated; TTFT error = simulated / real - 1, goal |p50| <= 15%)")
for name, side in [(name, side) for name in names
                   for side in ("sim", "sim-live", "sim-insample")]:
    if not (out / name / f"{side}.json").is_file():
        continue
    real, sim = (json.loads((out / name / f"{kind}.json").read_text())["summary"]
                 for kind in ("real", side))
    model = {"sim": "grid", "sim-live": "live", "sim-insample": "in-sample"}[side]
    r50, r99 = real["ttft"]["p50"], real["ttft"]["p99"]
    s50, s99 = sim["ttft"]["p50"], sim["ttft"]["p99"]
    good = [("-" if s.get("goodput") is None else f"{s['goodput']:.2f}") for s in (real, sim)]
    within = "" if not r50 or s50 is None else (" ok" if abs(s50 / r50 - 1) <= 0.15 else " OVER")
    print(f"{name:<16} {model} hit rate {pct(real.get('prefix_hit_rate'))} / "
          f"{pct(sim.get('prefix_hit_rate'))} | TTFT p50 {ms(r50)} / {ms(s50)} ms "
          f"({error(r50, s50)}{within}) | p99 {ms(r99)} / {ms(s99)} ms ({error(r99, s99)}) | "
          f"goodput {good[0]} / {good[1]} req/s | completed {real['completed']} / "
          f"{sim['completed']} of {real['requests']}")
EOF
echo "total $((SECONDS - BEGAN)) s; results under $OUT"
