"""``carpool evaluate batching``: the design's comparison table from simulation.

Rows (``--regimes``), each one simulated replica of carpool's own scheduler
on the analytic cost model of a replica sliced over GPUs
(carpool/sim/parallel_cost.py, e.g. DeepSeek-V3 over two H800 nodes):

* ``static``: static batching, batches of ``--static-batch-size`` padded
  requests (the scheduler's ``batching=static``; fewer after
  ``--static-max-wait``), each run to completion before the next forms;
* ``dynamic``: request-level dynamic batching (length buckets, Triton-style;
  not in the design's table, for reference);
* ``continuous``: the design's "dynamic batching": requests join and leave
  at every step (carpool's continuous batching), communication exposed;
* ``overlap``: the same with two micro-batches (``micro_batches=auto``:
  each step split where it pays).

Per row: the peak arrival rate the replica serves with ``--attainment`` of
its requests within the SLO (the trace's arrivals rescaled in time: from a
capacity probe, doubled while the SLO holds, then bisected, not below an
eighth of the capacity), and at that rate: output tok/s per GPU,
device utilisation (``StepMeter``: the seconds the GPUs computed real
tokens, padding, per-step overhead, exposed communication and idle time
excluded, over the run), mean TTFT / TPOT / end-to-end latency and the
share of communication left exposed. Then the day (carpool/sim/day_load.py:
the diurnal curve swung to ``--trough``, 75/275 by default): the day peaks
where the best row needs ``--peak-nodes`` nodes; every row is provisioned
per hour for the hour's busiest rate at its own peak rate within the SLO
(the time-of-day schedule of ``evaluate autoscale``), priced in GPU-hours.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass

from carpool.config import EngineConfig
from carpool.executor.shapes import StepShape
from carpool.settings_fields import add_setting_args, setting
from carpool.sim.analytic import _pairs
from carpool.sim.cost_flags import cost_model_from_args, pool_blocks
from carpool.sim.day_load import DAY_S, HOUR_S, SEEDS_TROUGH, DayLoad, swing
from carpool.sim.evaluate import fleet_capacity, offered_rate, scaled
from carpool.sim.plan_day import DIURNAL_CURVE, parse_curve
from carpool.sim.simulate import SimSettings, cyclic_gc_paused, simulate
from carpool.workload.command import arg_type, workload_spec
from carpool.workload.results import LoadRun, make_result
from carpool.workload.spec import mooncake_block_tokens, plan_workload

REGIMES = ("static", "dynamic", "continuous", "overlap")
DESIGN_NAMES = {"static": "static batching", "dynamic": "request-level dynamic (buckets)",
                "continuous": "dynamic batching (per step)",
                "overlap": "dynamic batching + overlap"}
# DeepSeek's own lease price in its day report (open-infra-index, V3/R1
# inference overview): "the leasing cost of one H800 GPU is $2 per hour".
GPU_HOUR_PRICE = 2.0
EXPANSIONS = 4  # doublings of the probed capacity while it stays within the SLO
FLOOR = 1 / 8  # rates below this share of the capacity are not searched


def _regimes(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in REGIMES]
    if unknown or not names:
        raise ValueError(f"unknown regimes {unknown}; choose from {', '.join(REGIMES)}")
    return names


@dataclass(frozen=True)
class BatchingEvaluationFlags:
    """``carpool evaluate batching``'s own flags (group "evaluation")."""

    regimes: tuple[str, ...] = setting(
        ("static", "continuous", "overlap"), "--regimes", None,
        f"comma separated, of {', '.join(REGIMES)} (default static,continuous,overlap: the "
        "design's three rows)", parse=arg_type(_regimes))
    static_batch_size: int | None = setting(
        None, "--static-batch-size", "N",
        "static and dynamic rows: requests a batch forms of (default --max-num-seqs)", parse=int)
    static_max_wait: float = setting(
        0.5, "--static-max-wait", "SECONDS",
        "static and dynamic rows: a batch goes with fewer once its oldest waited this long "
        "(default 0.5)", parse=float)
    attainment: float = setting(
        0.95, "--attainment", None,
        "share of requests within the SLO a rate needs (default 0.95)", parse=float)
    search_steps: int = setting(
        6, "--search-steps", None, "bisection steps for each row's peak rate (default 6)",
        parse=int)
    peak_nodes: int = setting(
        275, "--peak-nodes", None,
        "nodes the best row needs at the day's peak (default 275: the design's day)", parse=int)
    trough: float = setting(SEEDS_TROUGH, "--trough", None,
                            "the quietest hour's share of the peak (default 75/275)", parse=float)
    daily_curve: tuple[float, ...] = setting(
        DIURNAL_CURVE, "--daily-curve", "M0,...,M23",
        "hourly shape (default: an assumed typical diurnal shape, not data), rescaled to "
        "--trough", parse=arg_type(parse_curve))
    price_per_gpu_hour: float = setting(
        GPU_HOUR_PRICE, "--price-per-gpu-hour", None,
        f"$ per GPU-hour (default ${GPU_HOUR_PRICE:g}: DeepSeek's own H800 assumption)",
        parse=float)
    json: str | None = setting(None, "--json", None, "write every row here")


def add_batching_evaluation_args(parser: argparse.ArgumentParser) -> None:
    add_setting_args(parser.add_argument_group("evaluation"), BatchingEvaluationFlags)


class StepMeter:
    """What a run's executed steps spent, per GPU (the cost model's
    ``breakdown``): useful compute (the real tokens' roofline, padding
    excluded), communication and the part of it exposed, and the steps
    split in two micro-batches."""

    def __init__(self, cost) -> None:
        self.cost = cost
        self.steps = self.split_steps = 0
        self.seconds = self.useful_s = self.comm_s = self.exposed_s = 0.0

    def __call__(self, items, shape: StepShape) -> None:
        if shape.tokens == 0:
            return
        step = self.cost.breakdown(shape.tokens, shape.seqs, shape.context_tokens,
                                   _pairs(shape))
        real = StepShape.of(items)
        useful = self.cost.breakdown(real.tokens, real.seqs, real.context_tokens, _pairs(real))
        self._add(step, useful.compute_s)

    def decodes(self, seqs: int, context_tokens: int, steps: int) -> None:
        """A fast-forwarded run of ``steps`` decode steps of ``seqs``
        sequences, the first attending to ``context_tokens``."""
        for i in range(steps):
            context = context_tokens + i * seqs
            step = self.cost.breakdown(seqs, seqs, context, context)
            self._add(step, step.compute_s)

    def _add(self, step, useful_s: float) -> None:
        self.steps += 1
        self.split_steps += step.split
        self.seconds += step.seconds
        self.useful_s += useful_s
        self.comm_s += step.comm_s
        self.exposed_s += step.exposed_s


class MeteredCost:
    """``cost`` with a ``StepMeter`` the simulated executor calls on every
    executed step and the replica on every fast-forwarded run (the steps
    that ran of it)."""

    def __init__(self, cost) -> None:
        self._cost = cost
        self.meter = StepMeter(cost)

    def __getattr__(self, name: str):
        return getattr(self._cost, name)


def regime_setup(name: str, config: EngineConfig, cost, args) -> tuple[EngineConfig, object]:
    """The engine config and cost model of a row."""
    scheduler = config.scheduler
    size = args.static_batch_size or scheduler.max_num_seqs
    if name in ("static", "dynamic"):
        scheduler = dataclasses.replace(
            scheduler, batching=name, preferred_batch_size=size,
            max_batch_size=max(size, scheduler.max_batch_size) if name == "dynamic" else size,
            max_wait=args.static_max_wait, long_batch_size=None)  # one queue: whole batches
    else:
        scheduler = dataclasses.replace(scheduler, batching="continuous")
    split = "auto" if name == "overlap" else "off"
    if cost.parallel.micro_batches != "off" and name == "overlap":
        split = cost.parallel.micro_batches  # --sim-micro-batches on: always split
    cost = dataclasses.replace(cost, parallel=dataclasses.replace(cost.parallel,
                                                                  micro_batches=split))
    return dataclasses.replace(config, scheduler=scheduler), cost


def measure_rate(base, rate: float, config, cost, num_blocks: int, block_tokens: int,
                 slo: dict) -> dict:
    """One replica at ``rate`` requests/s: the latency summary and the meter."""
    plan = scaled(base, offered_rate(base) / rate)
    metered = MeteredCost(cost)
    run = simulate(plan, config, metered, num_blocks, SimSettings(
        replicas=1, routing="round-robin", hash_block=block_tokens,
        workers=1).validate())
    summary = make_result("row", {}, LoadRun(run.records, run.duration, []), slo,
                          per_request=False)["summary"]
    meter, gpus = metered.meter, cost.gpus
    busy, output_tok_s = steady_window(run, plan)
    return {"rate": rate, "requests": len(plan), "duration_s": run.duration,
            "slo_attainment": summary["slo_attainment"],
            "output_tok_s": output_tok_s, "output_tok_s_per_gpu": output_tok_s / gpus,
            "ttft_mean": summary["ttft"]["mean"], "tpot_mean": summary["tpot"]["mean"],
            "e2e_mean": summary["e2e"]["mean"],
            "utilisation": busy * meter.useful_s / max(meter.seconds, 1e-9), "busy": busy,
            "comm_share": meter.comm_s / max(meter.seconds, 1e-9),
            "exposed_of_comm": meter.exposed_s / meter.comm_s if meter.comm_s else 0.0,
            "split_steps": meter.split_steps / max(meter.steps, 1), "steps": meter.steps,
            "wall_s": run.wall_seconds}


def steady_window(run, plan) -> tuple[float, float]:
    """The replica's busy share and its output tokens per second between 10%
    and 90% of the arrivals' span (the steady part: no warm-up, no drain)."""
    first, last = min(r.arrival for r in plan), max(r.arrival for r in plan)
    begin, end = first + 0.1 * (last - first), first + 0.9 * (last - first)
    tokens = sum(r.output_tokens for r in run.records if r.ok and begin <= r.finished < end)
    timeline = run.timeline
    series = next(iter(timeline["replicas"].values()))
    interval, offset = timeline["interval_s"], series["first_sample"]
    # sample k, at (offset + k) x interval, covers the interval before it
    busy = [b for k, b in enumerate(series["busy"])
            if begin <= (offset + k - 1) * interval and (offset + k) * interval <= end]
    share = sum(busy) / len(busy) if busy else run.per_replica[0]["busy_s"] / run.duration
    return share, tokens / max(end - begin, 1e-9)


def peak_rate_row(name: str, base, config, cost, num_blocks: int, block_tokens: int,
                  args) -> dict:
    """A row's peak rate within the SLO (bisection below the probed
    capacity) and its figures there; when no rate meets the SLO, its
    figures at its capacity (``sized_by`` "throughput": the day is then
    sized by what it completes, the SLO unmet)."""
    started = time.perf_counter()
    capacity = fleet_capacity(base, config, cost, num_blocks, 1, block_tokens)
    low, high, best = 0.0, capacity, None
    for _ in range(EXPANSIONS):  # the probe's drain can understate what keeps the SLO
        point = _probe(name, base, high, config, cost, num_blocks, block_tokens, args)
        if point["slo_attainment"] < args.attainment:
            break
        low, best, high = high, point, 2 * high
    for _ in range(args.search_steps):
        rate = (low + high) / 2
        if rate < capacity * FLOOR:  # a regime that keeps the SLO only this idle has none
            break
        point = _probe(name, base, rate, config, cost, num_blocks, block_tokens, args)
        if point["slo_attainment"] >= args.attainment:
            low, best = rate, point
        else:
            high = rate
    sized_by = "slo"
    if best is None:
        best, sized_by = _probe(name, base, capacity, config, cost, num_blocks, block_tokens,
                                args), "throughput"
    return {"regime": name, "design_name": DESIGN_NAMES[name], "capacity": capacity,
            "peak_qps": best["rate"] if sized_by == "slo" else 0.0, "sized_by": sized_by,
            "sizing_qps": best["rate"], "gpus": cost.gpus, **best,
            "search_s": time.perf_counter() - started}


def _probe(name: str, base, rate: float, config, cost, num_blocks: int, block_tokens: int,
           args) -> dict:
    point = measure_rate(base, rate, config, cost, num_blocks, block_tokens, args.slo)
    print(f"  {name:<10} {rate:8.2f} req/s: {point['slo_attainment']:.1%} in SLO, "
          f"{point['output_tok_s_per_gpu']:.0f} tok/s/GPU, utilisation "
          f"{point['utilisation']:.0%} ({point['wall_s']:.0f} s wall)", flush=True)
    return point


def day_rows(rows: list[dict], args, gpus_per_node: int) -> DayLoad:
    """Each row's day: hourly replicas for the hour's busiest planned rate at
    the row's peak rate; node-hours and $. Returns the day's load."""
    best = max(rows, key=lambda r: r["sizing_qps"])
    nodes_per_replica = best["gpus"] / gpus_per_node
    peak_rate = args.peak_nodes / nodes_per_replica * best["sizing_qps"]
    load = DayLoad(peak_rate, swing(args.daily_curve, args.trough))
    busiest = [max(load.planned_rate_at(h * HOUR_S + s) for s in range(0, 3600, 60))
               for h in range(24)]
    requests = sum(load.planned_rate_at(t) for t in range(0, int(DAY_S), 60)) * 60
    for row in rows:
        replicas = [math.ceil(rate / row["sizing_qps"]) for rate in busiest]
        nodes = [r * row["gpus"] / gpus_per_node for r in replicas]
        gpu_hours = sum(r * row["gpus"] for r in replicas)
        tokens = requests * row["output_per_request"]
        row.update(nodes_min=min(nodes), nodes_max=max(nodes), node_hours=sum(nodes),
                   dollars_per_day=gpu_hours * args.price_per_gpu_hour,
                   day_tok_s_per_gpu=tokens / (gpu_hours * HOUR_S))
    return load


def run_batching_evaluation(config: EngineConfig, args: argparse.Namespace) -> int:
    cost = cost_model_from_args(args)
    if not hasattr(cost, "breakdown"):
        raise ValueError("evaluate batching needs a replica sliced over GPUs: --hardware, "
                         "--model-shape and --sim-tensor-parallel-size or "
                         "--sim-expert-parallel-size above 1")
    num_blocks = pool_blocks(config, cost, memory_set=args.engine_kv_cache_memory is not None)
    block_tokens = mooncake_block_tokens(args.token_scale)
    rows = []
    with cyclic_gc_paused():
        base = plan_workload(workload_spec(args))
        print(f"== {cost.model.name} on {cost.gpus} x {cost.hardware.name} (TP "
              f"{cost.parallel.tensor_parallel_size}, EP {cost.parallel.expert_parallel_size})"
              f", {num_blocks} KV blocks, {len(base)} requests, SLO {args.slo}", flush=True)
        for name in args.regimes:
            regime_config, regime_cost = regime_setup(name, config, cost, args)
            rows.append(peak_rate_row(name, base, regime_config, regime_cost, num_blocks,
                                      block_tokens, args))
            rows[-1]["output_per_request"] = sum(r.output_len for r in base) / len(base)
    load = day_rows(rows, args, cost.interconnect.gpus_per_node)
    print(format_batching_table(rows, args, load))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": rows, "slo": args.slo, "attainment": args.attainment,
                       "peak_rate": load.peak_rate, "cost_model": cost.describe()},
                      handle, indent=1)
    return 0


def format_batching_table(rows: list[dict], args, load: DayLoad) -> str:
    lines = [f"the day: {load.peak_rate:.0f} req/s at the peak, {args.trough:.3f} of it at the "
             f"trough; ${args.price_per_gpu_hour:g} a GPU-hour",
             "| regime | output tok/s per GPU | device utilisation | mean latency (E2E) | "
             "TTFT / TPOT mean | peak QPS within SLO (replica) | comm exposed | nodes "
             "(trough-peak) | $/day | day tok/s per GPU |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        none = "" if row["sized_by"] == "slo" else " (no rate in SLO: at its capacity)"
        lines.append(
            f"| {row['design_name']}{none} | {row['output_tok_s_per_gpu']:.0f} | "
            f"{row['utilisation']:.0%} | {row['e2e_mean']:.2f} s | "
            f"{row['ttft_mean'] * 1e3:.0f} ms / {row['tpot_mean'] * 1e3:.1f} ms | "
            f"{row['peak_qps']:.1f} | {row['exposed_of_comm']:.0%} | "
            f"{row['nodes_min']:.0f}-{row['nodes_max']:.0f} | {row['dollars_per_day']:,.0f} | "
            f"{row['day_tok_s_per_gpu']:.0f} |")
    return "\n".join(lines)
