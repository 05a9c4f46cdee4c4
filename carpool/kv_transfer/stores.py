"""Where KV block payloads wait for another replica: the store interface
and its in-process and Redis backends (TCP: ``tcp_store``).

A store maps a block's key (``payload.block_key_bytes``) to its payload
(``payload.encode_block``). It never interprets payloads; readers check
them. Every backend answers the same three calls, from any thread:

- ``put_many([(key, payload), ...])``: keep them (their TTL starts again);
- ``get_many(keys)``: the payloads, None where missing (a hit is a use);
- ``count_prefix(keys)``: how many leading keys it holds (no use counted).

A store that cannot be reached raises ``KVStoreUnavailable``; the
connector treats that as a miss, so a store going away costs only
recomputation. Plain Python; the Redis backend imports ``redis`` only
when made.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

DEFAULT_TTL_S = 1800.0  # a chat's next turn (the 30 minutes)


class KVStoreUnavailable(ConnectionError):
    """The store did not answer (down, unreachable, timed out)."""


@dataclass
class StoreStats:
    """What a store client did, for metrics."""

    queries: int = 0  # blocks asked for (get_many and count_prefix)
    hits: int = 0  # of those, found
    puts: int = 0  # blocks written
    bytes_in: int = 0  # payload bytes written
    bytes_out: int = 0  # payload bytes read
    errors: int = 0  # calls that found the store unavailable
    evicted: int = 0  # blocks dropped for room (stores that manage their capacity)
    expired: int = 0  # blocks dropped past their TTL
    deleted: int = 0  # blocks dropped on request (delete_many: single-use ones taken)
    extra: dict = field(default_factory=dict)

    def got(self, found: Sequence[bytes | None]) -> None:
        """Count a ``get_many`` answer."""
        self.queries += len(found)
        self.hits += sum(p is not None for p in found)
        self.bytes_out += sum(len(p) for p in found if p is not None)

    def looked_up(self, asked: int, found: int) -> None:
        """Count a ``count_prefix`` answer."""
        self.queries += asked
        self.hits += found

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Count a ``put_many`` of these items."""
        self.puts += len(items)
        self.bytes_in += sum(len(p) for _, p in items)


def leading(flags) -> int:
    """How many of ``flags`` are true before the first false one."""
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count


class KVStore(Protocol):
    stats: StoreStats

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None: ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    def count_prefix(self, keys: Sequence[bytes]) -> int: ...

    def delete_many(self, keys: Sequence[bytes]) -> None:
        """Drop ``keys`` now (absent ones: nothing): single-use entries,
        such as a P/D handoff's parts once taken, need no LRU or TTL."""

    def close(self) -> None: ...


class MemoryStore:
    """Payloads in this process: capacity in bytes with least-recently-used
    eviction, a TTL from each block's last use. Thread safe. The tests'
    store, and what the TCP store's server holds."""

    def __init__(self, capacity_bytes: int, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_bytes < 1 or ttl_s <= 0:
            raise ValueError("a KV store needs capacity_bytes >= 1 and ttl_s > 0")
        self.capacity_bytes, self.ttl_s, self.clock = capacity_bytes, ttl_s, clock
        self.stats = StoreStats()
        self.bytes_held = 0
        # key -> (payload, last use), least recently used first.
        self._blocks: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        now = self.clock()
        with self._lock:
            for key, payload in items:
                if len(payload) > self.capacity_bytes:
                    continue  # could never be held
                old = self._blocks.pop(key, None)
                if old is not None:
                    self.bytes_held -= len(old[0])
                self._blocks[key] = (bytes(payload), now)
                self.bytes_held += len(payload)
                self.stats.puts += 1
                self.stats.bytes_in += len(payload)
            while self.bytes_held > self.capacity_bytes:
                _, (payload, _) = self._blocks.popitem(last=False)
                self.bytes_held -= len(payload)
                self.stats.evicted += 1

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        now = self.clock()
        found: list[bytes | None] = []
        with self._lock:
            self._expire(now)
            for key in keys:
                entry = self._blocks.get(key)
                if entry is None:
                    found.append(None)
                    continue
                self._blocks[key] = (entry[0], now)
                self._blocks.move_to_end(key)
                found.append(entry[0])
            self.stats.got(found)
        return found

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            self._expire(self.clock())
            count = leading(key in self._blocks for key in keys)
            self.stats.looked_up(len(keys), count)
        return count

    def delete_many(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                entry = self._blocks.pop(key, None)
                if entry is not None:
                    self.bytes_held -= len(entry[0])
                    self.stats.deleted += 1

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.bytes_held = 0

    def _expire(self, now: float) -> None:
        """Drop blocks unused for ``ttl_s`` (the front is the oldest use)."""
        oldest = now - self.ttl_s
        while self._blocks:
            key, (payload, used) = next(iter(self._blocks.items()))
            if used >= oldest:
                break
            del self._blocks[key]
            self.bytes_held -= len(payload)
            self.stats.expired += 1


class RedisStore:
    """Payloads in a Redis server (the ``redis`` client from PyPI): each
    block one key with the TTL, renewed when read. Capacity and eviction
    are the server's (``maxmemory`` with ``maxmemory-policy allkeys-lru``:
    Redis's own LRU). Short socket timeouts: a store that hangs must cost
    a lookup, not a step."""

    def __init__(self, url: str, ttl_s: float = DEFAULT_TTL_S, prefix: bytes = b"carpool:kv:",
                 timeout_s: float = 0.5) -> None:
        try:
            import redis
        except ModuleNotFoundError:
            raise ValueError("a Redis KV store needs the redis client: "
                             "pip install 'carpool[redis]' (or redis)") from None
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                        OSError)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s)
        self.ttl_ms = int(ttl_s * 1000)
        self.prefix = prefix
        self.stats = StoreStats()

    def _call(self, build: Callable):
        try:
            pipe = self._client.pipeline(transaction=False)
            build(pipe)
            return pipe.execute()
        except self._errors as error:
            self.stats.errors += 1
            raise KVStoreUnavailable(f"redis: {error}") from error

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if not items:
            return
        self._call(lambda pipe: [pipe.set(self.prefix + key, payload, px=self.ttl_ms)
                                 for key, payload in items])
        self.stats.put(items)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        found = self._call(lambda pipe: [pipe.getex(self.prefix + key, px=self.ttl_ms)
                                         for key in keys])
        self.stats.got(found)
        return found

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        present = self._call(lambda pipe: [pipe.exists(self.prefix + key) for key in keys])
        count = leading(present)
        self.stats.looked_up(len(keys), count)
        return count

    def delete_many(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call(lambda pipe: [pipe.delete(self.prefix + key) for key in keys])
            self.stats.deleted += len(keys)

    def close(self) -> None:
        self._client.close()
