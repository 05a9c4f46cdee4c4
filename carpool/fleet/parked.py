"""Requests held while no replica is up to take them over.

When a fleet's only ready replica dies (a one-replica fleet, or every
replica down at once), its requests have nowhere to go *now*, but a new
worker is already starting in its place. Failing them would show the
client an error a few seconds of waiting avoid, so the fleet holds them
here, their callers none the wiser, and sends each on (``EngineClient.
adopt``: re-run, or resumed after what its caller got) as soon as a
replica joins. One that no replica takes within ``RESTART_WAIT_S`` ends
with an error (the restart keeps failing, or takes too long): no request
waits without bound. An abort while held ends it at once.
"""
from __future__ import annotations

import time

from carpool.engine.client import LiveRequest, output_of
from carpool.engine.streams import EngineDeadError
from carpool.engine.wire import Delta

# Longer than a worker's start here (about 10 s for the default model on
# 2 cores: load, calibrate), short enough that a client's own timeout is
# not the first thing to give up.
RESTART_WAIT_S = 60.0


class ParkedRequests:
    """The requests a fleet holds for its next replica (module docstring)."""

    def __init__(self, wait_s: float = RESTART_WAIT_S) -> None:
        self.wait_s = wait_s
        self._held: dict[str, tuple[LiveRequest, float]] = {}  # request id -> (it, deadline)
        self.held = 0  # requests held so far (``/carpool/policy``'s ``held_for_restart``)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def park(self, live: LiveRequest, now: float) -> None:
        self._held[live.add.request_id] = (live, now + self.wait_s)
        self.held += 1

    def take_all(self) -> list[LiveRequest]:
        """Every held request (a replica is up to take them), oldest first."""
        held, self._held = self._held, {}
        return [live for live, _ in held.values()]

    def expire(self, now: float) -> None:
        """End those past their deadline with an error."""
        for request_id, (live, deadline) in list(self._held.items()):
            if deadline <= now:
                del self._held[request_id]
                live.queue.put_nowait(EngineDeadError(
                    f"its engine worker died and no replica came back within "
                    f"{self.wait_s:.0f} s to take the request over"))

    def abort(self, request_id: str) -> bool:
        """End a held request as aborted (its final output); False: not held."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        live = held[0]
        live.queue.put_nowait(output_of(Delta(
            request_id, "", [], True, "abort", arrival_time=live.add.arrival_time or 0.0,
            finish_time=time.time()), live))
        return True

    def fail_all(self, error: BaseException) -> None:
        """The fleet stops: nothing held will be taken over."""
        for live in self.take_all():
            live.queue.put_nowait(error)
