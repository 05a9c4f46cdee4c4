"""uvicorn's h11 protocol with a deadline on every request head and a cap
on open connections.

uvicorn closes idle keep-alive connections, but a client that sends its
request head a byte at a time (slowloris) holds a connection open for as
long as it likes: each byte cancels the keep-alive timer. Here each
connection must deliver a complete head within ``head_timeout`` seconds of
opening, or of its previous response completing; otherwise it is closed.
(The body's deadline is ``GuardMiddleware``'s.)

Connections are counted in all and by client address. One over
``max_connections`` is answered 503, one over ``max_connections_per_client``
429 (each with ``Connection: close``, as soon as its head arrives, within
the head deadline); beyond twice ``max_connections`` a new connection is
closed at once, unanswered, so refused connections cannot pile up either.
"""
from __future__ import annotations

import asyncio
from collections import Counter

from uvicorn.protocols.http.h11_impl import H11Protocol

from carpool.server.config import ServerConfig
from carpool.server.errors import APIError, send_error


def with_head_timeout(head_timeout: float,
                      max_connections: int = ServerConfig.max_connections,
                      max_connections_per_client: int = ServerConfig.max_connections_per_client,
                      ) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, one per server
    (it counts that server's connections); a cap of 0 is no cap."""
    by_client: Counter[str] = Counter()

    class GuardedH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _counted: str | None = None  # the client address this connection counts for

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._admit()
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            if self._counted is not None:
                by_client[self._counted] -= 1
                if by_client[self._counted] <= 0:
                    del by_client[self._counted]
                self._counted = None
            super().connection_lost(exc)

        def _admit(self) -> None:
            """Count this connection; refuse it when over a cap."""
            self._counted = self.client[0] if self.client else ""
            by_client[self._counted] += 1
            total = len(self.connections)  # uvicorn's, this one included
            if max_connections and total > 2 * max_connections:
                self.transport.abort()
            elif max_connections and total > max_connections:
                self.app = _refusal(503, f"the server has {max_connections} connections open",
                                    "too_many_connections")
            elif max_connections_per_client and by_client[self._counted] > \
                    max_connections_per_client:
                self.app = _refusal(429, f"this client has {max_connections_per_client} "
                                         f"connections open", "too_many_client_connections")

        def _should_upgrade(self) -> bool:
            # No WebSocket routes: an upgrade would move the connection to
            # another protocol object, out of this one's count.
            return False

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._cancel_head_timer()  # a head arrived: the request is the app's now

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (
                    self.cycle is None or self.cycle.response_complete):
                self._arm_head_timer()  # waiting for the next head on this connection

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(head_timeout, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return GuardedH11


def _refusal(status: int, message: str, code: str):
    """An ASGI app answering every request ``status`` and closing the connection."""
    error = APIError(status, f"{message}; retry later", code=code,
                     headers={"Retry-After": "1", "Connection": "close"})

    async def refuse(scope, receive, send) -> None:
        if scope["type"] == "http":
            await send_error(send, error)

    return refuse
