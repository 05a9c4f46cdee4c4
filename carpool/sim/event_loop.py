"""The simulator's event loop over a fleet of simulated replicas.

Three kinds of event, on one virtual clock: arrivals (routed at once),
replica wake-ups (a step ends, a run of decodes ends, a poll), and fleet
timers (an autoscaler's tick, a failure, a replacement becoming ready).
At one instant timers come first, then wake-ups before arrivals only if
strictly earlier: a request arriving exactly when a step ends joins the
next step (as the engine's loop drains its inbox before scheduling).
"""
from __future__ import annotations

import bisect
import heapq
import math

from carpool.cluster import RoutingError
from carpool.cluster.autoscaler import AutoscaleConfig, make_scaler
from carpool.cluster.kv_tier import TierClient
from carpool.config import EngineConfig
from carpool.sim.costs import CostModel, kv_bytes_per_token
from carpool.sim.failures import FleetFailures
from carpool.sim.fleet import FleetRouter, FleetScaling, tier_report
from carpool.sim.pd import TransferInbox, kv_shape_of, pd_role
from carpool.sim.replica import SimReplica, VirtualClock
from carpool.sim.settings import SimRun, SimSettings
from carpool.sim.timeline import FleetSampler
from carpool.workload.stats import REJECTED, RequestRecord
from carpool.workload.traces import TraceRequest


class FleetLoop:
    """Simulate the replicas numbered ``indices`` fed ``arrivals`` (plan
    index, request; in arrival order); ``run`` returns the ``SimRun``."""

    def __init__(self, indices: list[int], arrivals: list[tuple[int, TraceRequest]],
                 config: EngineConfig, cost: CostModel, num_blocks: int,
                 settings: SimSettings, interval: float,
                 received: list[float] | None = None) -> None:
        """``received``: when each request (by plan index) reaches the fleet
        past the front (``simulate.front_times``); None: at its arrival.
        Records keep the arrival: the front's time counts in TTFT."""
        self.config, self.cost, self.num_blocks, self.settings = config, cost, num_blocks, settings
        self.arrivals = arrivals
        self.received = received
        self.clock = VirtualClock()
        self.tier = settings.kv_tier.build(kv_bytes_per_token(cost), config.cache.block_size,
                                           settings.replicas) if settings.kv_tier else None
        self.replicas = [self.make_replica(i) for i in indices]
        self.slot = {replica.index: position for position, replica in enumerate(self.replicas)}
        self.fleet = fleet = FleetRouter(settings.routing, settings.replicas,
                                         settings.replica_schedule)
        if (settings.routing != "round-robin" or settings.autoscale or self.tier is not None
                or settings.pd or settings.failures):  # else one replica's share of a plan
            fleet.attach(self.replicas, config, settings.hash_block, self._tier_client(),
                         settings.pd, kv_shape_of(cost), settings.fleet_ttft_target,
                         settings.lost_block_events)
        self.scaling = _scaling(settings, fleet, self.make_replica, arrivals)
        if self.scaling is not None:
            self.scaling.start(self.replicas, 0.0)
        self.failures = (FleetFailures(settings.failures, fleet, self.make_replica, self.scaling)
                         if settings.failures is not None else None)
        # Fleet events on their own clocks: next_time, and fire(now, replicas)
        # -> (replicas created, requests to route again).
        self.timers = [timer for timer in (self.scaling, self.failures) if timer is not None]
        self.records = [RequestRecord(i, r.arrival, r.input_len, r.output_len)
                        for i, r in arrivals]
        self.heap: list[tuple[float, int, int]] = []  # (time, sequence, slot); stale skipped
        self.posted = [-1] * len(self.replicas)  # sequence of each replica's live entry
        self.sequence = 0
        self.sampler = FleetSampler(self.replicas, interval, fleet.is_ready)

    def make_replica(self, index: int) -> SimReplica:
        settings, clock = self.settings, self.clock
        role = pd_role(settings.pd, index)
        external = self._tier_client() or (TransferInbox(clock) if role == "decode" else None)
        return SimReplica(index, self.config, self.num_blocks, self.cost, clock,
                          max_model_len=settings.max_model_len,
                          fast_forward=settings.fast_forward,
                          token_times=settings.token_times, hash_block=settings.hash_block,
                          external_kv=external, role=role)

    def _tier_client(self) -> TierClient | None:
        return TierClient(self.tier, self.clock) if self.tier is not None else None

    def run(self) -> SimRun:
        arrivals, heap = self.arrivals, self.heap
        next_arrival = 0
        # A timer holding requests (a pool at zero) keeps the run going.
        while next_arrival < len(arrivals) or heap or any(
                getattr(t, "holding", False) for t in self.timers):
            arrival_time = (self._received(*arrivals[next_arrival])
                            if next_arrival < len(arrivals) else math.inf)
            wake_time = heap[0][0] if heap else math.inf
            timer = min(self.timers, key=lambda t: t.next_time, default=None)
            if timer is not None and timer.next_time <= min(arrival_time, wake_time):
                self._fire(timer)
            elif wake_time < arrival_time:
                self._wake()
            else:
                index, request = arrivals[next_arrival]
                record = self.records[next_arrival]
                next_arrival += 1
                self.sampler.until(arrival_time)
                self.clock.set(arrival_time)
                self.route(index, request, record, arrival_time)
                if self.received is not None and record.sent is not None:
                    record.sent = request.arrival  # the client sent it then: TTFT counts the front
        self.sampler.until(self.clock.now)
        return self._result()

    def _received(self, index: int, request: TraceRequest) -> float:
        return request.arrival if self.received is None else self.received[index]

    def post(self, replica: SimReplica) -> None:
        """(Re)schedule ``replica``'s next wake-up; an older entry goes stale."""
        self.sequence += 1
        position = self.slot[replica.index]
        self.posted[position] = self.sequence
        if replica.next_time is not None:
            heapq.heappush(self.heap, (replica.next_time, self.sequence, position))

    def route(self, index: int, request: TraceRequest, record: RequestRecord,
              now: float, resumed: int = 0) -> None:
        """Send plan request ``index`` to its replica (or answer 429 for the
        front); ``resumed``: the output tokens it goes on after (its replica
        died)."""
        fleet = self.fleet
        if fleet.router is None:
            replica, leg = self.replicas[0], record  # one replica's share of a plan
        else:
            if self.scaling is not None:
                self.scaling.arrived()
                self.scaling.promote(now)
            try:
                replica, request, leg = fleet.place(self.replicas, index, request, record, now)
            except RoutingError as exc:  # what the front answers: 429, nothing queued
                record.sent = now
                if (exc.reason == "no_replica" and self.scaling is not None
                        and self.scaling.holds_at_zero):  # scaled to zero: it waits
                    self.scaling.hold(request, record, now)
                    return
                record.status, record.reason, record.finished = REJECTED, exc.reason, now
                return
        if replica.receive(request, leg, now, resumed=resumed):
            self.post(replica)

    def _fire(self, timer) -> None:
        self.clock.set(timer.next_time)
        created, retry = timer.fire(self.clock.now, self.replicas)
        for replica in created:
            self.slot[replica.index] = len(self.replicas)
            self.replicas.append(replica)
            self.posted.append(-1)
        for request, record, resumed in retry:  # the client sent these once, at arrival
            sent = record.sent
            self.route(record.index, request, record, self.clock.now, resumed)
            record.sent = sent

    def _wake(self) -> None:
        now, sequence, position = heapq.heappop(self.heap)
        if sequence != self.posted[position]:
            return
        self.sampler.until(now)
        replica = self.replicas[position]
        replica.advance(now)
        self.post(replica)
        pd = self.fleet.pd
        if pd is not None:  # prefill legs done: their decode legs go over now
            for decode, item, record in pd.take_handoffs():
                if decode.receive(item, record, now, handoff=True):
                    self.post(decode)
                record.sent = record.scheduled  # the client sent it on arrival

    def _result(self) -> SimRun:
        now, replicas = self.clock.now, self.replicas
        pd, scaling, failures = self.fleet.pd, self.scaling, self.failures
        return SimRun(self.records, now, self.sampler.samples,
                      steps=sum(r.steps for r in replicas),
                      fast_forwarded_steps=sum(r.fast_forwarded_steps for r in replicas),
                      per_replica=[replica_stats(r) for r in replicas],
                      scaling=scaling.finish(now) if scaling is not None else None,
                      kv_tier=tier_report(self.tier) if self.tier is not None else None,
                      pd=pd.report() if pd is not None else None,
                      failures=failures.events if failures is not None else None,
                      timeline=self.sampler.timeline(), routing=self._routing_report())

    def _routing_report(self) -> dict | None:
        router = self.fleet.router
        if router is None:  # round-robin split over processes: no router
            return None
        return {"mape": router.run_errors(), "index_corrections": router.index_corrections,
                "explored": getattr(router.policy, "explored", 0)}


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
                         schedule=settings.autoscale_schedule, rate_at=rate_at,
                         forecaster=settings.forecaster)
    return FleetScaling(scaler, router, make_replica)


def replica_stats(replica: SimReplica) -> dict:
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
