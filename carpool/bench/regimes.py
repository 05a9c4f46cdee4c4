"""``carpool bench regimes``: one workload replayed in real time against the
engine under each batching regime, side by side.

Requests arrive by a seeded Poisson process at ``--rate`` per second (the
same schedule for every regime) with lengths from ``--lengths-file`` or
fixed; ``ignore_eos`` makes every regime generate the same tokens. Latency
counts from the intended arrival time, so a regime that falls behind pays
for it in TTFT. All regimes share one loaded model (one executor).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from carpool.bench.throughput import BenchRequest, add_workload_args, make_workload
from carpool.config import EngineConfig
from carpool.sampling_params import SamplingParams


def add_regimes_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    group = parser.add_argument_group("replay")
    group.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second")
    group.add_argument("--regimes", default="static,dynamic,continuous",
                       help="comma-separated batching regimes to compare")
    parser.add_argument("--json", default=None, help="write the results here as JSON")


@dataclass
class RegimeResult:
    regime: str
    requests: int
    rejected: int
    output_tokens: int
    seconds: float  # first arrival to last finish
    computed_tokens: int
    slot_tokens: int
    busy_seconds: float
    batches: int
    ttft: list[float]
    tpot: list[float]
    e2e: list[float]

    def row(self) -> dict[str, float | str]:
        return {
            "regime": self.regime, "requests": self.requests,
            "output_tokens": self.output_tokens, "seconds": self.seconds,
            "output_tok_s": self.output_tokens / self.seconds,
            "effective_tok_s": self.computed_tokens / self.seconds,
            "fill_rate": self.computed_tokens / max(1, self.slot_tokens),
            "busy": self.busy_seconds / self.seconds, "batches": self.batches,
            "ttft_p50": _pct(self.ttft, 50), "ttft_p99": _pct(self.ttft, 99),
            "tpot_p50": _pct(self.tpot, 50), "tpot_p99": _pct(self.tpot, 99),
            "e2e_p50": _pct(self.e2e, 50), "e2e_p99": _pct(self.e2e, 99),
            "rejected_share": self.rejected / self.requests}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Seeded Poisson arrivals: exponential gaps with mean 1 / rate."""
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def replay(engine, workload: list[BenchRequest], offsets: list[float]) -> RegimeResult:
    """Add each request at its arrival time, step whenever there is work."""
    start = time.monotonic()
    counters_before = engine.counters.copy()
    pending = list(zip(offsets, workload))
    pending.reverse()
    finals = []
    while pending or engine.has_unfinished:
        now = time.monotonic() - start
        while pending and pending[-1][0] <= now:
            offset, request = pending.pop()
            engine.add_request(request.prompt_token_ids, SamplingParams(
                max_tokens=request.output_len, temperature=0, ignore_eos=True),
                arrival_time=start + offset)
        if engine.has_unfinished:
            finals += [o for o in engine.step() if o.finished]
        elif pending:
            time.sleep(max(0.0, pending[-1][0] - now))  # idle until the next arrival
    return _result(engine, finals, counters_before, time.monotonic() - start)


def _result(engine, finals, before, seconds: float) -> RegimeResult:
    after = engine.counters
    done = [o for o in finals if o.finish_reason != "rejected"]
    tpot = [(o.finish_time - o.first_token_time) / (o.num_output_tokens - 1)
            for o in done if o.num_output_tokens > 1]
    gate = engine.scheduler.gate
    return RegimeResult(
        regime=engine.config.scheduler.batching, requests=len(finals),
        rejected=len(finals) - len(done),
        output_tokens=sum(o.num_output_tokens for o in done), seconds=seconds,
        computed_tokens=after.computed_tokens - before.computed_tokens,
        slot_tokens=after.slot_tokens - before.slot_tokens,
        busy_seconds=after.busy_seconds - before.busy_seconds,
        batches=gate.stats.batches if gate else 0,
        ttft=[o.first_token_time - o.arrival_time for o in done],
        tpot=tpot, e2e=[o.finish_time - o.arrival_time for o in done])


def run_regimes(config: EngineConfig, args: argparse.Namespace) -> int:
    from carpool.engine.llm_engine import LLMEngine

    base = LLMEngine.from_config(config)
    workload = make_workload(args, base.model_config.vocab_size,
                             set(base.tokenizer.all_special_ids))
    offsets = arrival_offsets(len(workload), args.rate, args.bench_seed)
    _warm_up(base, workload[0])
    rows = []
    for regime in [r.strip() for r in args.regimes.split(",") if r.strip()]:
        regime_config = EngineConfig.from_dict({})
        regime_config.update({"model": vars(config.model), "cache": vars(config.cache),
                              "scheduler": {**vars(config.scheduler), "batching": regime}})
        regime_config.validate()
        engine = LLMEngine(regime_config, base.tokenizer, base.model_config, base.executor,
                           base.max_model_len)
        result = replay(engine, workload, offsets)
        rows.append(result.row())
        _print_row(rows[-1], rows[0])
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"config": {k: v for k, v in vars(args).items() if k != "func"},
             "scheduler": vars(config.scheduler), "results": rows}, indent=2, default=str))
    return 0


def _warm_up(engine, request: BenchRequest) -> None:
    engine.add_request(request.prompt_token_ids[:16], SamplingParams(max_tokens=4))
    while engine.has_unfinished:
        engine.step()


def _print_row(row: dict, first: dict) -> None:
    if row is first:
        print(f"{'regime':<11} {'out tok/s':>9} {'vs first':>8} {'eff tok/s':>9} {'fill':>5} "
              f"{'busy':>5} {'TTFT p50':>8} {'p99':>7} {'TPOT p50':>8} {'p99':>7} "
              f"{'E2E p50':>7} {'p99':>7} {'rej':>5}")
    ratio = row["output_tok_s"] / first["output_tok_s"]
    print(f"{row['regime']:<11} {row['output_tok_s']:>9.1f} {ratio:>7.2f}x "
          f"{row['effective_tok_s']:>9.1f} {row['fill_rate']:>5.2f} {row['busy']:>5.0%} "
          f"{row['ttft_p50']:>8.2f} {row['ttft_p99']:>7.2f} {row['tpot_p50']:>8.3f} "
          f"{row['tpot_p99']:>7.3f} {row['e2e_p50']:>7.2f} {row['e2e_p99']:>7.2f} "
          f"{row['rejected_share']:>5.0%}", flush=True)
