"""A KV store over TCP, between machines: a server holding a ``MemoryStore``
and the client every replica uses (``KVStore``).

Framing: each message is a 4-byte little-endian length, then a msgpack
body with an explicit schema (``msgspec`` structs below; no pickle). A
request is one call (``op``: put | get | count | delete) with its keys and, for a
put, payloads; the reply carries the payloads (get) or the count. Frames
above ``MAX_FRAME_BYTES`` are refused, so a client cannot make the server
allocate without bound. The client keeps one connection, reconnects on
the next call after a failure, and raises ``KVStoreUnavailable`` when the
server does not answer within its timeout.
"""
from __future__ import annotations

import socket
import socketserver
import struct
import threading
from collections.abc import Sequence

import msgspec

from carpool.kv_transfer.stores import KVStoreUnavailable, MemoryStore, StoreStats

MAX_FRAME_BYTES = 256 << 20  # 256 MiB: hundreds of blocks per call
_LENGTH = struct.Struct("<I")


class StoreCall(msgspec.Struct, frozen=True):
    op: str  # put | get | count | delete
    keys: list[bytes]
    payloads: list[bytes] = []


class StoreReply(msgspec.Struct, frozen=True):
    payloads: list[bytes | None] = []
    count: int = 0
    error: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode_call = msgspec.msgpack.Decoder(StoreCall).decode
_decode_reply = msgspec.msgpack.Decoder(StoreReply).decode


def _send(sock: socket.socket, body: bytes) -> None:
    """One frame: the length and the body gathered by one call (no copy of
    the body, which may be hundreds of MB)."""
    view = memoryview(body)
    sent = sock.sendmsg([_LENGTH.pack(len(body)), view])
    if sent < _LENGTH.size + len(body):  # a partial send: the rest in order
        done = sent - _LENGTH.size
        if done < 0:
            sock.sendall(_LENGTH.pack(len(body))[sent:])
            done = 0
        sock.sendall(view[done:])


def _receive(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> bytes | None:
    """One frame's body (at most ``limit`` bytes); None when the peer closed
    before a frame began."""
    head = _read_exact(sock, _LENGTH.size, allow_eof=True)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    if length > limit:
        raise ValueError(f"a frame of {length} bytes is over the limit of {limit}")
    return _read_exact(sock, length)


def _read_exact(sock: socket.socket, size: int, allow_eof: bool = False) -> bytes | None:
    """``size`` bytes into one buffer, received in place."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = sock.recv_into(view[got:], min(size - got, 1 << 22))
        if not count:
            if allow_eof and got == 0:
                return None
            raise ConnectionError("the peer closed mid-frame")
        got += count
    return buffer


class _Handler(socketserver.BaseRequestHandler):
    def setup(self) -> None:
        with self.server.lock:  # type: ignore[attr-defined]
            self.server.connections.add(self.request)  # type: ignore[attr-defined]

    def finish(self) -> None:
        with self.server.lock:  # type: ignore[attr-defined]
            self.server.connections.discard(self.request)  # type: ignore[attr-defined]

    def handle(self) -> None:
        store: MemoryStore = self.server.store  # type: ignore[attr-defined]
        while True:
            try:
                body = _receive(self.request)
            except (ValueError, ConnectionError, OSError):
                return  # a bad or broken client: drop its connection
            if body is None:
                return
            try:
                call = _decode_call(body)
                reply = _serve(store, call)
            except (msgspec.DecodeError, ValueError) as error:
                reply = StoreReply(error=str(error))
            _send(self.request, _encode(reply))


def _serve(store: MemoryStore, call: StoreCall) -> StoreReply:
    if call.op == "put":
        if len(call.payloads) != len(call.keys):
            raise ValueError("a put needs one payload per key")
        store.put_many(list(zip(call.keys, call.payloads)))
        return StoreReply()
    if call.op == "get":
        return StoreReply(payloads=store.get_many(call.keys))
    if call.op == "count":
        return StoreReply(count=store.count_prefix(call.keys))
    if call.op == "delete":
        store.delete_many(call.keys)
        return StoreReply()
    raise ValueError(f"unknown op {call.op!r}")


class TcpStoreServer(socketserver.ThreadingTCPServer):
    """Serves ``store`` on ``host:port`` (port 0: any free one; see
    ``address``), a thread per connection, until ``shutdown``."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, store: MemoryStore, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__((host, port), _Handler)
        self.store = store
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.server_address[0], self.server_address[1]

    def start(self) -> TcpStoreServer:
        """Serve on a background thread."""
        self._thread = threading.Thread(target=self.serve_forever, name="carpool-kv-store",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and drop every open connection (clients see the
        store gone at their next call)."""
        self.shutdown()
        self.server_close()
        with self.lock:
            for connection in self.connections:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.connections.clear()


class TcpStore:
    """A ``KVStore`` client of a ``TcpStoreServer``; thread safe (one call
    at a time on its connection)."""

    def __init__(self, host: str, port: int, timeout_s: float = 2.0) -> None:
        self.address, self.timeout_s = (host, port), timeout_s
        self.stats = StoreStats()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _call(self, call: StoreCall) -> StoreReply:
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.create_connection(self.address, timeout=self.timeout_s)
                    self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _send(self._sock, _encode(call))
                body = _receive(self._sock)
                if body is None:
                    raise ConnectionError("the store closed the connection")
            except (OSError, ValueError) as error:
                self._drop()
                self.stats.errors += 1
                raise KVStoreUnavailable(f"kv store {self.address}: {error}") from error
        reply = _decode_reply(body)
        if reply.error:
            raise ValueError(f"kv store refused the call: {reply.error}")
        return reply

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if items:
            self._call(StoreCall("put", [k for k, _ in items], [bytes(p) for _, p in items]))
            self.stats.put(items)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        found = self._call(StoreCall("get", list(keys))).payloads
        self.stats.got(found)
        return found

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        count = self._call(StoreCall("count", list(keys))).count
        self.stats.looked_up(len(keys), count)
        return count

    def delete_many(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call(StoreCall("delete", list(keys)))
            self.stats.deleted += len(keys)

    def close(self) -> None:
        with self._lock:
            self._drop()
