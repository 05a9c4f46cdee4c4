"""``carpool evaluate pd``: colocated against disaggregated fleets of equal size.

One workload, one cost model, one fleet size: its capacity is measured as
``evaluate routing`` does (colocated, round-robin, arrivals squeezed), the
arrivals are stretched or squeezed to offer ``--load`` of it, and each
configuration replays exactly those arrivals: every replica mixed
(predicted-TTFT routing), then per P:D split the planner prefilling every
request remotely (``always``: static disaggregation) and only where it pays
(``conditional``). Per row: TTFT p50 / p99, TPOT p99, goodput under the
TTFT + TPOT SLO, the share of requests disaggregated, the transfer time
that showed, and the wall time.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from carpool.config import EngineConfig
from carpool.settings_fields import add_setting_args, setting
from carpool.sim.command import add_pd_args, pd_from_args
from carpool.sim.cost_flags import cost_model_from_args, pool_blocks
from carpool.sim.evaluate import fleet_capacity, latency_row, offered_rate, scaled, write_rows
from carpool.sim.simulate import SimSettings, cyclic_gc_paused, simulate
from carpool.workload.command import arg_type, workload_spec
from carpool.workload.spec import mooncake_block_tokens, plan_workload


def _splits(text: str) -> tuple[tuple[int, int], ...]:
    splits = []
    for part in text.split(","):
        prefill, _, decode = part.strip().partition(":")
        if not (prefill.isdigit() and decode.isdigit()) or min(int(prefill), int(decode)) < 1:
            raise ValueError(f"splits are P:D with P, D >= 1, comma separated; got {part!r}")
        splits.append((int(prefill), int(decode)))
    return tuple(splits)


@dataclass(frozen=True)
class PDEvaluationFlags:
    """``carpool evaluate pd``'s own flags (group "evaluation")."""

    splits: tuple[tuple[int, int], ...] = setting(
        ((2, 6), (3, 5), (4, 4)), "--splits", None,
        "prefill:decode replica splits, comma separated (default 2:6,3:5,4:4); the colocated "
        "fleet has P + D replicas", parse=arg_type(_splits))
    modes: str = setting("always,conditional", "--modes", None,
                         "planner modes per split (default always,conditional)")
    load: float = setting(
        0.8, "--load", None,
        "offered rate as a share of the colocated fleet's measured capacity (default 0.8)",
        parse=float)
    json: str | None = setting(None, "--json", None, "write every row here")


def add_pd_evaluation_args(parser: argparse.ArgumentParser) -> None:
    """`PDEvaluationFlags` and the P/D link's flags (no pool sizes: the splits give them)."""
    add_setting_args(parser.add_argument_group("evaluation"), PDEvaluationFlags)
    add_pd_args(parser, pools=False)


def pd_row(label: str, plan, config, cost, num_blocks: int, settings: SimSettings,
           slo: dict) -> dict:
    run = simulate(plan, config, cost, num_blocks, settings)
    pd = run.pd or {"disaggregated": 0, "colocated": len(plan), "mean_exposed_transfer_s": 0.0}
    return {"config": label, "replicas": settings.replicas, **latency_row(run, label, slo),
            "disaggregated_share": pd["disaggregated"] / max(1, len(plan)),
            "exposed_transfer_ms": pd["mean_exposed_transfer_s"] * 1e3}


def run_pd_evaluation(config: EngineConfig, args: argparse.Namespace) -> int:
    cost = cost_model_from_args(args)
    num_blocks = pool_blocks(config, cost, memory_set=args.engine_kv_cache_memory is not None)
    block_tokens = mooncake_block_tokens(args.token_scale)
    sizes = {p + d for p, d in args.splits}
    if len(sizes) != 1:
        raise ValueError(f"every split must have the same replica count, got {args.splits}")
    replicas = sizes.pop()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rows = []
    with cyclic_gc_paused():
        base = plan_workload(workload_spec(args))
        started = time.perf_counter()
        capacity = fleet_capacity(base, config, cost, num_blocks, replicas, block_tokens)
        factor = offered_rate(base) / (args.load * capacity)
        plan = scaled(base, factor)
        print(f"== {replicas} replicas: colocated capacity {capacity:.2f} req/s "
              f"({time.perf_counter() - started:.1f} s); arrivals x{factor:.3f} in time offer "
              f"{offered_rate(plan):.2f} req/s", flush=True)
        common = dict(replicas=replicas, hash_block=block_tokens, routing="predicted-ttft")
        configs = [("colocated", SimSettings(**common))]
        for prefill, decode in args.splits:
            for mode in modes:
                configs.append((f"{prefill}P:{decode}D {mode}", SimSettings(
                    **common, pd=pd_from_args(args, prefill, mode))))
        for label, settings in configs:
            row = pd_row(label, plan, config, cost, num_blocks, settings.validate(), args.slo)
            row.update(capacity=capacity, offered_rate=offered_rate(plan), time_factor=factor)
            rows.append(row)
            print(format_pd_row(row), flush=True)
    print(format_pd_table(rows))
    write_rows(args.json, rows, args)
    return 0


def format_pd_row(row: dict) -> str:
    return (f"  {row['config']:<24} TTFT p50 {row['ttft_p50'] * 1e3:7.0f} ms  p99 "
            f"{row['ttft_p99'] * 1e3:7.0f} ms  TPOT p99 {row['tpot_p99'] * 1e3:5.1f} ms  goodput "
            f"{row['goodput']:.2f}/s ({row['slo_attainment']:.1%} in SLO)  disaggregated "
            f"{row['disaggregated_share']:.0%}  transfer shown {row['exposed_transfer_ms']:.1f} ms"
            f"  {row['wall_s']:.0f} s wall")


def format_pd_table(rows: list[dict]) -> str:
    lines = ["| fleet | TTFT p50 | TTFT p99 | TPOT p99 | goodput (in SLO) | disaggregated | "
             "transfer shown | wall |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['config']} | {row['ttft_p50'] * 1e3:.0f} ms | {row['ttft_p99'] * 1e3:.0f} ms"
            f" | {row['tpot_p99'] * 1e3:.1f} ms | {row['goodput']:.2f}/s "
            f"({row['slo_attainment']:.1%}) | {row['disaggregated_share']:.0%} | "
            f"{row['exposed_transfer_ms']:.1f} ms | {row['wall_s']:.0f} s |")
    return "\n".join(lines)
