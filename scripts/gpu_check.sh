#!/usr/bin/env bash
# carpool's GPU checks in one run (scripts/gpu_check.py says what they are).
# On a CUDA machine with torch and Triton installed, from a checkout (no
# install needed, nothing downloaded):
#   scripts/gpu_check.sh                 # results in $OUT (or .)/gpu_check.json
#   scripts/gpu_check.sh --dry-run       # the same sections on the CPU, tiny model
#   scripts/gpu_check.sh --only kernels,greedy
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-.}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
fi
exec python3 scripts/gpu_check.py --out "$out_dir/gpu_check.json" "$@"
