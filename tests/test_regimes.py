"""Batch formation of the static and dynamic regimes (fake clock)."""
from __future__ import annotations

import pytest

from carpool.scheduler.control.regimes import BatchGate
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


# -- wired into the scheduler ----------------------------------------------------------

def _scheduler(**config):
    from test_scheduler_properties import make_scheduler

    return make_scheduler(num_blocks=64, max_seqs=8, budget=64, policy="fcfs", **config)


def _drive(scheduler, steps: int) -> list[set[str]]:
    """Run ``steps`` steps; return the ids running after each step."""
    from test_scheduler_properties import run_step

    seen = []
    for _ in range(steps):
        run_step(scheduler)
        seen.append({r.request_id for r in scheduler.running})
    return seen


def test_a_static_batch_runs_to_completion_before_anyone_joins():
    scheduler = _scheduler(batching="static", preferred_batch_size=2, max_wait=None)
    short = Request("a", [1, 2, 3], 2, 0.0)
    long = Request("b", [4, 5, 6], 6, 0.0)
    scheduler.add_request(short)
    assert _drive(scheduler, 3) == [set(), set(), set()]  # 1 < B and no max_wait: waits
    scheduler.add_request(long)
    scheduler.add_request(Request("c", [7, 8, 9], 2, 0.0))
    scheduler.add_request(Request("d", [7, 8, 1], 2, 0.0))
    running = _drive(scheduler, 10)
    # a and b run together; c and d wait although a finished early and slots are free
    assert running[0] == {"a", "b"} and running[1] == {"b"}
    assert not {"c", "d"} & set().union(*running[:5])
    assert {"c", "d"} in running and scheduler.gate.stats.batches == 2
    scheduler.check_invariants()


def test_continuous_lets_a_request_join_mid_flight():
    scheduler = _scheduler()
    scheduler.add_request(Request("a", [1, 2, 3], 6, 0.0))
    _drive(scheduler, 2)
    scheduler.add_request(Request("c", [7, 8, 9], 2, 0.0))
    assert _drive(scheduler, 1) == [{"a", "c"}]


def test_dynamic_batches_by_length_bucket():
    scheduler = _scheduler(batching="dynamic", preferred_batch_size=2, max_batch_size=4,
                           max_wait=1.0)
    scheduler.add_request(Request("s1", [1] * 4, 3, 0.0))
    scheduler.add_request(Request("l1", [2] * 40, 3, 0.0))
    scheduler.add_request(Request("s2", [3] * 4, 3, 0.0))
    first = _drive(scheduler, 1)[0]
    assert first == {"s1", "s2"}  # the short bucket filled first; the long one waits


def test_predictive_shedding_rejects_a_deadline_the_cost_model_says_is_missed():
    from carpool.scheduler import RejectedError

    scheduler = _scheduler()
    for _ in range(16):  # a slow machine: 10 ms per step + 1 ms per token
        for tokens in (8, 64):
            scheduler.record_step(tokens, 4, 0.010 + 0.001 * tokens)
    for i in range(4):
        scheduler.add_request(Request(f"q{i}", [1] * 60, 4, 0.0))  # 240 tokens ahead
    with pytest.raises(RejectedError) as info:
        scheduler.add_request(Request("late", [1] * 10, 4, 0.0, deadline=0.1))
    assert info.value.reason == "predicted_deadline_miss"
    assert scheduler.rejections["predicted_deadline_miss"] == 1
    scheduler.add_request(Request("fine", [1] * 10, 4, 0.0, deadline=2.0))  # room enough


def test_the_dual_queue_gives_long_prompts_their_own_small_batches():
    """Issue 42: prompts over the threshold batch among themselves (2, or
    fewer after their wait); short ones keep the gate's own size and wait;
    the lane whose batch holds the oldest request goes first."""
    from carpool.scheduler.control.regimes import LongLane

    lane = LongLane(threshold=512, batch_size=2, max_wait=0.2)
    gate = BatchGate("static", preferred_batch_size=3, max_batch_size=8, max_wait=0.5,
                     long_lane=lane)
    short = [_req(i, 0.01 * (i + 1)) for i in range(3)]
    long = [_req(10, 0.0, 600), _req(11, 0.05, 700)]
    first = gate.next_batch([long[0], *short, long[1]], now=0.06)
    assert [r.request_id for r in first] == ["r10", "r11"]  # the oldest is long
    for r in first:
        gate.member_left(r)
    assert [r.request_id for r in gate.next_batch(short, now=0.07)] == ["r0", "r1", "r2"]
    for r in short:
        gate.member_left(r)
    lone = [_req(12, 1.0, 900)]
    assert gate.next_batch(lone, now=1.1) == []  # one long prompt waits for a partner...
    assert [r.request_id for r in gate.next_batch(lone, now=1.25)] == ["r12"]  # ...0.2 s
    # Without the lane, long and short share one queue (batches of 3).
    plain = BatchGate("static", preferred_batch_size=3, max_batch_size=8, max_wait=0.5)
    assert len(plain.next_batch([long[0], *short, long[1]], now=0.06)) == 3


def test_the_scheduler_builds_the_long_lane_from_its_settings():
    from test_scheduler_properties import make_scheduler

    from carpool.config import SchedulerConfig

    sched = make_scheduler(num_blocks=256, max_seqs=8, budget=4096, policy="fcfs",
                           batching="static", long_batch_size=3, long_max_wait=0.1,
                           long_prompt_threshold=100)
    lane = sched.gate.long_lane
    assert (lane.threshold, lane.batch_size, lane.max_wait) == (100, 3, 0.1)
    off = make_scheduler(num_blocks=256, max_seqs=8, budget=4096, policy="fcfs",
                         batching="dynamic", long_batch_size=None)
    assert off.gate.long_lane is None
    with pytest.raises(ValueError, match="long_batch_size"):
        SchedulerConfig(long_batch_size=0).validate()
