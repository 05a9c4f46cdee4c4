"""The emergency switch: sustained overload enters degrade mode, with hysteresis."""
from __future__ import annotations

import pytest

from carpool.scheduler.overload import BusyWindow, OverloadGuard


def test_busy_window_fraction():
    window = BusyWindow(window_s=10.0)
    for t in range(10):
        window.record(float(t), 0.5)
    assert window.fraction(9.0) == pytest.approx(0.5)
    assert window.fraction(30.0) == 0.0


def test_enters_only_when_sustained_and_leaves_with_hysteresis():
    guard = OverloadGuard(queue_threshold=100, busy_threshold=0.9, sustain_s=5.0)
    assert not guard.update(0.0, 150, 0.5)
    assert not guard.update(4.9, 150, 0.5) and not guard.degraded
    assert guard.update(5.0, 150, 0.5) and guard.degraded and "queue 150" in guard.reason
    # between the thresholds: stays degraded (no flapping)
    for t, queue in ((6.0, 80), (7.0, 60), (8.0, 99)):
        assert not guard.update(t, queue, 0.5) and guard.degraded
    assert guard.update(9.0, 40, 0.5) and not guard.degraded
    assert guard.switches == 2


def test_a_short_spike_does_not_switch():
    guard = OverloadGuard(queue_threshold=10, sustain_s=2.0)
    guard.update(0.0, 0, 0.95)
    guard.update(1.0, 0, 0.5)  # the spike ended: the clock restarts
    guard.update(2.5, 0, 0.95)
    assert not guard.update(4.0, 0, 0.95) and not guard.degraded
    assert guard.update(4.5, 0, 0.95) and "busy 95%" in guard.reason


def test_degrade_mode_sheds_the_lowest_priority_first():
    from test_scheduler_properties import make_scheduler

    from carpool.scheduler import RejectedError, Request

    scheduler = make_scheduler(num_blocks=64, max_seqs=1, budget=64, policy="priority",
                               emergency_switch=True, max_queue_requests=5)
    for i in range(6):  # one runs, five wait: the queue is at its bound
        scheduler.add_request(Request(f"n{i}", [i + 1] * 4, 50, float(i) * 1e-3))
        scheduler.schedule()
    for _ in range(3):  # sustained for 6 s of the fake clock
        scheduler.schedule()
        scheduler.clock.now += 3.0
    scheduler.schedule()
    assert scheduler.overload.degraded
    with pytest.raises(RejectedError) as info:
        scheduler.add_request(Request("low", [9] * 4, 4, scheduler.clock.now, priority=1))
    assert info.value.reason == "shed"
    # a high arrival takes the place of the latest normal request instead of a 429
    scheduler.add_request(Request("high", [8] * 4, 4, scheduler.clock.now, priority=-1))
    dropped = scheduler.pop_rejected()
    assert [(r.request_id, r.reject_reason) for r in dropped] == [("n5", "shed")]
    assert scheduler.rejections["shed"] == 2
    scheduler.check_invariants()


def test_without_the_switch_a_full_queue_rejects_the_arrival():
    from test_scheduler_properties import make_scheduler

    from carpool.scheduler import RejectedError, Request

    scheduler = make_scheduler(num_blocks=64, max_seqs=1, budget=64, policy="priority",
                               max_queue_requests=5)
    for i in range(6):
        scheduler.add_request(Request(f"n{i}", [i + 1] * 4, 50, float(i) * 1e-3))
        scheduler.schedule()
    scheduler.clock.now += 10.0
    scheduler.schedule()
    assert scheduler.overload is None
    with pytest.raises(RejectedError) as info:
        scheduler.add_request(Request("high", [8] * 4, 4, scheduler.clock.now, priority=-1))
    assert info.value.reason == "queue_full"


def test_busy_window_records_a_run_as_step_by_step():
    ends = [0.5 * i + 0.1 for i in range(1, 60)]
    seconds = [0.1 + 0.01 * (i % 7) for i in range(1, 60)]
    one_by_one, grouped = BusyWindow(window_s=3.0), BusyWindow(window_s=3.0)
    for end, step_seconds in zip(ends, seconds):
        one_by_one.record(end, step_seconds)
    grouped.record_many(ends[:20], seconds[:20])
    grouped.record_many(ends[20:], seconds[20:])
    assert grouped._total == one_by_one._total
    assert grouped.fraction(ends[-1]) == one_by_one.fraction(ends[-1])
