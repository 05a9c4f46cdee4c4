"""A fleet's requests held while no replica is up (``ParkedRequests``):
taken in arrival order, ended with an error past their deadline, ended as
aborted on an abort, and failed when the fleet stops; and a P/D decode part
that finds no decode replica up waits for the one restarting."""
from __future__ import annotations

import asyncio

from carpool.engine.client import LiveRequest
from carpool.engine.streams import EngineDeadError
from carpool.engine.wire import Add
from carpool.fleet.parked import ParkedRequests
from carpool.sampling_params import SamplingParams
from carpool.scheduler import RejectedError


def _live(request_id: str) -> LiveRequest:
    return LiveRequest(asyncio.Queue(), [1, 2, 3], [1, 2, 3, 4],
                       Add(request_id, [1, 2, 3], SamplingParams(max_tokens=4)))


def test_held_requests_are_taken_over_in_order_or_end_past_their_deadline():
    parked = ParkedRequests(wait_s=10.0)
    first, second, third = _live("a"), _live("b"), _live("c")
    parked.park(first, now=100.0)
    parked.park(second, now=105.0)
    parked.expire(now=109.9)
    assert len(parked) == 2 and first.queue.empty()
    parked.expire(now=110.0)  # the first waited its 10 s
    assert "a" not in parked and "b" in parked
    error = first.queue.get_nowait()
    assert isinstance(error, EngineDeadError) and "within 10 s" in str(error)
    parked.park(third, now=106.0)
    assert parked.take_all() == [second, third] and len(parked) == 0
    assert second.queue.empty() and third.queue.empty()


def test_an_abort_ends_a_held_request_and_a_stop_fails_the_rest():
    parked = ParkedRequests()
    held, other = _live("a"), _live("b")
    parked.park(held, now=0.0)
    parked.park(other, now=0.0)
    assert parked.abort("a") and not parked.abort("a")
    output = held.queue.get_nowait()
    assert output.finished and output.finish_reason == "abort"
    assert output.token_ids == [4]  # what its caller already got
    parked.fail_all(EngineDeadError("stopping"))
    assert isinstance(other.queue.get_nowait(), EngineDeadError) and len(parked) == 0


class _DecodePool:
    """A decode pool whose only replica restarts: ``add_request`` finds none
    up ``down`` times, then takes the part."""

    config = info = tokenizer = step_log = None

    def __init__(self, down: int, restarting: bool) -> None:
        self.down, self.restarting, self.asked = down, restarting, 0

    @property
    def degraded(self) -> str | None:
        return "1 replica(s) restarting, 0 serving" if self.restarting else None

    async def add_request(self, *args, **kwargs) -> str:  # noqa: ANN002, ANN003
        self.asked += 1
        if self.asked <= self.down:
            raise RejectedError("no_replica", 1.0, "no decode replica is ready")
        return "the decode part's stream"


def _decode_leg(pool: _DecodePool):  # noqa: ANN202
    from carpool.engine.wire import Handoff
    from carpool.fleet.pd import PDFleet

    fleet = PDFleet(_DecodePool(0, False), pool)
    leg = fleet._decode_leg([1, 2, 3], SamplingParams(max_tokens=4), "r", Handoff("decode", [4]),
                            "", {"cache_salt": None})
    return fleet, asyncio.run(leg)


def test_a_decode_part_waits_for_the_restarting_decode_replica():
    pool = _DecodePool(down=3, restarting=True)
    fleet, stream = _decode_leg(pool)
    assert stream == "the decode part's stream" and pool.asked == 4
    assert fleet.decode_waited == 1


def test_a_decode_part_fails_at_once_when_no_decode_replica_restarts():
    import pytest

    pool = _DecodePool(down=1, restarting=False)
    with pytest.raises(RejectedError):
        _decode_leg(pool)
    assert pool.asked == 1
