"""A KV store in POSIX shared memory for a fleet's processes on one machine:
the front's ``ShmStoreServer`` and each replica's ``ShmStore`` (a
``KVStore``) at ``shm://127.0.0.1:PORT/ARENA``.

The server owns an arena (``multiprocessing.shared_memory``, random name)
cut into equal slots, and the index (``SlotIndex``: LRU eviction and TTL
as ``MemoryStore``). Clients copy payloads in and out of the arena; only
keys, offsets and lengths cross the control socket (framed as ``tcp_store``:
4-byte length, msgpack structs, no pickle; frames and keys bounded).

Slots: ``slot_bytes``, else the first payload's length (a model's payloads
all have one size). Larger or empty payloads are refused: counted
(``stats.extra["refused"]``), not stored. A put ``reserve``s free slots
(evicting for room), copies, ``commit``s: only then are the keys visible.

Reads pin, rather than trust the payload check: a ``get`` pins its slots
until the client's one-way ``release`` after its copy, and a slot evicted
or replaced meanwhile is reused only once unpinned. So a reader never gets
another block's bytes (the CRC stays a second defence). A connection's
pins and reservations end with it: a replica dying mid-copy leaks no slot.
"""
from __future__ import annotations

import os
import secrets
import socket
import socketserver
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import suppress
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import msgspec

from carpool.kv_transfer.shm_index import Session, SlotIndex
from carpool.kv_transfer.stores import DEFAULT_TTL_S, KVStoreUnavailable, StoreStats
from carpool.kv_transfer.tcp_store import _receive as _receive_frame
from carpool.kv_transfer.tcp_store import _send

MAX_KEYS_PER_CALL = 1 << 16  # a million-token prompt's blocks
MAX_KEY_BYTES = 64  # block_key_bytes: 24
MAX_FRAME_BYTES = 8 << 20  # control messages only: above any valid call


class ShmCall(msgspec.Struct, frozen=True):
    op: str  # hello | reserve | commit | get | release (one-way) | count | delete
    keys: list[bytes] = []
    lengths: list[int] = []  # reserve: each payload's length
    offsets: list[int] = []  # release: what a get pinned


class ShmReply(msgspec.Struct, frozen=True):
    offsets: list[int] = []  # reserve, get: each key's offset in the arena; -1: none
    lengths: list[int] = []  # get: each payload's length
    count: int = 0  # commit: keys made visible; count: leading keys held
    arena: str = ""  # hello: the arena's name
    error: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode_call = msgspec.msgpack.Decoder(ShmCall).decode
_decode_reply = msgspec.msgpack.Decoder(ShmReply).decode


def _receive(sock: socket.socket) -> bytes | None:
    """One control frame's body (at most ``MAX_FRAME_BYTES``); None at a clean EOF."""
    return _receive_frame(sock, MAX_FRAME_BYTES)


def _check_keys(keys: Sequence[bytes]) -> None:
    if len(keys) > MAX_KEYS_PER_CALL:
        raise ValueError(f"at most {MAX_KEYS_PER_CALL} keys per call, got {len(keys)}")
    if any(len(key) > MAX_KEY_BYTES for key in keys):
        raise ValueError(f"a key is at most {MAX_KEY_BYTES} bytes")


def parse_shm_url(url: str) -> tuple[str, int, str]:
    """``shm://HOST:PORT/ARENA`` -> (host, port, arena name)."""
    address, _, arena = url.removeprefix("shm://").partition("/")
    host, _, port = address.rpartition(":")
    if not url.startswith("shm://") or not host or not port.isdigit() or not arena:
        raise ValueError(f"a shared-memory KV store is shm://HOST:PORT/ARENA, got {url!r}")
    return host.strip("[]"), int(port), arena


class _Handler(socketserver.BaseRequestHandler):
    server: ShmStoreServer

    def setup(self) -> None:
        self.session = Session()
        with self.server.lock:
            self.server.connections.add(self.request)

    def finish(self) -> None:
        self.server.index.end(self.session)
        with self.server.lock:
            self.server.connections.discard(self.request)

    def handle(self) -> None:
        index = self.server.index
        while True:
            try:
                body = _receive(self.request)
            except (ValueError, OSError):
                return  # a bad or broken client: drop its connection
            if body is None:
                return
            try:
                call = _decode_call(body)
                if call.op == "release":  # one-way: never answered
                    index.release(self.session, call.offsets)
                    continue
                reply = self._serve(index, call)
            except ValueError as error:  # msgspec's decode and schema errors too
                reply = ShmReply(error=str(error))
            try:
                _send(self.request, _encode(reply))
            except OSError:
                return

    def _serve(self, index: SlotIndex, call: ShmCall) -> ShmReply:
        _check_keys(call.keys)
        if call.op == "hello":
            return ShmReply(arena=self.server.arena_name)
        if call.op == "reserve":
            if len(call.lengths) != len(call.keys):
                raise ValueError("a reserve needs one length per key")
            return ShmReply(offsets=index.reserve(self.session, call.keys, call.lengths))
        if call.op == "commit":
            return ShmReply(count=index.commit(self.session, call.keys))
        if call.op == "get":
            offsets, lengths = index.lookup(self.session, call.keys)
            return ShmReply(offsets=offsets, lengths=lengths)
        if call.op == "count":
            return ShmReply(count=index.count(call.keys))
        if call.op == "delete":
            return ShmReply(count=index.delete(call.keys))
        raise ValueError(f"unknown op {call.op!r}")


def _release_arena(arena: SharedMemory) -> None:
    """Close and unlink the arena (``stop``, or interpreter exit)."""
    with suppress(BufferError):
        arena.close()
    try:
        arena.unlink()
    except FileNotFoundError:  # removed by hand: forget it (unlink did not)
        resource_tracker.unregister(arena._name, "shared_memory")


class ShmStoreServer(socketserver.ThreadingTCPServer):
    """The arena (``capacity_bytes``, rounded down to whole slots) and its
    index, served on ``host:port`` (port 0: any free one) to ``ShmStore``
    clients at ``url``. ``stop`` (or interpreter exit) unlinks the arena.
    ``clock``: the index's, for tests."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, capacity_bytes: int, ttl_s: float = DEFAULT_TTL_S,
                 slot_bytes: int | None = None, host: str = "127.0.0.1", port: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_bytes < 1 or ttl_s <= 0 or not 1 <= (slot_bytes or 1) <= capacity_bytes:
            raise ValueError("a KV store needs capacity_bytes >= 1, ttl_s > 0 and "
                             "1 <= slot_bytes <= capacity_bytes")
        arena_bytes = capacity_bytes - capacity_bytes % (slot_bytes or 1)
        _check_room(arena_bytes)
        super().__init__((host, port), _Handler)  # binds first: nothing to undo if it fails
        self.arena_name = "cpkv_" + secrets.token_hex(8)
        try:
            self.arena = SharedMemory(self.arena_name, create=True, size=arena_bytes)
        except OSError:
            self.server_close()
            raise
        self._finalizer = weakref.finalize(self, _release_arena, self.arena)
        self.index = SlotIndex(arena_bytes, ttl_s, slot_bytes, clock)
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return "shm://%s:%d/%s" % (*self.server_address[:2], self.arena_name)

    @property
    def stats(self) -> StoreStats:
        """The index's counters: puts, lookups, evicted, expired, refused."""
        return self.index.stats

    def start(self) -> ShmStoreServer:
        """Serve on a background thread."""
        self._thread = threading.Thread(target=self.serve_forever, args=(0.05,),
                                        name="carpool-kv-shm", daemon=True)  # stops in 50 ms
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, drop every connection (clients see the store gone
        at their next call) and unlink the arena. Idempotent."""
        if self._thread is not None:
            self.shutdown()
            self._thread = None
        self.server_close()
        with self.lock:
            for connection in self.connections:
                with suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
            self.connections.clear()
        self._finalizer()

    def __enter__(self) -> ShmStoreServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _check_room(arena_bytes: int) -> None:
    """Refuse an arena /dev/shm cannot hold: pages past its room would kill
    a writer with SIGBUS at first touch instead of failing here."""
    if os.path.isdir("/dev/shm"):
        info = os.statvfs("/dev/shm")
        if arena_bytes > info.f_bavail * info.f_frsize:
            raise ValueError(f"a shared-memory KV store of {arena_bytes} bytes does not fit in "
                             f"/dev/shm ({info.f_bavail * info.f_frsize} bytes free): lower "
                             f"its capacity or grow /dev/shm (docker: --shm-size)")


def _attach(name: str) -> SharedMemory:
    """Map the arena without adopting it: before Python 3.13, attaching
    registers it with this process's resource tracker, which would unlink
    the fleet's arena when this replica exits."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name, track=False)
    arena = SharedMemory(name)
    resource_tracker.unregister(arena._name, "shared_memory")
    return arena


class _Channel:
    """One control connection, made on first use and after a failure; its
    users hold ``lock`` for a whole exchange."""

    def __init__(self, address: tuple[str, int], arena: str, timeout_s: float) -> None:
        self.address, self.arena, self.timeout_s = address, arena, timeout_s
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()

    def call(self, call: ShmCall, answered: bool = True) -> ShmReply:
        if self.sock is None:
            self.sock = socket.create_connection(self.address, timeout=self.timeout_s)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.call(ShmCall("hello")).arena != self.arena:
                raise ConnectionError(f"the store there does not serve arena {self.arena!r}")
        _send(self.sock, _encode(call))
        if not answered:
            return ShmReply()
        body = _receive(self.sock)
        if body is None:
            raise ConnectionError("the store closed the connection")
        return _decode_reply(body)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class ShmStore:
    """A ``KVStore`` client of a ``ShmStoreServer`` at ``shm://HOST:PORT/ARENA``;
    thread safe. Puts and gets (with their copies) go one at a time on one
    connection, lookups on another: the engine thread's ``count_prefix``
    never waits behind a copy. ``timeout_s`` bounds each socket wait; a
    store gone, timing out or without its arena raises
    ``KVStoreUnavailable``, and the next call connects again."""

    def __init__(self, url: str, timeout_s: float = 0.5) -> None:
        host, port, self.arena_name = parse_shm_url(url)
        self.stats = StoreStats(extra={"refused": 0})
        self._data = _Channel((host, port), self.arena_name, timeout_s)
        self._lookup = _Channel((host, port), self.arena_name, timeout_s)
        self._arena: SharedMemory | None = None  # with the data channel, under its lock

    def _call(self, channel: _Channel, call: ShmCall, answered: bool = True) -> ShmReply:
        try:
            reply = channel.call(call, answered)
            if channel is self._data and self._arena is None:
                self._arena = _attach(self.arena_name)
            wanted = len(call.keys) if call.op in ("reserve", "get") else 0
            if (len(reply.offsets), len(reply.lengths)) != (wanted, wanted * (call.op == "get")):
                raise ValueError("a reply of the wrong length")
        except (OSError, ValueError) as error:  # timeouts, a missing arena, garbage replies
            self._drop(channel)
            self.stats.errors += 1
            raise KVStoreUnavailable(f"kv store {channel.address}: {error}") from error
        if reply.error:
            raise ValueError(f"kv store refused the call: {reply.error}")
        return reply

    def _drop(self, channel: _Channel) -> None:
        channel.close()
        if channel is self._data and self._arena is not None:
            self._arena.close()
            self._arena = None

    def _span(self, offset: int, length: int) -> memoryview:
        """The arena's bytes [offset, offset + length), checked."""
        if offset < 0 or offset + length > self._arena.size:
            self._drop(self._data)
            self.stats.errors += 1
            raise KVStoreUnavailable(f"kv store: [{offset}, +{length}) is outside the arena")
        return self._arena.buf[offset:offset + length]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        keys = [key for key, _ in items]
        _check_keys(keys)
        if not items:
            return
        with self._data.lock:
            offsets = self._call(self._data, ShmCall(
                "reserve", keys, [len(payload) for _, payload in items])).offsets
            placed = [(key, payload, offset)
                      for (key, payload), offset in zip(items, offsets) if offset >= 0]
            for _, payload, offset in placed:
                with self._span(offset, len(payload)) as view:
                    view[:] = payload
            if placed:  # on a failure before, the server frees them with the connection
                self._call(self._data, ShmCall("commit", [key for key, _, _ in placed]))
        self.stats.put([(key, payload) for key, payload, _ in placed])
        self.stats.extra["refused"] += len(items) - len(placed)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        keys = list(keys)
        _check_keys(keys)
        if not keys:
            return []
        found: list[bytes | None] = []
        with self._data.lock:
            reply = self._call(self._data, ShmCall("get", keys))
            for offset, length in zip(reply.offsets, reply.lengths):
                if offset < 0:
                    found.append(None)
                    continue
                with self._span(offset, length) as view:
                    found.append(bytes(view))
            pinned = [offset for offset in reply.offsets if offset >= 0]
            if pinned:
                with suppress(KVStoreUnavailable):  # the copies are done; if the connection
                    # broke, the pins ended with it
                    self._call(self._data, ShmCall("release", offsets=pinned), answered=False)
        self.stats.got(found)
        return found

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        keys = list(keys)
        _check_keys(keys)
        if not keys:
            return 0
        with self._lookup.lock:
            count = self._call(self._lookup, ShmCall("count", keys)).count
        self.stats.looked_up(len(keys), count)
        return count

    def delete_many(self, keys: Sequence[bytes]) -> None:
        keys = list(keys)
        _check_keys(keys)
        if keys:
            with self._lookup.lock:
                self._call(self._lookup, ShmCall("delete", keys))
            self.stats.deleted += len(keys)

    def close(self) -> None:
        for channel in (self._data, self._lookup):
            with channel.lock:
                self._drop(channel)
