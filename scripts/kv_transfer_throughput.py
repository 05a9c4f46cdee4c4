"""KV block transfer throughput per store backend, against a raw copy of the
same bytes (memcpy, and a loopback socket) as the ceiling.

    python scripts/kv_transfer_throughput.py [--blocks 64] [--repeats 5] [--redis URL]

Blocks have the default model's layout (30 layers, 3 KV heads, head_dim
64, 16 tokens, bf16: 360 KiB each). For each backend one round trip is:
read the blocks out of a KV cache (``KVBlockIO.read``), encode them
(``encode_block``: header + CRC-32), ``put_many``, ``get_many``,
``decode_block`` (checks) and ``KVBlockIO.write`` into another cache: the
connector's whole path. MB/s counts the blocks' data bytes once per
direction (put and get each move them). ``--redis`` adds a Redis server
you started (e.g. ``redis-server --port 6390 --save ''``), ``--ray`` Ray's
object store (``carpool/ray_serve/kv_store.py``). Run it alone.
"""
from __future__ import annotations

import argparse
import socket
import threading
import time

import torch

from carpool.kv_transfer.blocks import KVBlockIO
from carpool.kv_transfer.payload import block_key_bytes, decode_block, encode_block
from carpool.kv_transfer.shm_store import ShmStore, ShmStoreServer
from carpool.kv_transfer.stores import MemoryStore, RedisStore
from carpool.kv_transfer.tcp_store import TcpStore, TcpStoreServer

PRINT = bytes(16)


def _caches(blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(3, blocks + 1, 64, 16).bfloat16(),
             torch.randn(3, blocks + 1, 16, 64).bfloat16()) for _ in range(30)]


def round_trip(store, src: KVBlockIO, dst: KVBlockIO, blocks: int) -> tuple[float, float]:
    """(seconds to save, seconds to load) ``blocks`` blocks through ``store``."""
    ids = list(range(blocks))
    hashes = [1000 + i for i in ids]
    keys = [block_key_bytes(PRINT, h) for h in hashes]
    started = time.perf_counter()
    datas = src.read(ids)
    store.put_many([(k, encode_block(h, PRINT, src.layout, d))
                    for k, h, d in zip(keys, hashes, datas)])
    saved = time.perf_counter()
    payloads = store.get_many(keys)
    dst.write(ids, [decode_block(p, h, PRINT, dst.layout) for p, h in zip(payloads, hashes)])
    return saved - started, time.perf_counter() - saved


def memcpy_seconds(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    started = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - started


def socket_seconds(nbytes: int) -> float:
    """Send ``nbytes`` over a loopback TCP socket and receive them."""
    server = socket.create_server(("127.0.0.1", 0))
    payload = bytes(nbytes)

    def sink() -> None:
        conn, _ = server.accept()
        left = nbytes
        while left:
            left -= len(conn.recv(1 << 20))
        conn.sendall(b"k")
        conn.close()

    thread = threading.Thread(target=sink)
    thread.start()
    client = socket.create_connection(server.getsockname())
    started = time.perf_counter()
    client.sendall(payload)
    client.recv(1)
    seconds = time.perf_counter() - started
    thread.join()
    client.close()
    server.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--redis", default=None, help="redis://HOST:PORT/DB of a running server")
    parser.add_argument("--ray", action="store_true",
                        help="add Ray's object store (a local Ray on 127.0.0.1; needs '.[ray]')")
    args = parser.parse_args()
    src, dst = KVBlockIO(_caches(args.blocks)), KVBlockIO(_caches(args.blocks))
    nbytes = args.blocks * src.layout.data_bytes
    tcp_server = TcpStoreServer(MemoryStore(4 * nbytes)).start()
    shm_server = ShmStoreServer(4 * nbytes + (1 << 20)).start()
    backends = {"memory": MemoryStore(4 * nbytes),
                "tcp (loopback)": TcpStore(*tcp_server.address),
                "shared memory (`--kv-store shm`)": ShmStore(shm_server.url)}
    if args.redis:
        backends["redis (loopback)"] = RedisStore(args.redis)
    if args.ray:  # this process is both replicas: put and get from one Ray worker
        import ray

        from carpool.ray_serve.kv_store import RayObjectStore

        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False)
        backends["Ray object store (P/D on Ray)"] = RayObjectStore("KVIndex:bench", 4 * nbytes)
    mb = nbytes / 1e6
    print(f"{args.blocks} blocks of {src.layout.data_bytes} bytes ({mb:.1f} MB), best of "
          f"{args.repeats}")
    print("| path | save MB/s | load MB/s |\n|---|---:|---:|")
    for name, store in backends.items():
        times = [round_trip(store, src, dst, args.blocks) for _ in range(args.repeats)]
        print(f"| {name} | {mb / min(t[0] for t in times):.0f} | "
              f"{mb / min(t[1] for t in times):.0f} |")
    copy = min(memcpy_seconds(nbytes) for _ in range(args.repeats))
    sock = min(socket_seconds(nbytes) for _ in range(args.repeats))
    print(f"| ceiling: memcpy | {mb / copy:.0f} | {mb / copy:.0f} |")
    print(f"| ceiling: loopback socket | {mb / sock:.0f} | {mb / sock:.0f} |")
    tcp_server.stop()
    shm_server.stop()
    if args.ray:
        import ray

        ray.shutdown()


if __name__ == "__main__":
    main()
