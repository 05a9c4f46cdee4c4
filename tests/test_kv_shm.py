"""The shared-memory KV store (carpool/kv_transfer/shm_store.py): its slot
index's invariants, round trips with another process, LRU, TTL, the
leading-count rule, refusals, failures that raise instead of hanging,
garbage on the control socket, no arena left in /dev/shm, and KV blocks
through it as the connector moves them."""
from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.kv_transfer.blocks import KVBlockIO
from carpool.kv_transfer.payload import KVPayloadError, block_key_bytes, decode_block, encode_block
from carpool.kv_transfer.shm_store import (
    MAX_FRAME_BYTES,
    MAX_KEY_BYTES,
    MAX_KEYS_PER_CALL,
    Session,
    ShmStore,
    ShmStoreServer,
    SlotIndex,
    _receive,
    parse_shm_url,
)
from carpool.kv_transfer.stores import KVStoreUnavailable
from carpool.kv_transfer.tcp_store import _send

ROOT = Path(__file__).resolve().parent.parent
SHM = Path("/dev/shm")
PRINT = bytes(range(16))


def _arenas() -> set[str]:
    return {p.name for p in SHM.glob("cpkv_*")} if SHM.is_dir() else set()


@pytest.fixture(autouse=True)
def no_arena_left():
    """Every test gives back every arena it made."""
    before = _arenas()
    yield
    assert _arenas() <= before


@pytest.fixture
def server():
    with ShmStoreServer(1 << 16, ttl_s=60, slot_bytes=100) as running:
        yield running


def _run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


# -- the index ---------------------------------------------------------------------

_KEYS = [b"k%d" % i for i in range(3)]
_OPS = st.tuples(st.sampled_from(["put", "put", "reserve", "commit", "lookup", "lookup",
                                  "release", "end", "tick"]),
                 st.integers(0, 1), st.sampled_from(_KEYS), st.integers(0, 12))


def _check_invariants(index: SlotIndex, sessions: list[Session], content: dict,
                      reads: list[list[tuple[int, bytes]]]) -> None:
    """Each slot in exactly one state; pins add up; a pinned slot still
    holds what its reader was pointed at (no writer got it since)."""
    reserved = [slot for s in sessions for slot, _ in s.reserved.values()]
    held = [entry.slot for entry in index._entries.values()]
    states = index._free + reserved + held + sorted(index._retired)
    assert sorted(states) == list(range(index.num_slots))
    assert index._retired <= set(index._pins)
    for slot, pins in index._pins.items():
        assert pins == sum(s.pinned.get(slot, 0) for s in sessions) > 0
    for session_reads in reads:
        for offset, key in session_reads:
            assert content[offset // index.slot_bytes] == key


@given(st.lists(_OPS, max_size=60))
@settings(max_examples=300, deadline=None)
def test_the_index_never_hands_out_a_pinned_held_or_reserved_slot(ops):
    now = [0.0]
    index = SlotIndex(30, ttl_s=10, slot_bytes=10, clock=lambda: now[0])  # 3 slots
    sessions, reads = [Session(), Session()], [[], []]
    content: dict[int, bytes] = {}  # slot -> the key its last writer wrote
    for kind, s, key, size in ops:
        if kind in ("reserve", "put"):
            (offset,) = index.reserve(sessions[s], [key], [size])
            if offset >= 0:
                content[offset // 10] = key  # the writer's copy
            assert (offset >= 0) <= (1 <= size <= 10)
            if kind == "put":
                index.commit(sessions[s], [key])
        elif kind == "commit":
            index.commit(sessions[s], [key])
        elif kind == "lookup":
            (offset,), (length,) = index.lookup(sessions[s], [key])
            if offset >= 0:
                assert content[offset // 10] == key and 1 <= length <= 10
                reads[s].append((offset, key))
        elif kind == "release":
            index.release(sessions[s], [offset for offset, _ in reads[s]])
            reads[s].clear()
        elif kind == "end":
            index.end(sessions[s])
            reads[s].clear()
        else:
            now[0] += size / 2  # the TTL is 10 s
        _check_invariants(index, sessions, content, reads)


def test_a_pinned_slot_is_reused_only_after_its_release():
    index = SlotIndex(20, ttl_s=10, slot_bytes=10)  # 2 slots
    writer, reader = Session(), Session()
    index.reserve(writer, [b"a", b"b"], [10, 10])
    index.commit(writer, [b"a", b"b"])
    offsets, _ = index.lookup(reader, [b"a", b"b"])
    assert offsets == [0, 10]
    # Both evicted for c, but pinned: c finds no slot.
    assert index.reserve(writer, [b"c"], [10]) == [-1]
    assert len(index) == 0 and index.stats.evicted == 2
    index.release(reader, [10])
    assert index.reserve(writer, [b"c"], [10]) == [10]
    index.end(reader)  # its last pin: slot 0 is free again
    assert index.reserve(writer, [b"d"], [10]) == [0]
    index.end(writer)  # uncommitted: both back
    assert sorted(index._free) == [0, 1]


# -- the store ------------------------------------------------------------------------


def test_puts_gets_and_leading_counts(server):
    client = ShmStore(server.url)
    client.put_many([(b"k1", b"one"), (b"k2", b"two" * 10)])
    assert client.get_many([b"k1", b"nope", b"k2"]) == [b"one", None, b"two" * 10]
    assert client.count_prefix([b"k1", b"k2", b"k3", b"k1"]) == 2
    assert client.count_prefix([b"nope", b"k1"]) == 0
    assert client.get_many([]) == [] and client.count_prefix([]) == 0
    client.put_many([(b"k1", b"uno")])  # a put again replaces
    assert client.get_many([b"k1"]) == [b"uno"] and len(server.index) == 2
    stats = client.stats
    assert (stats.puts, stats.bytes_in, stats.hits, stats.errors) == (3, 36, 5, 0)
    assert server.stats.puts == 3
    with server.lock:  # the server drops both connections: one failed call each, then anew
        for connection in server.connections:
            connection.shutdown(socket.SHUT_RDWR)
    for call in (lambda: client.get_many([b"k2"]), lambda: client.count_prefix([b"k2"])):
        with pytest.raises(KVStoreUnavailable):
            call()
    assert client.get_many([b"k2"]) == [b"two" * 10] and client.count_prefix([b"k2"]) == 1
    client.close()


def test_a_deleted_block_is_gone_at_once_and_its_slot_free_after_its_readers():
    """``delete_many`` (a taken handoff's parts): the entry goes now; a slot
    a reader still pins is reused only after its release."""
    index = SlotIndex(300, ttl_s=60, slot_bytes=100)  # 3 slots
    writer, reader = Session(), Session()
    for key in (b"a", b"b", b"c"):
        index.reserve(writer, [key], [10])
    index.commit(writer, [b"a", b"b", b"c"])
    offsets, _ = index.lookup(reader, [b"a"])  # pinned by a reader
    assert index.delete([b"a", b"b", b"absent"]) == 2
    assert index.count([b"a"]) == 0 and len(index) == 1
    # b's slot and (evicting c) c's are handed out; a's is not while pinned.
    got = index.reserve(writer, [b"d", b"e", b"f"], [10, 10, 10])
    assert got[2] == -1 and offsets[0] not in got
    index.release(reader, offsets)
    assert index.reserve(writer, [b"g"], [10]) == offsets  # freed at its last unpin


def test_the_client_deletes_through_the_server(server):
    client = ShmStore(server.url)
    client.put_many([(b"k1", b"one"), (b"k2", b"two")])
    client.delete_many([b"k1"])
    assert client.get_many([b"k1", b"k2"]) == [None, b"two"] and client.stats.deleted == 1
    client.close()


CHILD = """
import sys
from carpool.kv_transfer.shm_store import ShmStore
store = ShmStore(sys.argv[1], timeout_s=5)
assert store.get_many([b"from-parent"]) == [b"p" * 100]
store.put_many([(b"from-child-%d" % i, bytes([i]) * (50 + i)) for i in range(3)])
store.close()
"""


def test_another_process_puts_and_this_one_gets(server):
    client = ShmStore(server.url)
    client.put_many([(b"from-parent", b"p" * 100)])
    child = _run_python(CHILD, server.url)
    assert child.returncode == 0, child.stderr
    assert "leaked" not in child.stderr  # it did not adopt (and unlink) the arena
    assert (SHM / server.arena_name).exists() or not SHM.is_dir()
    keys = [b"from-child-%d" % i for i in range(3)]
    assert client.get_many(keys) == [bytes([i]) * (50 + i) for i in range(3)]
    assert client.count_prefix(keys) == 3
    client.close()


def test_least_recently_used_blocks_make_room():
    with ShmStoreServer(300, ttl_s=60, slot_bytes=100) as server:  # 3 slots
        client = ShmStore(server.url)
        client.put_many([(b"a", b"x" * 100), (b"b", b"y" * 100), (b"c", b"z" * 100)])
        assert client.get_many([b"a"]) == [b"x" * 100]  # a used: b is the oldest
        assert client.count_prefix([b"b"]) == 1  # a count is no use
        client.put_many([(b"d", b"w" * 100)])
        assert client.get_many([b"a", b"b", b"c", b"d"]) == [b"x" * 100, None, b"z" * 100,
                                                              b"w" * 100]
        assert server.stats.evicted == 1 and len(server.index) == 3
        client.close()


def test_blocks_expire_a_ttl_after_their_last_use():
    now = [0.0]
    with ShmStoreServer(1000, ttl_s=10, slot_bytes=100, clock=lambda: now[0]) as server:
        client = ShmStore(server.url)
        client.put_many([(b"a", b"1"), (b"c", b"3")])
        now[0] = 9.0
        client.get_many([b"a"])
        now[0] = 15.0  # c unused for 15 s, a for 6
        assert client.count_prefix([b"a", b"c"]) == 1
        assert client.get_many([b"c"]) == [None]
        assert server.stats.expired == 1 and len(server.index._free) == 9
        client.close()


def test_the_first_payload_sizes_the_slots_and_larger_ones_are_refused():
    with ShmStoreServer(1000, ttl_s=60) as server:
        client = ShmStore(server.url)
        client.put_many([(b"huge", b"h" * 2000), (b"empty", b"")])  # refused: no size set
        assert server.index.slot_bytes is None
        client.put_many([(b"a", b"a" * 100)])
        assert (server.index.slot_bytes, server.index.num_slots) == (100, 10)
        client.put_many([(b"big", b"b" * 101), (b"small", b"s" * 50)])
        assert client.get_many([b"a", b"big", b"small"]) == [b"a" * 100, None, b"s" * 50]
        assert client.stats.extra["refused"] == server.stats.extra["refused"] == 3
        assert client.stats.puts == 2
        client.close()


def test_a_store_stopped_mid_run_raises_within_the_timeout():
    server = ShmStoreServer(1 << 16, slot_bytes=100).start()
    client = ShmStore(server.url, timeout_s=0.5)
    client.put_many([(b"k", b"v")])
    assert client.count_prefix([b"k"]) == 1
    server.stop()
    assert not (SHM / server.arena_name).exists()
    for call in (lambda: client.get_many([b"k"]), lambda: client.count_prefix([b"k"]),
                 lambda: client.put_many([(b"k", b"v")])):
        started = time.monotonic()
        with pytest.raises(KVStoreUnavailable):
            call()
        assert time.monotonic() - started < 2
    assert client.stats.errors == 3
    server.stop()  # again: nothing


def test_a_hung_store_or_a_missing_arena_is_unavailable(server):
    with socket.create_server(("127.0.0.1", 0)) as hung:  # listens, never answers
        client = ShmStore("shm://127.0.0.1:%d/cpkv_none" % hung.getsockname()[1],
                          timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(KVStoreUnavailable, match="timed out"):
            client.count_prefix([b"k"])
        assert time.monotonic() - started < 2
    host, port, _ = parse_shm_url(server.url)
    with pytest.raises(KVStoreUnavailable, match="does not serve arena"):
        ShmStore(f"shm://{host}:{port}/cpkv_other").get_many([b"k"])
    if SHM.is_dir():
        os.unlink(SHM / server.arena_name)  # gone behind the server's back
        with pytest.raises(KVStoreUnavailable, match="No such file"):
            ShmStore(server.url).put_many([(b"k", b"v")])


def test_bad_calls_are_refused_clearly():
    with pytest.raises(ValueError, match="shm://HOST:PORT/ARENA"):
        ShmStore("shm://127.0.0.1/arena")
    with pytest.raises(ValueError, match="shm://HOST:PORT/ARENA"):
        parse_shm_url("tcp://127.0.0.1:5/arena")
    assert parse_shm_url("shm://127.0.0.1:5/cpkv_x") == ("127.0.0.1", 5, "cpkv_x")
    client = ShmStore("shm://127.0.0.1:1/cpkv_x")  # checked before any connection
    with pytest.raises(ValueError, match="at most"):
        client.get_many([b"k" * (MAX_KEY_BYTES + 1)])
    with pytest.raises(ValueError, match="keys per call"):
        client.count_prefix([b"k"] * (MAX_KEYS_PER_CALL + 1))
    for bad in ({"capacity_bytes": 0}, {"capacity_bytes": 10, "slot_bytes": 11},
                {"capacity_bytes": 10, "ttl_s": 0}):
        with pytest.raises(ValueError, match="capacity_bytes"):
            ShmStoreServer(**bad)
    if SHM.is_dir():
        with pytest.raises(ValueError, match="does not fit in /dev/shm"):
            ShmStoreServer(1 << 60)


def _exchange(raw: socket.socket, body: bytes):
    _send(raw, body)
    return msgspec.msgpack.decode(_receive(raw))


def test_garbage_on_the_control_socket_does_not_kill_the_server(server):
    encode = msgspec.msgpack.encode
    with socket.create_connection(server.server_address) as raw:
        for body, error in ((b"\xc1garbage", "invalid"), (encode({"op": 5}), "Expected `str`"),
                            (encode({"op": "bogus"}), "unknown op"),
                            (encode({"op": "get", "keys": [b"k"] * (MAX_KEYS_PER_CALL + 1)}),
                             "keys per call"),
                            (encode({"op": "reserve", "keys": [b"k"]}), "one length per key")):
            assert error in _exchange(raw, body)["error"]
        _send(raw, encode({"op": "release", "offsets": [-5, 10**12, 100]}))  # ignored, no reply
        assert _exchange(raw, encode({"op": "hello"}))["arena"] == server.arena_name
    with socket.create_connection(server.server_address) as raw:  # over the limit: dropped
        raw.sendall(struct.pack("<I", MAX_FRAME_BYTES + 1))
        assert raw.recv(1) == b""
    with socket.create_connection(server.server_address) as raw:  # reserves, then vanishes
        assert _exchange(raw, encode({"op": "reserve", "keys": [b"x"], "lengths": [10]}))
        raw.sendall(random.Random(0).randbytes(3))
    client = ShmStore(server.url)
    client.put_many([(b"k", b"v")])
    assert client.get_many([b"k"]) == [b"v"]
    deadline = time.monotonic() + 2  # the vanished connection's slot came back
    while len(server.index._free) != server.index.num_slots - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(server.index._free) == server.index.num_slots - 1
    client.close()


def test_threads_and_clients_sharing_a_small_store_never_read_torn_blocks():
    """Two clients (one shared by two threads) put and get over 4 slots,
    evicting all the time: a get returns a key's own bytes or None."""
    with ShmStoreServer(256, ttl_s=60, slot_bytes=64) as server:
        shared, other = ShmStore(server.url, timeout_s=5), ShmStore(server.url, timeout_s=5)
        keys = [b"key%d" % i for i in range(8)]
        failures: list[str] = []

        def work(client: ShmStore, seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(150):
                picked = rng.sample(keys, 3)
                if rng.random() < 0.5:
                    version = bytes([rng.randrange(256)])
                    client.put_many([(k, (k + version) * (64 // (len(k) + 1))) for k in picked])
                else:
                    client.count_prefix(picked)
                    for k, got in zip(picked, client.get_many(picked)):
                        if got is not None and got != got[:len(k) + 1] * (64 // (len(k) + 1)):
                            failures.append(f"{k!r}: {got!r}")
                        elif got is not None and not got.startswith(k):
                            failures.append(f"{k!r}: {got!r}")

        threads = [threading.Thread(target=work, args=(c, i))
                   for i, c in enumerate((shared, shared, other))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures and server.stats.evicted > 0
        shared.close()
        other.close()


def test_kv_blocks_round_trip_through_the_store_as_the_connector_moves_them():
    from carpool.kv_transfer.connector import StoreConnector
    from carpool.scheduler import Request

    torch.manual_seed(0)
    caches = [(torch.randn(2, 6, 4, 4).to(torch.bfloat16),
               torch.randn(2, 6, 4, 4).to(torch.bfloat16)) for _ in range(2)]
    io = KVBlockIO(caches)
    hashes = [11, 22, 33]
    keys = [block_key_bytes(PRINT, h) for h in hashes]
    payloads = [encode_block(h, PRINT, io.layout, d) for h, d in zip(hashes, io.read([1, 3, 4]))]
    server = ShmStoreServer(1 << 16).start()  # slots sized by the first payload
    writer = ShmStore(server.url)
    writer.put_many(list(zip(keys, payloads)))
    writer.put_many([(block_key_bytes(PRINT, 44), payloads[0])])  # another block's bytes
    reader = ShmStore(server.url)
    got = reader.get_many(keys + [block_key_bytes(PRINT, 44)])
    datas = [decode_block(p, h, PRINT, io.layout) for h, p in zip(hashes, got)]
    with pytest.raises(KVPayloadError, match="holds block"):
        decode_block(got[3], 44, PRINT, io.layout)
    other = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    KVBlockIO(other).write([0, 2, 5], datas)
    for (k, v), (k2, v2) in zip(caches, other):
        for src, dst in ((1, 0), (3, 2), (4, 5)):
            assert torch.equal(k[:, src], k2[:, dst]) and torch.equal(v[:, src], v2[:, dst])
    connector = StoreConnector(reader, io, PRINT)
    try:
        request = Request("r", list(range(13)), 1, 0.0)
        assert connector.scheduler.loadable(request, hashes + [55]) == 3
        server.stop()
        assert connector.scheduler.loadable(request, hashes) == 0  # gone: a miss, not an error
        assert connector.stats.store_errors == 1
    finally:
        connector.close()
        writer.close()
        server.stop()


EXITING = """
from carpool.kv_transfer.shm_store import ShmStoreServer
server = ShmStoreServer(1 << 16).start()
print(server.arena_name, flush=True)
"""


def test_the_arena_is_unlinked_when_the_interpreter_exits_without_stop():
    child = _run_python(EXITING)
    assert child.returncode == 0, child.stderr
    name = child.stdout.strip()
    assert name.startswith("cpkv_") and "leaked" not in child.stderr
    assert not (SHM / name).exists()
