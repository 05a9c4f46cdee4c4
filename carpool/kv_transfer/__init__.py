"""Moving KV blocks out of a replica and back: the payload format, stores,
the worker side's block I/O and the live connector (issue: P/D and a
shared KV store). ``open_store`` makes a store from its URL."""
from __future__ import annotations

from carpool.kv_transfer.stores import DEFAULT_TTL_S, KVStore, MemoryStore, RedisStore


def open_store(url: str, ttl_s: float = DEFAULT_TTL_S, capacity_bytes: int = 1 << 30) -> KVStore:
    """``memory``, ``local`` or ``shm`` (in this process), ``tcp://HOST:PORT`` (a
    ``TcpStoreServer``, e.g. ``carpool kv-store``), ``shm://HOST:PORT/ARENA`` (a
    ``ShmStoreServer``: the processes of one machine) or ``redis://HOST:PORT[/DB]``."""
    if url in ("memory", "local", "shm"):  # local, shm: a fleet's front serves it (one
        return MemoryStore(capacity_bytes, ttl_s)  # replica: here)
    if url.startswith("shm://"):
        from carpool.kv_transfer.shm_store import ShmStore

        return ShmStore(url)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url, ttl_s)
    if url.startswith("tcp://"):
        from carpool.kv_transfer.tcp_store import TcpStore

        host, _, port = url.removeprefix("tcp://").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a TCP KV store is tcp://HOST:PORT, got {url!r}")
        return TcpStore(host.strip("[]"), int(port))
    raise ValueError(f"kv_store must be memory, tcp://HOST:PORT, shm://HOST:PORT/ARENA or "
                     f"redis://HOST:PORT[/DB], got {url!r}")
