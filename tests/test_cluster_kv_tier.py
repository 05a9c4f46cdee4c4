"""The shared external KV tier's bookkeeping (carpool.cluster.kv_tier)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.cluster.kv_tier import SharedKVTier


def test_lookup_counts_leading_blocks_and_a_load_is_priced_by_bandwidth():
    tier = SharedKVTier(100, block_bytes=2 << 20, bandwidth=1e9, latency=0.001)
    tier.store([1, 2, 3], 0.0)
    assert tier.lookup([1, 2, 4, 3], 1.0) == 2  # stops at the first miss
    assert tier.stats.queries == 4 and tier.stats.hits == 2
    assert tier.load_seconds(0) == 0.0
    assert tier.load_seconds(500) == pytest.approx(0.001 + 500 * (2 << 20) / 1e9)


def test_blocks_expire_after_their_ttl_unless_used():
    tier = SharedKVTier(100, 1.0, ttl_s=1800)
    tier.store([1, 2], 0.0)
    tier.store([3], 1000.0)
    assert tier.lookup([1], 1500.0) == 1  # used: its age starts again
    assert tier.lookup([2], 1900.0) == 0 and tier.stats.expired == 1  # 1900 s unused
    assert tier.lookup([1], 3200.0) == 1  # 1700 s after its last use
    assert tier.lookup([3], 3200.0) == 0


def test_a_full_tier_evicts_the_least_recently_used():
    tier = SharedKVTier(3, 1.0)
    tier.store([1, 2, 3], 0.0)
    tier.lookup([1], 1.0)
    tier.store([4], 2.0)  # evicts 2, the least recently used
    assert [tier.lookup([b], 3.0) for b in (1, 2, 3, 4)] == [1, 0, 1, 1]
    assert tier.stats.evicted == 1


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 30), max_size=8),
                              st.floats(0, 100)), max_size=60),
       capacity=st.integers(1, 12), ttl=st.floats(1, 50))
def test_the_tier_never_holds_more_than_its_capacity_nor_anything_past_its_ttl(ops, capacity,
                                                                                ttl):
    tier = SharedKVTier(capacity, 1.0, ttl_s=ttl)
    now = 0.0
    last_use: dict[int, float] = {}
    for is_store, hashes, step in ops:
        now += step
        if is_store:
            tier.store(hashes, now)
            last_use.update({h: now for h in hashes})
        else:
            found = tier.lookup(hashes, now)
            for h in hashes[:found]:
                assert now - last_use[h] <= ttl  # never served past its TTL
                last_use[h] = now
        assert tier.num_blocks <= capacity
