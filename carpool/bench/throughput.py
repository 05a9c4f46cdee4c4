"""``carpool bench throughput``: offline throughput of carpool's continuous
batching against HF transformers ``generate`` with static batches, on the
same requests in the same run.

Every request has ``ignore_eos`` (and HF ``min_new_tokens``) so both sides
generate exactly the drawn output lengths. Static batching runs each batch
until its longest member finishes; only each request's own tokens count as
output, which is what a static server delivers.
"""
from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from carpool.config import EngineConfig
from carpool.settings_fields import add_setting_args, setting


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class BenchResult:
    system: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


@dataclass
class ThroughputWorkload:
    """Request lengths: fixed, or drawn from a lengths file."""

    num_requests: int = setting(
        256, "--num-requests", "NUM_REQUESTS", "requests in the workload", parse=int)
    input_len: int = setting(128, "--input-len", "INPUT_LEN", "synthetic prompt length", parse=int)
    output_len: int = setting(
        128, "--output-len", "OUTPUT_LEN", "synthetic output length", parse=int)
    lengths_file: str | None = setting(
        None, "--lengths-file", "LENGTHS_FILE",
        "CSV with num_prefill_tokens,num_decode_tokens columns (e.g. "
        "../shared/traces/lengths/*.csv); lengths are drawn from it")
    length_scale: float = setting(
        1.0, "--length-scale", "LENGTH_SCALE",
        "multiply drawn lengths by this (e.g. 0.125 for a small CPU)", parse=float)
    max_input_len: int = setting(
        1024, "--max-input-len", "MAX_INPUT_LEN",
        "cap on a drawn prompt length (after --length-scale)", parse=int)
    max_output_len: int = setting(
        512, "--max-output-len", "MAX_OUTPUT_LEN",
        "cap on a drawn output length (after --length-scale)", parse=int)
    bench_seed: int = setting(
        0, "--bench-seed", "BENCH_SEED", "seed for lengths and prompts", parse=int)


@dataclass
class HFBaseline:
    """The transformers ``generate`` baseline: static batches."""

    hf_batch_sizes: str = setting(
        "1,8,32,64", "--hf-batch-sizes", "HF_BATCH_SIZES",
        "static batch sizes for the transformers baseline ('' to skip it)")
    hf_dtypes: str = setting(
        "float32,bfloat16", "--hf-dtypes", "HF_DTYPES",
        "dtypes to try for the baseline; the best is the reference")
    hf_batches: int = setting(
        2, "--hf-batches", "HF_BATCHES",
        "static batches run per baseline batch size (the first requests of the workload; 0 = "
        "all of them); tok/s is a rate, so a sample suffices and keeps batch size 1 affordable",
        parse=int)


@dataclass
class ThroughputOutputs:
    """Where the results go."""

    json: str | None = setting(None, "--json", "JSON", "write the results here as JSON")


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    add_setting_args(parser.add_argument_group("baseline"), HFBaseline)
    add_setting_args(parser, ThroughputOutputs)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Request lengths: fixed, or drawn from a lengths file (``ThroughputWorkload``)."""
    add_setting_args(parser.add_argument_group("workload"), ThroughputWorkload)


def make_workload(args: argparse.Namespace, vocab_size: int,
                  special_ids: set[int]) -> list[BenchRequest]:
    """Lengths from a file (scaled, clamped) or fixed; prompts are random
    non-special token ids, so every engine does the same work."""
    rng = random.Random(args.bench_seed)
    if args.lengths_file:
        with open(args.lengths_file, newline="", encoding="utf-8") as f:
            rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]))
                    for r in csv.DictReader(f)]
        drawn = [rows[rng.randrange(len(rows))] for _ in range(args.num_requests)]
        lengths = [(_scale(i, args.length_scale, args.max_input_len),
                    _scale(o, args.length_scale, args.max_output_len)) for i, o in drawn]
    else:
        lengths = [(args.input_len, args.output_len)] * args.num_requests
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    return [BenchRequest([rng.choice(allowed) for _ in range(i)], o) for i, o in lengths]


def _scale(value: int, factor: float, cap: int) -> int:
    return max(1, min(cap, round(value * factor)))


def run_carpool(config: EngineConfig, workload: list[BenchRequest]) -> tuple[BenchResult, dict]:
    from carpool.engine.llm_engine import LLMEngine
    from carpool.sampling_params import SamplingParams

    # An offline benchmark queues its whole workload at once, as static batching sees it.
    queue = config.scheduler
    queue.max_queue_requests = max(queue.max_queue_requests, len(workload))
    queue.max_queue_tokens = None
    engine = LLMEngine.from_config(config)
    # Warm up (first-call allocations, thread pools) outside the timing.
    engine.add_request(workload[0].prompt_token_ids, SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished:
        engine.step()
    start_counters = (engine.counters.steps, engine.scheduler.num_preemptions)
    started = time.perf_counter()
    for request in workload:
        engine.add_request(request.prompt_token_ids, SamplingParams(
            max_tokens=request.output_len, temperature=0, ignore_eos=True))
    produced = 0
    while engine.has_unfinished:
        produced += len(engine.step())
    seconds = time.perf_counter() - started
    stats = engine.scheduler.kv.stats()
    info = {"steps": engine.counters.steps - start_counters[0],
            "preemptions": engine.scheduler.num_preemptions - start_counters[1],
            "dtype": str(engine.executor.dtype).replace("torch.", ""),
            "kv_blocks": stats.num_blocks, "prefix_hit_rate": round(stats.prefix_hit_rate, 4)}
    result = BenchResult("carpool (continuous)", len(workload),
                         sum(len(r.prompt_token_ids) for r in workload),
                         sum(r.output_len for r in workload), seconds)
    return result, info


def run_hf_static(model_dir: Path, workload: list[BenchRequest], batch_size: int, dtype: str,
                  num_batches: int, pad_id: int) -> BenchResult:
    """transformers ``generate``, greedy, static batches of ``batch_size``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    count = len(workload) if num_batches <= 0 else min(len(workload), batch_size * num_batches)
    requests = workload[:count]
    output_tokens = 0
    started = time.perf_counter()
    for begin in range(0, count, batch_size):
        batch = requests[begin:begin + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, request in enumerate(batch):  # left padding, as generate expects
            ids[row, width - len(request.prompt_token_ids):] = torch.tensor(request.prompt_token_ids)
            mask[row, width - len(request.prompt_token_ids):] = 1
        longest = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=pad_id)
        output_tokens += sum(r.output_len for r in batch)
    seconds = time.perf_counter() - started
    return BenchResult(f"HF static b={batch_size} {dtype}", count,
                       sum(len(r.prompt_token_ids) for r in requests), output_tokens, seconds)


def run_throughput(config: EngineConfig, args: argparse.Namespace) -> int:
    from carpool.model.loader import load_model
    from carpool.paths import default_cache_dir

    cache_dir = Path(config.model.cache_dir) if config.model.cache_dir else default_cache_dir()
    loaded = load_model(config.model.model, cache_dir)
    tokenizer = loaded.tokenizer
    workload = make_workload(args, loaded.config.vocab_size, set(tokenizer.all_special_ids))
    del loaded
    ours, info = run_carpool(config, workload)
    results = [ours]
    _print_row(ours, None)
    batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b.strip()]
    model_dir = load_model(config.model.model, cache_dir).path
    pad_id = tokenizer.eos_token_ids[0]
    for dtype in [d for d in args.hf_dtypes.split(",") if d.strip()]:
        for batch_size in batch_sizes:
            result = run_hf_static(model_dir, workload, batch_size, dtype.strip(),
                                   args.hf_batches, pad_id)
            results.append(result)
            _print_row(result, ours)
    _print_summary(results, info, args)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"config": {k: v for k, v in vars(args).items() if k != "func"}, "carpool": info,
             "results": [asdict(r) | {"output_tps": r.output_tps, "total_tps": r.total_tps}
                         for r in results]}, indent=2, default=str))
    return 0


def _print_row(result: BenchResult, ours: BenchResult | None) -> None:
    ratio = f"  (carpool {ours.output_tps / result.output_tps:.2f}x)" if ours else ""
    print(f"{result.system:<30} {result.requests:>5} req  {result.output_tps:8.1f} out tok/s  "
          f"{result.total_tps:8.1f} total tok/s  {result.seconds:7.1f} s{ratio}", flush=True)


def _print_summary(results: list[BenchResult], info: dict, args: argparse.Namespace) -> None:
    ours, baselines = results[0], results[1:]
    print()
    print("| system | requests | output tok/s | total tok/s | carpool speed-up (output) |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.system} | {r.requests} | {r.output_tps:.1f} | {r.total_tps:.1f} | "
              f"{ours.output_tps / r.output_tps:.2f}x |")
    if baselines:
        best = max(baselines, key=lambda r: r.output_tps)
        print(f"\ncarpool vs best static batching ({best.system}): "
              f"{ours.output_tps / best.output_tps:.2f}x output tok/s")
    print(f"carpool: {info}", file=sys.stderr)
