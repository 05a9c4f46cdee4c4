#!/usr/bin/env bash
# The simulator's output on the workloads refactors must not change, for a
# before/after diff (issue 15's constraint):
#
#   scripts/sim_identity.sh OUT_DIR            # six runs, a few seconds each
#   SCALE=1 scripts/sim_identity.sh OUT_DIR    # and the README's scale command, timed
#
# then `python scripts/sim_identity.py OLD_DIR NEW_DIR` compares them (wall
# times excluded). Needs the whole traces (../shared/traces or `carpool traces
# download`); the excerpts give other windows.
set -euo pipefail
OUT=${1:?usage: scripts/sim_identity.sh OUT_DIR}
mkdir -p "$OUT"
sim() { local name=$1; shift; carpool simulate "$@" --json "$OUT/$name.json" >/dev/null; }

sim azure-conv-2-replicas --workload azure-conv --arrival trace --token-scale 0.125 \
  --time-scale 4 --num-requests 500 --replicas 2
sim mooncake-conv-tiny-pool --workload mooncake-conv --arrival trace --token-scale 0.0625 \
  --num-requests 300 --num-blocks 96
sim mooncake-synthetic-priority --workload mooncake-synthetic --arrival trace \
  --token-scale 0.0625 --num-requests 300 --scheduling-policy priority
sim azure-conv-no-fast-forward --workload azure-conv --arrival trace --token-scale 0.125 \
  --time-scale 4 --num-requests 500 --no-fast-forward
sim sharegpt-cpu-profile --workload sharegpt --arrival poisson --rate 2 --token-scale 0.125 \
  --num-requests 400
sim sharegpt-dynamic-padded --workload sharegpt --arrival poisson --rate 2 --token-scale 0.125 \
  --num-requests 300 --batching dynamic --preferred-batch-size 8 --max-wait 0.05 --padding left
if [[ -n "${SCALE:-}" ]]; then
  start=$(date +%s.%N)
  sim scale --hardware h100-sxm --model-shape llama-3-8b --replicas 10 --workload azure-conv \
    --arrival trace --time-scale 0.1 --trace-loop --num-requests 193660
  python -c "print(f'scale command: {$(date +%s.%N) - $start:.1f} s')" | tee "$OUT/scale-time.txt"
fi
