"""``carpool kv-store``: a shared KV store server for a fleet's replicas
(``--kv-store tcp://HOST:PORT``), holding blocks in memory with a capacity
(least recently used evicted first) and a TTL."""
from __future__ import annotations

import argparse
import signal
import threading
from dataclasses import dataclass

from carpool.config import parse_size
from carpool.kv_transfer.stores import DEFAULT_TTL_S, MemoryStore
from carpool.kv_transfer.tcp_store import TcpStoreServer
from carpool.settings_fields import add_setting_args, setting


@dataclass
class KVStoreOptions:
    """Where the store listens, and what it holds."""

    host: str = setting(
        "127.0.0.1", "--host", None,
        "address to listen on (default: loopback only; another machine's replicas need a "
        "reachable one, on a trusted network: the store has no authentication)")
    port: int = setting(7600, "--port", None, "port (0: any free one)", parse=int)
    capacity: str = setting("1GiB", "--capacity", None, "bytes of blocks held, e.g. 4GiB")
    ttl: float = setting(DEFAULT_TTL_S, "--ttl", None,
                         "seconds a block stays after its last use", parse=float)


def add_kv_store_args(parser: argparse.ArgumentParser) -> None:
    add_setting_args(parser, KVStoreOptions)


def run_kv_store(args: argparse.Namespace) -> int:
    store = MemoryStore(parse_size(args.capacity), args.ttl)
    server = TcpStoreServer(store, args.host, args.port).start()
    host, port = server.address
    print(f"carpool kv-store: serving on tcp://{host}:{port} ({args.capacity}, ttl "
          f"{args.ttl:g} s); replicas: --kv-store tcp://{host}:{port}", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0
