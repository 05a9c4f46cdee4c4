"""The ``carpool plan`` command: flags, the peak workload, and the run
(the planning itself is in carpool/sim/plan.py, the day and the report in
carpool/sim/plan_day.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

from carpool.config import EngineConfig
from carpool.settings_fields import add_setting_args, setting
from carpool.sim.command import add_simulation_args, cost_label, settings_from_args
from carpool.sim.cost_flags import add_cost_model_args, cost_model_from_args, pool_blocks
from carpool.sim.costs import machine_warning
from carpool.sim.plan import ASSUMED_PRICE, Batching, PeakProblem, plan_peak
from carpool.slo import parse_slo
from carpool.workload.arrivals import rescale_offsets
from carpool.workload.command import add_workload_args, workload_spec
from carpool.workload.flag_types import arg_type
from carpool.workload.spec import WorkloadSpec, describe_workload, plan_workload
from carpool.workload.traces import TraceRequest


@dataclasses.dataclass(frozen=True)
class PlanFlags:
    """``carpool plan``'s targets (group "plan"); ``--peak-rate`` and
    ``--slo`` are required (None only until parsed)."""

    peak_rate: float | None = setting(
        None, "--peak-rate", None,
        "requests/s at the peak; replaces --rate and --num-requests (a timed trace is looped "
        "and its time scaled to this mean rate)", parse=float, required=True)
    window: float = setting(300.0, "--window", None,
                            "seconds of peak traffic each probe simulates", parse=float)
    slo: dict | None = setting(
        None, "--slo", None,
        "per-request limits, e.g. ttft=500ms,tpot=100ms (ttft, tpot, e2e)",
        parse=arg_type(parse_slo), required=True)
    attainment: float = setting(0.95, "--attainment", None,
                                "share of requests that must meet the SLO, in (0, 1]",
                                parse=float)
    utilization: float = setting(0.8, "--utilization", None,
                                 "target utilisation of the first estimate, in (0, 1]",
                                 parse=float)
    price_per_hour: float | None = setting(
        None, "--price-per-hour", None,
        f"$ per replica-hour (default {ASSUMED_PRICE:g}: a placeholder assumption, replace it)",
        parse=float)
    batching_candidates: tuple[Batching, ...] | None = setting(
        None, "--batching-candidates", "SEQSxTOKENS,...",
        "max_num_seqs x max_num_batched_tokens settings to search, e.g. "
        "64x512,128x1024,256x2048 (default: the engine's)", parse=arg_type(Batching.parse_list))
    # the search's bound, not an autoscaler's (`carpool simulate --max-replicas`)
    max_replicas: int = setting(1024, "--max-replicas", None,
                                "the search gives up (an error) above this many replicas",
                                parse=int)
    json: str | None = setting(None, "--json", None, "write the plan here")


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """Workload, cost model, simulation options (no --replicas: the plan
    chooses them), the planning targets and the day-long mode."""
    from carpool.sim.plan_day import add_day_args

    add_workload_args(parser, seed_flag="--workload-seed")
    add_cost_model_args(parser)
    add_simulation_args(parser, fleet=False)
    group = parser.add_argument_group("plan")
    add_setting_args(group, PlanFlags)
    add_day_args(parser)


def validate_plan_args(args: argparse.Namespace) -> None:
    """ValueError for planning flags out of range or that do not apply."""
    checks = [(args.peak_rate > 0, f"--peak-rate must be > 0, got {args.peak_rate}"),
              (args.window > 0, f"--window must be > 0 seconds, got {args.window}"),
              (0 < args.attainment <= 1, f"--attainment must be in (0, 1], got {args.attainment}"),
              (0 < args.utilization <= 1,
               f"--utilization must be in (0, 1], got {args.utilization}"),
              (args.price_per_hour is None or args.price_per_hour >= 0,
               f"--price-per-hour must be >= 0, got {args.price_per_hour}"),
              (args.max_replicas >= 1, f"--max-replicas must be >= 1, got {args.max_replicas}"),
              (bool(args.slo), "plan needs an SLO, e.g. --slo ttft=500ms,tpot=100ms"),
              (not (args.surge or args.ramp), "--surge and --ramp do not apply to plan: it "
                                              "simulates steady peak traffic (--day: a curve)"),
              (args.arrival != "trace" or args.time_scale == 1,
               "--time-scale does not apply to plan: --peak-rate sets the trace's rate")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    from carpool.sim.plan_day import validate_day_args

    validate_day_args(args)


def peak_workload(args: argparse.Namespace, rate: float,
                  count: int) -> tuple[list[TraceRequest], WorkloadSpec]:
    """``count`` requests of the workload arriving at ``rate`` req/s on
    average, and the workload that describes them: generated arrivals get
    ``rate``; a timed trace is looped and its gaps scaled so its mean rate is
    ``rate`` (its burst pattern is kept)."""
    shaped = dataclasses.replace(workload_spec(args), num_requests=count)
    if args.arrival != "trace":
        shaped = dataclasses.replace(shaped, rate=rate)
        return plan_workload(shaped), shaped
    shaped = dataclasses.replace(shaped, trace_loop=True)
    plan = plan_workload(shaped)
    offsets = rescale_offsets([r.arrival for r in plan], rate)
    span = plan[-1].arrival - plan[0].arrival if len(plan) > 1 else 0.0
    shaped = dataclasses.replace(shaped, time_scale=offsets[-1] / span if span > 0 else 1.0)
    return [dataclasses.replace(r, arrival=t) for r, t in zip(plan, offsets)], shaped


def run_plan(config: EngineConfig, args: argparse.Namespace) -> int:
    """``carpool plan``: the peak plan (and with --day the day), printed and
    written to --json."""
    started = time.perf_counter()
    validate_plan_args(args)
    cost = cost_model_from_args(args)
    num_blocks = pool_blocks(config, cost, memory_set=args.engine_kv_cache_memory is not None)
    settings = settings_from_args(config, cost, argparse.Namespace(
        **vars(args), replicas=1, token_times=False))
    count = max(1, math.ceil(args.peak_rate * args.window - 1e-9))
    workload, shaped = peak_workload(args, args.peak_rate, count)
    problem = PeakProblem(workload, args.peak_rate, count / args.peak_rate, cost, num_blocks,
                          settings, args.slo, args.attainment)
    candidates = args.batching_candidates or [
        Batching(config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)]
    price = ASSUMED_PRICE if args.price_per_hour is None else args.price_per_hour
    doc = _plan_header(args, problem, shaped, config, price)
    doc.update(plan_peak(problem, config, candidates, args.utilization, args.max_replicas,
                         price))
    if args.day:
        from carpool.sim.plan_day import plan_day

        best = next(c for c in candidates if str(c) == doc["answer"]["batching"])
        doc["day"] = plan_day(problem, best.apply(config), doc["answer"]["replicas"],
                              args.daily_curve, args.hour_seconds or 3600.0, price,
                              lambda n: peak_workload(args, args.peak_rate, n)[0])
    doc["wall_s"] = time.perf_counter() - started
    from carpool.sim.plan_day import format_plan

    print(format_plan(doc))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
    return 0


def _plan_header(args: argparse.Namespace, problem: PeakProblem, shaped: WorkloadSpec,
                 config: EngineConfig, price: float) -> dict:
    """The plan document's description of what was planned and how it was priced."""
    return {"kind": "carpool-plan", "cost_model_kind": problem.cost.kind,
            "cost_model_label": cost_label(problem.cost), "cost_model": problem.cost.describe(),
            "cost_model_warning": machine_warning(problem.cost),
            "workload": describe_workload(shaped, plan=problem.workload),
            "inputs": {"peak_rate": problem.peak_rate, "window_s": problem.window_s,
                       "requests_per_probe": len(problem.workload), "slo": problem.slo,
                       "attainment": problem.attainment, "utilization": args.utilization,
                       "price_per_replica_hour": price,
                       "price_is_assumption": args.price_per_hour is None,
                       "max_replicas": args.max_replicas, "routing": args.routing,
                       "num_blocks": problem.num_blocks, "block_size": config.cache.block_size}}

