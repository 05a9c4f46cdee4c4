"""``carpool kv-store``: a shared KV store server for a fleet's replicas
(``--kv-store tcp://HOST:PORT``), holding blocks in memory with a capacity
(least recently used evicted first) and a TTL."""
from __future__ import annotations

import argparse
import signal
import threading

from carpool.config import parse_size
from carpool.kv_transfer.stores import DEFAULT_TTL_S, MemoryStore
from carpool.kv_transfer.tcp_store import TcpStoreServer


def add_kv_store_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: loopback only; another "
                             "machine's replicas need a reachable one, on a trusted network: "
                             "the store has no authentication)")
    parser.add_argument("--port", type=int, default=7600, help="port (0: any free one)")
    parser.add_argument("--capacity", default="1GiB", help="bytes of blocks held, e.g. 4GiB")
    parser.add_argument("--ttl", type=float, default=DEFAULT_TTL_S,
                        help="seconds a block stays after its last use")


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
