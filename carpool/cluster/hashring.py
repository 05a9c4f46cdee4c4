"""Consistent hashing with bounded loads, for session affinity.

Each replica owns ``VNODES`` points on a 64-bit ring; a session's home is
the first replica clockwise from the session's own point. With a load
bound (Mirrokni, Thorup and Zadimoghaddam's consistent hashing with
bounded loads) a replica already holding more than ``bound`` x the mean
load is passed over for the next one on the ring. So a session moves only
when its replica leaves or is overloaded past the bound, and adding one
replica to N moves about 1/(N+1) of the sessions: those whose points now
fall before one of the new replica's.

Hashes are keyed BLAKE2b, equal in every process and on every machine
given the same key, unlike Python's ``hash`` of a string; the key (a
fleet secret) keeps clients from choosing session ids that all land on
one replica.
"""
from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Iterable

VNODES = 64  # points per replica: spread within ~±20% of the mean share at N=16


def stable_hash(text: str, key: bytes = b"") -> int:
    """A 64-bit hash of ``text``, the same everywhere for the same ``key``."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "big")


class HashRing:
    """Replica ids on a ring of ``VNODES`` points each."""

    def __init__(self, replica_ids: Iterable[str] = (), key: bytes = b"",
                 vnodes: int = VNODES) -> None:
        self.key = key
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._members: set[str] = set()
        for replica_id in replica_ids:
            self.add(replica_id)

    def __contains__(self, replica_id: str) -> bool:
        return replica_id in self._members

    def __len__(self) -> int:
        return len(self._members)

    def add(self, replica_id: str) -> None:
        if replica_id in self._members:
            return
        self._members.add(replica_id)
        for vnode in range(self.vnodes):
            point = stable_hash(f"{replica_id}#{vnode}", self.key)
            index = bisect.bisect(self._points, point)
            self._points.insert(index, point)
            self._owners.insert(index, replica_id)

    def remove(self, replica_id: str) -> None:
        if replica_id not in self._members:
            return
        self._members.discard(replica_id)
        kept = [(p, o) for p, o in zip(self._points, self._owners) if o != replica_id]
        self._points = [p for p, _ in kept]
        self._owners = [o for _, o in kept]

    def walk(self, session_id: str) -> Iterable[str]:
        """Distinct replicas in ring order from the session's point."""
        if not self._points:
            return
        start = bisect.bisect(self._points, stable_hash(session_id, self.key))
        seen: set[str] = set()
        count = len(self._points)
        for step in range(count):
            owner = self._owners[(start + step) % count]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._members):
                    return

    def home(self, session_id: str, load: Callable[[str], int] | None = None,
             bound: float = 1.25, eligible: Callable[[str], bool] | None = None) -> str | None:
        """The session's replica: the first on its walk that is ``eligible``
        and, with ``load``, holds at most ``ceil(bound x (total + 1) / n)``
        (n the eligible replicas, total their load; the +1 counts this
        request). None when no replica is eligible."""
        members = [m for m in self._members if eligible is None or eligible(m)]
        if not members:
            return None
        limit = math.inf
        if load is not None:
            total = sum(load(m) for m in members)
            limit = math.ceil(bound * (total + 1) / len(members))
        first = None
        for replica_id in self.walk(session_id):
            if eligible is not None and not eligible(replica_id):
                continue
            first = first or replica_id
            if load is None or load(replica_id) + 1 <= limit:
                return replica_id
        return first
