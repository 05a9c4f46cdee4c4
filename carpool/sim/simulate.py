"""``carpool simulate``: replay a workload through simulated replicas.

A discrete-event simulation on a virtual clock. Arrivals come from the
same workload code as ``carpool bench serve`` (carpool/workload/spec.py);
a router sends each to a replica; each replica is carpool's own scheduler
(policy, controller, admission: the classes the engine runs) with a cost
model pricing its steps (carpool/sim/replica.py). The result is a
bench-serve JSON document, so ``carpool bench compare`` and the HTML report
work on it as on a real run; its ``simulation`` section says which cost
model (measured or analytic) priced it and how fast the simulation ran.
Pure Python: nothing here imports torch.
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import heapq
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from carpool.cluster import RoutingError
from carpool.cluster.autoscaler import AutoscaleConfig, make_scaler
from carpool.cluster.kv_tier import TierClient
from carpool.config import EngineConfig, parse_size
from carpool.sim.costs import CostModel, kv_bytes_per_token
from carpool.sim.fleet import ROUTING, FleetRouter, FleetScaling, KVTierSettings, tier_report
from carpool.sim.replica import SimReplica, VirtualClock
from carpool.workload.stats import REJECTED, RequestRecord
from carpool.workload.traces import TraceRequest

# The measured model of carpool's development machine (2-core CPU, default
# model, bf16): what a simulation uses when given no cost model.
DEFAULT_COST_MODEL = Path(__file__).parent / "data" / "dev-cpu-smollm2-bf16.json"
_SAMPLES = 1000  # queue-gauge samples per run, about


@dataclass
class SimSettings:
    """How to simulate (not what): replicas, routing, and the run's options."""

    replicas: int = 1
    routing: str = "round-robin"
    fast_forward: bool = True  # jump over runs of identical decode steps
    token_times: bool = False  # keep every token's time (ITL); costs memory on big runs
    max_model_len: int | None = None
    hash_block: int = 1  # tokens per Mooncake hash block (after token scaling)
    workers: int = 1  # processes simulating independent (round-robin) replicas
    # Autoscaling: (from time s, replicas taking new requests), times ascending;
    # before the first entry all ``replicas`` do. A replica scaled in stops
    # receiving requests and finishes the ones it has.
    replica_schedule: tuple[tuple[float, int], ...] = ()
    # Autoscaling (``carpool.cluster.autoscaler``): a policy name, its
    # settings, and for "schedule" its (seconds after midnight, replicas)
    # table; ``replicas`` is then the count at the start.
    autoscale: str | None = None
    autoscale_config: AutoscaleConfig | None = None
    autoscale_schedule: tuple[tuple[float, int], ...] = ()
    kv_tier: KVTierSettings | None = None  # a shared external KV tier (fleet.py)

    def validate(self) -> SimSettings:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        times = [t for t, _ in self.replica_schedule]
        if times != sorted(times) or any(not 1 <= n <= self.replicas
                                         for _, n in self.replica_schedule):
            raise ValueError(f"a replica schedule needs ascending times and counts in 1.."
                             f"{self.replicas}, got {self.replica_schedule}")
        if self.autoscale is not None and self.replica_schedule:
            raise ValueError("a replica schedule and an autoscaler exclude each other")
        if self.routing not in ROUTING:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING)}, got "
                             f"{self.routing!r}")
        return self


@dataclass
class SimRun:
    """A simulation's outcome: per-request records (bench-serve's), the
    virtual duration, queue gauges over time (t, waiting, running summed over
    replicas), and how much simulating it took."""

    records: list[RequestRecord]
    duration: float
    server_samples: list[tuple[float, float, float]] = field(default_factory=list)
    steps: int = 0
    fast_forwarded_steps: int = 0
    wall_seconds: float = 0.0
    per_replica: list[dict] = field(default_factory=list)
    scaling: dict | None = None  # the autoscaler's timeline, events and replica-hours
    kv_tier: dict | None = None  # the shared KV tier's size and counters

    def speed(self) -> dict:
        wall = max(self.wall_seconds, 1e-9)
        return {"wall_s": self.wall_seconds, "requests": len(self.records),
                "requests_per_wall_s": len(self.records) / wall,
                "steps": self.steps, "steps_per_wall_s": self.steps / wall,
                "fast_forwarded_steps": self.fast_forwarded_steps,
                "simulated_s_per_wall_s": self.duration / wall}


def simulate(plan: Sequence[TraceRequest], config: EngineConfig, cost: CostModel,
             num_blocks: int, settings: SimSettings | None = None) -> SimRun:
    """Run ``plan`` (arrival offsets in seconds, lengths) to completion.

    Under round-robin routing the replicas never influence each other
    (which replica gets a request depends only on its position in arrival
    order), so each replica is simulated on its own, ``settings.workers``
    at a time in worker processes; the result is the same for any number
    of workers. Least-outstanding routing reads every replica's state at
    each arrival: one event loop over all replicas.
    """
    settings = (settings or SimSettings()).validate()
    started = time.perf_counter()
    order = sorted(range(len(plan)), key=lambda i: (plan[i].arrival, i))
    interval = max(max((r.arrival for r in plan), default=0.0) / _SAMPLES, 0.5)
    if settings.routing == "round-robin" and settings.autoscale is None and not settings.kv_tier:
        router = FleetRouter(settings.routing, settings.replicas, settings.replica_schedule)
        shares: list[list[int]] = [[] for _ in range(settings.replicas)]
        for i in order:
            shares[router.next_turn(router.active(plan[i].arrival))].append(i)
        jobs = [(index, [(i, plan[i]) for i in share], config, cost, num_blocks, settings,
                 interval) for index, share in enumerate(shares)]
        with cyclic_gc_paused():  # forked workers inherit the pause
            parts = _map(_simulate_one, jobs, settings.workers)
    else:
        with cyclic_gc_paused():
            parts = [_event_loop(list(range(settings.replicas)), [(i, plan[i]) for i in order],
                                 config, cost, num_blocks, settings, interval)]
    records: list[RequestRecord | None] = [None] * len(plan)
    for part in parts:
        for record in part.records:
            records[record.index] = record
    return SimRun(records, max(part.duration for part in parts), _sum_samples(parts),
                  steps=sum(part.steps for part in parts),
                  fast_forwarded_steps=sum(part.fast_forwarded_steps for part in parts),
                  wall_seconds=time.perf_counter() - started,
                  per_replica=[row for part in parts for row in part.per_replica],
                  scaling=parts[0].scaling, kv_tier=parts[0].kv_tier)


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (nested pauses are fine).

    A simulation allocates millions of small objects (block keys, spans,
    token lists) that reference counting frees; the collector's passes
    over the survivors cost about 12% of the run (measured) and find
    almost nothing: a few thousand objects over 5,000 requests.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _simulate_one(job) -> SimRun:
    index, arrivals, config, cost, num_blocks, settings, interval = job
    return _event_loop([index], arrivals, config, cost, num_blocks, settings, interval)


def _map(function, jobs: list, workers: int) -> list:
    """``map`` over worker processes (fork: the jobs need not be sent)."""
    workers = min(workers, len(jobs))
    if workers <= 1:
        return [function(job) for job in jobs]
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(function, jobs, chunksize=1)


def _event_loop(indices: list[int], arrivals: list[tuple[int, TraceRequest]],
                config: EngineConfig, cost: CostModel, num_blocks: int,
                settings: SimSettings, interval: float) -> SimRun:
    """Simulate the replicas numbered ``indices`` fed ``arrivals`` (plan
    index, request; in arrival order).

    Events at the same instant: arrivals first, so a request arriving
    exactly when a step ends joins the next step (as the engine's loop
    drains its inbox before scheduling).
    """
    clock = VirtualClock()
    tier = settings.kv_tier.build(kv_bytes_per_token(cost), config.cache.block_size,
                                  settings.replicas) if settings.kv_tier else None

    def make_replica(index: int) -> SimReplica:
        return SimReplica(index, config, num_blocks, cost, clock,
                          max_model_len=settings.max_model_len,
                          fast_forward=settings.fast_forward,
                          token_times=settings.token_times, hash_block=settings.hash_block,
                          external_kv=TierClient(tier, clock) if tier is not None else None)

    replicas = [make_replica(i) for i in indices]
    slot = {replica.index: position for position, replica in enumerate(replicas)}
    router = FleetRouter(settings.routing, settings.replicas, settings.replica_schedule)
    if settings.routing != "round-robin" or settings.autoscale or tier is not None:
        router.attach(replicas, config, settings.hash_block,
                      TierClient(tier, clock) if tier is not None else None)
    scaling = _scaling(settings, router, make_replica, arrivals)
    if scaling is not None:
        scaling.start(replicas, 0.0)
    records = [RequestRecord(i, r.arrival, r.input_len, r.output_len) for i, r in arrivals]
    heap: list[tuple[float, int, int]] = []  # (time, sequence, slot), stale ones skipped
    posted = [-1] * len(replicas)  # sequence of each replica's live heap entry
    sequence = 0
    sampler = _GaugeSampler(replicas, interval)

    def post(replica: SimReplica) -> None:
        nonlocal sequence
        sequence += 1
        position = slot[replica.index]
        posted[position] = sequence
        if replica.next_time is not None:
            heapq.heappush(heap, (replica.next_time, sequence, position))

    next_arrival = 0
    while next_arrival < len(arrivals) or heap:
        arrival_time = (arrivals[next_arrival][1].arrival if next_arrival < len(arrivals)
                        else math.inf)
        if scaling is not None and scaling.next_tick <= min(arrival_time, heap[0][0] if heap
                                                             else math.inf):
            clock.set(scaling.next_tick)
            for replica in scaling.tick(clock.now, replicas):
                slot[replica.index] = len(replicas)
                replicas.append(replica)
                posted.append(-1)
            continue
        if heap and heap[0][0] < arrival_time:
            now, seq, position = heapq.heappop(heap)
            if seq != posted[position]:
                continue
            sampler.until(now)
            replicas[position].advance(now)
            post(replicas[position])
            continue
        request = arrivals[next_arrival][1]
        record = records[next_arrival]
        next_arrival += 1
        sampler.until(arrival_time)
        clock.set(arrival_time)
        if router.router is None:
            replica = replicas[0]  # one replica's share of a round-robin plan
        else:
            if scaling is not None:
                scaling.arrived()
                scaling.promote(arrival_time)
            try:
                replica = router.pick(replicas, arrivals[next_arrival - 1][0], request,
                                      arrival_time)
            except RoutingError as exc:  # what the front answers: 429, nothing queued
                record.sent = arrival_time
                record.status, record.reason, record.finished = REJECTED, exc.reason, arrival_time
                continue
        if replica.receive(request, record, arrival_time):
            post(replica)
    sampler.until(clock.now)
    return SimRun(records, clock.now, sampler.samples,
                  steps=sum(r.steps for r in replicas),
                  fast_forwarded_steps=sum(r.fast_forwarded_steps for r in replicas),
                  per_replica=[_replica_stats(r) for r in replicas],
                  scaling=scaling.finish(clock.now) if scaling is not None else None,
                  kv_tier=tier_report(tier) if tier is not None else None)


def _scaling(settings: SimSettings, router: FleetRouter, make_replica,
             arrivals: list[tuple[int, TraceRequest]]) -> FleetScaling | None:
    """The autoscaler of an event loop, if the settings ask for one; the
    oracle is given the plan's own arrival rate ahead of each time."""
    if settings.autoscale is None:
        return None
    config = settings.autoscale_config or AutoscaleConfig(max_replicas=settings.replicas)
    times = [item.arrival for _, item in arrivals]

    def rate_at(t: float, window: float = 60.0) -> float:
        return (bisect.bisect_left(times, t + window) - bisect.bisect_left(times, t)) / window

    scaler = make_scaler(settings.autoscale, config, settings.replicas,
                         schedule=settings.autoscale_schedule, rate_at=rate_at)
    return FleetScaling(scaler, router, make_replica)


def _sum_samples(parts: list[SimRun]) -> list[tuple[float, float, float]]:
    """Gauges of all replicas on one time grid (every part sampled the same
    grid; a part that ended early counts as empty from then on)."""
    longest = max(parts, key=lambda part: len(part.server_samples)).server_samples
    totals = []
    for row, (t, _, _) in enumerate(longest):
        waiting = sum(p.server_samples[row][1] for p in parts if row < len(p.server_samples))
        running = sum(p.server_samples[row][2] for p in parts if row < len(p.server_samples))
        totals.append((t, waiting, running))
    return totals


class _GaugeSampler:
    """Waiting and running requests over all replicas, every ``interval``
    seconds of virtual time (as ``bench serve`` polls a server's /metrics)."""

    def __init__(self, replicas: Sequence[SimReplica], interval: float) -> None:
        self.replicas = replicas
        self.interval = interval
        self.next = 0.0
        self.samples: list[tuple[float, float, float]] = []

    def until(self, now: float) -> None:
        while self.next <= now:
            waiting = sum(len(r.scheduler.waiting) for r in self.replicas)
            running = sum(len(r.scheduler.running) for r in self.replicas)
            self.samples.append((self.next, float(waiting), float(running)))
            self.next += self.interval


def _replica_stats(replica: SimReplica) -> dict:
    scheduler = replica.scheduler
    kv = scheduler.kv.stats()
    return {"replica": replica.index, "steps": replica.steps,
            "busy_s": replica.busy_seconds,
            "fast_forwarded_steps": replica.fast_forwarded_steps,
            "preemptions": scheduler.num_preemptions, "prefix_queries": kv.prefix_queries,
            "prefix_hits": kv.prefix_hits, "external_hits": kv.external_hits,
            "rejections": dict(scheduler.rejections)}


# -- cost model and pool size from the command line ------------------------------------


def add_cost_model_args(parser: argparse.ArgumentParser) -> None:
    """Group "cost model": a saved model (``carpool measure``'s or an
    analytic one) or an analytic model from presets."""
    group = parser.add_argument_group("cost model")
    group.add_argument("--cost-model", default=None,
                       help="a cost model JSON (carpool measure --out); default: the analytic "
                            "model when --hardware is given, else the measured model of "
                            "carpool's 2-core development CPU (default model, bf16)")
    group.add_argument("--hardware", default=None,
                       help="analytic model: accelerator preset (h100-sxm, h200, a100-80gb, l4)")
    group.add_argument("--model-shape", default=None,
                       help="analytic model: model preset (llama-3-8b, llama-3-70b, qwen2-7b, "
                            "smollm2-135m)")
    group.add_argument("--dtype-bytes", type=float, default=2.0,
                       help="analytic model: bytes per weight and KV value")


def cost_model_from_args(args: argparse.Namespace) -> CostModel:
    """The cost model the flags name; a measured one from another machine
    (or one that does not say) is warned about on stderr."""
    from carpool.sim.costs import load_cost_model, warn_if_elsewhere

    if args.cost_model and (args.hardware or args.model_shape):
        raise ValueError("give either --cost-model or --hardware/--model-shape, not both")
    if args.cost_model:
        cost = load_cost_model(args.cost_model)
        warn_if_elsewhere(cost)
        return cost
    if args.hardware or args.model_shape:
        if not (args.hardware and args.model_shape):
            raise ValueError("the analytic cost model needs both --hardware and --model-shape")
        from carpool.sim.analytic import analytic_from_names

        return analytic_from_names(args.hardware, args.model_shape, args.dtype_bytes)
    cost = load_cost_model(DEFAULT_COST_MODEL)
    warn_if_elsewhere(cost)
    return cost


def pool_blocks(config: EngineConfig, cost: CostModel, memory_set: bool) -> int:
    """KV blocks of one replica: ``--num-blocks``; else ``--kv-cache-memory``
    over the KV bytes per token the cost model knows; an analytic model
    without ``--kv-cache-memory`` (``memory_set``) fills 90% of the
    accelerator after the weights, as a GPU engine would."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cost.kind == "analytic" and not memory_set:
        return max(1, cost.max_kv_tokens(0.9) // cache.block_size)
    per_token = kv_bytes_per_token(cost)
    if not per_token:
        raise ValueError("the cost model does not say how many KV bytes a token takes; "
                         "pass --num-blocks")
    blocks = int(parse_size(cache.kv_cache_memory) // (per_token * cache.block_size))
    if blocks < 1:
        raise ValueError(f"kv_cache_memory {cache.kv_cache_memory} holds no KV block")
    return blocks
