"""Replica failures in a simulated fleet.

At each of its times a named replica dies. What it held goes on
elsewhere, as the live fleet's front sends it (``carpool.fleet.local``): a
request that had not streamed a token is routed again at once, and one
that had is resumed on another replica after the tokens its client got
(its prompt and those tokens computed there, found in a prefix cache or
the shared KV tier where they are). A request sent to ``MAX_ATTEMPTS``
replicas that died fails (``replica_failed``), and so does a streamed one
under P/D (the simulated planner places prompts, not resumed streams).
The router drops the replica (its
views, sessions and prefix index entries). Without an autoscaler a fresh
replica (empty cache) replaces it ``restart_s`` later, as a Kubernetes
restart would; with one, the autoscaler sees the smaller pool and decides.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from carpool.cluster import Health
from carpool.cluster.failover import MAX_ATTEMPTS
from carpool.sim.replica import SimReplica
from carpool.workload.stats import FAILED, RequestRecord
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
        self.attempts: dict[int, int] = {}  # a request (its plan index) -> replicas tried

    @property
    def next_time(self) -> float:
        times = [t for t, _ in self._due[:1]] + [t for t, _ in self._restarts[:1]]
        return min(times, default=float("inf"))

    def _goes_on(self, record: RequestRecord, streamed: int, now: float) -> bool:
        """Whether a request its replica held at its death is sent on (else
        it fails here): not past ``MAX_ATTEMPTS`` replicas, not a P/D stream."""
        tried = self.attempts.get(record.index, 1)
        if tried < MAX_ATTEMPTS and not (streamed and self.fleet.pd is not None):
            self.attempts[record.index] = tried + 1
            return True
        record.status, record.reason, record.finished = FAILED, "replica_failed", now
        record.error = "the replica failed mid-stream" if streamed else "the replica failed"
        return False

    def fire(self, now: float, replicas: list[SimReplica]
             ) -> tuple[list[SimReplica], list[tuple[TraceRequest, RequestRecord, int]]]:
        """Apply what is due at ``now``: (replicas created, requests to send
        on, each with the output tokens it resumes after)."""
        created: list[SimReplica] = []
        retry: list[tuple[TraceRequest, RequestRecord, int]] = []
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
            held = replica.fail(now)
            self.fleet.router.remove_replica(str(index))
            if self.scaling is not None:
                self.scaling.replica_failed(str(index), now)
            going_on = [(item, record, streamed) for item, record, streamed in held
                        if self._goes_on(record, streamed, now)]
            retry += going_on
            resumed = sum(1 for _, _, streamed in going_on if streamed)
            self.events.append({"t": now, "replica": str(index), "event": "failed",
                                "failed_requests": len(held) - len(going_on),
                                "retried": len(going_on) - resumed, "resumed": resumed})
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
