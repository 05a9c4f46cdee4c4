"""Batch formation of the static and dynamic regimes (fake clock)."""
from __future__ import annotations

import pytest

from carpool.scheduler.regimes import BatchGate
from carpool.scheduler.request import Request


def _req(i: int, arrival: float, prompt_len: int = 10) -> Request:
    return Request(f"r{i}", [1] * prompt_len, 4, arrival)


def test_static_waits_for_a_full_batch_or_max_wait():
    gate = BatchGate("static", preferred_batch_size=4, max_batch_size=8, max_wait=0.5)
    queue = [_req(i, 0.0) for i in range(3)]
    assert gate.next_batch(queue, now=0.4) == []  # 3 < 4 and not overdue
    assert [r.request_id for r in gate.next_batch(queue, now=0.5)] == ["r0", "r1", "r2"]
    assert gate.in_flight
    # nobody joins a batch in flight
    assert gate.next_batch([_req(9, 0.6)] * 4, now=10.0) == []
    for r in queue:
        gate.member_left(r)
    assert not gate.in_flight


def test_static_takes_exactly_b_in_arrival_order():
    gate = BatchGate("static", preferred_batch_size=2, max_batch_size=8, max_wait=None)
    queue = [_req(i, float(i)) for i in range(5)]
    assert [r.request_id for r in gate.next_batch(queue, now=100.0)] == ["r0", "r1"]
    assert gate.stats.batches == 1 and gate.stats.formation_wait_s == pytest.approx(100.0)
    lone = BatchGate("static", preferred_batch_size=2, max_batch_size=8, max_wait=None)
    assert lone.next_batch([_req(0, 0.0)], now=1e9) == []  # no max_wait: waits for B forever


def test_dynamic_groups_by_length_and_dispatches_the_oldest_bucket():
    gate = BatchGate("dynamic", preferred_batch_size=2, max_batch_size=3, max_wait=1.0,
                     bucket_tolerance=0.1)
    queue = [_req(0, 0.0, 100), _req(1, 0.1, 400), _req(2, 0.2, 104), _req(3, 0.3, 405),
             _req(4, 0.4, 98), _req(5, 0.5, 101)]
    assert gate.bucket_of(queue[0]) == gate.bucket_of(queue[2])
    assert gate.bucket_of(queue[0]) != gate.bucket_of(queue[1])
    batch = gate.next_batch(queue, now=0.5)
    lengths = [r.num_prompt_tokens for r in batch]
    assert len(batch) <= 3 and max(lengths) / min(lengths) <= 1.2
    assert batch[0].request_id == "r0"  # the oldest request's bucket first


def test_dynamic_dispatches_a_lone_request_after_max_wait():
    gate = BatchGate("dynamic", preferred_batch_size=4, max_batch_size=8, max_wait=0.2)
    queue = [_req(0, 0.0, 10), _req(1, 0.05, 900)]
    assert gate.next_batch(queue, now=0.19) == []
    assert [r.request_id for r in gate.next_batch(queue, now=0.2)] == ["r0"]


def test_continuous_has_no_gate():
    with pytest.raises(ValueError):
        BatchGate("continuous", 4, 8, None)
