"""Replica failures in a simulated fleet.

At each of its times a named replica dies. What it held is gone: a request
that had streamed tokens fails (``replica_failed``: the client saw half an
answer), one that had not is routed again at once (nothing of it was
visible, so the front retries it, as Ray Serve's handle retries a request
whose replica died before answering). The router drops the replica (its
views, sessions and prefix index entries). Without an autoscaler a fresh
replica (empty cache) replaces it ``restart_s`` later, as a Kubernetes
restart would; with one, the autoscaler sees the smaller pool and decides.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from carpool.cluster import Health
from carpool.sim.replica import SimReplica
from carpool.workload.stats import RequestRecord
from carpool.workload.traces import TraceRequest


def parse_failures(text: str) -> tuple[tuple[float, int], ...]:
    """``T:R,...``: replica R (its index) fails T seconds into the run."""
    events = []
    for part in text.split(","):
        when, _, replica = part.strip().partition(":")
        try:
            events.append((float(when), int(replica)))
        except ValueError:
            raise ValueError(f"--fail takes SECONDS:REPLICA pairs, got {part!r}") from None
    return tuple(sorted(events))


@dataclass(frozen=True)
class FailureSettings:
    """When which replica fails, and how long its replacement takes (None:
    not replaced, e.g. under an autoscaler)."""

    failures: tuple[tuple[float, int], ...]
    restart_s: float | None = 60.0

    def validate(self, replicas: int) -> FailureSettings:
        for when, index in self.failures:
            if when < 0 or not 0 <= index < replicas:
                raise ValueError(f"a failure needs a time >= 0 and a replica in 0.."
                                 f"{replicas - 1}, got {when}:{index}")
        if self.restart_s is not None and self.restart_s < 0:
            raise ValueError(f"--failure-restart-s must be >= 0, got {self.restart_s}")
        return self


class FleetFailures:
    """The failure schedule over a ``FleetRouter``: ``next_time`` says when
    it acts next; ``fire`` kills or brings back replicas then."""

    def __init__(self, settings: FailureSettings, fleet, make_replica: Callable[[int], SimReplica],
                 scaling=None) -> None:
        self.fleet, self.make_replica, self.scaling = fleet, make_replica, scaling
        self.restart_s = None if scaling is not None else settings.restart_s
        self._due = list(settings.failures)
        self._restarts: list[tuple[float, str]] = []  # (ready at, replica id), ascending
        self.events: list[dict] = []

    @property
    def next_time(self) -> float:
        times = [t for t, _ in self._due[:1]] + [t for t, _ in self._restarts[:1]]
        return min(times, default=float("inf"))

    def fire(self, now: float, replicas: list[SimReplica]
             ) -> tuple[list[SimReplica], list[tuple[TraceRequest, RequestRecord]]]:
        """Apply what is due at ``now``: (replicas created, requests to route again)."""
        created: list[SimReplica] = []
        retry: list[tuple[TraceRequest, RequestRecord]] = []
        while self._restarts and self._restarts[0][0] <= now:
            _, replica_id = self._restarts.pop(0)
            self.fleet.router.set_health(replica_id, Health.READY)
            self.events.append({"t": now, "replica": replica_id, "event": "ready"})
        while self._due and self._due[0][0] <= now:
            _, index = self._due.pop(0)
            replica = self.fleet.replica(str(index)) if str(index) in self.fleet.router.views \
                else None
            if replica is None:
                self.events.append({"t": now, "replica": str(index), "event": "not alive"})
                continue
            streamed, unstarted = replica.fail(now)
            self.fleet.router.remove_replica(str(index))
            if self.scaling is not None:
                self.scaling.replica_failed(str(index), now)
            retry += unstarted
            self.events.append({"t": now, "replica": str(index), "event": "failed",
                                "failed_requests": len(streamed), "retried": len(unstarted)})
            if self.restart_s is not None:
                fresh = self.make_replica(len(replicas) + len(created))
                created.append(fresh)
                self.fleet.add(fresh)
                self.fleet.router.set_health(str(fresh.index), Health.STARTING)
                self._restarts.append((now + self.restart_s, str(fresh.index)))
                self._restarts.sort()
                self.events.append({"t": now, "replica": str(fresh.index),
                                    "event": f"replacing {index}"})
        return created, retry
