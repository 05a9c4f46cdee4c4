"""A shared external KV tier: blocks any replica of a fleet can load.

What Mooncake's store, LMCache or a Redis tier hold for a fleet: KV blocks
by the same chained hashes the replicas' prefix caches use, in a capacity
of blocks, each kept ``ttl_s`` after its last use (30 minutes by default:
a chat's next turn), least recently used evicted first when full. A
replica that misses a prefix locally asks the tier how many of the
following blocks it holds and loads them at the tier's bandwidth instead
of computing them. This is the bookkeeping and the price of a load, in
plain Python; moving the bytes belongs to a KV connector's worker side.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass
class TierStats:
    queries: int = 0  # blocks asked for
    hits: int = 0  # of those, found
    stored: int = 0
    evicted: int = 0  # to make room
    expired: int = 0  # past their TTL


class SharedKVTier:
    """Blocks by chained hash; see the module docstring."""

    def __init__(self, capacity_blocks: int, block_bytes: float, *, ttl_s: float = 1800.0,
                 bandwidth: float = 10e9, latency: float = 1e-3) -> None:
        if capacity_blocks < 1 or block_bytes <= 0 or bandwidth <= 0 or ttl_s <= 0:
            raise ValueError("a KV tier needs capacity_blocks >= 1 and block_bytes, "
                             "bandwidth and ttl_s > 0")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.ttl_s, self.bandwidth, self.latency = ttl_s, bandwidth, latency
        # Hash -> time of its last use, oldest first: the front is both the
        # least recently used and the first to expire.
        self._blocks: OrderedDict[int, float] = OrderedDict()
        self.stats = TierStats()

    @property
    def num_blocks(self) -> int:
        """Blocks held now (expired ones included until a lookup drops them).
        (Not ``__len__``: an empty tier must not be falsy.)"""
        return len(self._blocks)

    def store(self, hashes: Iterable[int], now: float) -> None:
        """Blocks a replica computed (or holds): kept, or their age reset."""
        blocks = self._blocks
        for block_hash in hashes:
            if block_hash in blocks:
                blocks.move_to_end(block_hash)
            else:
                self.stats.stored += 1
            blocks[block_hash] = now
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
            self.stats.evicted += 1

    def lookup(self, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of ``hashes`` the tier holds (each found
        counts as used now)."""
        self._expire(now)
        blocks = self._blocks
        found = 0
        for block_hash in hashes:
            if block_hash not in blocks:
                break
            blocks.move_to_end(block_hash)
            blocks[block_hash] = now
            found += 1
        self.stats.queries += len(hashes)
        self.stats.hits += found
        return found

    def count(self, hashes: Sequence[int], now: float) -> int:
        """``lookup`` without using anything or counting the query: how many
        leading blocks of ``hashes`` are held and not past their TTL."""
        blocks, oldest = self._blocks, now - self.ttl_s
        found = 0
        for block_hash in hashes:
            used = blocks.get(block_hash)
            if used is None or used < oldest:
                break
            found += 1
        return found

    def load_seconds(self, blocks: int) -> float:
        """Seconds to bring ``blocks`` blocks into a replica (0 for none)."""
        if blocks <= 0:
            return 0.0
        return self.latency + blocks * self.block_bytes / self.bandwidth

    def _expire(self, now: float) -> None:
        blocks, oldest = self._blocks, now - self.ttl_s
        while blocks:
            block_hash, used = next(iter(blocks.items()))
            if used >= oldest:
                break
            blocks.popitem(last=False)
            self.stats.expired += 1


class TierClient:
    """One replica's side of a ``SharedKVTier``: the scheduler's
    ``ExternalKV`` (carpool.scheduler.kv_connector) on an injected clock.
    Also what a router asks to price a request's loadable prefix."""

    def __init__(self, tier: SharedKVTier, clock: Callable[[], float]) -> None:
        self.tier, self.clock = tier, clock

    def loadable(self, request, hashes: Sequence[int]) -> int:
        return self.tier.count(hashes, self.clock())

    def load(self, request, hashes: Sequence[int], first: int = 0,
             block_ids: Sequence[int] = ()) -> float:
        return self.tier.load_seconds(self.tier.lookup(hashes, self.clock()))

    def save(self, request, hashes: Sequence[int], first: int = 0,
             block_ids: Sequence[int] = ()) -> None:
        self.tier.store(hashes, self.clock())

    def filling(self, request, first: int, block_ids: Sequence[int],
                hashes: Sequence[int]) -> None:
        """No layer streaming in the simulator: blocks are saved whole."""

    def forget(self, request) -> None:
        """Nothing kept per request."""

    def count(self, hashes: Sequence[int]) -> int:
        """What a router asks: leading blocks of ``hashes`` held now."""
        return self.tier.count(hashes, self.clock())

    def load_seconds(self, blocks: int) -> float:
        return self.tier.load_seconds(blocks)
