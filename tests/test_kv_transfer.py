"""KV blocks leaving a replica and coming back: the payload format and its
refusals, the stores (in-process, TCP on 127.0.0.1), block I/O on cache
tensors, and two engines sharing prompt blocks through a store."""
from __future__ import annotations

import socket
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool import LLM, SamplingParams
from carpool.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.kv_transfer import open_store
from carpool.kv_transfer.blocks import KVBlockIO, weights_fingerprint
from carpool.kv_transfer.connector import StoreConnector
from carpool.kv_transfer.payload import (
    HEADER_BYTES,
    BlockLayout,
    KVPayloadError,
    block_key_bytes,
    decode_block,
    encode_block,
)
from carpool.kv_transfer.stores import KVStoreUnavailable, MemoryStore
from carpool.kv_transfer.tcp_store import MAX_FRAME_BYTES, TcpStore, TcpStoreServer

LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="bfloat16")
PRINT = bytes(range(16))
HASH_KEY = "00112233445566778899aabbccddeeff"


@given(st.integers(0, (1 << 64) - 1), st.binary(min_size=LAYOUT.data_bytes,
                                               max_size=LAYOUT.data_bytes))
@settings(max_examples=50, deadline=None)
def test_a_payload_decodes_to_its_data_and_only_for_its_own_block(key, data):
    payload = encode_block(key, PRINT, LAYOUT, data)
    assert len(payload) == HEADER_BYTES + LAYOUT.data_bytes
    assert bytes(decode_block(payload, key, PRINT, LAYOUT)) == data
    with pytest.raises(KVPayloadError, match="holds block"):
        decode_block(payload, key ^ 1, PRINT, LAYOUT)


@pytest.mark.parametrize("change, reason", [
    (lambda p: p, None),
    (lambda p: p[:HEADER_BYTES - 1], "at least"),
    (lambda p: b"XXXX" + p[4:], "not a carpool KV block"),
    (lambda p: p[:-1] + bytes([p[-1] ^ 1]), "damaged"),
    (lambda p: p[:-2], "bytes, expected"),
])
def test_damaged_payloads_are_refused_with_the_reason(change, reason):
    data = bytes(range(256)) * (LAYOUT.data_bytes // 256)
    payload = change(encode_block(7, PRINT, LAYOUT, data))
    if reason is None:
        assert bytes(decode_block(payload, 7, PRINT, LAYOUT)) == data
        return
    with pytest.raises(KVPayloadError, match=reason):
        decode_block(payload, 7, PRINT, LAYOUT)


def test_another_model_or_layout_is_refused():
    data = bytes(LAYOUT.data_bytes)
    payload = encode_block(7, PRINT, LAYOUT, data)
    with pytest.raises(KVPayloadError, match="another model"):
        decode_block(payload, 7, bytes(16), LAYOUT)
    for other in (BlockLayout(2, 2, 4, 4, "float16"), BlockLayout(2, 1, 8, 4, "bfloat16")):
        with pytest.raises(KVPayloadError, match="layout"):
            decode_block(payload, 7, PRINT, other)


def test_the_memory_store_evicts_least_recently_used_and_expires_by_ttl():
    now = [0.0]
    store = MemoryStore(capacity_bytes=300, ttl_s=10, clock=lambda: now[0])
    store.put_many([(b"a", b"x" * 100), (b"b", b"y" * 100), (b"c", b"z" * 100)])
    assert store.get_many([b"a"]) == [b"x" * 100]  # a is used: b is the oldest now
    store.put_many([(b"d", b"w" * 100)])
    assert store.get_many([b"a", b"b", b"c", b"d"]) == [b"x" * 100, None, b"z" * 100,
                                                        b"w" * 100]
    assert store.count_prefix([b"a", b"c", b"b", b"d"]) == 2
    now[0] = 9.0
    store.get_many([b"a"])
    now[0] = 15.0  # c and d unused for 15 s; a for 6
    assert store.count_prefix([b"a", b"c"]) == 1
    assert (store.stats.evicted, store.stats.expired) == (1, 2)
    assert store.bytes_held == 100


def test_the_tcp_store_serves_puts_gets_and_counts_and_fails_cleanly():
    server = TcpStoreServer(MemoryStore(1 << 20)).start()
    client = TcpStore(*server.address, timeout_s=2)
    try:
        client.put_many([(b"k1", b"one"), (b"k2", b"two")])
        assert client.get_many([b"k1", b"nope", b"k2"]) == [b"one", None, b"two"]
        assert client.count_prefix([b"k1", b"k2", b"k3"]) == 2
        client.delete_many([b"k2", b"absent"])  # a taken handoff part: gone at once
        assert client.get_many([b"k1", b"k2"]) == [b"one", None]
        assert len(server.store) == 1 and server.store.bytes_held == 3
        client.put_many([(b"k2", b"two")])
        # A frame over the limit: the server drops that connection, nothing more.
        with socket.create_connection(server.address) as raw:
            raw.sendall(struct.pack("<I", MAX_FRAME_BYTES + 1))
            assert raw.recv(1) == b""
        assert client.get_many([b"k1"]) == [b"one"]
    finally:
        server.stop()
    with pytest.raises(KVStoreUnavailable):
        client.get_many([b"k1"])
    assert client.stats.errors == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_io_round_trips_blocks_exactly(dtype):
    torch.manual_seed(0)
    caches = [(torch.randn(3, 10, 8, 4).to(dtype), torch.randn(3, 10, 4, 8).to(dtype))
              for _ in range(2)]
    io = KVBlockIO(caches)
    datas = io.read([2, 5, 7])
    assert all(len(d) == io.layout.data_bytes for d in datas)
    other = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    KVBlockIO(other).write([0, 9, 3], datas)
    for (k, v), (k2, v2) in zip(caches, other):
        for src, dst in ((2, 0), (5, 9), (7, 3)):
            assert torch.equal(k[:, src], k2[:, dst]) and torch.equal(v[:, src], v2[:, dst])
        assert not k2[:, 1].any()  # nothing else written


def _engine_with(llm: LLM, store) -> LLMEngine:
    """A fresh engine on ``llm``'s model and KV tensors, zeroed: a replica
    with an empty cache, sharing ``store``."""
    base = llm.engine
    executor = base.executor
    for k, v in executor.kv_caches:  # another replica: nothing of the last one's KV
        k.zero_()
        v.zero_()
    fingerprint = weights_fingerprint(executor.model, f"{base.model_config!r} {executor.dtype}")
    connector = StoreConnector(store, KVBlockIO(executor.kv_caches), fingerprint)
    return LLMEngine(base.config, base.tokenizer, base.model_config, executor,
                     base.max_model_len, kv_connector=connector)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="16MiB",
               block_hash_key=HASH_KEY)


def _generate(engine: LLMEngine, prompt: list[int], n: int = 8):
    return LLM.from_engine(engine).generate(
        [prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]


def test_a_second_replica_loads_the_prompt_from_the_store_and_says_the_same(tiny):
    prompt = [(i * 37) % 380 + 5 for i in range(70)]  # 4 full blocks of 16 before the last token
    expected = _generate(tiny.engine, prompt)
    assert expected.num_cached_tokens == 0
    store = MemoryStore(64 << 20)
    first = _engine_with(tiny, store)
    assert _generate(first, prompt).token_ids == expected.token_ids
    first.kv_connector.flush()  # the write-through runs off the step
    assert first.kv_connector.stats.blocks_saved == 4 and len(store) == 4
    # A replica with an empty cache: the four blocks come from the store.
    second = _engine_with(tiny, store)
    out = _generate(second, prompt)
    assert out.token_ids == expected.token_ids
    assert out.num_cached_tokens == 64
    assert second.kv_connector.stats.blocks_loaded == 4
    assert second.scheduler.kv.pool.num_free_blocks == second.executor.num_blocks


def test_refused_or_missing_blocks_are_computed_instead(tiny):
    prompt = [(i * 53) % 380 + 7 for i in range(70)]
    expected = _generate(tiny.engine, prompt)
    store = MemoryStore(64 << 20)
    _engine = _engine_with(tiny, store)
    _generate(_engine, prompt)
    _engine.kv_connector.flush()
    # Damage the third block in the store: the first two load, the rest are computed.
    keys = sorted(store._blocks)
    saved = _engine_with(tiny, store)
    ours = [k for k in keys if store.get_many([k])[0] is not None]
    victim = next(k for k in ours if k == block_key_bytes(saved.kv_connector.fingerprint,
                                                          _third_hash(saved, prompt)))
    payload = bytearray(store.get_many([victim])[0])
    payload[-1] ^= 0xFF
    store.put_many([(victim, bytes(payload))])
    out = _generate(saved, prompt)
    assert out.token_ids == expected.token_ids
    assert out.num_cached_tokens == 32
    assert saved.kv_connector.stats.blocks_refused == 1


def _third_hash(engine: LLMEngine, prompt: list[int]) -> int:
    from carpool.scheduler import Request

    request = Request("probe", prompt, 1, 0.0)
    engine.scheduler.kv._extend_hashes(request, 3)
    return request.block_hashes[2]


def test_a_store_gone_costs_only_recomputation(tiny):
    prompt = [(i * 29) % 380 + 9 for i in range(70)]
    expected = _generate(tiny.engine, prompt)
    server = TcpStoreServer(MemoryStore(64 << 20)).start()
    store_url = "tcp://%s:%d" % server.address
    first = _engine_with(tiny, open_store(store_url))
    _generate(first, prompt)
    first.kv_connector.flush()
    server.stop()  # gone before the second replica asks
    second = _engine_with(tiny, open_store(store_url))
    out = _generate(second, prompt)
    assert out.token_ids == expected.token_ids and out.num_cached_tokens == 0
    assert second.kv_connector.stats.store_errors >= 1


def test_kv_store_settings_are_checked():
    with pytest.raises(ValueError, match="kv_store must be"):
        EngineConfig.from_dict({"kv_store": "ftp://x"}).validate()
    with pytest.raises(ValueError, match="kv_store_ttl"):
        EngineConfig.from_dict({"kv_store_ttl": 0}).validate()
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        open_store("tcp://nohost")


def test_two_replicas_share_prompt_blocks_through_carpool_kv_store(tiny_model_dir):
    import re
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "carpool.cli", "kv-store", "--port", "0",
                             "--capacity", "64MiB"], stdout=subprocess.PIPE, text=True)
    try:
        url = re.search(r"tcp://[0-9.]+:\d+", proc.stdout.readline()).group(0)
        replicas = [LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="16MiB",
                        block_hash_key=HASH_KEY, kv_store=url) for _ in range(2)]
        prompt = [(i * 31) % 380 + 13 for i in range(70)]
        first = _generate(replicas[0].engine, prompt)
        replicas[0].engine.kv_connector.flush()
        second = _generate(replicas[1].engine, prompt)
        assert second.token_ids == first.token_ids
        assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 64)
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_store_metrics_reach_the_snapshot_the_fleet_sum_and_prometheus(tiny):
    from carpool.engine.stats import merge_stats
    from carpool.server.metrics_engine import engine_families

    prompt = [(i * 43) % 380 + 17 for i in range(70)]
    store = MemoryStore(64 << 20)
    first = _engine_with(tiny, store)
    _generate(first, prompt)
    first.kv_connector.flush()
    second = _engine_with(tiny, store)
    _generate(second, prompt)
    stats = second.stats()
    assert stats.kv_store["blocks_loaded"] == 4 and stats.kv_store["store_hits"] >= 4
    assert sum(stats.kv_store["load_buckets"]) == 1
    families = {f.name: f for f in engine_families(stats, {}, "m", 10.0, None)}
    assert families["kv_store_blocks_loaded"].samples[0].value == 4
    count = [s.value for s in families["kv_store_load_seconds"].samples
             if s.name.endswith("_count")]
    assert count == [1]
    fleet = merge_stats([stats, first.stats()])
    assert fleet.kv_store["blocks_loaded"] == 4
    assert fleet.kv_store["blocks_saved"] == 4 + stats.kv_store["blocks_saved"]
    assert sum(fleet.kv_store["save_buckets"]) >= 1
    assert "kv_store_hits" not in {f.name for f in engine_families(
        tiny.engine.stats(), {}, "m", 10.0, None)}  # no store, no series


def test_a_hung_store_costs_one_timeout_then_is_left_alone_for_a_while(tiny):
    """A store that accepts connections but never answers: the first lookup
    waits out the client's timeout, the next ones (within retry_after_s)
    do not ask at all."""
    import time

    hung = socket.create_server(("127.0.0.1", 0))  # listens, never replies
    try:
        store = TcpStore(*hung.getsockname(), timeout_s=0.3)
        engine = _engine_with(tiny, store)
        prompt = [(i * 47) % 380 + 19 for i in range(70)]
        started = time.monotonic()
        first = _generate(engine, prompt)
        second = _generate(engine, [t + 1 for t in prompt])
        assert time.monotonic() - started < 5
        assert first.num_cached_tokens == 0 and second.num_cached_tokens == 0
        assert engine.kv_connector.stats.store_errors >= 1
        assert store.stats.errors == 1  # one lookup; later lookups and saves skip it
        assert engine.kv_connector.stats.saves_dropped == 8
    finally:
        hung.close()


class _BrokenStore(MemoryStore):
    """Answers lookups, then fails every fetch and write with an error that
    is not a connection error (a backend's bug, a server's error reply)."""

    def get_many(self, keys):
        raise RuntimeError("boom")

    def put_many(self, items):
        raise RuntimeError("boom")


def test_a_fetch_that_fails_oddly_still_ends_the_load_and_the_request(tiny):
    prompt = [(i * 59) % 380 + 23 for i in range(70)]
    expected = _generate(tiny.engine, prompt)
    store = _BrokenStore(64 << 20)
    seeded = _engine_with(tiny, MemoryStore(64 << 20))
    _generate(seeded, prompt)
    seeded.kv_connector.flush()
    store._blocks = seeded.kv_connector.store._blocks  # lookups find the blocks
    engine = _engine_with(tiny, store)
    out = _generate(engine, prompt)
    assert out.token_ids == expected.token_ids and out.num_cached_tokens == 0
    assert engine.kv_connector.stats.store_errors >= 1
    assert not engine.has_unfinished
    assert engine.scheduler.kv.pool.num_free_blocks == engine.executor.num_blocks
