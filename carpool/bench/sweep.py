"""``carpool bench sweep``: find a server's capacity under an SLO.

As GuideLLM does it: a synchronous run (one request at a time) gives the
lowest useful rate, a throughput run (everything at once) the highest the
server completes; then ``--steps`` rates evenly between them are replayed
open-loop with the workload's arrival process (its gaps rescaled to each
rate). Capacity is the highest of those rates at which at least
``--attainment`` of the requests meet every SLO limit; the knee is where
p99 TTFT starts to climb (see ``report.find_knee``).
"""
from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from carpool.bench.loadgen import LoadLimits, run_load
from carpool.bench.serve import (
    add_target_args,
    load_bench_tokenizer,
    run_config,
    target_from_args,
    token_counter,
)
from carpool.report.html import write_outputs
from carpool.settings_fields import add_setting_args, setting
from carpool.workload.arrivals import rescale_offsets
from carpool.workload.command import add_workload_args, workload_spec
from carpool.workload.results import format_result, make_result
from carpool.workload.spec import BenchItem, build_workload

SWEEP_KIND, SWEEP_VERSION = "bench-sweep", 1


@dataclass
class SweepOptions:
    """The sweep's own flags (``bench serve``'s are added beside them)."""

    steps: int = setting(
        4, "--steps", "STEPS",
        "rates to try between the synchronous and the maximum rate", parse=int)
    sync_requests: int = setting(
        10, "--sync-requests", "SYNC_REQUESTS",
        "requests in the synchronous (one at a time) probe", parse=int)
    attainment: float = setting(
        0.9, "--attainment", "ATTAINMENT",
        "share of requests that must meet the SLO at a rate (0..1]", parse=float)


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    add_target_args(parser)
    add_workload_args(parser)
    add_setting_args(parser.add_argument_group("sweep"), SweepOptions)


def rescale(plan: list[BenchItem], rate: float) -> list[BenchItem]:
    """The plan with its arrival gaps stretched to offer ``rate`` req/s on average."""
    offsets = rescale_offsets([item.offset for item in plan], rate)
    return [replace(item, offset=offset) for item, offset in zip(plan, offsets)]


def sweep_rates(sync_rate: float, max_rate: float, steps: int) -> list[float]:
    """``steps`` rates evenly spaced strictly between the two probes."""
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    low, high = min(sync_rate, max_rate), max(sync_rate, max_rate)
    return [low + (high - low) * (k + 1) / (steps + 1) for k in range(steps)]


def capacity(runs: list[dict], attainment: float) -> float | None:
    """The highest open-loop rate whose run met the SLO for ``attainment`` of requests."""
    met = [run["rate"] for run in runs if run["mode"] == "rate" and run["meets_slo"]]
    return max(met) if met else None


def _meets(summary: dict, attainment: float) -> bool | None:
    if not summary["slo"]:
        return None
    return summary["slo_attainment"] is not None and summary["slo_attainment"] >= attainment


def run_sweep(args: argparse.Namespace) -> int:
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    tokenizer = load_bench_tokenizer(args.tokenizer)
    target = target_from_args(args, tokenizer)
    plan = build_workload(workload_spec(args), tokenizer)
    config = run_config(args, target)
    label = args.label or f"{target.model} @ {target.base_url}"

    def measure(mode: str, items: list[BenchItem], rate: float | None,
                max_concurrency: int | None) -> dict:
        limits = LoadLimits(max_concurrency, args.max_duration, args.request_timeout)
        run = asyncio.run(run_load(items, target, limits, token_counter(tokenizer),
                                   args.progress, args.metrics_interval, f"sweep {mode}"))
        result = make_result(f"{label} [{mode}]", config, run, args.slo)
        achieved = result["summary"]["request_throughput"]
        row = {"mode": mode, "rate": rate if rate is not None else achieved, "result": result,
               "meets_slo": _meets(result["summary"], args.attainment)}
        print(format_result(result), flush=True)
        return row

    at_once = [replace(item, offset=0.0) for item in plan]
    runs = [measure("synchronous", at_once[:args.sync_requests], None, 1),
            measure("throughput", at_once, None, args.max_concurrency)]
    for rate in sweep_rates(runs[0]["rate"], runs[1]["rate"], args.steps):
        runs.append(measure("rate", rescale(plan, rate), rate, args.max_concurrency))
    result = sweep_result(label, config, args.slo, args.attainment, runs)
    print(format_sweep(result))
    write_outputs(result, args.json, args.html)
    return 0


def sweep_result(label: str, config: dict, slo: dict, attainment: float,
                 runs: list[dict]) -> dict:
    from carpool.report.sweep import find_knee

    open_loop = [r for r in runs if r["mode"] == "rate"]
    knee = find_knee([r["rate"] for r in open_loop],
                     [r["result"]["summary"]["ttft"]["p99"] for r in open_loop])
    return {"kind": SWEEP_KIND, "version": SWEEP_VERSION, "label": label,
            "started_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "config": config, "slo": dict(slo), "attainment_target": attainment,
            "runs": runs, "capacity_rps": capacity(runs, attainment), "knee_rps": knee}


def format_sweep(result: dict) -> str:
    lines = [f"== sweep: {result['label']} ==",
             f"{'mode':<12} {'rate':>6} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>9} {'p99':>8} "
             f"{'TPOT p50':>9} {'p99':>8} {'attain':>7} meets"]
    for run in result["runs"]:
        s = run["result"]["summary"]
        attain = "-" if s["slo_attainment"] is None else f"{s['slo_attainment']:.0%}"
        meets = {None: "-", True: "yes", False: "no"}[run["meets_slo"]]
        lines.append(
            f"{run['mode']:<12} {run['rate']:>6.2f} {s['request_throughput']:>6.2f} "
            f"{s['output_throughput']:>7.1f} {_ms(s['ttft']['p50']):>9} {_ms(s['ttft']['p99']):>8} "
            f"{_ms(s['tpot']['p50']):>9} {_ms(s['tpot']['p99']):>8} {attain:>7} {meets}")
    if result["slo"]:
        cap = result["capacity_rps"]
        lines.append(f"capacity: {'no rate meets the SLO' if cap is None else f'{cap:.2f} req/s'}"
                     f" (>= {result['attainment_target']:.0%} of requests within "
                     f"{', '.join(f'{k}<={v * 1000:g}ms' for k, v in result['slo'].items())})")
    else:
        lines.append("capacity: give --slo to find it")
    if result["knee_rps"] is not None:
        lines.append(f"knee of p99 TTFT: {result['knee_rps']:.2f} req/s")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}ms"
