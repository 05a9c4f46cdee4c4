"""Admission control: bounded queues, retry-after estimates, deadlines and
queue timeouts, all on a fake clock."""
from __future__ import annotations

import pytest
from test_scheduler_properties import make_scheduler, run_step

from carpool.config import SchedulerConfig
from carpool.scheduler import RejectedError, Request, RequestStatus, Scheduler
from carpool.scheduler.control.admission import DepartureRate


def busy_scheduler(policy: str = "fcfs", **config) -> Scheduler:
    """One sequence slot, taken by a long request: everything else waits."""
    scheduler = make_scheduler(num_blocks=64, max_seqs=1, budget=64, policy=policy, **config)
    scheduler.add_request(Request("runner", [1, 2, 3], 100, 0.0))
    run_step(scheduler)
    assert scheduler.running
    return scheduler


def test_queue_bound_by_requests():
    scheduler = busy_scheduler(max_queue_requests=3)
    for i in range(3):
        scheduler.add_request(Request(f"w{i}", [5, 6], 4, scheduler.clock()))
    with pytest.raises(RejectedError) as info:
        scheduler.add_request(Request("late", [5, 6], 4, scheduler.clock()))
    err = info.value
    assert err.reason == "queue_full"
    assert 1 <= err.retry_after <= 60 and err.retry_after == int(err.retry_after)
    assert "queue is full (3 requests waiting" in str(err) and "retry in ~" in str(err)
    assert "late" not in scheduler.requests
    assert scheduler.rejections == {"queue_full": 1}
    scheduler.check_invariants()
    # A slot frees once a waiting request leaves; the same id is then accepted.
    scheduler.abort_request("w0")
    scheduler.add_request(Request("late", [5, 6], 4, scheduler.clock()))
    scheduler.check_invariants()


def test_queue_bound_by_prompt_tokens():
    scheduler = busy_scheduler(max_queue_tokens=20)
    scheduler.add_request(Request("a", [1] * 8, 2, 0.0))
    scheduler.add_request(Request("b", [2] * 8, 2, 0.0))
    with pytest.raises(RejectedError) as info:
        scheduler.add_request(Request("c", [3] * 8, 2, 0.0))
    assert info.value.reason == "queue_tokens"
    assert 1 <= info.value.retry_after <= 60
    assert "16 waiting + 8 in this request > limit 20" in str(info.value)
    scheduler.add_request(Request("d", [4] * 4, 2, 0.0))  # exactly at the limit
    # A prompt that could never fit the bound is a permanent error, not a retry.
    with pytest.raises(ValueError, match="max_queue_tokens=20"):
        scheduler.add_request(Request("huge", [5] * 21, 2, 0.0))
    assert scheduler.rejections == {"queue_tokens": 1}
    scheduler.check_invariants()


def test_config_rejects_unbounded_or_bad_admission_knobs():
    for bad in ({"max_queue_requests": 0}, {"max_queue_tokens": 0}, {"queue_timeout": 0.0},
                {"session_ttl": -1.0}, {"queue_timeout": float("nan")}):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad).validate()
    SchedulerConfig(max_queue_tokens=None, queue_timeout=None, session_ttl=0.0).validate()


def rejected_retry_after(seconds_per_step: float) -> float:
    """Keep the queue full while one request finishes every ``seconds_per_step``,
    then overflow it."""
    scheduler = make_scheduler(num_blocks=64, max_seqs=1, budget=64, policy="fcfs",
                               max_queue_requests=3)
    for i in range(9):
        if i >= 3:
            assert len(run_step(scheduler)) == 1  # max_tokens=1: done in its first step
            scheduler.clock.now += seconds_per_step
        scheduler.add_request(Request(f"r{i}", [1, 2], 1, scheduler.clock()))
    with pytest.raises(RejectedError) as info:
        scheduler.add_request(Request("over", [1, 2], 1, scheduler.clock()))
    return info.value.retry_after


def test_retry_after_shrinks_when_requests_complete_faster():
    slow = rejected_retry_after(10.0)
    fast = rejected_retry_after(0.05)
    assert fast == 1.0
    assert slow > fast
    assert 5 <= slow <= 20  # about one departure per 10 s, seen through a 30 s window


def test_departure_rate_estimate():
    rate = DepartureRate()
    assert rate.retry_after(0.0, 1) == 1.0  # cold start: the stated 1 s default
    rate.set_busy(0.0, True)
    assert rate.retry_after(20.0, 1) == 20.0  # busy 20 s and nothing left yet
    assert rate.retry_after(500.0, 1) == 30.0  # the window is 30 s
    for t in range(500, 530, 3):
        rate.record(float(t))
    assert rate.rate(530.0) == pytest.approx(10 / 30)
    assert rate.retry_after(530.0, 1) == 3.0
    assert rate.retry_after(530.0, 100) == 60.0  # capped
    # Idle time does not dilute the rate of a loaded server.
    rate.set_busy(530.0, False)
    rate.set_busy(5000.0, True)
    assert rate.rate(5000.0) == pytest.approx(10 / 30)


def test_deadline_expires_exactly_when_passed_and_is_popped_once():
    scheduler = busy_scheduler()
    late = Request("late", [7, 8], 3, 0.0, deadline=5.0)
    scheduler.add_request(late)
    scheduler.clock.now = 5.0
    run_step(scheduler)
    assert late.status == RequestStatus.WAITING and scheduler.pop_rejected() == []
    scheduler.clock.now = 5.0001
    run_step(scheduler)
    assert scheduler.pop_rejected() == [late]
    assert scheduler.pop_rejected() == []
    assert late.status == RequestStatus.FINISHED_REJECTED and late.status.finished
    assert late.reject_reason == "deadline" and late.first_scheduled_time is None
    assert "late" not in scheduler.requests
    assert scheduler.rejections == {"deadline": 1}
    scheduler.check_invariants()


@pytest.mark.parametrize("deadline, reason", [(None, "queue_timeout"), (10.0, "queue_timeout"),
                                              (2.5, "deadline"), (3.0, "deadline")])
def test_queue_timeout_and_the_earlier_of_the_two_wins(deadline, reason):
    scheduler = busy_scheduler(queue_timeout=2.0, policy="priority")
    request = Request("w", [7, 8], 3, 1.0, deadline=deadline)  # timeout at 1 + 2 = 3
    scheduler.add_request(request)
    expiry = min(3.0, deadline or 3.0)
    scheduler.clock.now = expiry
    run_step(scheduler)
    assert scheduler.pop_rejected() == []
    scheduler.clock.now = expiry + 1e-6
    run_step(scheduler)
    assert scheduler.pop_rejected() == [request] and request.reject_reason == reason
    assert scheduler.rejections == {reason: 1}
    scheduler.check_invariants()


def test_deadline_already_passed_at_arrival_is_rejected():
    scheduler = make_scheduler(num_blocks=16, max_seqs=2, budget=16, policy="fcfs")
    scheduler.clock.now = 3.0
    with pytest.raises(RejectedError) as info:
        scheduler.add_request(Request("x", [1], 1, 3.0, deadline=2.0))
    assert info.value.reason == "deadline" and info.value.retry_after == 1.0
    assert not scheduler.has_unfinished and scheduler.rejections == {"deadline": 1}


def test_a_scheduled_request_never_expires_even_when_preempted():
    scheduler = make_scheduler(num_blocks=6, max_seqs=4, budget=64, policy="fcfs",
                               queue_timeout=0.5)
    scheduler.kv.watermark_blocks = 0
    requests = [Request(f"r{i}", [i] * 7, 9, 0.0, deadline=0.2) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    finished = []
    for _ in range(200):
        if not scheduler.has_unfinished:
            break
        finished += run_step(scheduler)
        scheduler.clock.now += 1.0  # every deadline is long past after the first step
        expired = scheduler.pop_rejected()
        assert all(r.first_scheduled_time is None for r in expired)
        finished += expired
        scheduler.check_invariants()
    assert scheduler.num_preemptions > 0
    assert sorted(r.request_id for r in finished) == ["r0", "r1", "r2"]
    scheduled = [r for r in requests if r.first_scheduled_time is not None]
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in scheduled)
    assert len(scheduled) >= 2


def test_a_resumed_request_is_neither_refused_nor_queued_last():
    """A request going on after its replica died (``Request.resumed``) was
    admitted once: a full queue takes it anyway, at the front, as a
    preempted one."""
    scheduler = busy_scheduler(max_queue_requests=2)
    for i in range(2):
        scheduler.add_request(Request(f"w{i}", [5, 6], 4, scheduler.clock()))
    resumed = Request("moved", [7, 8, 9], 6, 0.0)
    resumed.token_ids += [4, 4]  # the tokens its client got before its replica died
    resumed.resumed = True
    scheduler.add_request(resumed)
    assert [r.request_id for r in scheduler.waiting] == ["moved", "w0", "w1"]
    with pytest.raises(RejectedError):
        scheduler.add_request(Request("late", [5, 6], 4, scheduler.clock()))
    scheduler.check_invariants()
