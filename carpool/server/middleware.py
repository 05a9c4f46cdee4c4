"""Pure-ASGI guards that run before any route: sizes, API key, draining.

They work on the raw ASGI scope, before routing or body parsing, so no
oversized or unauthenticated request reaches application code.
"""
from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from carpool.server.errors import APIError

Scope = dict
Receive = Callable
Send = Callable

_OPEN_PATH = "/health"  # the only route reachable without the API key


class GuardMiddleware:
    """Header size, body size (buffered up to the cap), then the API key.

    The body is read here in full (it is bounded by ``max_body_bytes``) and
    replayed to the app; later ``receive`` calls go to the server, so the
    app still sees the client's disconnect.
    """

    def __init__(self, app, max_body_bytes: int, max_header_bytes: int,
                 api_key: str | None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self._key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check_headers(scope)
        if error is not None:
            await _send_error(send, error)
            return
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
        if self._key is not None and not _is_open(scope):
            given = b""
            for name, value in headers:
                if name == b"authorization":
                    given = value
            if not hmac.compare_digest(given, self._key):
                return APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                code="invalid_api_key")
        for name, value in headers:
            if name == b"content-length":
                if not value.isdigit():
                    return APIError(400, "invalid Content-Length", code="invalid_request")
                if int(value) > self.max_body_bytes:
                    return _too_large(self.max_body_bytes)
        return None

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
