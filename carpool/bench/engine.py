"""``carpool bench engine``: what one engine step costs without a model.

Drives the live ``LLMEngine`` with a ``FakeExecutor`` (no model, no KV
tensors; it samples a pseudo-random ordinary token per row) and the
model's real tokenizer, so detokenizing costs what it costs in serving.
``--num-seqs`` requests of ``--prompt-len`` random prompt tokens are
added at once; the bench steps until all of them decode together, runs
``--warmup-steps`` more, then times ``--steps`` steps: each step's wall
time and its phases (``StepPhases``: schedule, batch items and sampling
rows, executor, commit with the stop-token and length checks, outputs:
detokenizing, stop strings and per-request outputs, counters and step log). ``--step-seconds`` makes the fake wait as
a device would, from its launch (with ``--overlap on`` the previous step's
outputs are made meanwhile); the summary then gives the host time per step
beyond it. Requests are greedy with ``ignore_eos``
and long enough (``--output-len``, by default) that none finishes while
timed, so every timed step decodes exactly ``--num-seqs`` sequences.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import json
import pstats
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from carpool.config import EngineConfig
from carpool.engine.step_log import StepPhases
from carpool.model.config import ModelConfig
from carpool.sampling_params import SamplingParams
from carpool.settings_fields import add_setting_args, setting

if TYPE_CHECKING:  # the engine imports torch: only when the bench runs
    from carpool.engine.llm_engine import LLMEngine

PHASES = StepPhases._fields
PREFILLS_PER_STEP = 32  # whole prompts a step's token budget fits beside the decodes


@dataclass
class EngineBenchOptions:
    """The bench's own flags (the engine flags are added beside them)."""

    num_seqs: int = setting(
        1024, "--num-seqs", "NUM_SEQS", "sequences decoding together in every timed step",
        parse=int)
    steps: int = setting(200, "--steps", "STEPS", "steps timed", parse=int)
    warmup_steps: int = setting(
        20, "--warmup-steps", "WARMUP_STEPS", "steps run untimed once all sequences decode",
        parse=int)
    prompt_len: int = setting(
        128, "--prompt-len", "PROMPT_LEN", "prompt tokens per request", parse=int)
    output_len: int | None = setting(
        None, "--output-len", "OUTPUT_LEN",
        "max_tokens per request (default: enough that none finishes while timed)", parse=int)
    step_seconds: float = setting(
        0.0, "--step-seconds", "STEP_SECONDS",
        "seconds the fake executor waits per step (stands in for a device)", parse=float)
    bench_seed: int = setting(0, "--bench-seed", "BENCH_SEED", "seed of the random prompts",
                              parse=int)
    cprofile: str | None = setting(
        None, "--cprofile", "PATH",
        "cProfile the timed steps, write the stats here (pstats) and print the top functions; "
        "the profiler slows every step")
    json: str | None = setting(None, "--json", "JSON", "write the results here as JSON")


def add_engine_bench_args(parser: argparse.ArgumentParser) -> None:
    """The bench's own flags (``EngineBenchOptions``; the engine flags are added beside them)."""
    add_setting_args(parser.add_argument_group("engine bench"), EngineBenchOptions)


@dataclass
class EngineBenchResult:
    """Timed steps of one run: wall milliseconds per step, and per phase."""

    num_seqs: int
    prompt_len: int
    output_len: int
    step_ms: list[float]
    phase_ms: dict[str, list[float]]
    decode_seqs: list[int]
    step_seconds: float = 0.0  # the fake device's time per step
    overlap: bool = False

    def summary(self) -> dict:
        """Median and p90 of the step and of each phase, in milliseconds."""
        def stats(values: list[float]) -> dict[str, float]:
            return {"median": statistics.median(values), "p90": _quantile(values, 0.9),
                    "mean": statistics.fmean(values)}
        return {"num_seqs": self.num_seqs, "steps": len(self.step_ms),
                "prompt_len": self.prompt_len, "output_len": self.output_len,
                "step": stats(self.step_ms),
                "phases": {name: stats(ms) for name, ms in self.phase_ms.items()},
                "us_per_seq": 1000 * statistics.median(self.step_ms) / max(1, self.num_seqs),
                "step_seconds": self.step_seconds, "overlap": self.overlap,
                # What the host adds to a step beyond the device's time: all
                # of it without a device; with overlap, what it could not hide.
                "host_ms": statistics.median(self.step_ms) - 1000 * self.step_seconds}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def batched_tokens(config: EngineConfig, num_seqs: int, prompt_len: int) -> int:
    """The per-step token budget of the bench (see ``bench_config``)."""
    return max(config.scheduler.max_num_batched_tokens,
               num_seqs + PREFILLS_PER_STEP * prompt_len)


def bench_config(config: EngineConfig, num_seqs: int, prompt_len: int,
                 blocks_per_seq: int) -> EngineConfig:
    """``config`` with room for ``num_seqs`` decoding together: the sequence
    and queue limits raised to it, a token budget that also fits
    ``PREFILLS_PER_STEP`` prompts beside them (else decodes would crowd the
    last prefills out) and a pool of enough blocks (plus the watermark's
    share); continuous batching."""
    budget = batched_tokens(config, num_seqs, prompt_len)
    scheduler = dataclasses.replace(
        config.scheduler, max_num_seqs=max(num_seqs, config.scheduler.max_num_seqs),
        max_queue_requests=max(num_seqs, config.scheduler.max_queue_requests),
        max_num_batched_tokens=budget, batching="continuous", padding=None)
    needed = num_seqs * blocks_per_seq
    cache = dataclasses.replace(config.cache, num_blocks=int(needed * 1.1) + 64)
    return dataclasses.replace(config, scheduler=scheduler, cache=cache).validate()


def fake_model_config(vocab_size: int, eos_token_ids: list[int]) -> ModelConfig:
    """A model description carrying what the engine reads without a model
    (vocabulary size, EOS ids); the layer shapes are nominal."""
    return ModelConfig(architecture="llama", vocab_size=vocab_size, hidden_size=64,
                       intermediate_size=128, num_layers=1, num_heads=1, num_kv_heads=1,
                       head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                       max_position_embeddings=1 << 20, tie_word_embeddings=True,
                       attention_bias=False, bos_token_id=None, eos_token_ids=list(eos_token_ids))


def make_engine(config: EngineConfig, tokenizer, num_seqs: int, prompt_len: int,
                blocks_per_seq: int, step_seconds: float = 0.0) -> LLMEngine:
    """An engine on a ``FakeExecutor`` sampling ``tokenizer``'s ordinary
    tokens (no special token, no EOS)."""
    from carpool.engine.llm_engine import LLMEngine
    from carpool.executor.fake import FakeExecutor

    config = bench_config(config, num_seqs, prompt_len, blocks_per_seq)
    vocab = tokenizer.vocab_size
    special = set(tokenizer.all_special_ids) | set(tokenizer.eos_token_ids)
    ordinary = [t for t in range(vocab) if t not in special]
    executor = FakeExecutor(config.cache.num_blocks, config.cache.block_size, vocab,
                            token_ids=ordinary, step_seconds=step_seconds)
    max_len = blocks_per_seq * config.cache.block_size
    return LLMEngine(config, tokenizer, fake_model_config(vocab, tokenizer.eos_token_ids),
                     executor, max_len)


def run_bench(engine: LLMEngine, num_seqs: int, steps: int, warmup_steps: int,
              prompt_len: int, output_len: int, seed: int = 0,
              profiler: cProfile.Profile | None = None) -> EngineBenchResult:
    """Add the requests, step until all decode together, warm up, time
    ``steps`` (under ``profiler`` when given)."""
    rng = random.Random(seed)
    pool = engine.executor._pool
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for _ in range(num_seqs):
        engine.add_request([rng.choice(pool) for _ in range(prompt_len)], params)
    _step_until_all_decode(engine, num_seqs)
    for _ in range(warmup_steps):
        engine.step()
    step_ms, decode_seqs = [], []
    phase_ms: dict[str, list[float]] = {name: [] for name in PHASES}
    log = engine.step_log
    with profiler or contextlib.nullcontext():
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            step_ms.append(1000 * (time.perf_counter() - started))
            for name, seconds in zip(PHASES, engine.last_phases):
                phase_ms[name].append(1000 * seconds)
            decode_seqs.append(log.snapshot(1)[0][-1].shape.decode_seqs)
    return EngineBenchResult(num_seqs, prompt_len, output_len, step_ms, phase_ms, decode_seqs,
                             getattr(engine.executor, "step_seconds", 0.0), engine.overlap)


def _step_until_all_decode(engine: LLMEngine, num_seqs: int, most: int = 1_000_000) -> None:
    """Step through the prefills until one step decodes all ``num_seqs``."""
    log = engine.step_log
    for _ in range(most):
        engine.step()
        steps, _ = log.snapshot(1)
        shape = steps[-1].shape if steps else None
        if shape is not None and shape.decode_seqs == num_seqs and not shape.prefill_tokens:
            return
        if not engine.has_unfinished:
            break
    raise ValueError(f"the {num_seqs} sequences never decoded together (the pool or the "
                     f"output length is too small)")


def default_output_len(config: EngineConfig, num_seqs: int, prompt_len: int,
                       steps: int, warmup_steps: int) -> int:
    """Long enough that no request finishes while timed: the prefill steps
    (during which early requests decode already), warm-up, timed steps."""
    per_step = batched_tokens(config, num_seqs, prompt_len) - num_seqs
    prefill_steps = -(-num_seqs * prompt_len // max(prompt_len, per_step))
    return prefill_steps + warmup_steps + steps + 8


def format_summary(summary: dict) -> str:
    """The step and its phases, median and p90, as a Markdown table."""
    lines = [f"engine step, fake executor: {summary['num_seqs']} sequences decoding, "
             f"{summary['steps']} steps timed ({summary['prompt_len']} prompt tokens, "
             f"max_tokens {summary['output_len']})",
             "", "| phase | median ms | p90 ms | mean ms |", "|---|---:|---:|---:|"]
    rows = [("step (total)", summary["step"])] + list(summary["phases"].items())
    for name, stats in rows:
        lines.append(f"| {name} | {stats['median']:.3f} | {stats['p90']:.3f} | "
                     f"{stats['mean']:.3f} |")
    lines.append("")
    lines.append(f"{summary['us_per_seq']:.2f} us per sequence per step (median)")
    if summary.get("step_seconds"):
        lines.append(f"host time per step beyond the fake device's "
                     f"{1000 * summary['step_seconds']:g} ms: {summary['host_ms']:.3f} ms (median; "
                     f"overlap {'on' if summary['overlap'] else 'off'})")
    return "\n".join(lines)


def run_engine_bench(config: EngineConfig, args: argparse.Namespace) -> int:
    """``carpool bench engine``: print the table; ``--json``: write the summary."""
    from carpool.model.loader import load_tokenizer

    if args.num_seqs < 1 or args.steps < 1 or args.prompt_len < 1 or args.warmup_steps < 0:
        raise ValueError("--num-seqs, --steps and --prompt-len must be >= 1, "
                         "--warmup-steps >= 0")
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.model,
                               config.model.cache_dir)
    output_len = args.output_len or default_output_len(
        config, args.num_seqs, args.prompt_len, args.steps, args.warmup_steps)
    block = config.cache.block_size
    blocks_per_seq = -(-(args.prompt_len + output_len + 1) // block)
    engine = make_engine(config, tokenizer, args.num_seqs, args.prompt_len, blocks_per_seq,
                         args.step_seconds)
    profiler = cProfile.Profile() if args.cprofile else None
    result = run_bench(engine, args.num_seqs, args.steps, args.warmup_steps, args.prompt_len,
                       output_len, args.bench_seed, profiler)
    summary = result.summary()
    print(format_summary(summary))
    if profiler is not None:
        profiler.dump_stats(args.cprofile)
        print()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"summary": summary, "step_ms": result.step_ms, "decode_seqs": result.decode_seqs},
            indent=2))
    return 0
