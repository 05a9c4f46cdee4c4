"""What both engine fronts hand to callers: a request's output stream.

``AsyncEngine`` (the engine on a thread of this process) and
``EngineClient`` (the engine in a worker process) queue a request the same
way and return the same ``RequestStream``; the HTTP server cannot tell
them apart.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from carpool.engine.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can make progress any more."""


class DeliveryLag:
    """How long first tokens wait, once the engine made them, until the event
    loop takes them (the GIL, the loop's other work, the transport from a
    worker process): part of the TTFT a client sees that the engine's own
    TTFT misses, so admission adds it (``AdmissionControl.delivery_lag``).
    ``seconds`` is the 90th percentile of the last ``window`` first tokens;
    written by the loop thread, read as one float by the engine."""

    def __init__(self, window: int = 64) -> None:
        self._lags: deque[float] = deque(maxlen=window)
        self.seconds = 0.0

    def observe(self, lag: float) -> None:
        self._lags.append(max(0.0, lag))
        ordered = sorted(self._lags)
        self.seconds = ordered[int(0.9 * (len(ordered) - 1))]


class StreamOwner(Protocol):
    """What a ``RequestStream`` needs of the engine front that made it."""

    def abort(self, request_id: str) -> None: ...

    def abort_without_lock(self, request_id: str) -> None: ...

    def first_token_seen(self, first_token_time: float) -> None: ...


class RequestStream:
    """The outputs of one queued request, as an async iterator.

    It ends after the output whose ``finished`` is true. Until then the
    request is live in the engine, and every way of leaving early aborts
    it: ``aclose()`` (idempotent, and also for a stream never iterated), or
    a cancellation while waiting for the next output. An exception put on
    the queue (the engine died or shut down) is raised and ends the stream.
    """

    def __init__(self, owner: StreamOwner, request_id: str, queue: asyncio.Queue) -> None:
        self.owner = owner
        self.request_id = request_id
        self._queue = queue
        self._done = False
        self._first_seen = False

    def __aiter__(self) -> "RequestStream":
        return self

    @property
    def ready(self) -> bool:
        """Whether the next output (or error) is already here: ``anext``
        returns it without waiting."""
        return not self._queue.empty()

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._done = True  # the engine dropped the request (failure or shutdown)
            raise item
        if not self._first_seen and item.num_output_tokens and item.first_token_time is not None:
            self._first_seen = True
            self.owner.first_token_seen(item.first_token_time)
        if item.finished:
            self._done = True
        return item

    async def aclose(self) -> None:
        """Abort the request unless its final output was delivered."""
        if not self._done:
            self._done = True
            self.owner.abort(self.request_id)

    def __del__(self) -> None:
        # Dropped unfinished (a caller broke out of its loop): abort, as an
        # async generator's finalizer would. Lock-free, since the garbage
        # collector may run this on any thread, the engine's included.
        if not self._done:
            self._done = True
            self.owner.abort_without_lock(self.request_id)
