"""uvicorn's h11 protocol with a deadline on every request head.

uvicorn closes idle keep-alive connections, but a client that sends its
request head a byte at a time (slowloris) holds a connection open for as
long as it likes: each byte cancels the keep-alive timer. Here each
connection must deliver a complete head within ``head_timeout`` seconds of
opening, or of its previous response completing; otherwise it is closed.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


def with_head_timeout(head_timeout: float) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``."""

    class HeadTimeoutH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

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

    return HeadTimeoutH11
