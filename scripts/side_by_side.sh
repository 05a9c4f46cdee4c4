#!/usr/bin/env bash
# carpool vs llama.cpp's llama-server, side by side over HTTP on the same
# requests (128 prompt + 128 output tokens, streaming), one server at a
# time, at concurrency 1, 8, 32 and 64: README "Numbers", the speed issue's
# table. Run it alone: any other process on a small machine skews it.
#
#   scripts/side_by_side.sh [OUTDIR] [SERVERS...]
#
# SERVERS (default: all): llama-f16 llama-q4_1 carpool-bf16 carpool-int8
# carpool-int4. Writes OUTDIR/<server>-c<N>.json (`carpool bench serve`
# results) and prints one `carpool bench compare` table per concurrency.
set -euo pipefail
out="${1:-side-by-side}"; shift || true
servers=("$@"); [ ${#servers[@]} -gt 0 ] || servers=(llama-f16 llama-q4_1 carpool-bf16 carpool-int8 carpool-int4)
port=8790
mkdir -p "$out"
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

for server in "${servers[@]}"; do
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
for conc in 1 8 32 64; do
    echo "## concurrency $conc"
    carpool bench compare --markdown $(for s in "${servers[@]}"; do echo "$out/$s-c$conc.json"; done)
done
