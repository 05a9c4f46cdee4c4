"""What a simulated fleet looked like over time.

Every ``interval`` seconds of virtual time the sampler reads each replica
as ``bench serve`` polls a server's /metrics: the fleet's waiting and
running requests (the result's server gauges), and per replica its role,
readiness (the router's: starting and draining replicas are not), waiting
and running requests, KV usage, the share of the interval it spent
in steps (utilisation) and the prefix hit rate of the prompts admitted in
the interval (local and loaded hits over prompt tokens looked up). The
per-replica series start when a replica joins and stop when it fails, so
pools and fleets that change size read right.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from carpool.sim.replica import SimReplica

SERIES = ("ready", "waiting", "running", "kv_usage", "busy", "hit_rate")


class FleetSampler:
    """See the module docstring; ``replicas`` may grow while it samples."""

    def __init__(self, replicas: Sequence[SimReplica], interval: float,
                 ready: Callable[[SimReplica], bool] | None = None) -> None:
        self.replicas = replicas
        self.ready = ready  # whether a replica takes requests (the router's health)
        self.interval = interval
        self.next = 0.0
        self.samples: list[tuple[float, float, float]] = []  # (t, waiting, running)
        self.per_replica: dict[str, dict] = {}
        self._last: dict[int, tuple[float, int, int]] = {}  # busy s, hits, queries so far

    def until(self, now: float) -> None:
        while self.next <= now:
            self._sample(self.next)
            self.next += self.interval

    def _sample(self, t: float) -> None:
        row = len(self.samples)
        waiting = running = 0
        for replica in self.replicas:
            if replica.failed_at is not None and replica.failed_at < t:
                continue
            scheduler, kv = replica.scheduler, replica.scheduler.kv
            queued, active = len(scheduler.waiting), len(scheduler.running)
            waiting += queued
            running += active
            series = self.per_replica.get(str(replica.index))
            if series is None:
                series = self.per_replica[str(replica.index)] = {
                    "role": replica.role, "first_sample": row, **{name: [] for name in SERIES}}
            busy, hits = replica.busy_seconds, kv.prefix_hits + kv.external_hits
            last_busy, last_hits, last_queries = self._last.get(replica.index, (0.0, 0, 0))
            self._last[replica.index] = (busy, hits, kv.prefix_queries)
            queries = kv.prefix_queries - last_queries
            series["ready"].append(1 if self.ready is None or self.ready(replica) else 0)
            series["waiting"].append(queued)
            series["running"].append(active)
            series["kv_usage"].append(round(kv.pool.num_used_blocks / kv.pool.num_blocks, 4))
            series["busy"].append(round(min(1.0, (busy - last_busy) / self.interval), 4))
            series["hit_rate"].append(round((hits - last_hits) / queries, 4) if queries else None)
        self.samples.append((t, float(waiting), float(running)))

    def timeline(self) -> dict:
        return {"interval_s": self.interval, "samples": len(self.samples),
                "replicas": self.per_replica}


def merge_timelines(parts: Sequence[dict]) -> dict:
    """Timelines of independently simulated replicas on one grid (each
    sampled the same grid from 0)."""
    merged = {"interval_s": parts[0]["interval_s"],
              "samples": max(part["samples"] for part in parts), "replicas": {}}
    for part in parts:
        merged["replicas"].update(part["replicas"])
    return merged


def sum_samples(parts: Sequence[list[tuple[float, float, float]]]
                ) -> list[tuple[float, float, float]]:
    """Fleet gauges of independently simulated replicas on one time grid (a
    part that ended early counts as empty from then on)."""
    longest = max(parts, key=len)
    totals = []
    for row, (t, _, _) in enumerate(longest):
        waiting = sum(part[row][1] for part in parts if row < len(part))
        running = sum(part[row][2] for part in parts if row < len(part))
        totals.append((t, waiting, running))
    return totals
