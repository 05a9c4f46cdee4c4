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

import contextlib
import gc
import math
import time
from collections.abc import Iterator, Sequence

from carpool.config import EngineConfig
from carpool.sim.costs import CostModel
from carpool.sim.event_loop import FleetLoop
from carpool.sim.fleet import ROUTING, FleetRouter
from carpool.sim.settings import SimRun, SimSettings
from carpool.sim.timeline import merge_timelines, sum_samples
from carpool.workload.stats import RequestRecord
from carpool.workload.traces import TraceRequest

__all__ = ["ROUTING", "SimRun", "SimSettings", "cyclic_gc_paused", "simulate"]
_SAMPLES = 1000  # queue-gauge samples per run, about


def simulate(plan: Sequence[TraceRequest], config: EngineConfig, cost: CostModel,
             num_blocks: int, settings: SimSettings | None = None) -> SimRun:
    """Run ``plan`` (arrival offsets in seconds, lengths) to completion.

    Under round-robin routing the replicas never influence each other
    (which replica gets a request depends only on its position in arrival
    order), so each replica is simulated on its own, ``settings.workers``
    at a time in worker processes; the result is the same for any number
    of workers. Any other fleet (routing that reads replica state,
    autoscaling, a shared KV tier, P/D pools, failures) runs in one event
    loop over all replicas (``event_loop.FleetLoop``).
    """
    settings = (settings or SimSettings()).validate()
    started = time.perf_counter()
    order = sorted(range(len(plan)), key=lambda i: (plan[i].arrival, i))
    interval = max(max((r.arrival for r in plan), default=0.0) / _SAMPLES, 0.5)
    received = front_times(plan, order, settings.front_seconds)
    if (settings.routing == "round-robin" and settings.autoscale is None
            and not settings.kv_tier and not settings.pd and not settings.failures):
        router = FleetRouter(settings.routing, settings.replicas, settings.replica_schedule)
        shares: list[list[int]] = [[] for _ in range(settings.replicas)]
        for i in order:
            shares[router.next_turn(router.active(plan[i].arrival))].append(i)
        jobs = [(index, [(i, plan[i]) for i in share], config, cost, num_blocks, settings,
                 interval, received) for index, share in enumerate(shares)]
        with cyclic_gc_paused():  # forked workers inherit the pause
            parts = _map(_simulate_one, jobs, settings.workers)
    else:
        with cyclic_gc_paused():
            parts = [FleetLoop(list(range(settings.replicas)), [(i, plan[i]) for i in order],
                               config, cost, num_blocks, settings, interval, received).run()]
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
                  failures=parts[0].failures, routing=parts[0].routing,
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
    index, arrivals, config, cost, num_blocks, settings, interval, received = job
    return FleetLoop([index], arrivals, config, cost, num_blocks, settings, interval,
                     received).run()


def front_times(plan: Sequence[TraceRequest], order: Sequence[int],
                seconds: float) -> list[float] | None:
    """When each request of ``plan`` reaches the fleet past the front (by
    plan index), the front serving arrivals one at a time (``order``: by
    arrival), ``seconds`` each (``SimSettings.front_seconds``); None for 0:
    each request reaches the fleet as it arrives."""
    if seconds <= 0:
        return None
    received = [0.0] * len(plan)
    free = -math.inf
    for i in order:  # first come, first served: times never decrease in order
        free = max(plan[i].arrival, free) + seconds
        received[i] = free
    return received


def _map(function, jobs: list, workers: int) -> list:
    """``map`` over worker processes (fork: the jobs need not be sent)."""
    workers = min(workers, len(jobs))
    if workers <= 1:
        return [function(job) for job in jobs]
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(function, jobs, chunksize=1)
