"""``carpool measure``: measure the real engine's step time on this machine
and fit the measured cost model (carpool/sim/fitted.py) the simulator uses.

The grid covers prefill chunks of several sizes, decode batches of several
sizes at several context lengths, and mixed steps (decodes with a prefill
chunk). Every step the engine runs is a sample: its shape comes from the
batch the executor receives, its time is the whole ``LLMEngine.step()``
wall time (scheduling and detokenizing included, as a simulated step must
advance the clock by all of it), with the idle gap before it. Prompts are
random tokens, so no prefix cache hit shortens a step. A few prefills run
after the engine idled (``Scenario.idle_before``): real traffic starts most
first-token steps after a gap, and a step after idling costs more (the
fitted form's wake term).
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from carpool.config import EngineConfig
from carpool.engine.step_log import kv_bytes_per_token
from carpool.executor.shapes import (
    DEFAULT_ROW_BUCKET,
    EXACT_ROWS,
    ShapeMemory,
    StepSample,
    StepShape,
)
from carpool.machine import available_cpus, machine_identity
from carpool.measure.steps import save_steps
from carpool.settings_fields import add_setting_args, setting
from carpool.sim.costs import save_cost_model
from carpool.sim.fitted import FEATURES, FittedCostModel, fit


@dataclass(frozen=True)
class Scenario:
    """Requests added together: ``count`` prompts of ``prompt_len`` tokens,
    each generating ``output_len``; with ``late_prompt`` one more request of
    that length joins once all of them decode, so that the step after it is
    the mixed step the label names (its prompt beside ``count`` decodes)."""

    label: str
    count: int
    prompt_len: int
    output_len: int
    late_prompt: int = 0
    idle_before: float = 0.0  # seconds the engine idles before the requests come
    rounds: int = 1  # times the whole scenario runs, one after another


WAKE_IDLE_S = 0.5  # the idle gap of the wake points: the wake cost's whole (99%)
PREFILL_ROUNDS = 3


GRIDS = ("smoke", "quick", "full")


def grid(size: str, max_batch_tokens: int, max_seqs: int) -> list[Scenario]:
    """Prefill chunks, decode batches x contexts, mixed steps (within the
    engine's limits). ``full`` (~5 min for the default model on a 2-core
    CPU); ``quick`` (~1 min) keeps every kind and the corners of the
    full grid's batch x context range, so the fit is not extrapolated
    where real traffic goes; ``smoke`` (seconds: tests; a poor fit)."""
    if size not in GRIDS:
        raise ValueError(f"grid must be one of {', '.join(GRIDS)}, got {size!r}")
    # Prefill chunks and mixed steps where real traffic puts them (replays of
    # the shared traces: mostly 16-150-token prompts, one or two decodes
    # beside a chunk), and at the batch x context corners.
    if size == "smoke":
        prefills, batches, contexts, mixed = [8, 32], [1, 4], [16, 48], [(4, 32, 24)]
        woken = [8]
    elif size == "quick":
        prefills, batches, contexts = [16, 32, 64, 128, 256, 512], [1, 8, 32], [64, 512]
        mixed = [(1, 64, 32), (2, 128, 128), (1, 64, 384), (8, 256, 128), (32, 32, 256)]
        woken = [32, 128]
    else:
        prefills = [16, 32, 64, 128, 256, 512, 1024]
        batches, contexts = [1, 4, 16, 64], [64, 256, 1024]
        # (decodes, their context, the chunk that joins them)
        mixed = [(1, 64, 32), (2, 128, 128), (1, 64, 384), (8, 256, 128), (16, 128, 256),
                 (32, 32, 512), (64, 32, 256)]
        woken = [32, 128, 512]
    # A prefill is one step: rounds of it, for as many samples as a decode
    # point's run gives (a 3 ms effect is within one step's noise).
    rounds = 1 if size == "smoke" else PREFILL_ROUNDS
    out = [Scenario(f"prefill {t}", 1, t, 1, rounds=rounds)
           for t in prefills if t <= max_batch_tokens]
    out += [Scenario(f"prefill {t} after {WAKE_IDLE_S:g} s idle", 1, t, 1,
                     idle_before=WAKE_IDLE_S, rounds=rounds)
            for t in woken if t <= max_batch_tokens]
    # enough output that every member still decodes once the last prompt is in
    out += [Scenario(f"decode b={b} ctx={c}", b, c, 16 + -(-b * c // max_batch_tokens))
            for b in batches for c in contexts if b <= max_seqs]
    out += [Scenario(f"mixed b={b} ctx={c} + chunk {t}", b, c, 32, late_prompt=t)
            for b, c, t in mixed if b < max_seqs and t <= max_batch_tokens]
    return out


class ShapeRecorder:
    """Wraps the executor and keeps the shape of the batch it last ran."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.last: StepShape | None = None

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def execute(self, items, padding=None):
        self.last = StepShape.of(items)
        return self._inner.execute(items, padding)


class StepTimer:
    """Times the steps of one engine process: each one's seconds, the gap
    before it since the last one ended (the engine's idle time: ~20 us
    between steps of a busy loop) and whether its token count was new to
    the process (a ``ShapeMemory`` over every step it timed)."""

    def __init__(self, row_bucket: int = DEFAULT_ROW_BUCKET) -> None:
        self.last_end: float | None = None
        self.shapes = ShapeMemory(row_bucket=row_bucket)

    def run(self, step, recorder: ShapeRecorder):
        """(what ``step()`` returned, its ``StepSample`` or None when it ran
        no batch); ``recorder`` wraps the engine's executor."""
        recorder.last = None
        started = time.perf_counter()
        idle = 0.0 if self.last_end is None else started - self.last_end
        result = step()
        self.last_end = time.perf_counter()
        shape = recorder.last
        if shape is None:
            return result, None
        return result, StepSample(shape, self.last_end - started, idle,
                                  self.shapes.see(shape.tokens))


def run_scenario(engine, recorder: ShapeRecorder, scenario: Scenario, rng: random.Random,
                 vocab: list[int], timer: StepTimer | None = None) -> list[StepSample]:
    """Every timed step of one scenario, run to completion (``timer``: the
    grid's, so that a scenario's first step knows the gap since the last)."""
    from carpool.sampling_params import SamplingParams

    def prompt(length: int) -> list[int]:
        return [rng.choice(vocab) for _ in range(length)]

    def add(prompt_ids: list[int], output_len: int) -> None:
        engine.add_request(prompt_ids, SamplingParams(max_tokens=output_len, temperature=0,
                                                      ignore_eos=True))

    samples: list[StepSample] = []
    timer = timer or StepTimer(engine.config.model.row_bucket)
    for _ in range(scenario.rounds):
        prompts = [prompt(scenario.prompt_len) for _ in range(scenario.count)]
        if scenario.idle_before:  # the engine idles, as between real arrivals
            time.sleep(scenario.idle_before)
        for prompt_ids in prompts:
            add(prompt_ids, scenario.output_len)
        late = scenario.late_prompt
        while engine.has_unfinished:
            if late and _all_decoding(engine.scheduler):
                add(prompt(late), 1)
                late = 0
            _, sample = timer.run(engine.step, recorder)
            if sample is not None:
                samples.append(sample)
    return samples


def _all_decoding(scheduler) -> bool:
    """Nothing waits and every running request has its whole prompt computed."""
    return not scheduler.waiting and all(
        request.num_computed_tokens >= request.num_prompt_tokens
        for request in scheduler.running)


@dataclass(frozen=True)
class MeasureFlags:
    """``carpool measure``'s own flags (the engine's come from the engine flags)."""

    out: str = setting("cost-model.json", "--out", None, "where to write the fit")
    grid: str = setting(
        "full", "--grid", None,
        "full (~5 min for the default model on 2 cores), quick (~1 min, every step kind) or "
        "smoke (seconds, a poor fit)", choices=GRIDS)
    # given, it wins over --grid (`measure_grid`)
    quick: bool = setting(False, "--quick", None, "the same as --grid quick", parse=bool)
    repeats: int = setting(2, "--repeats", None, "runs of each grid point", parse=int)
    measure_seed: int = setting(0, "--measure-seed", None,
                                "seed of the grid's random prompt tokens", parse=int)
    steps_out: str | None = setting(
        None, "--steps-out", "FILE",
        "also write the measured steps (shape and seconds, gzipped JSON lines), for judging "
        "a fit offline")
    from_url: str | None = setting(
        None, "--from", "URL",
        "fit on the steps a live carpool server ran (its GET /carpool/steps; an operator "
        "key) instead of running a grid")
    # None: $OPENAI_API_KEY, read when the command runs rather than at import
    api_key: str | None = setting(
        None, "--api-key", None, "with --from: the server's key (default $OPENAI_API_KEY)")
    steps_limit: int | None = setting(None, "--steps-limit", "N",
                                      "with --from: only the server's last N steps", parse=int)


def add_measure_args(parser: argparse.ArgumentParser) -> None:
    """`MeasureFlags`."""
    add_setting_args(parser, MeasureFlags)


def measure_grid(args: argparse.Namespace) -> str:
    """The grid to run: ``--quick`` or ``--grid``."""
    return "quick" if getattr(args, "quick", False) else args.grid


def run_measure(config: EngineConfig, args: argparse.Namespace) -> int:
    from carpool.engine.llm_engine import LLMEngine

    if getattr(args, "from_url", None):
        return _measure_from_server(args)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    config.scheduler.batching = "continuous"
    args.grid = measure_grid(args)
    model = measure(LLMEngine.from_config(config), config, args)
    save_cost_model(model, args.out)
    print(format_cost_model(model))
    print(f"wrote {args.out}")
    return 0


def _measure_from_server(args: argparse.Namespace) -> int:
    from carpool.measure.live import fetch_steps, fit_live, format_live_fit

    key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
    document = fetch_steps(args.from_url, key, args.steps_limit)
    model, notes = fit_live(document, args.from_url)
    save_cost_model(model, args.out)
    print(format_cost_model(model))
    print(format_live_fit(model, notes))
    print(f"wrote {args.out}")
    return 0


def measure(engine, config: EngineConfig, args: argparse.Namespace) -> FittedCostModel:
    """Run the grid (``args.grid``, ``args.repeats``, ``args.measure_seed``)
    on a loaded continuous-batching engine and fit; the engine is left as it
    was (drained, its executor unwrapped)."""
    from tqdm import tqdm

    recorder = ShapeRecorder(engine.executor)
    engine.executor = recorder
    try:
        rng = random.Random(args.measure_seed)
        special = set(engine.tokenizer.all_special_ids)
        vocab = [t for t in range(engine.model_config.vocab_size) if t not in special]
        kv_tokens = engine.scheduler.kv.stats().num_blocks * config.cache.block_size
        scenarios = [s for s in grid(args.grid, config.scheduler.max_num_batched_tokens,
                                     config.scheduler.max_num_seqs)
                     if s.count * (s.prompt_len + s.output_len) <= kv_tokens]  # no preemption
        timer = StepTimer(config.model.row_bucket)
        run_scenario(engine, recorder, Scenario("warm-up", 2, 16, 4), rng, vocab, timer)
        measured: list[list[StepSample]] = [[] for _ in scenarios]
        # Repeats go round the whole grid rather than back to back: a shared
        # machine's speed drifts by 10-20% over tens of seconds, and each
        # point should see that drift as the simulated workload will.
        runs = [(i, s) for _ in range(args.repeats) for i, s in enumerate(scenarios)]
        for index, scenario in tqdm(runs, desc="measure", unit="run", file=sys.stderr):
            measured[index] += run_scenario(engine, recorder, scenario, rng, vocab, timer)
        samples = [sample for runs_of_point in measured for sample in runs_of_point]
        points = list(zip(scenarios, measured))
    finally:
        engine.executor = recorder._inner
    if getattr(args, "steps_out", None):
        save_steps(samples, args.steps_out)
    model = fit(samples, _meta(engine, config, args))
    rows = (_point_row(s, m, model) for s, m in points)
    model.meta["points"] = [row for row in rows if row is not None]
    return model


def _point_row(scenario: Scenario, measured: list[StepSample],
               model: FittedCostModel) -> dict | None:
    """The steps the point is named after (its prefill, its full decode
    batch, or its mixed step): median time, context and idle gap vs the
    fit; None when no step had that shape (never any other step in its
    place)."""
    if scenario.late_prompt:
        chosen = [m for m in measured if m.shape.prefill_tokens == scenario.late_prompt
                  and m.shape.decode_seqs]
    elif scenario.output_len == 1:
        chosen = [m for m in measured if m.shape.prefill_tokens]
    else:
        chosen = [m for m in measured if not m.shape.prefill_tokens
                  and m.shape.decode_seqs == scenario.count]
    if not chosen:
        return None
    first = chosen[0].shape
    typical = StepShape(first.prefill_tokens, first.decode_seqs,
                        int(statistics.median(m.shape.context_tokens for m in chosen)),
                        first.seqs,
                        int(statistics.median(m.shape.attention_pairs for m in chosen)))
    idle = statistics.median(m.idle_s for m in chosen)
    return {"label": scenario.label, "shape": asdict(typical), "steps": len(chosen),
            "idle_s": idle, "measured_s": statistics.median(m.seconds for m in chosen),
            "predicted_s": model.sample_seconds(StepSample(typical, 0.0, idle))}


def _meta(engine, config: EngineConfig, args: argparse.Namespace) -> dict:
    import torch

    return {
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": {"machine": platform.machine(), "processor": platform.processor(),
                     "cpus": available_cpus(), "torch": torch.__version__,
                     "device": str(getattr(engine.executor, "device", "cpu"))},
        "machine": machine_identity(str(getattr(engine.executor, "device", "cpu"))),
        "model": config.model.model or "default (SmolLM2-135M-Instruct)",
        "dtype": str(engine.executor.dtype).replace("torch.", ""),
        "kv_bytes_per_token": kv_bytes_per_token(engine),
        "max_model_len": engine.max_model_len,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "row_bucket": config.model.row_bucket, "grid": args.grid, "repeats": args.repeats}


def format_cost_model(model: FittedCostModel) -> str:
    meta = model.meta
    c = dict(zip(FEATURES, model.coefficients))
    lines = [f"{'point':<26} {'tokens':>6} {'seqs':>5} {'context':>8} {'measured':>9} "
             f"{'fit':>8} {'error':>6}"]
    for row in meta.get("points", []):
        shape = StepShape(**row["shape"])
        error = row["predicted_s"] / row["measured_s"] - 1
        lines.append(f"{row['label']:<26} {shape.tokens:>6} {shape.seqs:>5} "
                     f"{shape.context_tokens:>8} {row['measured_s'] * 1000:>7.1f}ms "
                     f"{row['predicted_s'] * 1000:>6.1f}ms {error:>+6.0%}")
    fit_error = meta["fit"]
    lines.append(f"fit over {fit_error['steps']} steps: seconds = {c['step'] * 1000:.2f}ms + "
                 f"{c['tokens'] * 1e6:.1f}us*rows + {c['seqs'] * 1e6:.1f}us*seqs + "
                 f"{c['context_tokens'] * 1e9:.2f}ns*context_tokens + "
                 f"{c['attention_pairs'] * 1e9:.3f}ns*attention_pairs + "
                 f"{c['prefill_chunks'] * 1e3:.2f}ms*prefill_chunks + "
                 f"{c['first_64_tokens'] * 1e6:.1f}us*min(rows,64) + "
                 f"{c['first_256_tokens'] * 1e6:.1f}us*min(rows,256) + "
                 f"{c['wake'] * 1e3:.2f}ms*wake(idle) + new shape*({c['new_shape'] * 1e3:.2f}ms + "
                 f"{c['new_shape_tokens'] * 1e6:.1f}us*tokens);"
                 f" rows: tokens padded to a multiple of {model.row_bucket} above "
                 f"{EXACT_ROWS}; error median "
                 f"{fit_error['median_abs_error']:.1%}, p90 {fit_error['p90_abs_error']:.1%} "
                 f"({meta['dtype']}, {meta['hardware']['cpus']} cpus)")
    return "\n".join(lines)
