"""The block hashes a fleet agrees on, and the events that carry them.

``BlockKeyChain`` names each full KV block by an exact key and a chained
64-bit hash (the hash of block i covers blocks 0..i); ``BlockEvents`` is
how a block pool reports the hashes it caches and evicts; ``KvEventBuffer``
keeps those reports between two engine steps for a fleet router's prefix
index (``carpool.cluster.prefix_index``). Pure Python, no torch.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# Chain seed for the first block of a sequence.
ROOT_HASH = 0
# A block-hash secret's length in bytes (blake2b takes keys of up to 64).
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 16, 64


# A full block's exact identity: its parent's chain hash (8 bytes), then its
# token ids as int32 (every vocabulary is far smaller, and the engine
# rejects ids outside it; the simulator's ids fit too).
BlockKey = bytes


class BlockKeyChain:
    """Prefix-cache keys of full blocks of ``block_size`` tokens.

    The cache is keyed by the exact key, so two blocks collide only when
    their parents' 64-bit hashes collide *and* their tokens are equal. A
    key's hash is the next block's parent hash, signed 64-bit:

    - ``secret`` None: Python's hash of the key's bytes, keyed per process
      (unless PYTHONHASHSEED fixes it): fast, exact within one process (the
      simulator's router and replicas), meaningless across processes;
    - ``secret`` (16 to 64 bytes): blake2b of the key with that secret, 8
      bytes: the same in every process and machine given the same secret
      (a fleet's router, replicas and shared KV store), and still not
      forgeable by clients who do not know it (the live engine).

    Why bytes: a bytes object is one allocation that caches its own Python
    hash, so the dict operations on every eviction and registration
    (millions in a simulation) neither rehash it nor chase the pointers of
    a tuple.
    """

    def __init__(self, block_size: int, secret: bytes | None = None) -> None:
        self.block_size = block_size
        self._pack = struct.Struct(f"<q{block_size}i").pack
        self._blake = None  # keyed once; each hash copies it (saves the key's block)
        if secret is not None:
            if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
                raise ValueError(f"a block-hash secret has {MIN_SECRET_BYTES} to "
                                 f"{MAX_SECRET_BYTES} bytes, got {len(secret)}")
            self._blake = hashlib.blake2b(digest_size=8, key=bytes(secret))

    @property
    def keyed(self) -> bool:
        """Whether hashes are keyed with a secret (the same across processes)."""
        return self._blake is not None

    def hash_of(self, data: bytes) -> int:
        """The chain's 64-bit hash of ``data`` (a key, or a salt's seed)."""
        if self._blake is None:
            return hash(data)
        blake = self._blake.copy()
        blake.update(data)
        return int.from_bytes(blake.digest(), "little", signed=True)

    def root(self, cache_salt: str | None) -> int:
        """The parent hash of a sequence's first block: a salt gives its
        requests a chain of their own, so they never match another salt's."""
        if cache_salt is None:
            return ROOT_HASH
        return self.hash_of(b"cache-salt\x00" + cache_salt.encode("utf-8", "surrogatepass"))

    def keys(self, parent_hash: int, tokens: Sequence[int], first: int,
             last: int) -> tuple[list[BlockKey], list[int]]:
        """Keys and chained hashes of full blocks ``first..last-1`` of
        ``tokens``; ``parent_hash`` is block ``first - 1``'s hash
        (``root(salt)`` for none)."""
        size, pack = self.block_size, self._pack
        keys: list[BlockKey] = []
        hashes: list[int] = []
        if self._blake is not None:
            hash_of = self.hash_of
            for start in range(first * size, last * size, size):
                key = pack(parent_hash, *tokens[start:start + size])
                parent_hash = hash_of(key)
                keys.append(key)
                hashes.append(parent_hash)
            return keys, hashes
        for start in range(first * size, last * size, size):  # the simulator's hot path
            key = pack(parent_hash, *tokens[start:start + size])
            parent_hash = hash(key)
            keys.append(key)
            hashes.append(parent_hash)
        return keys, hashes


class BlockEvents(Protocol):
    """Where a pool reports what its prefix cache gained and lost, as the
    chained hashes of the blocks (``BlockKeyChain``'s): what a fleet
    router's prefix index is fed (``carpool.cluster.prefix_index``).
    ``carpool.scheduler.kv_events.KvEventBuffer`` buffers them between steps."""

    def stored(self, hashes: list[int]) -> None: ...

    def evicted(self, hashes: list[int]) -> None: ...


@dataclass(frozen=True)
class KvEventBatch:
    """What a pool's prefix cache gained (``stored``) and lost (``evicted``)
    since the previous drain, as chained block hashes.

    The two lists are disjoint and net: a block stored and evicted again
    between two drains is in neither, so a listener applies both in any
    order. ``reset``: the buffer dropped what it held (it overflowed, or
    its engine just started, whose cache is empty whatever the listener
    kept from an earlier life); the listener must *replace* everything it
    holds for this pool with ``stored`` (then the pool's every reported
    block; ``evicted`` is empty).
    """

    stored: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    reset: bool = False

    @property
    def empty(self) -> bool:
        """Nothing to tell (no message needed)."""
        return not (self.stored or self.evicted or self.reset)


class KvEventBuffer:
    """``BlockEvents`` kept between drains, coalesced per hash.

    A pool stores a hash only while it does not hold it and evicts it only
    while it does, so each hash's events alternate: the buffer keeps one
    pending verdict per hash (stored or evicted) and drops a pair that
    cancels out. So it never holds more than about twice the pool's blocks.

    Bounded all the same: past ``limit`` pending hashes (nobody drains, or
    a step churned more than a message should carry) it forgets them all,
    ignores every event until the next drain, and that drain is a reset
    (``KvEventBatch.reset``) listing ``snapshot()``, the hashes the pool
    holds then (none without a snapshot: the listener starts over empty
    and merely misses hits until the next stores).
    """

    def __init__(self, limit: int = 65536,
                 snapshot: Callable[[], list[int]] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"an event buffer's limit must be >= 1, got {limit}")
        self.limit = limit
        self._snapshot = snapshot
        self._net: dict[int, bool] = {}  # hash -> True: stored, False: evicted
        self.reset_due = False  # the next drain is a reset; events ignored until then

    @property
    def pending(self) -> int:
        """Hashes waiting for the next drain (0 after an overflow)."""
        return len(self._net)

    def resync(self) -> None:
        """Make the next drain a reset: the listener drops what it knew of
        this pool and takes its snapshot (``KVCacheManager.event_buffer``
        starts every buffer so)."""
        self._net = {}
        self.reset_due = True

    def stored(self, hashes: Iterable[int]) -> None:
        self._record(hashes, True)

    def evicted(self, hashes: Iterable[int]) -> None:
        self._record(hashes, False)

    def _record(self, hashes: Iterable[int], stored: bool) -> None:
        if self.reset_due:
            return
        net = self._net
        for block_hash in hashes:
            if net.get(block_hash) is (not stored):
                del net[block_hash]  # the opposite event earlier in the window: back as it was
            else:
                net[block_hash] = stored
        if len(net) > self.limit:
            self.resync()

    def drain(self) -> KvEventBatch:
        """The net events since the previous drain (or a reset, see the class)."""
        if self.reset_due:
            self.reset_due = False
            return KvEventBatch(list(self._snapshot()) if self._snapshot is not None else [],
                                [], reset=True)
        net, self._net = self._net, {}
        return KvEventBatch([h for h, stored in net.items() if stored],
                            [h for h, stored in net.items() if not stored])
