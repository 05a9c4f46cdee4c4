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

import bisect
import contextlib
import gc
import heapq
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from carpool.cluster import RoutingError
from carpool.cluster.autoscaler import AutoscaleConfig, make_scaler
from carpool.cluster.kv_tier import TierClient
from carpool.config import EngineConfig
from carpool.sim.costs import CostModel, kv_bytes_per_token
from carpool.sim.failures import FailureSettings, FleetFailures
from carpool.sim.fleet import ROUTING, FleetRouter, FleetScaling, KVTierSettings, tier_report
from carpool.sim.pd import PDSettings, TransferInbox, kv_shape_of, pd_role
from carpool.sim.replica import SimReplica, VirtualClock
from carpool.sim.timeline import FleetSampler, merge_timelines, sum_samples
from carpool.workload.stats import REJECTED, RequestRecord
from carpool.workload.traces import TraceRequest

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
    pd: PDSettings | None = None  # prefill and decode pools (pd.py); the planner routes
    failures: FailureSettings | None = None  # replicas killed on a schedule (failures.py)
    # Fleet admission: the router turns a request away (429) when no replica's
    # predicted TTFT is within this many seconds (predicted-ttft routing).
    fleet_ttft_target: float | None = None

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
        if self.pd is not None:
            self.pd.validate(self.replicas)
            if self.autoscale or self.replica_schedule or self.kv_tier:
                raise ValueError("prefill/decode pools do not yet combine with autoscaling, a "
                                 "replica schedule or a KV tier")
        if self.failures is not None:
            self.failures.validate(self.replicas)
            if self.pd or self.replica_schedule:
                raise ValueError("failures do not yet combine with P/D pools or a replica "
                                 "schedule")
        if self.fleet_ttft_target is not None and (
                self.fleet_ttft_target <= 0 or self.routing != "predicted-ttft"):
            raise ValueError("--fleet-ttft-target needs a target > 0 and --routing "
                             "predicted-ttft (the policy that predicts TTFTs)")
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
    pd: dict | None = None  # the P/D planner's choices
    failures: list[dict] | None = None  # what failed when, and what it took with it
    timeline: dict | None = None  # per replica over time (timeline.FleetSampler)

    def replica_seconds(self) -> float:
        """Replica-seconds the fleet paid for: the autoscaler's account, else
        each replica from its creation to its failure or the run's end."""
        if self.scaling is not None:
            return self.scaling["replica_seconds"]
        return sum((row["failed_s"] if row["failed_s"] is not None else self.duration)
                   - row["created_s"] for row in self.per_replica)

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
    if (settings.routing == "round-robin" and settings.autoscale is None
            and not settings.kv_tier and not settings.pd and not settings.failures):
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
    return SimRun(records, max(part.duration for part in parts),
                  sum_samples([part.server_samples for part in parts]),
                  steps=sum(part.steps for part in parts),
                  fast_forwarded_steps=sum(part.fast_forwarded_steps for part in parts),
                  wall_seconds=time.perf_counter() - started,
                  per_replica=[row for part in parts for row in part.per_replica],
                  scaling=parts[0].scaling, kv_tier=parts[0].kv_tier, pd=parts[0].pd,
                  failures=parts[0].failures,
                  timeline=merge_timelines([part.timeline for part in parts]))


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
        role = pd_role(settings.pd, index)
        external = (TierClient(tier, clock) if tier is not None else
                    TransferInbox(clock) if role == "decode" else None)
        return SimReplica(index, config, num_blocks, cost, clock,
                          max_model_len=settings.max_model_len,
                          fast_forward=settings.fast_forward,
                          token_times=settings.token_times, hash_block=settings.hash_block,
                          external_kv=external, role=role)

    replicas = [make_replica(i) for i in indices]
    slot = {replica.index: position for position, replica in enumerate(replicas)}
    router = FleetRouter(settings.routing, settings.replicas, settings.replica_schedule)
    if (settings.routing != "round-robin" or settings.autoscale or tier is not None
            or settings.pd or settings.failures):
        router.attach(replicas, config, settings.hash_block,
                      TierClient(tier, clock) if tier is not None else None,
                      settings.pd, kv_shape_of(cost), settings.fleet_ttft_target)
    pd = router.pd
    scaling = _scaling(settings, router, make_replica, arrivals)
    if scaling is not None:
        scaling.start(replicas, 0.0)
    failures = (FleetFailures(settings.failures, router, make_replica, scaling)
                if settings.failures is not None else None)
    # Fleet events on their own clocks: (next_time, fire(now, replicas) ->
    # (replicas created, requests to route again)).
    timers = [timer for timer in (scaling, failures) if timer is not None]
    records = [RequestRecord(i, r.arrival, r.input_len, r.output_len) for i, r in arrivals]
    heap: list[tuple[float, int, int]] = []  # (time, sequence, slot), stale ones skipped
    posted = [-1] * len(replicas)  # sequence of each replica's live heap entry
    sequence = 0
    sampler = FleetSampler(replicas, interval, router.is_ready)

    def post(replica: SimReplica) -> None:
        nonlocal sequence
        sequence += 1
        position = slot[replica.index]
        posted[position] = sequence
        if replica.next_time is not None:
            heapq.heappush(heap, (replica.next_time, sequence, position))

    def route(index: int, request: TraceRequest, record: RequestRecord, now: float) -> None:
        if router.router is None:
            replica, leg = replicas[0], record  # one replica's share of a round-robin plan
        else:
            if scaling is not None:
                scaling.arrived()
                scaling.promote(now)
            try:
                replica, request, leg = router.place(replicas, index, request, record, now)
            except RoutingError as exc:  # what the front answers: 429, nothing queued
                record.sent = now
                record.status, record.reason, record.finished = REJECTED, exc.reason, now
                return
        if replica.receive(request, leg, now):
            post(replica)

    next_arrival = 0
    while next_arrival < len(arrivals) or heap:
        arrival_time = (arrivals[next_arrival][1].arrival if next_arrival < len(arrivals)
                        else math.inf)
        timer = min(timers, key=lambda t: t.next_time, default=None)
        if timer is not None and timer.next_time <= min(arrival_time, heap[0][0] if heap
                                                         else math.inf):
            clock.set(timer.next_time)
            created, retry = timer.fire(clock.now, replicas)
            for replica in created:
                slot[replica.index] = len(replicas)
                replicas.append(replica)
                posted.append(-1)
            for request, record in retry:  # the client sent these once, at arrival
                sent = record.sent
                route(record.index, request, record, clock.now)
                record.sent = sent
            continue
        if heap and heap[0][0] < arrival_time:
            now, seq, position = heapq.heappop(heap)
            if seq != posted[position]:
                continue
            sampler.until(now)
            replicas[position].advance(now)
            post(replicas[position])
            if pd is not None:  # prefill legs done: their decode legs go over now
                for replica, item, record in pd.take_handoffs():
                    if replica.receive(item, record, now):
                        post(replica)
                    record.sent = record.scheduled  # the client sent it on arrival
            continue
        index, request = arrivals[next_arrival]
        record = records[next_arrival]
        next_arrival += 1
        sampler.until(arrival_time)
        clock.set(arrival_time)
        route(index, request, record, arrival_time)
    sampler.until(clock.now)
    return SimRun(records, clock.now, sampler.samples,
                  steps=sum(r.steps for r in replicas),
                  fast_forwarded_steps=sum(r.fast_forwarded_steps for r in replicas),
                  per_replica=[_replica_stats(r) for r in replicas],
                  scaling=scaling.finish(clock.now) if scaling is not None else None,
                  kv_tier=tier_report(tier) if tier is not None else None,
                  pd=pd.report() if pd is not None else None,
                  failures=failures.events if failures is not None else None,
                  timeline=sampler.timeline())


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


def _replica_stats(replica: SimReplica) -> dict:
    scheduler = replica.scheduler
    kv = scheduler.kv.stats()
    return {"replica": replica.index, "role": replica.role, "steps": replica.steps,
            "created_s": replica.created_at, "failed_s": replica.failed_at,
            "busy_s": replica.busy_seconds,
            "fast_forwarded_steps": replica.fast_forwarded_steps,
            "preemptions": scheduler.num_preemptions, "prefix_queries": kv.prefix_queries,
            "prefix_hits": kv.prefix_hits, "external_hits": kv.external_hits,
            "prompt_tokens": replica.prompt_tokens, "cached_tokens": replica.cached_tokens,
            "loaded_tokens": replica.loaded_tokens,
            "rejections": dict(scheduler.rejections)}
