"""The Redis KV store against a real ``redis-server`` on 127.0.0.1 (Debian's
package; ``.ci/run`` installs it), started and stopped here: blocks shared
by two replicas, the TTL renewed on use, and the server going away mid-run
costing only recomputation."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
from test_kv_transfer import HASH_KEY, _engine_with, _generate

from carpool import LLM
from carpool.kv_transfer import open_store
from carpool.kv_transfer.stores import KVStoreUnavailable, RedisStore

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (Debian package "
                                       "redis-server; .ci/run installs it)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A throwaway redis-server: loopback only, no persistence, 64 MiB with LRU."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru",
             "--protected-mode", "yes"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


def test_redis_store_puts_gets_counts_and_renews_the_ttl(redis_server):
    store = RedisStore(redis_server.url, ttl_s=30)
    store.put_many([(b"a", b"one"), (b"b", b"two")])
    assert store.get_many([b"a", b"x", b"b"]) == [b"one", None, b"two"]
    assert store.count_prefix([b"a", b"b", b"c"]) == 2
    store.put_many([(b"c", b"three")])
    store.delete_many([b"c", b"absent"])
    assert store.get_many([b"c"]) == [None] and store.stats.deleted == 2
    raw = store._client
    raw.pexpire(store.prefix + b"a", 1000)
    store.get_many([b"a"])  # a read renews the full TTL
    assert raw.pttl(store.prefix + b"a") > 20_000
    store.close()
    redis_server.stop()
    gone = RedisStore(redis_server.url, timeout_s=0.2)
    with pytest.raises(KVStoreUnavailable):
        gone.count_prefix([b"a"])


def test_replicas_share_blocks_through_redis_and_survive_it_going_away(tiny_model_dir,
                                                                      redis_server):
    tiny = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="16MiB",
               block_hash_key=HASH_KEY)
    prompt = [(i * 41) % 380 + 11 for i in range(70)]
    expected = _generate(tiny.engine, prompt)
    first = _engine_with(tiny, open_store(redis_server.url))
    assert _generate(first, prompt).token_ids == expected.token_ids
    first.kv_connector.close()  # waits for the write-through
    second = _engine_with(tiny, open_store(redis_server.url))
    out = _generate(second, prompt)
    assert out.token_ids == expected.token_ids and out.num_cached_tokens == 64
    redis_server.stop()  # the store goes away mid-run
    third = _engine_with(tiny, open_store(redis_server.url))
    started = time.monotonic()
    out = _generate(third, prompt)
    assert out.token_ids == expected.token_ids and out.num_cached_tokens == 0
    assert third.kv_connector.stats.store_errors >= 1
    assert time.monotonic() - started < 10  # a lookup's timeout, not a hang
