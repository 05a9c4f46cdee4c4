"""A pool of replicas as a fluid, for days at full fleet size. Pure Python + numpy.

A day at 275 replicas is ~10^8 requests: 2-5 days of per-request
simulation on this machine. The fluid model keeps what autoscaling is
about (how many replicas are up, starting and draining; a queue that
builds when the ready ones cannot keep up; what the autoscaler sees at
each tick) and takes a replica's behaviour from a ``ReplicaResponse``:
measured by the per-request simulator on a few replicas at several
arrival rates (carpool/sim/evaluate_day.py), interpolated between them.

Every ``tick_s`` (the autoscaler's tick) ``A`` requests arrive (those
of the per-request simulation's re-timed trace, or ``Poisson(rate x
tick)``); the ready replicas complete up to ``ready x capacity x
tick`` of the queue plus the arrivals, spread evenly over them (a router
that balances; the per-request check measures how far that holds); what
they cannot take waits, and this tick's arrivals wait behind it for
``queued / (ready x capacity)`` seconds on top of the TTFT they see at
that load, where ``queued`` is the part of the queue the running batches
have no room for (continuous batching takes a burst into the batch up to
the most a replica was seen running). The ``PoolScaler`` gets the pool's
signals (backlog = ready x waiting per replica at the load + ``queued``;
in flight = ready x in flight at the load + the queue) and its count: new
replicas cost from the tick they are asked for and take load
``startup_s`` later; removed ones (the newest first, starting ones before
ready ones, as the simulator's ``FleetScaling`` does) cost for one more
service time while they drain.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from carpool.cluster.autoscaler import PoolScaler, PoolSignals

HOUR_S = 3600.0


@dataclass
class LoadPoint:
    """One replica at one arrival rate, as the per-request simulator saw it."""

    rate: float  # requests per second per replica
    in_flight: float  # mean requests held (waiting + running)
    waiting: float  # mean requests waiting for a batch slot
    service_s: float  # mean seconds from arrival to the last token
    ttft: np.ndarray  # per request (inf: did not complete)
    tpot: np.ndarray  # per request (0: one token, nothing to miss)

    def attainment(self, delay: float, slo: dict) -> float:
        """Share of requests within the SLO had each waited ``delay`` s more."""
        met = np.ones(len(self.ttft), dtype=bool)
        if "ttft" in slo:
            met &= self.ttft + delay <= slo["ttft"]
        if "tpot" in slo:
            met &= self.tpot <= slo["tpot"]
        return float(met.mean()) if len(met) else 0.0

    def summary(self, slo: dict) -> dict:
        return {"rate": self.rate, "in_flight": self.in_flight, "waiting": self.waiting,
                "service_s": self.service_s, "requests": len(self.ttft),
                "slo_attainment": self.attainment(0.0, slo)}


@dataclass
class ReplicaResponse:
    """A replica's behaviour against its arrival rate (points by rate), its
    capacity (the most requests per second it completes) and the most
    requests it runs at once (its batch when full: a burst past capacity
    joins the running batch up to that, continuous batching, and waits
    beyond it); by default the most running at any point."""

    points: list[LoadPoint]
    capacity: float
    max_running: float | None = None

    def __post_init__(self) -> None:
        if not self.points or self.capacity <= 0:
            raise ValueError("a replica response needs load points and a capacity > 0")
        self.points.sort(key=lambda p: p.rate)
        self._rates = [p.rate for p in self.points]
        if self.max_running is None:
            self.max_running = max(p.in_flight - p.waiting for p in self.points)

    def _bracket(self, rate: float) -> tuple[LoadPoint, LoadPoint, float]:
        """The two points around ``rate`` and its share of the way between."""
        if rate <= self._rates[0]:
            return self.points[0], self.points[0], 0.0
        if rate >= self._rates[-1]:
            return self.points[-1], self.points[-1], 0.0
        high = next(i for i, r in enumerate(self._rates) if r >= rate)
        low_point, high_point = self.points[high - 1], self.points[high]
        return low_point, high_point, (rate - low_point.rate) / (high_point.rate - low_point.rate)

    def gauges(self, rate: float) -> tuple[float, float, float]:
        """(in flight, waiting, service seconds) per replica at ``rate``; under
        the lowest measured rate in flight and waiting scale with the rate."""
        low, high, share = self._bracket(rate)
        values = [a + (b - a) * share for a, b in ((low.in_flight, high.in_flight),
                                                    (low.waiting, high.waiting),
                                                    (low.service_s, high.service_s))]
        if rate < self._rates[0]:
            scale = rate / self._rates[0] if self._rates[0] else 0.0
            values[0] *= scale
            values[1] *= scale
        return values[0], values[1], values[2]

    def attainment(self, rate: float, delay: float, slo: dict) -> float:
        low, high, share = self._bracket(rate)
        return ((1 - share) * low.attainment(delay, slo) + share * high.attainment(delay, slo))


@dataclass
class FluidDay:
    """What a fluid pool did: per hour and in total."""

    policy: str
    replica_seconds: float = 0.0
    hourly: list[dict] = field(default_factory=list)
    timeline: list[tuple[float, int, int, float]] = field(default_factory=list)
    events: int = 0

    def summary(self, hour_goal: float) -> dict:
        arrived = sum(h["arrivals"] for h in self.hourly)
        within = sum(h["within_slo"] for h in self.hourly)
        missing = [h["hour"] for h in self.hourly
                   if h["arrivals"] and h["within_slo"] / h["arrivals"] < hour_goal]
        return {"policy": self.policy, "replica_hours": self.replica_seconds / HOUR_S,
                "slo_attainment": within / arrived if arrived else 1.0,
                "hours_missing_slo": len(missing), "missing_hours": missing,
                "worst_hour_attainment": min((h["within_slo"] / h["arrivals"]
                                              for h in self.hourly if h["arrivals"]),
                                             default=1.0),
                "scale_events": self.events,
                "peak_replicas": max((r for _, r, _, _ in self.timeline), default=0),
                "min_replicas": min((r for _, r, _, _ in self.timeline), default=0)}


def run_fluid(scaler: PoolScaler, rate_at, response: ReplicaResponse, slo: dict,
              start_s: float, end_s: float, seed: int = 0,
              arrivals_in: Callable[[float, float], int] | None = None) -> FluidDay:
    """The pool from ``start_s`` to ``end_s`` under ``scaler`` (its
    ``replicas`` ready at the start): ``arrivals_in(begin, end)`` requests
    arrive in each tick (``day_load.TraceArrivals``), by default a Poisson
    number at ``rate_at`` (seeded)."""
    config, rng = scaler.config, np.random.default_rng(seed)
    tick = config.tick_s
    ready_at = [start_s] * scaler.replicas  # per live replica, oldest first
    draining: list[float] = []  # when each removed replica stops costing
    queue = 0.0
    day = FluidDay(scaler.policy.name)
    now = start_s
    while now < end_s - 1e-9:
        hour = int((now - start_s) // HOUR_S)
        if len(day.hourly) <= hour:
            day.hourly.append({"hour": hour, "arrivals": 0, "within_slo": 0.0,
                               "replica_seconds": 0.0})
        arrivals = (arrivals_in(now, now + tick) if arrivals_in is not None
                    else int(rng.poisson(rate_at(now + tick / 2) * tick)))
        ready = sum(1 for t in ready_at if t <= now)
        work = queue + arrivals
        capacity = ready * response.capacity * tick
        served = min(work, capacity)
        queue = work - served
        per_replica = served / (ready * tick) if ready else 0.0
        in_flight, waiting, service = response.gauges(per_replica)
        # What is not yet served joins the running batches while they have
        # room, and waits beyond; this tick's arrivals wait behind that.
        room = ready * max(0.0, response.max_running - (in_flight - waiting))
        queued = max(0.0, queue - room)
        delay = queued / (ready * response.capacity) if ready else math.inf
        within = arrivals * (response.attainment(per_replica, delay, slo) if ready else 0.0)
        draining = [t for t in draining if t > now]
        cost = (len(ready_at) + len(draining)) * tick
        day.replica_seconds += cost
        bucket = day.hourly[hour]
        bucket["arrivals"] += arrivals
        bucket["within_slo"] += within
        bucket["replica_seconds"] += cost
        now += tick
        signals = PoolSignals(
            now, len(ready_at), ready, round(ready * waiting + queued),
            round(ready * in_flight + queue), arrivals,
            min(1.0, (ready * in_flight + queue) / max(1.0, ready * config.replica_concurrency)),
            service)  # what completions show at this load (FleetScaling's EWMA of them)
        wanted = scaler.tick(signals)
        while len(ready_at) < wanted:
            ready_at.append(now + config.startup_s)
        while len(ready_at) > wanted:  # the newest (starting ones first) leave
            leaving = ready_at.pop()
            if leaving <= now:
                draining.append(now + service)
        day.timeline.append((now, len(ready_at), ready, queue))
    day.events = len(scaler.events)
    return day
