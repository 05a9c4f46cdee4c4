"""Settings that change while the engine runs: time-of-day profile windows
applied at their boundaries, and the learned TTFT prediction margin."""
from __future__ import annotations

from datetime import datetime

import pytest

from carpool.config import CacheConfig, ControllerConfig, EngineConfig, SchedulerConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.profiles.schedule import ProfileSchedule
from carpool.sampling_params import SamplingParams
from carpool.scheduler import Scheduler
from carpool.scheduler.control.live_settings import apply_live_settings
from carpool.scheduler.control.shedding import RATIO_SLACK, PredictionError
from tests.test_scheduler_properties import FakeClock


def scheduler(adaptive: bool = False) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256)
    controller = ControllerConfig(adaptive=adaptive)
    return Scheduler(config, CacheConfig(block_size=4), 64, FakeClock(), controller)


def test_live_settings_take_effect_at_once_without_a_controller() -> None:
    sched = scheduler()
    changed = apply_live_settings(sched, {"max_num_seqs": 4, "session_ttl": 60.0,
                                          "max_queue_requests": 10})
    assert changed == {"max_num_seqs": (16, 4), "session_ttl": (1800.0, 60.0),
                       "max_queue_requests": (200, 10)}
    assert sched.knobs.max_num_seqs == 4 and sched.config.max_num_seqs == 4
    assert sched.sessions.ttl == 60.0
    assert apply_live_settings(sched, {"max_num_seqs": 4}) == {}


def test_a_bad_or_fixed_setting_changes_nothing() -> None:
    sched = scheduler()
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        apply_live_settings(sched, {"max_num_batched_tokens": 64, "max_num_seqs": 0})
    assert sched.config.max_num_batched_tokens == 256 and sched.knobs.max_num_seqs == 16
    with pytest.raises(ValueError, match="block_size cannot change while the server runs"):
        apply_live_settings(sched, {"block_size": 32})


def test_batching_is_a_live_setting_and_the_running_batch_goes_first() -> None:
    """Issue 42: a window (or the emergency switch) may change the regime
    while requests run; what runs then is the first static batch, so no new
    request starts beside it."""
    from carpool.scheduler import Request
    from tests.test_scheduler_properties import run_step

    sched = scheduler()
    for i in range(3):
        sched.add_request(Request(f"r{i}", [1 + i] * 4, 20, 0.0))
    run_step(sched)
    assert len(sched.running) == 3 and sched.gate is None
    assert apply_live_settings(sched, {"batching": "static", "preferred_batch_size": 2,
                                       "max_batch_size": 2}) == {
        "batching": ("continuous", "static"), "preferred_batch_size": (8, 2),
        "max_batch_size": (16, 2)}
    assert sched.gate is not None and sched.gate.members == {"r0", "r1", "r2"}
    sched.add_request(Request("late", [9] * 4, 4, sched.clock()))
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["r0", "r1", "r2"]  # late waits
    apply_live_settings(sched, {"batching": "continuous"})
    run_step(sched)
    assert "late" in [r.request_id for r in sched.running] and sched.gate is None
    sched.check_invariants()


def test_with_a_controller_new_settings_are_caps() -> None:
    sched = scheduler(adaptive=True)
    sched.knobs.max_num_seqs = 12
    apply_live_settings(sched, {"max_num_seqs": 8, "max_num_batched_tokens": 512})
    assert sched.knobs.max_num_seqs == 8  # clamped to the new cap
    assert sched.knobs.max_num_batched_tokens == 256  # the controller raises it if it wants
    sched.check_invariants()


def test_schedule_windows_must_be_live_settings() -> None:
    profile = {"schedule": [{"name": "night", "from": "22:00", "to": "06:00",
                             "scheduler": {"policy": "priority"}}]}
    with pytest.raises(ValueError, match="policy cannot change while the server runs"):
        ProfileSchedule.from_profile(profile)


def test_engine_follows_the_profile_schedule_at_its_boundaries(tiny_model_dir) -> None:
    config = EngineConfig.from_dict({"model": str(tiny_model_dir), "dtype": "float32",
                                     "kv_cache_memory": "16MiB", "max_num_seqs": 16})
    engine = LLMEngine.from_config(config)
    profile = {"scheduler": {"max_num_seqs": 16},
               "schedule": [{"name": "peak", "from": "09:00", "to": "11:00",
                             "scheduler": {"max_num_seqs": 32, "max_queue_requests": 50}}]}
    wall = [datetime(2026, 12, 1, 8, 59, 30)]
    engine.follow_schedule(ProfileSchedule.from_profile(profile), lambda: wall[0])
    engine.step()
    assert engine.scheduler.knobs.max_num_seqs == 16
    assert engine._schedule_due == datetime(2026, 12, 1, 9, 0)
    wall[0] = datetime(2026, 12, 1, 9, 0, 1)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    engine.step()
    assert engine.scheduler.knobs.max_num_seqs == 32
    assert engine.scheduler.config.max_queue_requests == 50
    assert engine._schedule_due == datetime(2026, 12, 1, 11, 0)
    wall[0] = datetime(2026, 12, 1, 11, 0)
    while engine.has_unfinished:
        engine.step()
    assert engine.scheduler.knobs.max_num_seqs == 16
    assert engine.scheduler.config.max_queue_requests == 200  # back to the default
    assert engine._schedule_due == datetime(2026, 12, 2, 9, 0)  # tomorrow's peak


def test_prediction_margin_is_the_late_quantile_of_relative_errors() -> None:
    slack = RATIO_SLACK
    errors = PredictionError(window=100)
    for _ in range(7):
        errors.record(1.0, 3.0)
    assert errors.margin(predicted=1.0) == 0.0  # too few samples to trust
    errors = PredictionError(window=100, quantile=0.9)
    for i in range(100):  # late by 0 .. 99% of (prediction + slack)
        errors.record(1.0, 1.0 + (1.0 + slack) * i / 100)
    assert errors.factor() == pytest.approx(1.9)
    assert errors.margin(predicted=1.0) == pytest.approx(0.9 * (1.0 + slack))
    # Relative: the same history adds less to a smaller prediction.
    assert errors.margin(predicted=0.0) == pytest.approx(0.9 * slack)
    # The default: p95 of the errors (over a short age a p99 is the single worst one,
    # which then set every arrival's margin); the class shares keep the p99 within.
    assert PredictionError().quantile == 0.95
    early = PredictionError()
    for _ in range(20):
        early.record(2.0, 1.0)
    assert early.margin(predicted=2.0) == 0.0  # early first tokens never lower a prediction


def test_a_surge_margin_does_not_swamp_the_calm_after_it() -> None:
    """Seconds late when seconds were predicted (a surge's queue) add little
    to the sub-second predictions that follow it; an absolute margin added
    the full seconds (and rejected the calm)."""
    errors = PredictionError()
    for _ in range(50):
        errors.record(3.0, 6.0)  # a surge: twice as late as predicted
    assert errors.margin(predicted=0.3) < 0.6 < 3.0


def test_adaptive_admission_sheds_a_predicted_ttft_miss_including_the_margin() -> None:
    from carpool.scheduler import RejectedError, Request

    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64)
    sched = Scheduler(config, CacheConfig(block_size=4), 256, FakeClock(),
                      ControllerConfig(adaptive=True, ttft_target=1.0))
    for tokens in (8, 16, 32, 64, 24, 40, 56, 12, 60, 30):
        sched.record_step(tokens, 2, 0.01 + 0.001 * tokens)  # a 64-token step: 74 ms
    sched.add_request(Request("a", [1] * 40, 4, 0.0))  # predicted ~0.05 s: admitted
    assert sched.requests["a"].predicted_ttft == pytest.approx(0.05, abs=0.01)
    for _ in range(10):
        sched.admission.prediction_error.record(0.05, 1.05)  # first tokens came 3.3x as late
    with pytest.raises(RejectedError) as info:
        sched.add_request(Request("b", [2] * 40, 4, 0.0))
    assert info.value.reason == "predicted_ttft_miss"
    assert sched.rejections == {"predicted_ttft_miss": 1}
