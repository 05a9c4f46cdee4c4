#!/usr/bin/env bash
# OpenVINO GenAI offline-throughput baseline, to set beside `carpool bench throughput`.
#
# 1. Makes a separate venv (default ~/.cache/carpool/openvino-venv; never the main
#    Python) with a CPU torch and pinned transformers / optimum-intel / nncf /
#    openvino-genai versions that resolve together.
# 2. Once: turns carpool's default GGUF (SmolLM2-135M-Instruct Q4_1, from carpool's
#    cache; no Hugging Face Hub needed) into an HF checkpoint (dequantized fp32, by
#    carpool's converter in the main Python) and exports it to OpenVINO IR with
#    optimum-cli, as OpenVINO GenAI users do: int4 (asym, group size 64, ratio 1.0),
#    plus int8 and fp16 variants, into
#    ~/.cache/carpool/openvino/SmolLM2-135M-Instruct-{int4,int8,fp16} (skipped if present).
# 3. Runs scripts/openvino_offline.py with the venv's python (int4 model by default),
#    passing the remaining arguments through: one batched continuous-batching
#    generate of N x (input-len prompt + output-len output) tokens, u8 KV cache.
#
# Usage: scripts/openvino_offline.sh [VENV_DIR] [openvino_offline.py args...]
#   e.g. flock /tmp/w/BENCH_LOCK scripts/openvino_offline.sh --num-requests 64 --json ov.json
#        scripts/openvino_offline.sh "" --model-dir ~/.cache/carpool/openvino/SmolLM2-135M-Instruct-int8
# Env: OV_FORMATS (default "int4 int8 fp16"), CARPOOL_PYTHON (python with carpool,
#      default `python`), GGUF (skip carpool's lookup), TORCH_SPEC (default torch==2.13.0).
# Run timed runs alone (flock the bench lock): OpenVINO uses every core.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=""
if (($#)) && [[ "$1" != -* ]]; then VENV=$1; shift; fi
VENV=${VENV:-$HOME/.cache/carpool/openvino-venv}
OUT_ROOT=$HOME/.cache/carpool/openvino
OV_FORMATS=${OV_FORMATS:-int4 int8 fp16}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# Versions that pip resolved consistently together (optimum-intel 2.2.0 caps
# transformers<5.6 and huggingface-hub<1.22).
PINS=(transformers==5.5.4 tokenizers==0.22.2 huggingface-hub==1.21.0 gguf==0.19.0
      optimum==2.3.0 "optimum-intel[openvino]==2.2.0" nncf==3.4.0
      openvino==2026.4.1 openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0)
PY=$VENV/bin/python

# --- 1. venv --------------------------------------------------------------
STAMP="$VENV/.carpool-openvino-pins"
if [[ ! -x $PY || "$(cat "$STAMP" 2>/dev/null)" != "$TORCH_SPEC ${PINS[*]}" ]]; then
  [[ -x $PY ]] || python3 -m venv "$VENV"
  "$PY" -m pip install -q -U pip
  # Torch first, and only a CPU build: refuse anything that would pull CUDA wheels.
  picked=$("$PY" -m pip install --dry-run --no-deps -q --report - "$TORCH_SPEC" | "$PY" -c '
import json, sys; r = json.load(sys.stdin)["install"]
print(r[0]["metadata"]["version"] if r else "installed")')
  if [[ $picked != *+cpu* && $picked != installed ]]; then
    echo "pip would install torch $picked (not a +cpu build); point pip at a CPU wheel" \
         "(e.g. PIP_FIND_LINKS or TORCH_SPEC=/path/torch-...+cpu...whl)" >&2
    exit 1
  fi
  "$PY" -m pip install -q "$TORCH_SPEC"
  "$PY" -m pip install -q "$TORCH_SPEC" "${PINS[@]}"
  # optimum-intel requires torchvision, and the one pip finds is built against CUDA
  # torch (its ops fail to load with the CPU torch, which breaks transformers' imports);
  # only optimum-intel's vision-language models use it.
  "$PY" -m pip uninstall -q -y torchvision || true
  "$PY" -c 'import torch; assert torch.version.cuda is None, torch.__version__'
  echo "$TORCH_SPEC ${PINS[*]}" >"$STAMP"
fi

# --- 2. model conversion (once) ---------------------------------------------
missing=()
for fmt in $OV_FORMATS; do
  [[ -f $OUT_ROOT/SmolLM2-135M-Instruct-$fmt/openvino_model.xml ]] || missing+=("$fmt")
done
if ((${#missing[@]})); then
  GGUF=${GGUF:-$(${CARPOOL_PYTHON:-python} -c "from carpool.model.hub import fetch_default_model
from carpool.paths import default_cache_dir; print(fetch_default_model(default_cache_dir()))")}
  mkdir -p "$OUT_ROOT"
  TMP=$(mktemp -d "$OUT_ROOT/.convert.XXXXXX")
  trap 'rm -rf "$TMP"' EXIT
  # GGUF -> HF with carpool's own converter: the fp32 weights carpool serves (identical
  # to transformers' gguf_file= loading) and a correct byte-level BPE tokenizer.json
  # (transformers 5.5's GGUF loader, the newest optimum-intel 2.2 allows, turns
  # SmolLM2's tokenizer into a broken Metaspace/CodeLlama one).
  ${CARPOOL_PYTHON:-python} -c 'import sys, torch; from carpool.model.gguf_convert import convert_gguf
print("HF checkpoint:", convert_gguf(sys.argv[1], sys.argv[2], torch.float32))' "$GGUF" "$TMP/hf"
  for fmt in "${missing[@]}"; do
    extra=()
    # hidden size 576 is not a multiple of the default group size 128
    [[ $fmt == int4 ]] && extra=(--group-size 64 --ratio 1.0)
    "$VENV/bin/optimum-cli" export openvino --model "$TMP/hf" --task text-generation-with-past \
      --weight-format "$fmt" "${extra[@]}" "$TMP/$fmt" 2>&1 | grep -v -E 'Warning|^\s+"__module' || true
    [[ -f $TMP/$fmt/openvino_model.xml ]] || { echo "export $fmt failed" >&2; exit 1; }
    mv "$TMP/$fmt" "$OUT_ROOT/SmolLM2-135M-Instruct-$fmt"
    echo "wrote $OUT_ROOT/SmolLM2-135M-Instruct-$fmt"
  done
  rm -rf "$TMP"; trap - EXIT
fi

# --- 3. benchmark -------------------------------------------------------------
exec "$PY" scripts/openvino_offline.py "$@"
