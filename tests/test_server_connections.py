"""Slow bodies and too many connections (issue 51), over raw sockets against
uvicorn running carpool's protocol (``carpool.server.http``) and guards
(``GuardMiddleware``) around a small echo app, with small settings: each
test takes a few seconds at most. ``test_server_abuse.py`` checks the
defaults on a live ``carpool serve``."""
from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn

from carpool.server.auth import KeyRing
from carpool.server.config import ServerConfig
from carpool.server.http import with_head_timeout
from carpool.server.middleware import BODY_RATE_GRACE_S, GuardMiddleware


async def _echo(scope, receive, send) -> None:
    """200 with the body's length."""
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    payload = json.dumps({"bytes": size}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


@contextmanager
def _serving(body_timeout: float = 5.0, body_min_rate: float = 0.0, head_timeout: float = 5.0,
             max_connections: int = 0, per_client: int = 0) -> Iterator[int]:
    """A server on a free loopback port, in a thread; yields the port."""
    app = GuardMiddleware(_echo, max_body_bytes=2**20, max_header_bytes=16384,
                          keyring=KeyRing({}), body_timeout=body_timeout,
                          body_min_rate=body_min_rate)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="error",
                            access_log=False,
                            http=with_head_timeout(head_timeout, max_connections, per_client))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _head(length: int | None = None, path: str = "/") -> bytes:
    method = "GET" if length is None else "POST"
    size = "" if length is None else f"Content-Length: {length}\r\n"
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{size}\r\n".encode()


def _reply(conn: socket.socket, seconds: float) -> tuple[bytes, bool]:
    """What the server sent, and whether it closed the connection, within ``seconds``."""
    conn.settimeout(seconds)
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:")]
            if length and len(body) >= length[0] and b"connection: close" not in head.lower():
                return data, False  # a whole kept-alive answer: no close to wait for
        return data, True
    except (TimeoutError, socket.timeout):
        return data, False


def _status(data: bytes) -> int:
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0


def _wait_until(check, seconds: float = 3.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _get(port: int, source: str = "127.0.0.1") -> int:
    with _connect(port, source) as conn:
        conn.sendall(_head())
        return _status(_reply(conn, 3.0)[0])


# -- the body deadline ---------------------------------------------------------------------


def test_a_body_that_stops_is_answered_408_and_closed_at_the_deadline():
    with _serving(body_timeout=1.5) as port, _connect(port) as conn:
        started = time.monotonic()
        conn.sendall(_head(100) + b"x" * 10)  # ...and nothing more
        data, closed = _reply(conn, 4.0)
        took = time.monotonic() - started
    assert _status(data) == 408 and closed, data
    assert b'"body_timeout"' in data
    assert 1.4 < took < 3.0, took


def test_a_body_below_the_minimum_rate_is_answered_408():
    with _serving(body_timeout=30.0, body_min_rate=200.0) as port, _connect(port) as conn:
        conn.sendall(_head(1000))
        started = time.monotonic()
        while time.monotonic() - started < 5.0:  # 10 bytes/s
            if select.select([conn], [], [], 0.1)[0]:
                break  # answered: stop writing
            conn.sendall(b"x")
        data, closed = _reply(conn, 3.0)
        took = time.monotonic() - started
    assert _status(data) == 408 and closed, data
    assert BODY_RATE_GRACE_S < took < BODY_RATE_GRACE_S + 2.0, took  # not the 30 s


def test_a_slow_body_at_the_minimum_rate_is_served():
    with _serving(body_timeout=5.0, body_min_rate=200.0) as port, _connect(port) as conn:
        conn.sendall(_head(1200))
        for _ in range(6):  # 200 bytes every 0.25 s: 800 bytes/s
            conn.sendall(b"x" * 200)
            time.sleep(0.25)
        data, _ = _reply(conn, 3.0)
    assert _status(data) == 200 and data.endswith(b'{"bytes": 1200}'), data


# -- connection caps -----------------------------------------------------------------------


def test_connections_over_the_per_client_cap_are_answered_429():
    with _serving(per_client=2) as port:
        first, second = _connect(port), _connect(port)  # open, idle
        try:
            with _connect(port) as third:
                third.sendall(_head())
                data, closed = _reply(third, 3.0)
            assert _status(data) == 429 and closed, data
            assert b"retry-after: 1" in data.lower()
            assert _get(port, "127.0.0.2") == 200  # another address has its own count
        finally:
            first.close()
        _wait_until(lambda: _get(port) == 200)  # the slot is free again
        second.close()


def test_connections_over_the_total_cap_are_answered_503_and_then_closed_at_once():
    with _serving(max_connections=2, head_timeout=5.0) as port:
        held = [_connect(port, "127.0.0.1"), _connect(port, "127.0.0.2")]
        try:
            with _connect(port, "127.0.0.3") as refused:
                refused.sendall(_head())
                data, closed = _reply(refused, 3.0)
                assert _status(data) == 503 and closed, data
            held += [_connect(port, "127.0.0.3"), _connect(port, "127.0.0.4")]  # 3 and 4 of 2
            with _connect(port, "127.0.0.5") as dropped:  # beyond twice the cap
                started = time.monotonic()
                try:
                    data, closed = _reply(dropped, 3.0)
                except ConnectionResetError:
                    data, closed = b"", True
                assert closed and data == b"" and time.monotonic() - started < 1.0
        finally:
            for conn in held:
                conn.close()
        _wait_until(lambda: _get(port) == 200)


# -- the settings --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [{"body_timeout": 0}, {"body_timeout": float("nan")},
                                 {"body_min_rate": -1}, {"max_connections": -1},
                                 {"max_connections_per_client": -1}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ServerConfig(**bad).validate()


def test_the_settings_are_flags():
    from carpool.cli import build_parser, server_config_from_args

    args = build_parser().parse_args(["serve", "--body-timeout", "7", "--body-min-rate", "0",
                                      "--max-connections", "9",
                                      "--max-connections-per-client", "3"])
    config = server_config_from_args(args)
    assert (config.body_timeout, config.body_min_rate, config.max_connections,
            config.max_connections_per_client) == (7.0, 0.0, 9, 3)
