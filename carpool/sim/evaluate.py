"""``carpool evaluate routing``: routing policies side by side in the simulator.

One workload, one cost model, each fleet size: the fleet's capacity is
first measured (round-robin, the arrivals squeezed to ``PROBE_SQUEEZE`` of
their time, and further while the fleet keeps up, so that the queues never
empty: requests completed per second),
the arrivals are then stretched or squeezed so that they offer ``--load``
of it, and every policy replays exactly those arrivals. (Busy time is no
measure of load under continuous batching: a lighter load runs more,
smaller steps, and its replicas were as busy as at twice the rate.)
Per policy: TTFT p50 / p99, TPOT p99, goodput under the SLO, the fleet's
prefix-cache hit rate (prompt tokens cached or loaded from the shared tier
on each request's first admission, over all prompt tokens) against the
plan's ideal (every prompt token whose leading blocks any earlier prompt
had), the busiest / idlest replica's
busy time, and the wall time of the run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass

from carpool.config import EngineConfig
from carpool.settings_fields import add_setting_args, setting
from carpool.sim.command import add_kv_tier_args, kv_tier_from_args
from carpool.sim.cost_flags import cost_model_from_args, pool_blocks
from carpool.sim.costs import CostModel
from carpool.sim.fleet import ROUTING
from carpool.sim.simulate import (
    SimSettings,
    cyclic_gc_paused,
    simulate,
)
from carpool.workload.command import arg_type, workload_spec
from carpool.workload.results import LoadRun, make_result
from carpool.workload.spec import mooncake_block_tokens, plan_workload
from carpool.workload.traces import TraceRequest

PROBE_SQUEEZE = 0.1  # the capacity probe's arrivals come 10x as fast as the trace's
PROBE_ROUNDS = 4  # then 4x faster each round, while the fleet keeps up
SATURATED = 0.9  # completing under this share of the offered rate: behind
DEFAULT_POLICIES = ("random", "round-robin", "least-outstanding", "approx-cache-aware",
                    "kv-cost", "predicted-ttft")


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in ROUTING]
    if unknown or not names:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(ROUTING)}")
    return names


def _counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(n) for n in text.split(",") if n.strip())
    if not counts or min(counts) < 1:
        raise ValueError(f"replica counts must be >= 1, got {text!r}")
    return counts


@dataclass(frozen=True)
class RoutingEvaluationFlags:
    """``carpool evaluate routing``'s own flags (group "evaluation")."""

    # fleet sizes, unlike `carpool simulate`'s --replicas (one count)
    replicas: tuple[int, ...] = setting(
        (8, 16), "--replicas", None, "fleet sizes, comma separated (default 8,16)",
        parse=arg_type(_counts))
    policies: tuple[str, ...] = setting(
        DEFAULT_POLICIES, "--policies", None, f"comma separated, of {', '.join(ROUTING)}",
        parse=arg_type(_names))
    load: float = setting(
        0.8, "--load", None,
        "offered rate as a share of the fleet's measured capacity (default 0.8); 0: the "
        "arrivals as planned (--rate, --ramp), no capacity probe", parse=float)
    json: str | None = setting(None, "--json", None, "write every row here")


def add_routing_evaluation_args(parser: argparse.ArgumentParser) -> None:
    """`RoutingEvaluationFlags` and the shared KV tier's flags."""
    add_setting_args(parser.add_argument_group("evaluation"), RoutingEvaluationFlags)
    add_kv_tier_args(parser)


def ideal_hit_rate(plan: list[TraceRequest], block_tokens: int) -> float:
    """Prompt tokens an infinite, fleet-wide prefix cache would hit: a
    prompt's leading blocks (hash ids) that some earlier prompt also began
    with, at most all but its last token, over all prompt tokens."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for item in sorted(plan, key=lambda r: r.arrival):
        total += item.input_len
        prefix: tuple[int, ...] = ()
        cached = 0
        for hash_id in item.hash_ids:
            prefix += (hash_id,)
            if prefix in seen:
                cached += 1
            else:
                seen.add(prefix)
                break
        for more in item.hash_ids[len(prefix):]:
            prefix += (more,)
            seen.add(prefix)
        hits += min(cached * block_tokens, max(0, item.input_len - 1))
    return hits / total if total else 0.0


def scaled(plan: list[TraceRequest], factor: float) -> list[TraceRequest]:
    return [dataclasses.replace(r, arrival=r.arrival * factor) for r in plan]


def offered_rate(plan: list[TraceRequest]) -> float:
    """Requests per second over the plan's span of arrivals."""
    span = max(r.arrival for r in plan) - min(r.arrival for r in plan)
    return len(plan) / max(span, 1e-9)


def fleet_capacity(plan, config, cost, num_blocks: int, replicas: int,
                   block_tokens: int, kv_tier=None) -> float:
    """Requests completed per second by ``replicas`` round-robin replicas
    (sharing ``kv_tier``, if given) when the plan's arrivals come
    ``1 / PROBE_SQUEEZE`` times as fast, or faster still until the fleet
    falls behind (completes under ``SATURATED`` of what is offered: a fleet
    that keeps up measures the offered rate, not its capacity)."""
    squeeze = PROBE_SQUEEZE
    for _ in range(PROBE_ROUNDS):
        probe = scaled(plan, squeeze)
        run = simulate(probe, config, cost, num_blocks, SimSettings(
            replicas=replicas, routing="round-robin", hash_block=block_tokens, workers=2,
            kv_tier=kv_tier))
        done = sum(1 for r in run.records if r.status == "ok")
        rate = done / max(run.duration, 1e-9)
        if rate < SATURATED * offered_rate(probe):
            break
        squeeze /= 4
    return rate


def _busy_share(run, replicas: int) -> float:
    return sum(r["busy_s"] for r in run.per_replica) / (replicas * max(run.duration, 1e-9))


def latency_row(run, label: str, slo: dict) -> dict:
    """The latency and goodput figures of a simulated run every evaluation reports."""
    summary = make_result(label, {}, LoadRun(run.records, run.duration, []), slo,
                          per_request=False)["summary"]
    return {"requests": len(run.records), "ttft_p50": summary["ttft"]["p50"],
            "ttft_p99": summary["ttft"]["p99"], "tpot_p99": summary["tpot"]["p99"],
            "goodput": summary["goodput"], "slo_attainment": summary["slo_attainment"],
            "wall_s": run.wall_seconds}


def write_rows(path: str | None, rows: list[dict], args: argparse.Namespace) -> None:
    """An evaluation's rows as JSON (with its SLO and load), if asked."""
    if path:
        with open(path, "w") as handle:
            json.dump({"rows": rows, "slo": args.slo, "load": args.load}, handle, indent=1)


def evaluate_row(policy: str, plan, config, cost, num_blocks, replicas: int, slo: dict,
                 block_tokens: int, kv_tier=None) -> dict:
    settings = SimSettings(replicas=replicas, routing=policy, hash_block=block_tokens,
                           workers=2, kv_tier=kv_tier).validate()
    run = simulate(plan, config, cost, num_blocks, settings)
    busy = [r["busy_s"] for r in run.per_replica]
    rows = run.per_replica
    prompt_tokens = max(1, sum(item.input_len for item in plan))
    return {"policy": policy, "replicas": replicas, **latency_row(run, policy, slo),
            # Each prompt once, cached or loaded on its first admission, over
            # every prompt token of the plan (the ideal's denominator).
            "hit_rate": sum(r["cached_tokens"] for r in rows) / prompt_tokens,
            "local_hit_rate": sum(r["cached_tokens"] - r["loaded_tokens"]
                                  for r in rows) / prompt_tokens,
            # None: a replica never worked (the ratio has no bound).
            "busy_max_min": max(busy) / min(busy) if min(busy) > 0 else None,
            "busy_share": _busy_share(run, replicas),
            # The TTFT predictions' MAPE over every first token: the one each
            # decision used, and the analytic and learned models side by side.
            **_prediction_errors(run.routing)}


def _prediction_errors(routing: dict | None) -> dict:
    """MAPE of the TTFT predictions (each decision's, the analytic and the
    learned model's) and the requests the affinity gate explored with."""
    mape = routing["mape"] if routing else {}
    return {**{f"mape_{model}": mape.get(model) for model in ("decided", "analytic", "learned")},
            "explored": routing["explored"] if routing else 0}


def run_routing_evaluation(config: EngineConfig, args: argparse.Namespace) -> int:
    cost: CostModel = cost_model_from_args(args)
    num_blocks = pool_blocks(config, cost, memory_set=args.engine_kv_cache_memory is not None)
    block_tokens = mooncake_block_tokens(args.token_scale)
    kv_tier = kv_tier_from_args(args)
    rows = []
    with cyclic_gc_paused():
        base = plan_workload(workload_spec(args))
        ideal = ideal_hit_rate(base, block_tokens)
        for replicas in args.replicas:
            capacity, factor = _time_factor(base, config, cost, num_blocks, replicas,
                                            block_tokens, kv_tier, args.load)
            plan = scaled(base, factor)
            for policy in args.policies:
                row = evaluate_row(policy, plan, config, cost, num_blocks, replicas, args.slo,
                                   block_tokens, kv_tier)
                row.update(time_factor=factor, ideal_hit_rate=ideal, capacity=capacity,
                           offered_rate=offered_rate(plan))
                rows.append(row)
                print(format_row(row), flush=True)
    print(format_table(rows))
    write_rows(args.json, rows, args)
    return 0


def _time_factor(base, config, cost, num_blocks: int, replicas: int, block_tokens: int,
                 kv_tier, load: float) -> tuple[float | None, float]:
    """The fleet's measured capacity and the factor on arrival times that
    offers ``load`` of it (None and 1 for ``load`` 0: as planned)."""
    if load <= 0:
        print(f"== {replicas} replicas: arrivals as planned, {offered_rate(base):.2f} req/s "
              f"on average", flush=True)
        return None, 1.0
    started = time.perf_counter()
    capacity = fleet_capacity(base, config, cost, num_blocks, replicas, block_tokens, kv_tier)
    factor = offered_rate(base) / (load * capacity)
    print(f"== {replicas} replicas: capacity {capacity:.2f} req/s (round-robin, "
          f"{time.perf_counter() - started:.1f} s); arrivals x{factor:.3f} in time "
          f"offer {offered_rate(base) / factor:.2f} req/s", flush=True)
    return capacity, factor


def _busy(row: dict) -> str:
    ratio = row["busy_max_min"]
    return "one idle" if ratio is None else f"{ratio:.2f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def format_row(row: dict) -> str:
    return (f"  {row['policy']:<20} TTFT p50 {row['ttft_p50'] * 1e3:7.0f} ms  p99 "
            f"{row['ttft_p99'] * 1e3:7.0f} ms  TPOT p99 {row['tpot_p99'] * 1e3:5.1f} ms  goodput "
            f"{row['goodput']:.2f}/s  hit {row['hit_rate']:.1%} ({row['local_hit_rate']:.1%} "
            f"local; ideal "
            f"{row['ideal_hit_rate']:.1%})  busy max/min {_busy(row)}  "
            f"({row['busy_share']:.2f} busy)  TTFT MAPE {_percent(row['mape_decided'])} "
            f"(analytic {_percent(row['mape_analytic'])}, learned "
            f"{_percent(row['mape_learned'])})  {row['wall_s']:.0f} s wall")


def format_table(rows: list[dict]) -> str:
    lines = ["| replicas | policy | TTFT p50 | TTFT p99 | TPOT p99 | goodput | hit rate "
             "(% of ideal) | local hits | busy max/min | TTFT MAPE (analytic, learned) | wall |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        share = row["hit_rate"] / row["ideal_hit_rate"] if row["ideal_hit_rate"] else 0.0
        lines.append(
            f"| {row['replicas']} | {row['policy']} | {row['ttft_p50'] * 1e3:.0f} ms | "
            f"{row['ttft_p99'] * 1e3:.0f} ms | {row['tpot_p99'] * 1e3:.1f} ms | "
            f"{row['goodput']:.2f}/s | {row['hit_rate']:.1%} ({share:.0%}) | "
            f"{row['local_hit_rate']:.1%} | "
            f"{_busy(row)} | {_percent(row['mape_decided'])} "
            f"({_percent(row['mape_analytic'])}, {_percent(row['mape_learned'])}) | "
            f"{row['wall_s']:.0f} s |")
    return "\n".join(lines)
