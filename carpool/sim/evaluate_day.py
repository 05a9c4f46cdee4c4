"""``carpool evaluate autoscale``: autoscaling policies over a full-size day.

1. *Calibration* (per-request): ``--calibration-replicas`` replicas
   (predicted-TTFT routing) replay the workload at several shares of
   their measured capacity (``--calibration-loads``); each load gives a
   ``fluid.LoadPoint`` (per replica: in flight, waiting, service time, and
   every request's TTFT / TPOT). The rate the pool is sized for comes from
   it: ``replica_concurrency`` is the in-flight count per replica at the
   highest load whose SLO attainment is at least ``--hour-goal``.
2. *The day* (fluid, carpool/sim/fluid.py): ``day_load.DayLoad`` peaking
   where the sizing rule wants ``--peak-replicas`` (275: the seeds' day
   swings between 75 and 275 nodes), with ``--surges`` nobody planned for,
   under each policy: static peak provisioning (sized for the day's real
   peak), reactive, predictive, a time-of-day schedule (from the curve
   without the surges: what past days show), and the oracle that knows
   the day's real rate. The real ``PoolScaler`` objects decide every
   ``--scale-tick`` seconds with the real start-up time.
3. *A per-request check* of the fluid model: a ``--check-replicas``-sized
   pool through a step surge (``--check-surge``) simulated request by
   request with the same scalers, beside the fluid model of the same
   window: replica-seconds, SLO attainment and scale events of both.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, replace

import numpy as np

from carpool.cluster.autoscaler import (
    AutoscaleConfig,
    PoolScaler,
    SchedulePolicy,
    make_scaler,
    replicas_for,
)
from carpool.cluster.fleet_config import FleetConfig
from carpool.cluster.forecast import FORECASTERS
from carpool.config import EngineConfig
from carpool.settings_fields import add_setting_args, flag_fields, setting
from carpool.sim.cost_flags import cost_model_from_args, pool_blocks
from carpool.sim.day_load import (
    DAY_S,
    HOUR_S,
    SEEDS_TROUGH,
    DayLoad,
    TraceArrivals,
    parse_surges,
    retime,
    swing,
)
from carpool.sim.day_report import (
    equal_attainment_rows,
    format_check_row,
    format_day_table,
    format_equal_table,
)
from carpool.sim.evaluate import fleet_capacity, latency_row, offered_rate, scaled
from carpool.sim.fluid import LoadPoint, ReplicaResponse, run_fluid
from carpool.sim.plan import ASSUMED_PRICE
from carpool.sim.plan_day import DIURNAL_CURVE, parse_curve
from carpool.sim.scale_flags import add_reactive_args, reactive_knobs
from carpool.sim.simulate import SimSettings, cyclic_gc_paused, simulate
from carpool.workload.command import arg_type, workload_spec
from carpool.workload.spec import mooncake_block_tokens, plan_workload

DAY_POLICIES = ("static", "reactive", "predictive", "schedule", "oracle")
# More names --policies takes: the forecast alone, and either forecast
# policy with a forecaster other than Holt (``predictive:seasonal``).
MORE_POLICIES = ("forecast", *(f"{policy}:{name}" for policy in ("predictive", "forecast")
                               for name in FORECASTERS))


def _floats(text: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in text.split(",") if v.strip())
    if not values or min(values) <= 0:
        raise ValueError(f"need positive numbers, comma separated; got {text!r}")
    return values


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in DAY_POLICIES + MORE_POLICIES]
    if unknown or not names:
        raise ValueError(f"unknown policies {unknown}; choose from "
                         f"{', '.join(DAY_POLICIES + MORE_POLICIES)}")
    return names


@dataclass(frozen=True)
class DayEvaluationFlags:
    """``carpool evaluate autoscale``'s own flags (group "evaluation"; the
    reactive scaler's tick and thresholds, ``FleetConfig``'s, come after ``startup_s``)."""

    policies: tuple[str, ...] = setting(
        DAY_POLICIES, "--policies", None, f"comma separated, of {', '.join(DAY_POLICIES)}",
        parse=arg_type(_policies))
    peak_replicas: int = setting(
        275, "--peak-replicas", None,
        "replicas the sizing rule wants at the curve's peak (default 275)", parse=int)
    trough: float = setting(SEEDS_TROUGH, "--trough", None,
                            "the quietest hour's share of the peak (default 75/275)", parse=float)
    daily_curve: tuple[float, ...] = setting(
        DIURNAL_CURVE, "--daily-curve", "M0,...,M23",
        "hourly shape (default: an assumed typical diurnal shape, not data), rescaled to "
        "--trough", parse=arg_type(parse_curve))
    surges: tuple = setting(
        parse_surges("20:20:1.25"), "--surges", None,
        "unplanned surges HOUR:MINUTES:FACTOR,... or none (default 20:20:1.25: +25% for 20 "
        "minutes from 20:00)", parse=arg_type(parse_surges))
    calibration_replicas: int = setting(4, "--calibration-replicas", None,
                                        "the calibration fleet's replicas", parse=int)
    calibration_loads: tuple[float, ...] = setting(
        (0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25), "--calibration-loads", None,
        "shares of the calibration fleet's capacity to measure", parse=arg_type(_floats))
    hour_goal: float = setting(
        0.99, "--hour-goal", None,
        "an hour meets the SLO when this share of what the calibrated replicas reached at "
        "their lightest load does (default 0.99)", parse=float)
    startup_s: tuple[float, ...] = setting(
        (60.0,), "--startup-s", None,
        "a replica's start-up time, seconds, comma separated: every policy runs the day at "
        "each; the first sizes the check (default 60)", parse=arg_type(_floats))
    target_utilization: tuple[float, ...] = setting(
        (0.7, 0.9), "--target-utilization", None,
        "the sizing rule's target utilisation of the calibrated SLO rate, comma separated: "
        "every policy runs the day at each; the first sizes the day (--peak-replicas) and the "
        "check (default 0.7,0.9)", parse=arg_type(_floats))
    price_per_hour: float | None = setting(
        None, "--price-per-hour", None, f"$ per replica-hour (default an assumed "
        f"${ASSUMED_PRICE:g})", parse=float)
    check_replicas: int = setting(
        4, "--check-replicas", None, "the per-request check's pool before its surge (0: no "
        "check)", parse=int)
    check_surge: float = setting(
        1.5, "--check-surge", None,
        "the check's step: this many times the rate for 10 of its 20 minutes", parse=float)
    check_policies: tuple[str, ...] = setting(
        ("reactive", "predictive"), "--check-policies", None,
        "the policies the per-request check runs, comma separated (default "
        "reactive,predictive)", parse=arg_type(_policies))
    json: str | None = setting(None, "--json", None, "write every row here")


# DayEvaluationFlags' fields before the reactive scaler's flags in the group
_BEFORE_REACTIVE = ("policies", "peak_replicas", "trough", "daily_curve", "surges",
                    "calibration_replicas", "calibration_loads", "hour_goal", "startup_s")


def add_day_evaluation_args(parser: argparse.ArgumentParser) -> None:
    """`DayEvaluationFlags`, with the reactive scaler's thresholds among them."""
    group = parser.add_argument_group("evaluation")
    after = tuple(name for name, _ in flag_fields(DayEvaluationFlags)
                  if name not in _BEFORE_REACTIVE)
    add_setting_args(group, DayEvaluationFlags, skip=after)
    add_setting_args(group, FleetConfig, only=("scale_tick",))
    add_reactive_args(group)
    add_setting_args(group, DayEvaluationFlags, skip=_BEFORE_REACTIVE)


def load_point(run, plan, replicas: int) -> LoadPoint:
    """A ``LoadPoint`` of a calibration run (gauges averaged between 10% of
    the arrivals' span, past the warm-up, and the last arrival)."""
    ttft, tpot, e2e = [], [], []
    for record in run.records:
        latencies = record.latencies()
        if latencies is None:
            ttft.append(math.inf)
            tpot.append(math.inf)
            continue
        ttft.append(latencies[0])
        tpot.append(latencies[1] or 0.0)
        e2e.append(latencies[2])
    first, last = plan[0].arrival, plan[-1].arrival
    begin = first + 0.1 * (last - first)
    samples = [(w, r) for t, w, r in run.server_samples if begin <= t <= last] or \
        [(w, r) for _, w, r in run.server_samples]
    waiting = float(np.mean([w for w, _ in samples])) / replicas
    running = float(np.mean([r for _, r in samples])) / replicas
    return LoadPoint(offered_rate(plan) / replicas, waiting + running, waiting,
                     float(np.mean(e2e)) if e2e else math.inf, np.array(ttft), np.array(tpot))


def completed_rate(run, plan) -> float:
    """Requests completed per second between 10% and 90% of the arrivals'
    span (the steady part: no warm-up, no drain)."""
    first, last = plan[0].arrival, plan[-1].arrival
    begin, end = first + 0.1 * (last - first), first + 0.9 * (last - first)
    done = sum(1 for r in run.records if r.ok and begin <= r.finished < end)
    return done / max(end - begin, 1e-9)


def calibrate(base, config, cost, num_blocks, args, block_tokens) -> tuple[ReplicaResponse, float]:
    """The replica response of ``--calibration-replicas`` replicas; and the
    seconds it took. A replica's capacity is the most it completed per
    second, in the capacity probe or at any load; loads it could not keep up
    with (completed under 95% of the offered rate) set the capacity only:
    their queues are the fluid model's own to build."""
    replicas = args.calibration_replicas
    started = time.perf_counter()
    capacity = fleet_capacity(base, config, cost, num_blocks, replicas, block_tokens)
    print(f"== calibration: {replicas} replicas complete {capacity:.2f} req/s in the probe "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    points, most_running = [], 0.0
    for load in args.calibration_loads:
        plan = scaled(base, offered_rate(base) / (load * capacity))
        run = simulate(plan, config, cost, num_blocks, SimSettings(
            replicas=replicas, routing="predicted-ttft", hash_block=block_tokens).validate())
        point, completed = load_point(run, plan, replicas), completed_rate(run, plan)
        kept = completed >= 0.95 * offered_rate(plan)
        if kept:
            points.append(point)
        capacity = max(capacity, completed)
        most_running = max(most_running, point.in_flight - point.waiting)
        row = point.summary(args.slo)
        print(f"  load {load:.0%}: {row['rate']:.2f} req/s per replica, completed "
              f"{completed / replicas:.2f}, in flight {row['in_flight']:.1f}, waiting "
              f"{row['waiting']:.2f}, service {row['service_s']:.2f} s, "
              f"{row['slo_attainment']:.2%} in SLO{'' if kept else ' (behind: capacity only)'}"
              f" ({run.wall_seconds:.0f} s wall)", flush=True)
    return (ReplicaResponse(points, capacity / replicas, most_running),
            time.perf_counter() - started)


def hour_goal(response: ReplicaResponse, args) -> float:
    """The share of an hour's requests within the SLO for the hour to meet it:
    ``--hour-goal`` of what the calibrated replicas reached at their best
    (their lightest load): a prompt too long to prefill within the TTFT
    limit misses it on an idle replica, and no policy can change that."""
    return args.hour_goal * response.points[0].attainment(0.0, args.slo)  # by rate


def sizing_config(response: ReplicaResponse, args,
                  max_replicas: int) -> tuple[AutoscaleConfig, float]:
    """The autoscaler's settings: the seeds' rules, the start-up and tick
    asked for, and ``replica_concurrency`` from the calibration: the
    highest calibrated rate per replica whose SLO attainment is at least
    ``--hour-goal`` (x_ok) times the service time at ``target_utilization``
    of it, so that ``demand()`` sizes the pool for ``target_utilization x
    x_ok`` requests per second per replica; and that service time."""
    goal = hour_goal(response, args)
    good = [p for p in response.points if p.attainment(0.0, args.slo) >= goal]
    if not good:
        raise ValueError(f"no calibrated load meets the SLO for {goal:.1%} of its "
                         f"requests: add lower --calibration-loads or loosen --slo")
    best = max(p.rate for p in good)
    service = response.gauges(args.target_utilization[0] * best)[2]
    return AutoscaleConfig(min_replicas=1, max_replicas=max_replicas, tick_s=args.scale_tick,
                           startup_s=args.startup_s[0],
                           target_utilization=args.target_utilization[0],
                           replica_concurrency=best * service,
                           **reactive_knobs(args)).validate(), service


def day_scaler(name: str, load: DayLoad, config: AutoscaleConfig, service: float,
               start: int) -> PoolScaler:
    """A ``PoolScaler`` for the day; ``static`` is a one-entry schedule sized
    for the day's real peak, ``schedule`` a table per hour from the
    planned curve (no surges), the oracle sees the real rate."""
    peak = max(load.rate_at(t) for t in np.arange(0, DAY_S, config.tick_s))
    if name == "static":
        policy = SchedulePolicy(config, ((0.0, replicas_for(peak, service, config)),))
        policy.name = "static peak"
        return PoolScaler(policy, config, replicas_for(peak, service, config))
    table = []
    for hour in range(24):
        busiest = max(load.planned_rate_at(hour * HOUR_S + s) for s in range(0, 3600, 60))
        table.append((hour * HOUR_S, replicas_for(busiest, service, config)))
    policy, _, forecaster = name.partition(":")
    scaler = make_scaler(policy, config, start, schedule=table, rate_at=load.rate_at,
                         forecaster=forecaster or "holt")
    scaler.policy.name = name
    if policy in ("predictive", "forecast"):
        # Forecasters know yesterday as the schedule does: the planned curve
        # (no surges), one rate per bucket, so a daily shape can be learned.
        bucket = config.forecast_bucket_s
        scaler.rates.remember([load.planned_rate_at(-DAY_S + (i + 0.5) * bucket)
                               for i in range(round(DAY_S / bucket))])
    return scaler


def run_day_rows(base, load: DayLoad, response: ReplicaResponse, config: AutoscaleConfig,
                 service: float, args, price: float) -> list[dict]:
    """Every policy over the same day (the same seeded arrivals) at each
    target utilisation; ratios are to the oracle and static peak at the same."""
    rate_ok = config.replica_concurrency / service  # x_ok (see sizing_config)
    return [row for startup in args.startup_s for target in args.target_utilization
            for row in _day_rows(
                base, load, response,
                replace(config, target_utilization=target, startup_s=startup),
                response.gauges(target * rate_ok)[2], args, price)]


def _day_rows(base, load: DayLoad, response: ReplicaResponse, config: AutoscaleConfig,
              service: float, args, price: float) -> list[dict]:
    start = replicas_for(load.rate_at(0.0), service, config)
    rows = []
    for name in args.policies:
        started = time.perf_counter()
        scaler = day_scaler(name, load, config, service, start)
        day = run_fluid(scaler, load.rate_at, response, args.slo, 0.0, DAY_S,
                        arrivals_in=TraceArrivals(base, load.rate_at))
        row = {"policy": scaler.policy.name, "target_utilization": config.target_utilization,
               "startup_s": config.startup_s,
               **day.summary(hour_goal(response, args)),
               "hourly_attainment": [h["within_slo"] / h["arrivals"] if h["arrivals"] else 1.0
                                     for h in day.hourly],
               "hourly_replicas": [h["replica_seconds"] / HOUR_S for h in day.hourly],
               "wall_s": time.perf_counter() - started}
        row["cost"] = row["replica_hours"] * price
        rows.append(row)
    oracle = next((r for r in rows if r["policy"] == "oracle"), None)
    static = next((r for r in rows if r["policy"] == "static peak"), None)
    for row in rows:
        row["vs_oracle"] = row["replica_hours"] / oracle["replica_hours"] if oracle else None
        row["vs_static"] = row["replica_hours"] / static["replica_hours"] if static else None
    return rows


def run_check_rows(base, config, cost, num_blocks, block_tokens, response: ReplicaResponse,
                   scale: AutoscaleConfig, service: float, args) -> list[dict]:
    """The per-request check: 20 minutes, the rate stepping to
    ``--check-surge`` x from minute 5 to 15, request by request and fluid."""
    from carpool.sim.day_load import Surge

    base_rate = (args.check_replicas * scale.replica_concurrency * scale.target_utilization
                 / service)
    load = DayLoad(base_rate, (1.0,) * 24, (Surge(300.0, 600.0, args.check_surge),))
    window = 1200.0
    plan = retime(base, load.rate_at, 0.0, window)
    check = replace(scale, max_replicas=4 * args.check_replicas)
    rows = []
    for name in args.check_policies:
        policy, _, forecaster = name.partition(":")
        settings = SimSettings(replicas=args.check_replicas, routing="predicted-ttft",
                               hash_block=block_tokens, autoscale=policy,
                               autoscale_config=check,
                               forecaster=forecaster or "holt").validate()
        run = simulate(plan, config, cost, num_blocks, settings)
        measured = latency_row(run, name, args.slo)
        scaler = make_scaler(policy, check, args.check_replicas, rate_at=load.rate_at,
                             forecaster=forecaster or "holt")
        fluid = run_fluid(scaler, load.rate_at, response, args.slo, 0.0, window,
                          arrivals_in=TraceArrivals(base, load.rate_at))
        fluid_row = fluid.summary(hour_goal(response, args))
        rows.append({"policy": name, "requests": len(plan), "offered_base": base_rate,
                     "per_request": {"replica_seconds": run.replica_seconds(),
                                     "slo_attainment": measured["slo_attainment"],
                                     "ttft_p99": measured["ttft_p99"],
                                     "scale_events": len(run.scaling["events"]),
                                     "wall_s": run.wall_seconds},
                     "fluid": {"replica_seconds": fluid.replica_seconds,
                               "slo_attainment": fluid_row["slo_attainment"],
                               "scale_events": fluid_row["scale_events"]}})
        print(format_check_row(rows[-1]), flush=True)
    return rows


def run_day_evaluation(config: EngineConfig, args: argparse.Namespace) -> int:
    cost = cost_model_from_args(args)
    num_blocks = pool_blocks(config, cost, memory_set=args.engine_kv_cache_memory is not None)
    block_tokens = mooncake_block_tokens(args.token_scale)
    price = args.price_per_hour if args.price_per_hour is not None else ASSUMED_PRICE
    with cyclic_gc_paused():
        base = plan_workload(workload_spec(args))
        response, calibration_s = calibrate(base, config, cost, num_blocks, args, block_tokens)
        scale, service = sizing_config(response, args, max_replicas=4 * args.peak_replicas)
        peak_rate = (args.peak_replicas * scale.replica_concurrency * scale.target_utilization
                     / service)
        load = DayLoad(peak_rate, swing(args.daily_curve, args.trough), args.surges)
        print(f"== goal: {hour_goal(response, args):.2%} of an hour's requests within the "
              f"SLO; sizing: {scale.replica_concurrency:.1f} in flight per replica at most, "
              f"service {service:.2f} s; the day peaks at {peak_rate:.0f} req/s "
              f"({sum(load.rate_at(t) for t in range(0, 86400, 60)) * 60 / 1e6:.0f}M requests "
              f"a day)", flush=True)
        rows = run_day_rows(base, load, response, scale, service, args, price)
        print(format_day_table(rows, price))
        equal = equal_attainment_rows(rows)
        print(format_equal_table(equal))
        checks = []
        if args.check_replicas:
            print(f"== per-request check: {args.check_replicas} replicas, x{args.check_surge} "
                  f"for 10 of 20 minutes", flush=True)
            checks = run_check_rows(base, config, cost, num_blocks, block_tokens, response,
                                    scale, service, args)
    if args.json:
        import json

        with open(args.json, "w") as handle:
            json.dump({"rows": rows, "equal_attainment": equal, "checks": checks, "slo": args.slo, "price_per_hour": price,
                       "peak_rate": peak_rate, "calibration_s": calibration_s,
                       "calibration": [p.summary(args.slo) for p in response.points],
                       "replica_capacity": response.capacity,
                       "replica_concurrency": scale.replica_concurrency}, handle, indent=1)
    return 0
