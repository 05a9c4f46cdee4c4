"""``reject_rate`` and ``arrival_rate`` count every arrival and every
rejection reason (issue 42): each reason below is produced on a real
scheduler (fake clock), and the rates read from its snapshots are the true
share of arrivals turned away, never above 1."""
from __future__ import annotations

import pytest
from test_scheduler_admission import busy_scheduler
from test_scheduler_properties import make_scheduler, run_step
from test_shedding import _adaptive, _try

from carpool.engine.stats import EngineCounters, EngineStats
from carpool.scheduler import RejectedError, Request, Scheduler
from carpool.server.metrics import RateWindow


def _snapshot(scheduler: Scheduler) -> EngineStats:
    added = scheduler.admission.arrivals - sum(
        n for reason, n in scheduler.rejections.items()
        if reason not in ("queue_timeout", "deadline_expired"))
    return EngineStats(time=scheduler.clock(), num_running=0, num_waiting=0, waiting_tokens=0,
                       kv_num_blocks=1, kv_used_blocks=0, prefix_queries=0, prefix_hits=0,
                       num_preemptions=0, counters=EngineCounters(requests_added=added),
                       rejections=dict(scheduler.rejections), sessions={}, knobs={},
                       arrivals=scheduler.admission.arrivals)


def _add(scheduler: Scheduler, request: Request) -> bool:
    """True when admitted."""
    try:
        scheduler.add_request(request)
    except RejectedError:
        return False
    return True


def queue_full() -> Scheduler:
    scheduler = busy_scheduler(max_queue_requests=1)
    _add(scheduler, Request("w", [5, 6], 4, 0.0))
    assert not _add(scheduler, Request("late", [5, 6], 4, 0.0))
    return scheduler


def queue_tokens() -> Scheduler:
    scheduler = busy_scheduler(max_queue_tokens=10)
    _add(scheduler, Request("a", [1] * 8, 2, 0.0))
    assert not _add(scheduler, Request("b", [2] * 8, 2, 0.0))
    return scheduler


def session_full() -> Scheduler:
    scheduler = busy_scheduler(max_session_requests=1)
    _add(scheduler, Request("turn1", [1] * 4, 2, 0.0, session_id="s"))
    assert not _add(scheduler, Request("turn2", [1] * 4, 2, 0.0, session_id="s"))
    return scheduler


def deadline() -> Scheduler:
    scheduler = busy_scheduler()
    scheduler.clock.now = 5.0
    assert not _add(scheduler, Request("late", [1] * 4, 2, 5.0, deadline=4.0))
    return scheduler


def queue_timeout() -> Scheduler:
    scheduler = busy_scheduler(queue_timeout=1.0)
    _add(scheduler, Request("w", [7, 8], 3, 0.0))
    scheduler.clock.now = 2.0
    run_step(scheduler)
    assert [r.reject_reason for r in scheduler.pop_rejected()] == ["queue_timeout"]
    return scheduler


def predicted_ttft_miss() -> Scheduler:
    scheduler = _adaptive(80)
    assert _try(scheduler, "normal").reason == "predicted_ttft_miss"
    return scheduler


def predicted_deadline_miss() -> Scheduler:
    scheduler = _adaptive(80, target=100.0)
    now = scheduler.clock()
    assert not _add(scheduler, Request("due", [7] * 4, 4, now, deadline=now + 0.2))
    return scheduler


def shed() -> Scheduler:
    scheduler = make_scheduler(num_blocks=64, max_seqs=1, budget=64, policy="priority",
                               emergency_switch=True, max_queue_requests=5)
    for i in range(6):
        scheduler.add_request(Request(f"n{i}", [i + 1] * 4, 50, float(i) * 1e-3))
        scheduler.schedule()
    for _ in range(3):
        scheduler.schedule()
        scheduler.clock.now += 3.0
    scheduler.schedule()
    assert not _add(scheduler, Request("low", [9] * 4, 4, scheduler.clock.now, priority=1))
    return scheduler


SCENARIOS = {f.__name__: f for f in (queue_full, queue_tokens, session_full, deadline,
                                     queue_timeout, predicted_ttft_miss,
                                     predicted_deadline_miss, shed)}


@pytest.mark.parametrize("reason", sorted(SCENARIOS))
def test_every_reason_counts_against_every_arrival(reason):
    window = RateWindow(window_s=60.0)
    scheduler = SCENARIOS[reason]()
    assert scheduler.rejections.get(reason, 0) >= 1, scheduler.rejections
    base = EngineStats(time=0.0, num_running=0, num_waiting=0, waiting_tokens=0,
                       kv_num_blocks=1, kv_used_blocks=0, prefix_queries=0, prefix_hits=0,
                       num_preemptions=0, counters=EngineCounters(), rejections={},
                       sessions={}, knobs={})
    window.update(base, now=0.0)
    window.update(_snapshot(scheduler), now=10.0)
    rates = window.rates()
    arrivals = scheduler.admission.arrivals
    rejected = sum(scheduler.rejections.values())
    assert 0 < rejected < arrivals  # every scenario admits some work too
    assert rates["reject_rate"] == pytest.approx(rejected / arrivals)
    assert rates["arrival_rate"] == pytest.approx(arrivals / 10.0)


def test_arrivals_count_rejected_requests_but_not_malformed_ones():
    scheduler = busy_scheduler(max_queue_requests=1)
    assert scheduler.admission.arrivals == 1  # the runner
    with pytest.raises(ValueError):  # can never run: a client error, not an arrival
        scheduler.add_request(Request("runner", [1], 1, 0.0))
    assert scheduler.admission.arrivals == 1
    _add(scheduler, Request("w", [5, 6], 4, 0.0))
    _add(scheduler, Request("x", [5, 6], 4, 0.0))
    assert scheduler.admission.arrivals == 3 and scheduler.rejections == {"queue_full": 1}
