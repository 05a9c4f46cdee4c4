"""The shared-memory KV store's index (``shm_store``): which arena slot
holds which block, LRU eviction by slot and TTL from last use (as
``MemoryStore``), and each connection's reserved and pinned slots. Plain
Python, thread safe; the server answers every call from it."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from carpool.kv_transfer.stores import StoreStats, leading


@dataclass(slots=True)
class _Entry:
    slot: int
    length: int
    used: float


@dataclass
class Session:
    """One connection's slots in flight, given back when it ends."""

    reserved: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # key -> slot, length
    pinned: dict[int, int] = field(default_factory=dict)  # slot -> pins


class SlotIndex:
    """Which slot holds which block; thread safe. Invariant: each slot is
    in exactly one state: free, reserved by one session, held by one entry,
    or retired (its entry dropped while pinned; freed at the last unpin).
    Only free slots are handed out, so no writer ever touches bytes that a
    reader has pinned."""

    def __init__(self, arena_bytes: int, ttl_s: float, slot_bytes: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.arena_bytes, self.ttl_s, self.clock = arena_bytes, ttl_s, clock
        self.slot_bytes: int | None = None
        self.num_slots = 0
        self.stats = StoreStats(extra={"refused": 0})
        self._free: list[int] = []
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._pins: dict[int, int] = {}  # slot -> pins of all sessions
        self._retired: set[int] = set()
        self._lock = threading.Lock()
        if slot_bytes is not None:
            self._size_slots(slot_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def _size_slots(self, slot_bytes: int) -> None:
        self.slot_bytes, self.num_slots = slot_bytes, self.arena_bytes // slot_bytes
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out 0 first

    def reserve(self, session: Session, keys: Sequence[bytes],
                lengths: Sequence[int]) -> list[int]:
        """A free slot's offset per key; -1: refused (too large, empty, the
        key already being written by this session, every slot busy)."""
        with self._lock:
            self._expire(self.clock())
            offsets = []
            for key, length in zip(keys, lengths):
                slot = None if key in session.reserved else self._take_slot(length)
                if slot is None:
                    self.stats.extra["refused"] += 1
                    offsets.append(-1)
                else:
                    session.reserved[key] = (slot, length)
                    offsets.append(slot * self.slot_bytes)
            return offsets

    def _take_slot(self, length: int) -> int | None:
        if self.slot_bytes is None and 1 <= length <= self.arena_bytes:
            self._size_slots(length)  # the first payload sets the slot size
        if self.slot_bytes is None or not 1 <= length <= self.slot_bytes:
            return None
        while not self._free and self._entries:  # evict for room, oldest use first
            self._drop_slot(self._entries.popitem(last=False)[1].slot)
            self.stats.evicted += 1
        return self._free.pop() if self._free else None

    def commit(self, session: Session, keys: Sequence[bytes]) -> int:
        """Make this session's reserved ``keys`` visible (a key held before
        moves to its new slot); returns how many."""
        with self._lock:
            now, done = self.clock(), 0
            for key in keys:
                reserved = session.reserved.pop(key, None)
                if reserved is None:
                    continue  # not reserved here
                old = self._entries.pop(key, None)
                if old is not None:
                    self._drop_slot(old.slot)
                self._entries[key] = _Entry(*reserved, now)
                self.stats.puts += 1
                self.stats.bytes_in += reserved[1]
                done += 1
            return done

    def lookup(self, session: Session, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """Each key's (offset, length), (-1, 0) if missing. A hit is a use
        and pins its slot for ``session`` until ``release``."""
        with self._lock:
            now = self.clock()
            self._expire(now)
            offsets, lengths = [], []
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    entry.used = now
                    self._entries.move_to_end(key)
                    self._pins[entry.slot] = self._pins.get(entry.slot, 0) + 1
                    session.pinned[entry.slot] = session.pinned.get(entry.slot, 0) + 1
                offsets.append(-1 if entry is None else entry.slot * self.slot_bytes)
                lengths.append(0 if entry is None else entry.length)
            self.stats.looked_up(len(keys), sum(o >= 0 for o in offsets))
            self.stats.bytes_out += sum(lengths)
            return offsets, lengths

    def release(self, session: Session, offsets: Sequence[int]) -> None:
        """Unpin what ``lookup`` pinned for ``session`` (others: ignored)."""
        with self._lock:
            for offset in offsets:
                slot = offset // self.slot_bytes if self.slot_bytes and offset >= 0 else -1
                if session.pinned.get(slot, 0) > 0:
                    session.pinned[slot] -= 1
                    if not session.pinned[slot]:
                        del session.pinned[slot]
                    self._unpin(slot, 1)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Drop ``keys``' entries now (a pinned slot is freed at its last
        unpin); returns how many were held."""
        with self._lock:
            dropped = 0
            for key in keys:
                entry = self._entries.pop(key, None)
                if entry is not None:
                    self._drop_slot(entry.slot)
                    dropped += 1
            return dropped

    def count(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are held (no use counted)."""
        with self._lock:
            self._expire(self.clock())
            return leading(key in self._entries for key in keys)

    def end(self, session: Session) -> None:
        """A connection ended: its pins and uncommitted slots go back."""
        with self._lock:
            for slot, pins in session.pinned.items():
                self._unpin(slot, pins)
            self._free += [slot for slot, _ in session.reserved.values()]
            session.pinned.clear()
            session.reserved.clear()

    def _unpin(self, slot: int, pins: int) -> None:
        self._pins[slot] -= pins
        if not self._pins[slot]:
            del self._pins[slot]
            if slot in self._retired:
                self._retired.remove(slot)
                self._free.append(slot)

    def _drop_slot(self, slot: int) -> None:
        """A slot's entry is gone: free now, or at its last unpin."""
        if slot in self._pins:
            self._retired.add(slot)
        else:
            self._free.append(slot)

    def _expire(self, now: float) -> None:
        """Drop blocks unused for ``ttl_s`` (the front is the oldest use)."""
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.used >= now - self.ttl_s:
                break
            del self._entries[key]
            self._drop_slot(entry.slot)
            self.stats.expired += 1
