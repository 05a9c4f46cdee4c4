"""Stable prefix keys across processes (issue 19, item 1): keyed chained
block hashes, the block-hash secret's settings, and the block events a
replica buffers for the fleet router's prefix index."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.config import BLOCK_HASH_KEY_ENV, CacheConfig, EngineConfig
from carpool.scheduler.kv_events import ROOT_HASH, BlockKeyChain, KvEventBatch, KvEventBuffer
from carpool.scheduler.kv_manager import KVCacheManager
from carpool.scheduler.request import Request

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))
TOKENS = list(range(100, 140))  # 10 full blocks of 4

# Prints [keyed hashes, Python-hash chain hashes] of TOKENS' blocks.
_SCRIPT = """
import json, sys
from carpool.scheduler.kv_events import ROOT_HASH, BlockKeyChain
secret, tokens = bytes.fromhex(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps([BlockKeyChain(4, secret).keys(ROOT_HASH, tokens, 0, len(tokens) // 4)[1],
                  BlockKeyChain(4).keys(ROOT_HASH, tokens, 0, len(tokens) // 4)[1]]))
"""


def _hashes_in_a_process(hash_seed: str) -> list[list[int]]:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONHASHSEED": hash_seed,
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, SECRET.hex(), json.dumps(TOKENS)],
                          env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_keyed_hashes_are_the_same_in_every_process():
    """Two processes with different Python hash seeds agree on the keyed
    hashes (and with this one); Python's hash chain does not (why keys)."""
    first, second = _hashes_in_a_process("1"), _hashes_in_a_process("2")
    here = BlockKeyChain(4, SECRET).keys(ROOT_HASH, TOKENS, 0, 10)[1]
    assert first[0] == second[0] == here and len(set(here)) == 10
    assert first[1] != second[1]


def test_the_secret_decides_the_hashes():
    keyed, other = BlockKeyChain(4, SECRET), BlockKeyChain(4, OTHER)
    keys, hashes = keyed.keys(ROOT_HASH, TOKENS, 0, 10)
    other_keys, other_hashes = other.keys(ROOT_HASH, TOKENS, 0, 10)
    assert keys[0] == other_keys[0]  # the first key has no secret in it: only the hashes do
    assert not set(hashes) & set(other_hashes)
    assert all(-2**63 <= h < 2**63 for h in hashes)  # the next key packs it as int64
    # Chained: a block's hash names its whole prefix, computed in pieces or at once.
    head, tail = keyed.keys(ROOT_HASH, TOKENS, 0, 4), keyed.keys(hashes[3], TOKENS, 4, 10)
    assert head[1] + tail[1] == hashes and head[0] + tail[0] == keys
    assert keyed.root(None) == ROOT_HASH and keyed.root("a") != keyed.root("b") != other.root("b")
    assert keyed.keyed and not BlockKeyChain(4).keyed
    for bad in (b"short", bytes(65)):
        with pytest.raises(ValueError, match="16 to 64 bytes"):
            BlockKeyChain(4, bad)


def test_a_keyed_manager_names_blocks_as_the_router_does():
    """A replica's request hashes are what the router's own chain computes
    from the prompt (and its salt), given the fleet's secret."""
    kv = KVCacheManager(num_blocks=32, block_size=4, block_hash_key=SECRET)
    kv.event_buffer()  # reporting: every block keyed at once (none lazy)
    router = BlockKeyChain(4, SECRET)
    for salt in (None, "tenant-a"):
        request = _serve(kv, f"r-{salt}", TOKENS + [1], salt=salt)
        assert request.block_hashes == router.keys(router.root(salt), TOKENS, 0, 10)[1]
    assert KVCacheManager(8, 4).key_chain.keyed is False  # the simulator's default


class _CollidingChain(BlockKeyChain):
    """Keyed hashes cut to one bit: different tokens collide all the time."""

    def hash_of(self, data: bytes) -> int:
        return super().hash_of(data) & 1


def _serve(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None,
           ) -> Request | None:
    """Admit a request, compute its whole prompt and cache its full blocks
    (None if it does not fit now); the caller frees it."""
    request = Request(rid, tokens, 1, 0.0, cache_salt=salt)
    if not kv.try_admit(request, len(tokens)):
        return None
    request.num_cached_tokens = request.num_computed_tokens  # the hit, as the scheduler keeps it
    request.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(request)
    return request


def test_a_hash_collision_alone_never_shares_a_block():
    """Three one-block prompts on a one-bit hash: two hashes collide
    (pigeonhole), yet each prompt hits only its own block."""
    kv = KVCacheManager(num_blocks=16, block_size=2)
    kv.key_chain = _CollidingChain(2, SECRET)
    kv.lazy_keys = False
    prompts = [[1, 2, 0], [3, 4, 0], [5, 6, 0]]
    served = [_serve(kv, f"a{i}", p) for i, p in enumerate(prompts)]
    assert len({r.block_hashes[0] for r in served}) < 3
    for i, prompt in enumerate(prompts):
        assert _serve(kv, f"b{i}", prompt).num_cached_tokens == 2
        assert kv.block_tables[f"b{i}"][0] == kv.block_tables[f"a{i}"][0]
    assert len({kv.block_tables[f"a{i}"][0] for i in range(3)}) == 3
    kv.check_invariants()


@settings(max_examples=40, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 2), min_size=3, max_size=13), max_size=25),
       lazy=st.booleans())
def test_blocks_are_shared_only_between_equal_tokens(prompts, lazy):
    """On a one-bit hash, every prefix hit still holds the very tokens of
    the block it stands for: the cache is keyed by the exact key."""
    kv = KVCacheManager(num_blocks=12, block_size=2)
    kv.key_chain = _CollidingChain(2, SECRET)
    kv.lazy_keys = lazy
    tokens_of: dict[int, tuple[int, ...]] = {}  # block id -> the tokens its KV holds
    for index, prompt in enumerate(prompts):
        request = _serve(kv, f"r{index}", prompt)
        if request is None:
            continue
        table = kv.block_tables[request.request_id]
        for position, block_id in enumerate(table[:len(prompt) // 2]):
            block = tuple(prompt[2 * position:2 * position + 2])
            if position < request.num_cached_tokens // 2:
                assert tokens_of[block_id] == block, "a hit on another block's tokens"
            tokens_of[block_id] = block
        kv.free(request)
        kv.check_invariants()


def test_keyed_and_python_hashes_cache_alike():
    """The same requests hit and place blocks identically under either hash
    (lazy runs included: only the keys' names change)."""
    managers = KVCacheManager(16, 4), KVCacheManager(16, 4, block_hash_key=SECRET)
    prompts = [TOKENS[:13], TOKENS[:9] + [7, 7, 7, 7], TOKENS[:13], [5] * 20, TOKENS[:17]]
    for kv in managers:
        for index, prompt in enumerate(prompts):
            kv.free(_serve(kv, f"r{index}", prompt))
        kv.check_invariants()
    assert managers[0].prefix_hits == managers[1].prefix_hits > 0
    assert managers[0].pool.num_cached_blocks == managers[1].pool.num_cached_blocks
    assert list(managers[0].pool._free) == list(managers[1].pool._free)


# -- the secret's settings ------------------------------------------------------------


def test_block_hash_key_setting_and_environment(monkeypatch):
    monkeypatch.delenv(BLOCK_HASH_KEY_ENV, raising=False)
    drawn = CacheConfig().block_hash_secret(), CacheConfig().block_hash_secret()
    assert drawn[0] != drawn[1] and len(drawn[0]) == 32  # unset: random per engine
    config = CacheConfig(block_hash_key=f" {SECRET.hex().upper()}\n")
    config.validate()
    assert config.block_hash_secret() == SECRET and SECRET.hex() not in repr(config)
    monkeypatch.setenv(BLOCK_HASH_KEY_ENV, OTHER.hex())
    assert CacheConfig().block_hash_secret() == OTHER
    assert config.block_hash_secret() == SECRET  # the setting wins over the environment
    monkeypatch.setenv(BLOCK_HASH_KEY_ENV, "not hex")
    with pytest.raises(ValueError, match=BLOCK_HASH_KEY_ENV):
        CacheConfig().validate()
    for bad, why in (("zz" * 16, "hexadecimal"), ("ab" * 15, "16 to 64 bytes"),
                     ("ab" * 65, "16 to 64 bytes"), (12345678, "hex string")):
        with pytest.raises(ValueError, match=why) as caught:
            CacheConfig(block_hash_key=bad).validate()
        assert str(bad) not in str(caught.value)  # a secret is never echoed


def test_block_hash_key_comes_from_files_never_from_flags(tmp_path):
    from carpool.cli_flags import ENGINE_FLAGS

    assert "block_hash_key" in CacheConfig.SECRET_FIELDS
    assert not any(flag.key == "block_hash_key" or "hash-key" in flag.flag
                   for flag in ENGINE_FLAGS)
    path = tmp_path / "fleet.yaml"
    path.write_text(f'cache:\n  block_hash_key: "{SECRET.hex()}"\n')
    assert EngineConfig.from_yaml(path).validate().cache.block_hash_secret() == SECRET
    flat = EngineConfig.from_dict({"block_hash_key": OTHER.hex()})
    assert flat.cache.block_hash_secret() == OTHER


def test_the_key_travels_to_a_worker_with_the_engine_config():
    """The worker gets its EngineConfig field by field in MessagePack."""
    config = EngineConfig.from_dict({"cache": {"block_hash_key": SECRET.hex(), "block_size": 32}})
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig)
    assert decoded == config and decoded.cache.block_hash_secret() == SECRET
    unset = msgspec.msgpack.decode(msgspec.msgpack.encode(EngineConfig()), type=EngineConfig)
    assert unset.cache.block_hash_key is None


# -- block events -----------------------------------------------------------------------


def _apply(index: set[int], batch: KvEventBatch) -> None:
    """What a router's prefix index does with one drained batch."""
    assert not set(batch.stored) & set(batch.evicted)
    if batch.reset:
        index.clear()
    index.difference_update(batch.evicted)
    index.update(batch.stored)


def _truth(kv: KVCacheManager) -> set[int]:
    """The keyed hash of every block the pool caches, from its keys."""
    return {kv.key_chain.hash_of(key) for key in kv.pool._cached}


def test_events_follow_a_kv_managers_cache_step_by_step():
    kv = KVCacheManager(num_blocks=8, block_size=2, block_hash_key=SECRET)
    buffer = kv.event_buffer()
    assert kv.lazy_keys is False
    a = _serve(kv, "a", [1, 2, 3, 4, 5])
    # The first drain is a reset with the pool's snapshot (a new subscriber,
    # or a restarted engine: whatever the listener held for it is stale).
    assert buffer.drain() == KvEventBatch(a.block_hashes[:2], [], reset=True)
    kv.free(a)  # freed blocks stay cached: nothing to tell
    assert buffer.drain().empty
    b = _serve(kv, "b", [1, 2, 9, 9, 8, 8, 7, 7, 6, 6, 5, 5, 4])  # hits a's first block
    assert b.num_cached_tokens == 2
    batch = buffer.drain()
    assert batch.stored == b.block_hashes[1:6] and batch.evicted == []
    kv.free(b)
    c = _serve(kv, "c", list(range(20, 33)))  # 7 blocks of 8: evicts b's and a's
    batch = buffer.drain()
    assert batch.stored == c.block_hashes[:6]
    assert batch.evicted and set(batch.evicted) <= set(a.block_hashes + b.block_hashes)
    index: set[int] = set(a.block_hashes[:2] + b.block_hashes[1:6])
    _apply(index, batch)
    assert index == _truth(kv) == set(kv.pool.reported_hashes())


@settings(max_examples=40, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=14), max_size=30),
       drain_every=st.integers(1, 5), limit=st.sampled_from([4, 65536]))
def test_drained_events_keep_an_index_equal_to_the_cache(prompts, drain_every, limit):
    """Whatever is cached, hit and evicted, and however rarely the buffer is
    drained (overflowing or not), applying the batches leaves an index
    holding exactly the keyed hashes of the blocks the pool caches."""
    kv = KVCacheManager(num_blocks=10, block_size=2, block_hash_key=SECRET)
    buffer = kv.event_buffer(limit)
    index: set[int] = set()
    for number, prompt in enumerate(prompts):
        request = _serve(kv, f"r{number}", prompt)
        if request is not None:
            kv.free(request)
        assert buffer.pending <= limit
        if number % drain_every == 0:
            _apply(index, buffer.drain())
            assert index == _truth(kv)
    _apply(index, buffer.drain())
    assert index == _truth(kv) == set(kv.pool.reported_hashes())
    kv.check_invariants()


def test_events_cancel_out_within_a_window():
    buffer = KvEventBuffer()
    buffer.stored([1, 2])
    buffer.evicted([1, 3])  # 1: stored then evicted (never there); 3: was there
    buffer.stored([3, 4])  # 3: evicted then stored again: as it was
    assert buffer.drain() == KvEventBatch([2, 4], [])
    buffer.evicted([2])
    assert buffer.drain() == KvEventBatch([], [2])
    assert buffer.drain().empty


def test_an_overflowing_buffer_resets_the_index_from_the_pool():
    kv = KVCacheManager(num_blocks=16, block_size=2, block_hash_key=SECRET)
    buffer = kv.event_buffer(limit=3)
    index = {12345}  # stale: the reset must drop it
    _serve(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 4 blocks > 3 pending: overflow
    assert buffer.reset_due and buffer.pending == 0
    _serve(kv, "b", [5, 5, 6, 6, 7])  # ignored until the reset is drained
    assert buffer.pending == 0
    batch = buffer.drain()
    assert batch.reset and batch.evicted == [] and len(batch.stored) == 6
    _apply(index, batch)
    assert index == _truth(kv)
    assert not buffer.reset_due and buffer.drain().empty
    c = _serve(kv, "c", [8, 8, 9])  # then normal batches again
    assert buffer.drain() == KvEventBatch(c.block_hashes[:1], [])
    bare = KvEventBuffer(limit=1)  # no snapshot: the listener starts over empty
    bare.stored([1, 2])
    assert bare.drain() == KvEventBatch([], [], reset=True)
    with pytest.raises(ValueError, match="limit"):
        KvEventBuffer(limit=0)
