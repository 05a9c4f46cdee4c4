#!/usr/bin/env bash
# carpool vs llama.cpp's llama-server, side by side over HTTP on the same
# requests (128 prompt + 128 output tokens, streaming), one server at a
# time, at concurrency 1, 8, 32 and 64; then offline, carpool's engine vs
# OpenVINO GenAI int4 at 64 and 256 requests of 128 + 128 tokens: README
# "Numbers", the speed issues' tables. Run it alone: any other process on a
# small machine skews it. Every carpool server is the default `carpool
# serve` (CARPOOL_FLAGS adds flags).
#
#   scripts/side_by_side.sh [OUTDIR] [SERVERS...]
#
# SERVERS (default: all): llama-f16 llama-q4_1 carpool-bf16 carpool-int8
# carpool-int4 carpool-w8a8, and the offline rows offline-carpool,
# offline-carpool-w8a8 and offline-openvino (scripts/openvino_offline.sh
# makes its venv on first use). Writes OUTDIR/machine.txt (this machine
# kind: CPU, tier, flags), OUTDIR/<server>-c<N>.json (`carpool bench
# serve` results), OUTDIR/<offline row>-n<N>.json, and prints one `carpool
# bench compare` table per concurrency and the offline tok/s.
set -euo pipefail
out="${1:-side-by-side}"; shift || true
servers=("$@"); [ ${#servers[@]} -gt 0 ] || servers=(llama-f16 llama-q4_1 carpool-bf16 carpool-int8
    carpool-int4 carpool-w8a8 offline-carpool offline-carpool-w8a8 offline-openvino)
port=8790
mkdir -p "$out"
python - >"$out/machine.txt" <<'EOF'
from carpool.kernel_plan import TIERS, plan_kernels
from carpool.machine import available_cpus, cpu_model_and_flags
model, flags = cpu_model_and_flags()
known = sorted({flag for _, needs in TIERS for flag in needs} & flags)
print(f"{model}, {available_cpus()} CPUs; kernel tier {plan_kernels(flags).isa} "
      f"({' '.join(known)})")
EOF
cat "$out/machine.txt"
cache="${CARPOOL_CACHE:-$HOME/.cache/carpool}"
bin=""
q41="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"   # the default model's own file
f16="$cache/llama.cpp/SmolLM2-135M-Instruct.F16.gguf"

llama_files() {
    bin=$(scripts/build_llama_cpp.sh)
    [ -f "$q41" ] || carpool generate "hi" --max-tokens 1 >/dev/null   # fetches the GGUF
    # F16 of the same (Q4_1-rounded) weights carpool's bf16 loads.
    [ -f "$f16" ] || LD_LIBRARY_PATH="$bin" "$bin/llama-quantize" --allow-requantize \
        "$q41" "$f16" F16 >/dev/null 2>&1
}

start() {  # server name -> starts it in the background, sets $pid
    case "$1" in
        llama-f16|llama-q4_1)
            [ -n "$bin" ] || llama_files
            model=$([ "$1" = llama-f16 ] && echo "$f16" || echo "$q41")
            # 64 slots of 256 tokens: every request of concurrency 64 runs at once.
            LD_LIBRARY_PATH="$bin" "$bin/llama-server" -m "$model" --host 127.0.0.1 \
                --port $port -c 16384 -np 64 -t "$(nproc)" >"$out/$1.log" 2>&1 &
            pid=$! ;;
        carpool-*)
            quant=${1#carpool-}; flags=()
            [ "$quant" = bf16 ] || flags=(--quantization "$quant")
            # The default server, as users run it (CARPOOL_FLAGS: extra flags,
            # e.g. "--adaptive false" for the plain rows of earlier tables).
            # shellcheck disable=SC2086
            carpool serve --port $port "${flags[@]}" ${CARPOOL_FLAGS:-} >"$out/$1.log" 2>&1 &
            pid=$! ;;
        *) echo "unknown server $1" >&2; exit 2 ;;
    esac
    for _ in $(seq 1 300); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
        kill -0 $pid 2>/dev/null || { echo "$1 died; see $out/$1.log" >&2; exit 1; }
        sleep 1
    done
    echo "$1 did not start" >&2; exit 1
}

offline() {  # row -> OUTDIR/<row>-n64.json and -n256.json
    for n in 64 256; do
        case "$1" in
            offline-openvino) scripts/openvino_offline.sh "" --num-requests $n \
                --input-len 128 --output-len 128 --json "$out/$1-n$n.json" >/dev/null ;;
            offline-carpool*)
                flags=(); [ "$1" = offline-carpool ] || flags=(--quantization "${1#offline-carpool-}")
                carpool bench throughput --num-requests $n --input-len 128 --output-len 128 \
                    --hf-batch-sizes '' "${flags[@]}" --json "$out/$1-n$n.json" >/dev/null ;;
            *) echo "unknown offline row $1" >&2; exit 2 ;;
        esac
    done
}

served=()
for server in "${servers[@]}"; do
    case "$server" in offline-*) offline "$server"; continue ;; esac
    served+=("$server")
    start "$server"
    url="http://127.0.0.1:$port/v1"
    # Warm-up (kernels built per shape on first use), not recorded.
    carpool bench serve --base-url "$url" --max-concurrency 16 --rate 1000 \
        --num-requests 16 --input-len 128 --output-len 32 >/dev/null
    for conc in 1 8 32 64; do
        n=$([ $conc = 1 ] && echo 8 || echo 64)
        carpool bench serve --base-url "$url" --max-concurrency $conc --rate 1000 \
            --num-requests $n --input-len 128 --output-len 128 --label "$server" \
            --json "$out/$server-c$conc.json" >/dev/null
    done
    kill -TERM $pid; wait $pid || true
done
if [ ${#served[@]} -gt 0 ]; then
    for conc in 1 8 32 64; do
        echo "## concurrency $conc"
        carpool bench compare --markdown $(for s in "${served[@]}"; do echo "$out/$s-c$conc.json"; done)
    done
fi
python - "$out" "${servers[@]}" <<'EOF'
import json, sys
from pathlib import Path
out, rows = Path(sys.argv[1]), [r for r in sys.argv[2:] if r.startswith("offline-")]
for row in rows:
    runs = [json.loads((out / f"{row}-n{n}.json").read_text()) for n in (64, 256)]
    tps = [run["results"][0]["output_tps"] if "results" in run else run["output_tps"]
           for run in runs]  # carpool bench throughput's, openvino_offline.py's
    print(f"{row}: output tok/s at 64 / 256 requests: {tps[0]:.1f} / {tps[1]:.1f}")
EOF
