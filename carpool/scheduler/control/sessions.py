"""Sessions: per-session request order and protection of a session's prefix.

A session is a client-chosen id shared by the turns of one conversation.
Its requests run one at a time in arrival order, and when one finishes the
cached blocks it used are protected from eviction for ``ttl`` seconds, so
the next turn finds its history in the prefix cache even under pressure
from unrelated traffic. Pure Python; time comes from the caller's clock.
"""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from carpool.scheduler.block_pool import BlockPool
from carpool.scheduler.request import Request

_MIN_COMPACT = 64


@dataclass
class SessionStats:
    """Counters are cumulative; gauges are current."""

    active_sessions: int  # sessions with unfinished requests or unexpired protection
    session_requests: int  # requests accepted with a session id
    session_prefix_hit_tokens: int  # their prompt tokens served from the prefix cache
    protected_blocks: int  # cached blocks some session protects


class SessionTracker:
    """Order and prefix protection for the requests that carry a session id.

    Invariants: ``_unfinished[s]`` holds the accepted, not yet finished
    requests of session ``s`` in acceptance order (never empty); only its
    head may be admitted. A session owns protections in the block pool only
    while ``_expires`` has an entry for it, and every ``_expires`` entry has
    a matching ``(expiry, session)`` entry in ``_heap`` (stale entries of
    refreshed sessions are dropped lazily).
    """

    def __init__(self, pool: BlockPool, ttl: float) -> None:
        self.pool = pool
        self.ttl = ttl
        self._unfinished: dict[str, deque[Request]] = {}
        self._expires: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self._compact_at = _MIN_COMPACT
        self.session_requests = 0
        self.session_prefix_hit_tokens = 0

    def add(self, request: Request) -> None:
        """Record an accepted request; it queues behind its session's others."""
        if request.session_id is None:
            return
        self.session_requests += 1
        self._unfinished.setdefault(request.session_id, deque()).append(request)

    def num_unfinished(self, session_id: str) -> int:
        """Accepted, not yet finished requests of ``session_id``."""
        queue = self._unfinished.get(session_id)
        return len(queue) if queue else 0

    def is_blocked(self, request: Request) -> bool:
        """Whether an earlier request of the same session is still unfinished."""
        sid = request.session_id
        return sid is not None and self._unfinished[sid][0] is not request

    def first_admitted(self, request: Request) -> None:
        """Count the prefix-cache hit of a session request's first admission."""
        if request.session_id is not None:
            self.session_prefix_hit_tokens += request.num_cached_tokens

    def finish(self, request: Request, block_ids: Iterable[int], now: float) -> None:
        """A request left (any finished status): unblock its successor and
        protect the cached blocks it used for ``ttl`` seconds from ``now``.

        Call before the request's blocks are released, or after: protection
        applies to cached blocks whether referenced or free.
        """
        sid = request.session_id
        if sid is None:
            return
        queue = self._unfinished[sid]
        queue.remove(request)
        if not queue:
            del self._unfinished[sid]
        # Lapsed protection must end before the refresh, not be extended by it.
        self.expire(now)
        if self.ttl <= 0:
            return
        self.pool.protect(sid, block_ids)
        expiry = now + self.ttl
        self._expires[sid] = expiry
        heapq.heappush(self._heap, (expiry, sid))
        self._compact()

    def expire(self, now: float) -> None:
        """End the protection of every session whose TTL is past at ``now``."""
        while self._heap and self._heap[0][0] < now:
            expiry, sid = heapq.heappop(self._heap)
            if self._expires.get(sid) == expiry:
                del self._expires[sid]
                self.pool.unprotect(sid)

    @property
    def next_expiry(self) -> float | None:
        """The earliest time a protection may lapse (``expire`` after it may
        change the pool), or None when nothing is protected. Stale entries
        make it early, never late."""
        return self._heap[0][0] if self._heap else None

    def stats(self) -> SessionStats:
        """Current counters; call ``expire`` first for up-to-date gauges."""
        return SessionStats(
            active_sessions=len(self._expires.keys() | self._unfinished.keys()),
            session_requests=self.session_requests,
            session_prefix_hit_tokens=self.session_prefix_hit_tokens,
            protected_blocks=self.pool.num_protected_blocks)

    def _compact(self) -> None:
        # Stale entries of refreshed sessions would otherwise pile up for a
        # whole TTL; rebuilding after the heap doubles is amortised O(1).
        if len(self._heap) < self._compact_at:
            return
        self._heap = [(expiry, sid) for sid, expiry in self._expires.items()]
        heapq.heapify(self._heap)
        self._compact_at = max(_MIN_COMPACT, 2 * len(self._heap))

    def check_invariants(self, requests: Mapping[str, Request]) -> None:
        """Raise ``AssertionError`` on inconsistent bookkeeping (tests)."""
        tracked = [r for queue in self._unfinished.values() for r in queue]
        assert all(self._unfinished.values()), "empty session queue kept"
        assert len(tracked) == len({id(r) for r in tracked}), "request tracked twice"
        assert {id(r) for r in tracked} == {
            id(r) for r in requests.values() if r.session_id is not None}
        for sid, queue in self._unfinished.items():
            assert all(r.session_id == sid for r in queue)
        assert set(self._heap) >= {(e, s) for s, e in self._expires.items()}
        assert self.pool.protection_owners() <= self._expires.keys(), \
            "protection without a live TTL"
