"""Pure-ASGI guards that run before any route: sizes, Host, API key.

They work on the raw ASGI scope, before routing or body parsing, so no
oversized, unauthenticated or DNS-rebound request reaches application
code. The authenticated ``Principal`` goes to the app in
``scope["state"]["principal"]`` (``request.state.principal``).
"""
from __future__ import annotations

import json
from collections.abc import Callable

from carpool.server.auth import ANONYMOUS, KeyRing
from carpool.server.errors import APIError

Scope = dict
Receive = Callable
Send = Callable

_OPEN_PATH = "/health"  # the only route reachable without the API key


class GuardMiddleware:
    """Header size, Host, API key, then body size (buffered up to the cap).

    ``allowed_hosts`` (names without port; None = any) guards a keyless
    server on loopback against DNS rebinding: a web page whose name was
    re-pointed at 127.0.0.1 still sends its own name as Host.

    The body is read here in full (it is bounded by ``max_body_bytes``) and
    replayed to the app; later ``receive`` calls go to the server, so the
    app still sees the client's disconnect.
    """

    def __init__(self, app, max_body_bytes: int, max_header_bytes: int, keyring: KeyRing,
                 allowed_hosts: frozenset[str] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.keyring = keyring
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check_headers(scope)
        if error is not None:
            await _send_error(send, error)
            return
        principal = self._authenticate(scope)
        if principal is None:
            await _send_error(send, APIError(
                401, "invalid or missing API key (Authorization: Bearer ...)",
                code="invalid_api_key"))
            return
        scope.setdefault("state", {})["principal"] = principal
        body, error = await self._read_body(receive)
        if error is None and body and not _is_utf8(body):
            error = APIError(400, "the request body is not valid UTF-8", code="invalid_body")
        if error is not None:
            await _send_error(send, error)
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_headers(self, scope: Scope) -> APIError | None:
        headers = scope.get("headers", [])
        if sum(len(k) + len(v) for k, v in headers) > self.max_header_bytes:
            return APIError(431, f"request headers exceed {self.max_header_bytes} bytes",
                            code="headers_too_large")
        for name, value in headers:
            if name == b"host" and not self._host_allowed(value):
                return APIError(400, "the Host header names no address of this server",
                                code="invalid_host")
            if name == b"content-length":
                if not value.isdigit():
                    return APIError(400, "invalid Content-Length", code="invalid_request")
                if int(value) > self.max_body_bytes:
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
                given = value
        principal = self.keyring.authenticate(given)
        if principal is None and _is_open(scope):
            return ANONYMOUS
        return principal

    async def _read_body(self, receive: Receive) -> tuple[bytes, APIError | None]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", _too_large(self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


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


async def _send_error(send: Send, error: APIError) -> None:
    payload = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
