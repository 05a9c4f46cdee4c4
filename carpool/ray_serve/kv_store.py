"""RayObjectStore: a ``KVStore`` whose payloads live in Ray's object store.

P/D serving on Ray Serve (``carpool.ray_serve.app``) moves a prompt's KV
blocks from a prefill replica to a decode replica through Ray itself: no
store server to run. Two parts:

- the payloads: each ``put_many`` call ``ray.put``s its payloads as one
  object (a msgpack list of bytes: no pickle of carpool objects), so a
  layer of a step's blocks is one object, not one per block;
- the index: one named actor per application (``KVIndex``, in namespace
  ``carpool``, got or created by whoever asks first) mapping each key to
  (its batch's ``ObjectRef``, its place in the batch), with least-recently
  used eviction by payload bytes and a TTL from each key's last use, as
  ``MemoryStore`` has them. The refs reach the actor inside a list, so it
  *borrows* them: a batch stays alive as long as the index lists one of
  its keys, and is freed when its last key is evicted, expires or is
  overwritten (a batch partly evicted keeps all its bytes until then).

``get_many`` asks the index for the refs, then ``ray.get``s the batches;
``count_prefix`` is answered by the index alone.

Ownership (why a miss can be a lost object): Ray's objects are owned by
the process that put them, here the replica that computed the blocks (Ray
2.56 removed ``ray.put(_owner=...)``). A replica that dies takes its
objects with it, though the index still lists them: reading one raises
``OwnerDiedError``, which this client turns into a miss (and tells the
index to forget the key). So a replica's death costs only recomputation:
the decode side computes what it cannot load (a P/D decode part first
waits up to the connector's ``handoff_wait_s`` for it). The index is an
ordinary actor owned by whoever created it (the ingress, in the
application: ``carpool.ray_serve.app``), alive while its creator is and
holds its handle; its dying (its creator died, or it was killed) loses
every key, and the next call after that gets or creates a new, empty one.

Every call has a timeout (``timeout_s``): an index that is dead, restarting
or slower than that raises ``KVStoreUnavailable``, which the connector
treats as a miss (and then leaves the store alone for a while).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayError

from carpool.kv_transfer.stores import DEFAULT_TTL_S, KVStoreUnavailable, StoreStats, leading

NAMESPACE = "carpool"  # the index actors' Ray namespace (Serve replicas run in "serve")
DEFAULT_TIMEOUT_S = 2.0  # as the TCP store's client

_encode_batch = msgspec.msgpack.Encoder().encode
_decode_batch = msgspec.msgpack.Decoder(list[bytes]).decode


def index_name(app_name: str) -> str:
    """The index actor's name for a Serve application."""
    return f"KVIndex:{app_name}"


def uses_ray_store(cache) -> bool:  # noqa: ANN001 - a CacheConfig
    """Whether P/D replicas with this ``CacheConfig`` share Ray's object
    store: ``kv_store`` unset, ``local`` or ``memory`` (a store inside one
    replica could not hand anything over); a TCP or Redis store is used
    as configured instead."""
    return cache.kv_store in (None, "local", "memory")


def store_for(cache, app_name: str) -> "RayObjectStore":  # noqa: ANN001 - a CacheConfig
    """The store of a P/D replica of application ``app_name``, with the
    capacity and TTL of ``cache`` (``kv_store_capacity``, ``kv_store_ttl``)."""
    from carpool.config import parse_size

    return RayObjectStore(index_name(app_name), parse_size(cache.kv_store_capacity),
                          cache.kv_store_ttl)


@dataclass
class _Entry:
    batch: int  # the batch's id in KVIndex._batches
    position: int  # the payload's index in its batch
    size: int  # payload bytes
    used: float  # last put or get (the index's clock)


class KVIndex:
    """The actor side: key -> (batch ref, position), LRU by bytes and TTL.

    One call at a time (a plain actor): every method sees a consistent
    map. Holds no payload bytes itself, only borrowed refs."""

    def __init__(self, capacity_bytes: int, ttl_s: float = DEFAULT_TTL_S,
                 clock=time.monotonic) -> None:  # noqa: ANN001 - () -> seconds
        if capacity_bytes < 1 or ttl_s <= 0:
            raise ValueError("a KV store needs capacity_bytes >= 1 and ttl_s > 0")
        self.capacity_bytes, self.ttl_s, self.clock = capacity_bytes, ttl_s, clock
        self.bytes_held = 0
        self.evicted = self.expired = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        # Batch id -> [its ObjectRef, how many entries point at it]. The ref is
        # dropped (the object freed, once no reader holds it) at zero.
        self._batches: dict[int, list] = {}
        self._next_batch = 0

    def put(self, keys: list[bytes], sizes: list[int], refs: list) -> int:
        """Register one batch (``refs``: its one ObjectRef, borrowed);
        returns how many entries were evicted for room."""
        now = self.clock()
        batch = self._next_batch
        self._next_batch += 1
        self._batches[batch] = [refs[0], 0]
        for position, (key, size) in enumerate(zip(keys, sizes)):
            if size > self.capacity_bytes:
                continue  # could never be held
            self._drop(key)
            self._entries[key] = _Entry(batch, position, size, now)
            self._batches[batch][1] += 1
            self.bytes_held += size
        self._release(batch)
        evicted = 0
        while self.bytes_held > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
            evicted += 1
        self.evicted += evicted
        return evicted

    def get(self, keys: list[bytes]) -> tuple[list, list[tuple[int, int] | None]]:
        """The refs of the batches holding ``keys`` and, per key, (index in
        those refs, position in its batch) or None; a hit is a use."""
        now = self.clock()
        self._expire(now)
        refs: list = []
        index_of: dict[int, int] = {}
        where: list[tuple[int, int] | None] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                where.append(None)
                continue
            entry.used = now
            self._entries.move_to_end(key)
            if entry.batch not in index_of:
                index_of[entry.batch] = len(refs)
                refs.append(self._batches[entry.batch][0])
            where.append((index_of[entry.batch], entry.position))
        return refs, where

    def count(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` are listed (no use counted)."""
        self._expire(self.clock())
        return leading(key in self._entries for key in keys)

    def forget(self, keys: list[bytes]) -> None:
        """Drop ``keys`` (a reader found their object lost)."""
        for key in keys:
            self._drop(key)

    def info(self) -> dict:
        """Entries, batches, bytes held, and how many were evicted and expired."""
        return {"entries": len(self._entries), "batches": len(self._batches),
                "bytes_held": self.bytes_held, "evicted": self.evicted,
                "expired": self.expired}

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes_held -= entry.size
            self._batches[entry.batch][1] -= 1
            self._release(entry.batch)

    def _release(self, batch: int) -> None:
        if self._batches[batch][1] <= 0:
            del self._batches[batch]

    def _expire(self, now: float) -> None:
        """Drop entries unused for ``ttl_s`` (the front is the oldest use)."""
        oldest = now - self.ttl_s
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.used >= oldest:
                break
            self._drop(key)
            self.expired += 1


# The actor class: no CPU reserved (it only moves refs), a few calls at once
# from every replica's store I/O thread, answered one at a time.
KVIndexActor = ray.remote(num_cpus=0, max_restarts=0)(KVIndex)


class RayObjectStore:
    """A ``KVStore`` on Ray's object store and a ``KVIndex`` actor (module
    docstring). Thread safe: the engine thread asks ``count_prefix``, the
    connector's I/O thread puts and gets. Needs Ray initialized (a Serve
    replica, or after ``ray.init``)."""

    def __init__(self, name: str, capacity_bytes: int = 1 << 30, ttl_s: float = DEFAULT_TTL_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S, namespace: str = NAMESPACE) -> None:
        """``name``: the index actor's (``index_name(app)``); ``capacity_bytes``
        and ``ttl_s`` apply if this client creates it; ``timeout_s``: the
        most any call waits before raising ``KVStoreUnavailable``."""
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.name, self.namespace = name, namespace
        self.capacity_bytes, self.ttl_s, self.timeout_s = capacity_bytes, ttl_s, timeout_s
        self.stats = StoreStats()
        self._actor = None
        self._lock = threading.Lock()

    def index(self):
        """The index actor's handle: got, or created if there is none (then
        owned by this process: it lives while this process does and keeps a
        handle to it, so create it where it should live)."""
        with self._lock:
            if self._actor is None:
                self._actor = KVIndexActor.options(
                    name=self.name, namespace=self.namespace, get_if_exists=True,
                ).remote(self.capacity_bytes, self.ttl_s)
            return self._actor

    def _call(self, method: str, *args):
        """One call to the index, its answer within the timeout, else
        ``KVStoreUnavailable`` (a dead index is looked up again next time)."""
        try:
            actor = self.index()
            return ray.get(getattr(actor, method).remote(*args), timeout=self.timeout_s)
        except GetTimeoutError as error:
            raise self._unavailable(f"the KV index did not answer in {self.timeout_s:g} s",
                                    error) from error
        except RayActorError as error:  # dead, or restarting: ask for it again next time
            with self._lock:
                self._actor = None
            raise self._unavailable(f"the KV index is gone: {type(error).__name__}",
                                    error) from error
        except (RayError, ValueError) as error:  # GCS unreachable, name lookups failing...
            raise self._unavailable(f"the KV index: {error}", error) from error

    def _unavailable(self, message: str, error: Exception) -> KVStoreUnavailable:
        self.stats.errors += 1
        return KVStoreUnavailable(message)

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """One object for every payload, then one index call to list them.
        The object is owned by this process (module docstring)."""
        if not items:
            return
        try:
            ref = ray.put(_encode_batch([payload for _, payload in items]))
        except RayError as error:  # the object store full, the raylet gone
            raise self._unavailable(f"ray.put: {error}", error) from error
        # Inside a list: the actor keeps the ref itself (a top-level ref
        # argument would be resolved to its value).
        evicted = self._call("put", [key for key, _ in items],
                             [len(payload) for _, payload in items], [ref])
        self.stats.put(items)
        self.stats.evicted += evicted

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The payloads, None for keys not listed or whose object is lost."""
        if not keys:
            return []
        deadline = time.monotonic() + self.timeout_s
        refs, where = self._call("get", list(keys))
        batches = [self._batch(ref, deadline) for ref in refs]
        found: list[bytes | None] = []
        lost: list[bytes] = []
        for key, place in zip(keys, where):
            batch = batches[place[0]] if place is not None else None
            if place is not None and batch is None:
                lost.append(key)
            found.append(batch[place[1]] if batch is not None else None)
        if lost:  # fire and forget: the next readers need not find them lost again
            self._forget(lost)
        self.stats.got(found)
        return found

    def _batch(self, ref, deadline: float) -> list[bytes] | None:
        """A batch's payloads; None when its object is lost (its owner died)."""
        try:
            return _decode_batch(ray.get(ref, timeout=max(0.001, deadline - time.monotonic())))
        except ObjectLostError:
            return None
        except GetTimeoutError as error:
            raise self._unavailable(f"a KV batch did not arrive in {self.timeout_s:g} s",
                                    error) from error
        except RayError as error:
            raise self._unavailable(f"reading a KV batch: {error}", error) from error

    def _forget(self, keys: list[bytes]) -> None:
        try:
            self.index().forget.remote(keys)
        except RayError:
            pass  # the index is gone too: so are the keys

    def delete_many(self, keys: Sequence[bytes]) -> None:
        """Unlist ``keys`` now (their objects go with their last reference)."""
        if keys:
            self._forget(list(keys))
            self.stats.deleted += len(keys)

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the index lists (their objects may still
        turn out lost: ``get_many`` says so)."""
        if not keys:
            return 0
        count = self._call("count", list(keys))
        self.stats.looked_up(len(keys), count)
        return count

    def info(self) -> dict:
        """The index's own counters (``KVIndex.info``)."""
        return self._call("info")

    def close(self) -> None:
        """Forget the handle; the index stays (other replicas share it)."""
        with self._lock:
            self._actor = None
