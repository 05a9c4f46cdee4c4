"""``carpool bench regimes``: one workload replayed in real time against the
engine under each batching regime, side by side.

Requests arrive by a seeded Poisson process at ``--rate`` per second (the
same schedule for every regime) with lengths from ``--lengths-file`` or
fixed; ``ignore_eos`` makes every regime generate the same tokens. Latency
counts from the intended arrival time, so a regime that falls behind pays
for it in TTFT. All regimes share one loaded model (one executor).

Static and dynamic batches run padded (``padding: right`` unless the
settings say otherwise), so they pay the padding a real request-level
batcher pays; continuous batching never pads. ``--padding none`` runs them
ragged; another alignment needs ``--batching static`` (or dynamic) too, as
continuous batching, the default, only admits ``none``. Fill rate = real
tokens / computed token slots; padding waste = 1 - fill; effective tok/s
counts real tokens only.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from carpool.bench.arrivals import Surge, arrival_offsets
from carpool.bench.throughput import BenchRequest, add_workload_args, make_workload
from carpool.config import EngineConfig
from carpool.sampling_params import SamplingParams
from carpool.scheduler import RejectedError

# Regimes: the three batching modes, and continuous batching under the adaptive controller.
REGIMES = ("static", "dynamic", "continuous", "adaptive")


def add_arrival_args(parser: argparse.ArgumentParser) -> None:
    """Seeded arrivals (shared with ``carpool tune``)."""
    group = parser.add_argument_group("arrivals")
    group.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of the gaps: 1 = Poisson, < 1 burstier")
    group.add_argument("--surge", action="append", type=Surge.parse, default=[],
                       metavar="FACTORx@START+DURATION",
                       help="multiply the rate for a while, e.g. 3x@20+30 (repeatable)")


def add_regimes_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    add_arrival_args(parser)
    parser.add_argument("--regimes", default="static,dynamic,continuous,adaptive",
                        help=f"comma-separated, from {', '.join(REGIMES)} (adaptive = "
                             f"continuous under the adaptive controller)")
    parser.add_argument("--json", default=None, help="write the results here as JSON")


@dataclass
class RegimeResult:
    regime: str
    padding: str
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
        fill = self.computed_tokens / max(1, self.slot_tokens)
        return {
            "regime": self.regime, "padding": self.padding, "requests": self.requests,
            "output_tokens": self.output_tokens, "seconds": self.seconds,
            "output_tok_s": self.output_tokens / self.seconds,
            "effective_tok_s": self.computed_tokens / self.seconds,
            "fill_rate": fill, "padding_waste": 1.0 - fill,
            "slot_tokens": self.slot_tokens, "computed_tokens": self.computed_tokens,
            "busy": self.busy_seconds / self.seconds, "batches": self.batches,
            "ttft_p50": _pct(self.ttft, 50), "ttft_p99": _pct(self.ttft, 99),
            "tpot_p50": _pct(self.tpot, 50), "tpot_p99": _pct(self.tpot, 99),
            "e2e_p50": _pct(self.e2e, 50), "e2e_p99": _pct(self.e2e, 99),
            "ttft_max": max(self.ttft, default=float("nan")),
            "rejected_share": self.rejected / self.requests}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def workload_offsets(args: argparse.Namespace, count: int) -> list[float]:
    return arrival_offsets(count, args.rate, args.bench_seed, args.burstiness, args.surge)


def excess_share(offsets: list[float], capacity: float, max_delay: float) -> float:
    """The share of arrivals an ideal server must turn away to start every
    admitted one within ``max_delay``: a FIFO fluid queue serving
    ``capacity`` requests per second that rejects an arrival whose wait would
    exceed ``max_delay``. It is the load in excess of capacity."""
    free_at, rejected = 0.0, 0
    for t in offsets:
        start = max(t, free_at)
        if start - t > max_delay:
            rejected += 1
            continue
        free_at = start + 1.0 / capacity
    return rejected / len(offsets) if offsets else 0.0


def replay(engine, workload: list[BenchRequest], offsets: list[float]) -> RegimeResult:
    """Add each request at its arrival time, step whenever there is work."""
    start = time.monotonic()
    counters_before = engine.counters.copy()
    pending = list(zip(offsets, workload))
    pending.reverse()
    finals = []
    turned_away = 0
    while pending or engine.has_unfinished:
        now = time.monotonic() - start
        while pending and pending[-1][0] <= now:
            offset, request = pending.pop()
            try:
                engine.add_request(request.prompt_token_ids, SamplingParams(
                    max_tokens=request.output_len, temperature=0, ignore_eos=True),
                    arrival_time=start + offset)
            except RejectedError:
                turned_away += 1  # admission control said no at arrival (HTTP 429)
        if engine.has_unfinished:
            finals += [o for o in engine.step() if o.finished]
        elif pending:
            time.sleep(max(0.0, pending[-1][0] - now))  # idle until the next arrival
    result = _result(engine, finals, counters_before, time.monotonic() - start)
    result.requests += turned_away
    result.rejected += turned_away
    return result


def _result(engine, finals, before, seconds: float) -> RegimeResult:
    after = engine.counters
    done = [o for o in finals if o.finish_reason != "rejected"]
    tpot = [(o.finish_time - o.first_token_time) / (o.num_output_tokens - 1)
            for o in done if o.num_output_tokens > 1]
    gate = engine.scheduler.gate
    adaptive = engine.scheduler.controller is not None
    return RegimeResult(
        regime="adaptive" if adaptive else engine.config.scheduler.batching,
        padding=engine.config.scheduler.padding_mode, requests=len(finals),
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
    offsets = workload_offsets(args, len(workload))
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    unknown = set(regimes) - set(REGIMES)
    if unknown:
        raise ValueError(f"unknown regimes {sorted(unknown)}; choose from {', '.join(REGIMES)}")
    _warm_up(base, workload[0])
    summary = {}
    if args.surge:
        summary = _surge_summary(base, config, workload, offsets)
    rows = []
    for regime in regimes:
        engine = LLMEngine(regime_config(config, regime), base.tokenizer, base.model_config,
                           base.executor, base.max_model_len)
        result = replay(engine, workload, offsets)
        rows.append(result.row())
        _print_row(rows[-1], rows[0])
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"config": {k: v for k, v in vars(args).items() if k != "func"},
             "scheduler": vars(config.scheduler), "controller": vars(config.controller),
             **summary, "results": rows}, indent=2, default=str))
    return 0


def regime_config(config: EngineConfig, regime: str) -> EngineConfig:
    """``config`` under one regime. Continuous never pads; static and dynamic
    keep the settings' padding (None: right); only ``adaptive`` runs the controller."""
    batching = "continuous" if regime == "adaptive" else regime
    padding = "none" if batching == "continuous" else config.scheduler.padding
    out = EngineConfig.from_dict({})
    out.update({"model": vars(config.model), "cache": vars(config.cache),
                "scheduler": {**vars(config.scheduler), "batching": batching,
                              "padding": padding},
                "controller": {**vars(config.controller), "adaptive": regime == "adaptive"}})
    return out.validate()


def _surge_summary(base, config: EngineConfig, workload, offsets) -> dict:
    """Capacity (requests/s, every request at once, continuous batching) and
    the excess load of this schedule against the TTFT target."""
    from carpool.engine.llm_engine import LLMEngine

    engine = LLMEngine(regime_config(config, "continuous"), base.tokenizer, base.model_config,
                       base.executor, base.max_model_len)
    offline = replay(engine, workload, [0.0] * len(workload))
    capacity = offline.requests / offline.seconds
    target = config.controller.ttft_target or 0.0
    excess = excess_share(offsets, capacity, target)
    print(f"capacity {capacity:.2f} requests/s (all {offline.requests} at once); offered "
          f"{len(offsets) / max(offsets[-1], 1e-9):.2f}/s on average; excess load over "
          f"capacity at TTFT target {target:g} s: {excess:.1%}", flush=True)
    return {"capacity_rps": capacity, "excess_share": excess, "ttft_target": target}


def _warm_up(engine, request: BenchRequest) -> None:
    engine.add_request(request.prompt_token_ids[:16], SamplingParams(max_tokens=4))
    while engine.has_unfinished:
        engine.step()


def _print_row(row: dict, first: dict) -> None:
    if row is first:
        print(f"{'regime':<11} {'padding':<7} {'out tok/s':>9} {'vs first':>8} {'eff tok/s':>9} "
              f"{'fill':>5} {'waste':>5} {'busy':>5} {'TTFT p50':>8} {'p99':>7} "
              f"{'TPOT p50':>8} {'p99':>7} {'E2E p50':>7} {'p99':>7} {'rej':>5}")
    ratio = row["output_tok_s"] / first["output_tok_s"]
    print(f"{row['regime']:<11} {row['padding']:<7} {row['output_tok_s']:>9.1f} {ratio:>7.2f}x "
          f"{row['effective_tok_s']:>9.1f} {row['fill_rate']:>5.2f} {row['padding_waste']:>5.0%} "
          f"{row['busy']:>5.0%} {row['ttft_p50']:>8.2f} {row['ttft_p99']:>7.2f} "
          f"{row['tpot_p50']:>8.3f} {row['tpot_p99']:>7.3f} {row['e2e_p50']:>7.2f} "
          f"{row['e2e_p99']:>7.2f} {row['rejected_share']:>5.0%}", flush=True)
