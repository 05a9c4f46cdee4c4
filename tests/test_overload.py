"""The emergency switch: sustained overload enters degrade mode, with hysteresis."""
from __future__ import annotations

import pytest

from carpool.scheduler.control.overload import BusyWindow, OverloadGuard


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


def test_degrade_deepens_in_steps_and_a_cpu_breaker_trips_it():
    """Issue 42: each sustained interval of overload goes one step deeper
    (shed low priority, static batching, response cache); host CPU over its
    threshold is a breaker of its own; calm undoes every step at once."""
    guard = OverloadGuard(queue_threshold=100, busy_threshold=0.9, sustain_s=5.0,
                          cpu_threshold=0.9)
    assert not guard.update(0.0, 0, 0.5, cpu=0.95)
    assert guard.update(5.0, 0, 0.5, cpu=0.95) and guard.stage == 1
    assert "host CPU 95% > 90%" in guard.reason
    assert not guard.update(9.0, 0, 0.5, cpu=0.95) and guard.stage == 1
    assert guard.update(10.0, 0, 0.5, cpu=0.95) and guard.stage == 2
    assert guard.update(15.0, 120, 0.5, cpu=0.5) and guard.stage == 3
    assert not guard.update(30.0, 120, 0.5, cpu=0.5) and guard.stage == 3  # the deepest
    assert OverloadGuard.STAGES[guard.stage] == "response_cache"
    # CPU at 0.85 is not calm (threshold less 0.1): stays degraded.
    assert not guard.update(31.0, 10, 0.5, cpu=0.85) and guard.degraded
    assert guard.update(32.0, 10, 0.5, cpu=0.7) and guard.stage == 0 and not guard.degraded
    # Without a CPU threshold the CPU never trips it.
    plain = OverloadGuard(queue_threshold=100, sustain_s=1.0)
    assert not plain.update(0.0, 0, 0.5, cpu=1.0) and not plain.update(2.0, 0, 0.5, cpu=1.0)


def test_the_scheduler_switches_to_static_batching_at_stage_two_and_back():
    from test_scheduler_properties import make_scheduler

    from carpool.scheduler import Request

    scheduler = make_scheduler(num_blocks=256, max_seqs=4, budget=64, policy="fcfs",
                               emergency_switch=True, max_queue_requests=5,
                               emergency_sustain=2.0, emergency_queue_share=0.6)
    for i in range(8):  # 4 run, 4 wait: the queue is over 0.6 x 5 = 3
        scheduler.add_request(Request(f"n{i}", [i + 1] * 4, 200, 0.0))
        scheduler.schedule()
    for _ in range(5):
        scheduler.clock.now += 1.0
        scheduler.schedule()
    assert scheduler.overload.stage == 2 and scheduler.gate is not None
    assert scheduler.gate.regime == "static" and scheduler.config.batching == "continuous"
    running = {r.request_id for r in scheduler.running}
    assert scheduler.gate.members == running
    for request in list(scheduler.waiting):
        scheduler.abort_request(request.request_id)
    scheduler.clock.now += 20.0  # the busy window empties: calm
    scheduler.schedule()
    assert scheduler.overload.stage == 0 and scheduler.gate is None
    scheduler.check_invariants()


def test_emergency_thresholds_are_checked_settings():
    from carpool.config import SchedulerConfig

    for bad in ({"emergency_queue_share": 0.0}, {"emergency_busy": 1.5},
                {"emergency_host_cpu": 0.0}, {"emergency_sustain": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SchedulerConfig(**bad).validate()
    SchedulerConfig(emergency_host_cpu=None).validate()


def test_the_engine_feeds_the_cpu_breaker_from_the_host(tiny_model_dir):
    from carpool.config import EngineConfig
    from carpool.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig.from_dict({
        "model": str(tiny_model_dir), "attention_backend": "torch", "kv_cache_memory": "16MiB",
        "emergency_switch": True}))
    source = engine.scheduler.overload.cpu_source
    assert source is not None
    import time

    time.sleep(0.6)  # past the reader's min_interval: a real reading
    value = source()
    assert value is None or 0.0 <= value <= 1.0  # None only without /proc/stat
    # A reading of NaN (none yet) is no reading: it neither trips nor blocks calm.
    engine.scheduler.overload.cpu_source = lambda: float("nan")
    engine.scheduler.schedule()
    assert not engine.scheduler.overload.degraded
