"""Request-level batching regimes, as baselines beside continuous batching.

Under ``static`` and ``dynamic`` batching a batch is formed from waiting
requests, runs to completion, and nobody joins it mid-flight; only then is
the next batch formed. ``BatchGate`` decides *which* waiting requests form
the next batch and *when*; the scheduler still runs the batch with its
token budget, KV blocks and chunked prefill, so the regimes differ only in
what they are about (batch formation), not in the engine under them.

- ``static``: a batch of exactly ``batch_size`` requests in arrival order,
  or fewer once the oldest has waited ``max_wait`` (if set).
- ``dynamic`` (Triton/TensorRT-style request-level batching): requests are
  grouped by prompt length into buckets of +-``bucket_tolerance``; a bucket
  is dispatched when it holds ``preferred_batch_size`` requests (at most
  ``max_batch_size`` go), or when its oldest request has waited
  ``max_wait``. The bucket of the oldest request goes first.

A request may carry its own, lower batching wait (``Request.max_wait``):
its batch goes once it has waited that long. Under the adaptive controller
``set_limits`` moves the preferred size, the largest batch and ``max_wait``.

Pure Python; time comes from the caller.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from carpool.scheduler.queues import is_long_prompt
from carpool.scheduler.request import Request

REGIMES = ("static", "dynamic", "continuous")


@dataclass
class GateStats:
    """Cumulative counters of batch formation."""

    batches: int = 0
    batched_requests: int = 0
    formation_wait_s: float = 0.0  # summed over batches: oldest member's wait at dispatch

    @property
    def mean_batch_size(self) -> float:
        return self.batched_requests / self.batches if self.batches else 0.0


class BatchGate:
    """Forms request-level batches for the ``static`` and ``dynamic`` regimes.

    Invariant: while ``members`` is not empty a batch is in flight; no other
    request may start until every member has left (finished, aborted or
    rejected), which the scheduler reports with ``member_left``.
    ``batch_rows`` is the batch's size at dispatch while it is in flight
    (0 otherwise): a padded batch keeps its shape, finished members' rows
    included, until it completes.
    """

    def __init__(self, regime: str, preferred_batch_size: int, max_batch_size: int,
                 max_wait: float | None, bucket_tolerance: float = 0.1,
                 long_lane: "LongLane | None" = None) -> None:
        if regime not in ("static", "dynamic"):
            raise ValueError(f"a batch gate is for static or dynamic batching, not {regime!r}")
        self.regime = regime
        self.long_lane = long_lane
        self.preferred = preferred_batch_size
        self.max_size = max_batch_size if regime == "dynamic" else preferred_batch_size
        self.max_wait = max_wait
        # Geometric buckets: lengths within a factor (1 + 2 * tol) share a bucket.
        self._log_width = math.log1p(2 * bucket_tolerance)
        self.members: set[str] = set()
        self.batch_rows = 0
        self.stats = GateStats()

    @property
    def in_flight(self) -> bool:
        return bool(self.members)

    def may_start(self, request: Request) -> bool:
        """Whether ``request`` belongs to the batch in flight."""
        return request.request_id in self.members

    def member_left(self, request: Request) -> None:
        """``request`` left the scheduler; the batch completes with its last member."""
        self.members.discard(request.request_id)
        if not self.members:
            self.batch_rows = 0

    def next_batch(self, waiting: Iterable[Request], now: float) -> list[Request]:
        """Form the next batch if one is due (no batch in flight); else []."""
        if self.members:
            return []
        queue = list(waiting)
        if not queue:
            return []
        lane = self.long_lane
        long = [r for r in queue if lane.is_long(r)] if lane is not None else []
        if long:  # the dual queue: long prompts batch among themselves
            short = [r for r in queue if not lane.is_long(r)]
            batches = [b for b in (self._short_batch(short, now), lane.batch(long, now)) if b]
            # The lane whose batch holds the oldest request goes first.
            batch = min(batches, key=lambda b: min(r.arrival_time for r in b), default=[])
        else:
            batch = self._short_batch(queue, now)
        if batch:
            self.members = {r.request_id for r in batch}
            self.batch_rows = len(batch)
            self.stats.batches += 1
            self.stats.batched_requests += len(batch)
            self.stats.formation_wait_s += now - min(r.arrival_time for r in batch)
        return batch

    def _short_batch(self, queue: list[Request], now: float) -> list[Request]:
        if not queue:
            return []
        return self._static(queue, now) if self.regime == "static" else self._dynamic(queue, now)

    def set_limits(self, preferred: int, max_size: int, max_wait: float | None) -> None:
        """Live knobs from the adaptive controller; they shape the next batch."""
        self.preferred = preferred
        self.max_size = max(preferred, max_size) if self.regime == "dynamic" else preferred
        self.max_wait = max_wait

    def _overdue(self, request: Request, now: float) -> bool:
        """The request waited its batching wait: the knob's, or its own cap if lower."""
        wait = self.max_wait
        if request.max_wait is not None:
            wait = request.max_wait if wait is None else min(wait, request.max_wait)
        return wait is not None and now - request.arrival_time >= wait

    def _static(self, queue: list[Request], now: float) -> list[Request]:
        if len(queue) >= self.preferred or any(self._overdue(r, now)
                                                for r in queue[:self.preferred]):
            return queue[:self.preferred]
        return []

    def bucket_of(self, request: Request) -> int:
        return int(math.log(max(1, request.num_prompt_tokens)) / self._log_width)

    def _dynamic(self, queue: list[Request], now: float) -> list[Request]:
        buckets: dict[int, list[Request]] = {}
        for request in queue:  # arrival order is kept inside each bucket
            buckets.setdefault(self.bucket_of(request), []).append(request)
        # Oldest first: the bucket whose head arrived first gets the first look.
        for bucket in sorted(buckets.values(), key=lambda b: b[0].arrival_time):
            if len(bucket) >= self.preferred or any(self._overdue(r, now) for r in bucket):
                return bucket[:self.max_size]
        return []


@dataclass(frozen=True)
class LongLane:
    """The dual queue under request-level batching: prompts longer than
    ``threshold`` tokens form their own small batches (``batch_size``, or
    fewer once the oldest waited ``max_wait``), so a long prompt never pads
    or holds back a batch of short ones, and short ones keep the live knobs."""

    threshold: int
    batch_size: int
    max_wait: float | None

    def is_long(self, request: Request) -> bool:
        return not request.kv_handoff and is_long_prompt(request, self.threshold)

    def batch(self, queue: list[Request], now: float) -> list[Request]:
        """The first ``batch_size`` long requests once that many wait or one
        of them waited its wait (the lane's, or its own if lower); else []."""
        head = queue[:self.batch_size]

        def overdue(request: Request) -> bool:
            waits = [w for w in (self.max_wait, request.max_wait) if w is not None]
            return bool(waits) and now - request.arrival_time >= min(waits)

        return head if len(queue) >= self.batch_size or any(map(overdue, head)) else []


class GateHook:
    """Static / dynamic batching's step hook (a ``Scheduler.step_hooks``
    entry): form the next request-level batch from the waiting requests a
    session does not hold back, once the batch in flight has left."""

    def __init__(self, gate: BatchGate) -> None:
        self.gate = gate

    def before_step(self, now: float, scheduler) -> None:
        gate = self.gate
        if gate.in_flight:
            return
        sessions = scheduler.sessions
        batch = gate.next_batch(
            (r for r in scheduler.waiting if not sessions.is_blocked(r)), now)
        if batch and scheduler.controller is not None:
            scheduler.controller.observe_step(now, len(batch) / gate.preferred, 0)
