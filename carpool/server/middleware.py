"""Pure-ASGI guards that run before any route: sizes, Host, API key, body
deadline and the number of JSON values in a body.

They work on the raw ASGI scope, before routing or body parsing, so no
oversized, unauthenticated or DNS-rebound request reaches application
code. The authenticated ``Principal`` goes to the app in
``scope["state"]["principal"]`` (``request.state.principal``).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import anyio
import anyio.to_thread
import numpy as np

from carpool.server.auth import ANONYMOUS, KeyRing
from carpool.server.config import ServerConfig
from carpool.server.errors import APIError, send_error

Scope = dict
Receive = Callable
Send = Callable

_OPEN_PATH = "/health"  # the only route reachable without the API key
# Headers a request may carry once: with two Authorization headers, which
# one a proxy checked and which one the server reads could differ.
_SINGLE_HEADERS = (b"authorization", b"host")
# A body gets this long before its minimum rate applies (the round trip of
# an ``Expect: 100-continue``, a client's first write).
BODY_RATE_GRACE_S = 1.0
# A body may cost one unit per this many bytes of ``max_body_bytes``
# (349,525 in 2 MiB); see ``json_cost``. The largest valid request, 32
# prompts of 8,192 token ids, costs 262,286.
BODY_BYTES_PER_UNIT = 6
_COST_CHUNK = 1 << 18  # bytes json_cost looks at in one numpy pass


class GuardMiddleware:
    """Header size, duplicate headers, Host, API key, then the body: its
    size (buffered up to the cap), its deadline and what parsing it costs.

    ``allowed_hosts`` (names without port; None = any) guards a keyless
    server on loopback against DNS rebinding: a web page whose name was
    re-pointed at 127.0.0.1 still sends its own name as Host.

    The body is read here in full (it is bounded by ``max_body_bytes``)
    within ``body_timeout`` seconds of the head and at ``body_min_rate``
    bytes/s on average after ``BODY_RATE_GRACE_S`` (0: no minimum); else the
    answer is 408 and the connection is closed. It is then replayed to the
    app; later ``receive`` calls go to the server, so the app still sees the
    client's disconnect.
    """

    def __init__(self, app, max_body_bytes: int, max_header_bytes: int, keyring: KeyRing,
                 allowed_hosts: frozenset[str] | None = None,
                 body_timeout: float = ServerConfig.body_timeout,
                 body_min_rate: float = ServerConfig.body_min_rate) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.keyring = keyring
        self.allowed_hosts = allowed_hosts
        self.body_timeout = body_timeout
        self.body_min_rate = body_min_rate
        self.max_body_cost = max_body_bytes // BODY_BYTES_PER_UNIT
        self._costing: anyio.CapacityLimiter | None = None  # made on the loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check_headers(scope)
        if error is not None:
            await send_error(send, error)
            return
        principal = self._authenticate(scope)
        if principal is None:
            await send_error(send, APIError(
                401, "invalid or missing API key (Authorization: Bearer ...)",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            return
        scope.setdefault("state", {})["principal"] = principal
        body, error = await self._read_body(receive)
        if error is None and body and not _is_utf8(body):
            error = APIError(400, "the request body is not valid UTF-8", code="invalid_body")
        if error is None and body:
            error = await self._check_cost(body)
        if error is not None:
            await send_error(send, error)
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_headers(self, scope: Scope) -> APIError | None:
        headers = scope.get("headers", [])
        if sum(len(k) + len(v) for k, v in headers) > self.max_header_bytes:
            return APIError(431, f"request headers exceed {self.max_header_bytes} bytes",
                            code="headers_too_large")
        names = [name for name, _ in headers if name in _SINGLE_HEADERS]
        for single in _SINGLE_HEADERS:
            if names.count(single) > 1:
                return APIError(400, f"the request has more than one "
                                     f"{single.decode().capitalize()} header",
                                code="duplicate_header", param=single.decode())
        for name, value in headers:
            if name == b"host" and not self._host_allowed(value):
                return APIError(400, "the Host header names no address of this server",
                                code="invalid_host")
            if name == b"content-length":
                if not value.isdigit():
                    return APIError(400, "invalid Content-Length", code="invalid_request")
                if len(value) > 18 or int(value) > self.max_body_bytes:
                    return _too_large(self.max_body_bytes)
        return None

    def _host_allowed(self, value: bytes) -> bool:
        if self.allowed_hosts is None:
            return True
        host = value.decode("latin-1").strip().lower()
        if host.startswith("["):  # [v6]:port
            host = host[:host.find("]") + 1]
        elif host.count(":") == 1:
            host = host.split(":")[0]
        return host in self.allowed_hosts

    def _authenticate(self, scope: Scope):
        """The caller's principal; None when a key is required and missing or wrong."""
        if not self.keyring.enabled:
            return ANONYMOUS
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value  # the only one: _check_headers refused two
        principal = self.keyring.authenticate(given)
        if principal is None and _is_open(scope):
            return ANONYMOUS
        return principal

    async def _read_body(self, receive: Receive) -> tuple[bytes, APIError | None]:
        clock = asyncio.get_running_loop().time
        started = clock()
        chunks, size = [], 0
        while True:
            left = self._body_time_left(size, clock() - started)
            if left <= 0:
                return b"", self._too_slow(size, clock() - started)
            try:
                message = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                continue  # the next turn answers 408
            if message["type"] == "http.disconnect":
                return b"", None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", _too_large(self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    def _body_time_left(self, size: int, elapsed: float) -> float:
        left = self.body_timeout - elapsed
        if self.body_min_rate > 0:
            left = min(left, BODY_RATE_GRACE_S + size / self.body_min_rate - elapsed)
        return left

    def _too_slow(self, size: int, elapsed: float) -> APIError:
        rate = f", at least {self.body_min_rate:g} bytes/s" if self.body_min_rate > 0 else ""
        return APIError(408, f"the request body did not arrive in time ({size} bytes in "
                             f"{elapsed:.1f} s; at most {self.body_timeout:g} s{rate})",
                        code="body_timeout", headers={"Connection": "close"})

    async def _check_cost(self, body: bytes) -> APIError | None:
        """413 when parsing ``body`` would build more than ``max_body_cost``
        units of objects (``json_cost``). The exact count (~10 ms for 2 MiB)
        runs only when a quick upper bound is over, on a thread, one body at
        a time."""
        if _units(body) <= self.max_body_cost:
            return None
        if self._costing is None:
            self._costing = anyio.CapacityLimiter(1)
        cost = await anyio.to_thread.run_sync(json_cost, body, limiter=self._costing)
        if cost <= self.max_body_cost:
            return None
        return APIError(413, f"the request body holds too many JSON values (cost {cost}; at "
                             f"most {self.max_body_cost}, one per {BODY_BYTES_PER_UNIT} bytes "
                             f"of the {self.max_body_bytes}-byte limit)",
                        code="body_too_complex")


def json_cost(body: bytes) -> int:
    """What parsing the JSON ``body`` builds, in units of about one small
    number each (~36 bytes of Python objects at most): a value after a comma
    1, a string 2 (its quotes), a list or object 4 (an empty one is the
    costliest value per byte: 690k of them in 2 MiB took 59 MiB), a ``.``,
    ``e`` or ``E`` 1 more (a float takes twice an int's memory), a ``:`` 1
    (an object's entry). What is inside strings costs nothing.

    Escapes are blanked first (``\\\\`` then ``\\"``, left to right as JSON
    reads them), so every quote left opens or closes a string; a quote
    count's parity then tells which bytes are inside one, by numpy in chunks
    (a few MB, ~10 ms for 2 MiB; a regex would build an object per string)."""
    if b"\\" in body:
        body = body.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    data = np.frombuffer(body, dtype=np.uint8)
    cost, inside = body.count(b'"'), 0
    for start in range(0, len(data), _COST_CHUNK):
        chunk = data[start:start + _COST_CHUNK]
        parity = (np.cumsum(chunk == ord('"'), dtype=np.int32) + inside) & 1
        outside = parity == 0
        cost += int(np.count_nonzero((chunk == ord(",")) & outside))
        cost += 4 * int(np.count_nonzero(((chunk == ord("[")) | (chunk == ord("{"))) & outside))
        ones = ((chunk == ord(".")) | (chunk == ord("e")) | (chunk == ord("E"))
                | (chunk == ord(":")))
        cost += int(np.count_nonzero(ones & outside))
        inside = int(parity[-1])
    return cost


def _units(body: bytes) -> int:
    """``json_cost`` counting inside strings too: an upper bound (~1 ms for 2 MiB)."""
    return (body.count(b",") + body.count(b'"') + 4 * (body.count(b"[") + body.count(b"{"))
            + body.count(b".") + body.count(b"e") + body.count(b"E") + body.count(b":"))


def _is_open(scope: Scope) -> bool:
    # Both the decoded and the raw path must be exactly /health: no prefix,
    # suffix, encoding or dot-segment trick reaches another route unguarded.
    raw = scope.get("raw_path")
    return scope.get("path") == _OPEN_PATH and (raw is None or raw == _OPEN_PATH.encode())


def _is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code="body_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
