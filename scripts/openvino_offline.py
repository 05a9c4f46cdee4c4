"""OpenVINO GenAI offline throughput: the external baseline for `carpool bench throughput`.

What it measures: one batched `LLMPipeline.generate` call (continuous batching,
paged attention, KV cache in u8 by default) over --num-requests prompts of
exactly --input-len random token ids, each generating exactly --output-len
tokens (greedy, ignore_eos, min_new_tokens = max_new_tokens). Reported: wall
seconds of that call, output tokens counted from the results, output tok/s,
and every setting. Prompts are random non-special token ids (seeded), like
carpool's own workload, passed as token ids so their length is exact.

Run it through scripts/openvino_offline.sh (venv + model conversion), alone on
the machine (it uses every core):
    flock /tmp/w/BENCH_LOCK scripts/openvino_offline.sh "" --num-requests 64 --json out.json
or directly with the venv's python:
    ~/.cache/carpool/openvino-venv/bin/python scripts/openvino_offline.py --help
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

DEFAULT_MODEL = Path.home() / ".cache/carpool/openvino/SmolLM2-135M-Instruct-int4"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL), help="OpenVINO IR directory")
    p.add_argument("--device", default="CPU")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed warmup runs (each: min(4, N) requests, 8 output tokens)")
    # SchedulerConfig (continuous batching); unset flags keep the library defaults.
    p.add_argument("--cache-size", type=int, default=2,
                   help="KV cache size in GB (0 = dynamic allocation)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="overrides --cache-size")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--no-dynamic-split-fuse", action="store_true")
    # CPU plugin properties ('' = plugin default).
    p.add_argument("--kv-cache-precision", default="u8", help="u8, f16, bf16, f32 or ''")
    p.add_argument("--inference-precision", default="",
                   help="INFERENCE_PRECISION_HINT, e.g. f32 or bf16 ('' = plugin default)")
    p.add_argument("--num-threads", type=int, default=0, help="INFERENCE_NUM_THREADS (0 = all)")
    p.add_argument("--json", default=None, help="also write the result here")
    return p.parse_args()


def make_prompts(model_dir: str, n: int, length: int, seed: int) -> np.ndarray:
    """n x length random token ids, none of them special (as carpool's workload)."""
    from transformers import AutoTokenizer  # in the venv; only used for vocab/special ids
    tok = AutoTokenizer.from_pretrained(model_dir)
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    allowed = [t for t in range(len(tok)) if t not in special]
    rng = random.Random(seed)
    return np.array([[rng.choice(allowed) for _ in range(length)] for _ in range(n)],
                    dtype=np.int64)


def weight_types(model_dir: str) -> dict[str, int]:
    """Parameters per element type of the IR's weight constants (e.g. u4 / u8 / f32)."""
    counts: dict[str, int] = {}
    for op in ov.Core().read_model(Path(model_dir, "openvino_model.xml")).get_ops():
        shape = op.get_output_partial_shape(0)
        if op.get_type_name() == "Constant" and shape.rank.get_length() >= 2:
            t = op.get_output_element_type(0).get_type_name()
            counts[t] = counts.get(t, 0) + int(np.prod(list(op.get_output_shape(0))))
    return counts


def run(pipe, ids: np.ndarray, output_len: int) -> tuple[float, list[int]]:
    """One batched generate over all rows; returns (seconds, tokens generated per request)."""
    inputs = ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = output_len
    cfg.min_new_tokens = output_len
    cfg.ignore_eos = True
    cfg.do_sample = False  # greedy
    started = time.perf_counter()
    res = pipe.generate(inputs, cfg)
    seconds = time.perf_counter() - started
    return seconds, [len(t) for t in res.tokens]


def main() -> int:
    a = parse_args()
    sched = ov_genai.SchedulerConfig()
    sched.cache_size = a.cache_size
    if a.num_kv_blocks is not None:
        sched.num_kv_blocks = a.num_kv_blocks
    if a.max_num_seqs is not None:
        sched.max_num_seqs = a.max_num_seqs
    if a.max_num_batched_tokens is not None:
        sched.max_num_batched_tokens = a.max_num_batched_tokens
    sched.dynamic_split_fuse = not a.no_dynamic_split_fuse
    props: dict = {"scheduler_config": sched}  # scheduler_config => continuous batching
    if a.kv_cache_precision:
        props["KV_CACHE_PRECISION"] = a.kv_cache_precision
    if a.inference_precision:
        props["INFERENCE_PRECISION_HINT"] = a.inference_precision
    if a.num_threads:
        props["INFERENCE_NUM_THREADS"] = a.num_threads

    ids = make_prompts(a.model_dir, a.num_requests, a.input_len, a.seed)
    t0 = time.perf_counter()
    pipe = ov_genai.LLMPipeline(a.model_dir, a.device, **props)
    load_s = time.perf_counter() - t0
    for _ in range(a.warmup):
        run(pipe, ids[: min(4, len(ids))], 8)
    seconds, per_request = run(pipe, ids, a.output_len)
    out_tokens = sum(per_request)

    core = ov.Core()
    result = {
        "system": "openvino_genai LLMPipeline (continuous batching)",
        "requests": a.num_requests, "input_len": a.input_len, "output_len": a.output_len,
        "prompt_tokens": int(ids.size), "output_tokens": out_tokens,
        "expected_output_tokens": a.num_requests * a.output_len,
        "min_max_output_per_request": [min(per_request), max(per_request)],
        "seconds": round(seconds, 4), "output_tps": round(out_tokens / seconds, 2),
        "total_tps": round((ids.size + out_tokens) / seconds, 2),
        "load_seconds": round(load_s, 2), "warmup_runs": a.warmup, "seed": a.seed,
        "model_dir": a.model_dir, "device": a.device,
        "weight_params_by_type": weight_types(a.model_dir),
        "scheduler_config": {k: getattr(sched, k) for k in (
            "cache_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
            "dynamic_split_fuse", "enable_prefix_caching")},
        "properties_set": {k: str(v) for k, v in props.items() if k != "scheduler_config"},
        "cpu_defaults": {k: core.get_property(a.device, k).get_type_name() for k in (
            "KV_CACHE_PRECISION", "INFERENCE_PRECISION_HINT")},
        "cpu": core.get_property(a.device, "FULL_DEVICE_NAME"), "cores": os.cpu_count(),
        "versions": {p: version(p) for p in ("openvino", "openvino-genai",
                                             "openvino-tokenizers", "optimum-intel", "nncf")},
        "python": platform.python_version(),
    }
    print(json.dumps(result, indent=2))
    print(f"openvino_genai: {out_tokens} output tokens in {seconds:.3f} s = "
          f"{out_tokens / seconds:.1f} output tok/s ({a.num_requests} x {a.input_len}+"
          f"{a.output_len})")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    if out_tokens != a.num_requests * a.output_len:
        print(f"WARNING: expected {a.num_requests * a.output_len} output tokens")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
