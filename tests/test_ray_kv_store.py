"""``RayObjectStore``: KV payloads in Ray's object store, listed by a ``KVIndex`` actor.

The index's bookkeeping (LRU by bytes, TTL, batches freed with their last
key) is checked on the plain class; the store on a real local Ray
(127.0.0.1, 2 CPUs): round trips between a task, an actor and the driver,
the leading-count rule, eviction, expiry, a lost object (its owner died)
read as a miss, and an index that died or hangs answering
``KVStoreUnavailable`` within the timeout, then (dead) replaced by an
empty one.
"""
from __future__ import annotations

import os
import time
import uuid

import pytest
import ray

from carpool.kv_transfer.stores import KVStoreUnavailable
from carpool.ray_serve.kv_store import NAMESPACE, KVIndex, RayObjectStore, index_name


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _store(**kwargs) -> RayObjectStore:
    """A client of a fresh index (its own name: tests share nothing)."""
    return RayObjectStore(index_name(f"test-{uuid.uuid4().hex[:8]}"), **kwargs)


def _helpers():
    """A task and an actor that use a store by name (defined here: Ray
    ships them by value, the tests module need not be importable there)."""

    @ray.remote(num_cpus=0)
    def put_in_task(name: str, items):
        RayObjectStore(name).put_many(items)

    @ray.remote(num_cpus=0)
    class Client:
        def __init__(self, name: str) -> None:
            self.store = RayObjectStore(name)

        def put(self, items) -> None:
            self.store.put_many(items)

        def get(self, keys):
            return self.store.get_many(keys)

    return put_in_task, Client


# -- the index's bookkeeping, without Ray -----------------------------------------------


def test_the_index_evicts_least_recently_used_by_bytes_and_frees_emptied_batches():
    index = KVIndex(capacity_bytes=250)
    assert index.put([b"a", b"b"], [100, 100], ["batch-1"]) == 0
    refs, where = index.get([b"a", b"x"])  # a use: "a" is now the most recent
    assert refs == ["batch-1"] and where == [(0, 0), None]
    assert index.put([b"c"], [100], ["batch-2"]) == 1  # "b" went for room
    assert index.count([b"a", b"b"]) == 1 and index.count([b"c"]) == 1
    assert index.put([b"big"], [251], ["batch-3"]) == 0  # could never fit: not listed
    assert index.info()["batches"] == 2
    index.forget([b"a"])  # batch-1's last key: its ref is dropped
    assert index.info() == {"entries": 1, "batches": 1, "bytes_held": 100, "evicted": 1,
                            "expired": 0}
    index.put([b"c"], [50], ["batch-4"])  # overwritten: batch-2 dropped too
    assert index.get([b"c"]) == (["batch-4"], [(0, 0)]) and index.info()["batches"] == 1


def test_the_index_forgets_keys_unused_for_the_ttl():
    now = [0.0]
    index = KVIndex(capacity_bytes=1000, ttl_s=0.2, clock=lambda: now[0])
    index.put([b"a", b"b"], [10, 10], ["batch"])
    now[0] = 0.1
    index.get([b"a"])  # renewed
    now[0] = 0.25
    assert index.count([b"a"]) == 1 and index.count([b"b"]) == 0
    assert index.info()["expired"] == 1


# -- on a real Ray ---------------------------------------------------------------------


def test_payloads_round_trip_between_a_task_an_actor_and_the_driver(local_ray):
    put_in_task, Client = _helpers()
    driver = _store()
    driver.index()  # created (owned) here: an index created by the task would end with it
    ray.get(put_in_task.remote(driver.name, [(b"k1", b"one"), (b"k2", b"two" * 1000)]))
    reader = Client.remote(driver.name)
    assert ray.get(reader.get.remote([b"k1", b"missing", b"k2"])) == [b"one", None,
                                                                      b"two" * 1000]
    ray.get(reader.put.remote([(b"k3", b"three")]))
    assert driver.get_many([b"k3", b"k1"]) == [b"three", b"one"]
    # The leading-count rule: up to the first key not held.
    assert driver.count_prefix([b"k1", b"k2", b"k3"]) == 3
    assert driver.count_prefix([b"k1", b"missing", b"k3"]) == 1
    assert driver.count_prefix([b"missing", b"k1"]) == 0
    assert driver.count_prefix([]) == 0 and driver.get_many([]) == []
    stats = driver.stats
    assert (stats.hits, stats.bytes_out, stats.errors) == (2 + 3 + 1, 8, 0)
    ray.kill(reader)


def test_least_recently_used_blocks_are_evicted_and_unused_ones_expire(local_ray):
    store = _store(capacity_bytes=250, ttl_s=60)
    store.put_many([(b"a", b"x" * 100)])
    store.put_many([(b"b", b"y" * 100)])
    assert store.get_many([b"a"]) == [b"x" * 100]  # "a" used: "b" is the oldest
    store.put_many([(b"c", b"z" * 100)])
    assert store.get_many([b"a", b"b", b"c"]) == [b"x" * 100, None, b"z" * 100]
    assert store.stats.evicted == 1 and store.info()["bytes_held"] == 200
    store.delete_many([b"c", b"absent"])  # a taken handoff's parts: unlisted at once
    assert store.get_many([b"c"]) == [None] and store.info()["bytes_held"] == 100
    short = _store(ttl_s=0.3)
    short.put_many([(b"a", b"x")])
    time.sleep(0.5)
    assert short.count_prefix([b"a"]) == 0 and short.get_many([b"a"]) == [None]
    assert short.info()["expired"] == 1


def test_an_object_whose_owner_died_is_a_miss_and_is_forgotten(local_ray):
    _, Client = _helpers()
    store = _store()
    store.index()  # owned by the driver, not by the client that dies
    owner = Client.remote(store.name)
    ray.get(owner.put.remote([(b"a", b"payload")]))
    store.put_many([(b"b", b"mine")])
    assert store.get_many([b"a", b"b"]) == [b"payload", b"mine"]
    ray.kill(owner)  # its objects are gone with it; the index still lists them
    deadline = time.monotonic() + 30
    while (found := store.get_many([b"a", b"b"]))[0] is not None:
        assert time.monotonic() < deadline, "the dead owner's object was still read"
        time.sleep(0.2)
    assert found == [None, b"mine"]
    deadline = time.monotonic() + 10  # the index was told (fire and forget)
    while store.count_prefix([b"a"]):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _kill(actor) -> None:
    """Kill ``actor`` and wait until calls to it fail (the kill is asynchronous)."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            ray.get(actor.info.remote(), timeout=1)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers")


def test_a_dead_index_is_unavailable_at_once_then_replaced_by_an_empty_one(local_ray):
    store = _store(timeout_s=1.0)
    store.put_many([(b"a", b"x")])
    for call in (lambda: store.count_prefix([b"a"]), lambda: store.get_many([b"a"]),
                 lambda: store.put_many([(b"b", b"y")])):
        _kill(store.index())
        started = time.monotonic()
        with pytest.raises(KVStoreUnavailable, match="gone"):
            call()
        assert time.monotonic() - started < 1.0 + 2.0  # the timeout at most, with slack
    assert store.stats.errors == 3
    # The next call gets (creates) a new index: it holds nothing.
    assert store.count_prefix([b"a"]) == 0 and store.get_many([b"a"]) == [None]


def test_an_index_that_hangs_is_unavailable_within_the_timeout(local_ray):
    @ray.remote(num_cpus=0)
    class Stuck:
        def count(self, keys):
            time.sleep(60)

    name = index_name(f"stuck-{uuid.uuid4().hex[:8]}")
    stuck = Stuck.options(name=name, namespace=NAMESPACE).remote()
    store = RayObjectStore(name, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(KVStoreUnavailable, match="did not answer"):
        store.count_prefix([b"a"])
    assert time.monotonic() - started < 5  # the timeout, not the hang
    ray.kill(stuck)
