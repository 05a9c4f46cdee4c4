"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 431: "invalid_request_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error to send to the client as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        fallback = "internal_error" if self.status >= 500 else "invalid_request_error"
        return _TYPES.get(self.status, fallback)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> str:
        """The error as the final event of a stream that has already begun."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


async def send_error(send, error: APIError) -> None:
    """``error`` as a whole response on a raw ASGI ``send`` (before any route)."""
    payload = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
