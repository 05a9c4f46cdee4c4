"""The adaptive controller on a fake clock: hysteresis, ramps, timeout
rules, the batch-limit formula, alpha, decision logging, and that no
accepted request is lost while it moves the knobs."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.config import CacheConfig, ControllerConfig, SchedulerConfig
from carpool.scheduler import RejectedError, Request, RequestStatus, Scheduler
from carpool.scheduler.control.controller import (
    MIN_WAIT,
    AdaptiveController,
    KnobRamp,
    LiveKnobs,
)
from carpool.scheduler.control.cost_model import StepCostModel
from carpool.scheduler.control.live_window import Signals, percentile
from carpool.scheduler.control.modes import PRESETS, ModeSelector
from tests.test_scheduler_properties import FakeClock, Ledger


def signals(now: float = 10.0, busy: float = 0.6, waiting: int = 2, ttft: float | None = 0.5,
            tpot: float | None = 0.05, fill: float | None = 0.8, running: int = 4,
            tokens: float | None = 256.0) -> Signals:
    return Signals(now=now, arrival_rate=1.0, waiting=waiting, waiting_tokens=100 * waiting,
                   running=running, kv_usage=0.3, busy=busy, ttft_p95=ttft, tpot_p95=tpot,
                   fill=fill, mean_request_tokens=tokens, batch_limit=4)


def linear_cost(per_token: float = 0.001, per_seq: float = 0.0, fixed: float = 0.01,
                ) -> StepCostModel:
    """A cost model fed exactly ``fixed + per_token * tokens + per_seq * seqs``."""
    cost = StepCostModel()
    for tokens, seqs in [(1, 1), (8, 8), (64, 2), (200, 4), (16, 16), (300, 10), (40, 3),
                         (120, 30), (5, 2), (90, 12)]:
        cost.record(tokens, seqs, fixed + per_token * tokens + per_seq * seqs)
    return cost


def controller(request_level: bool = False, cost: StepCostModel | None = None,
               **overrides) -> AdaptiveController:
    config = ControllerConfig(adaptive=True, **overrides)
    config.validate()
    base = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_wait=0.1,
                           preferred_batch_size=8, max_batch_size=32)
    return AdaptiveController(config, base, LiveKnobs.from_config(base), num_blocks=1000,
                              block_size=16, cost_model=cost or StepCostModel(),
                              request_level=request_level)


def tick(ctl: AdaptiveController, s: Signals) -> None:
    """One decision and the first step of its ramp (as ``on_step`` does)."""
    ctl.tick(s)
    ctl.ramp.advance(ctl.knobs)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 95) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 95) == 95.0


# -- hysteresis ----------------------------------------------------------------------


def test_mode_needs_consecutive_ticks_and_does_not_flap_on_noise() -> None:
    selector = ModeSelector(ControllerConfig(adaptive=True, hysteresis_ticks=2))
    assert selector.mode == "balanced"
    # One overloaded tick between calm ones never switches.
    for busy in [0.95, 0.6, 0.95, 0.6, 0.95, 0.6]:
        assert selector.update(signals(busy=busy)) is None
    assert selector.mode == "balanced"
    # Two in a row do.
    assert selector.update(signals(busy=0.95)) is None
    changed = selector.update(signals(busy=0.95))
    assert changed is not None and changed[0] == "balanced" and selector.mode == "throughput"
    assert "busy 95% > 85%" in changed[1]
    # Noise between the exit (70%) and entry (85%) thresholds keeps the mode.
    for busy in [0.72, 0.9, 0.75, 0.8, 0.71, 0.88] * 3:
        assert selector.update(signals(busy=busy)) is None
    assert selector.mode == "throughput"


def test_latency_mode_under_light_load_and_pinned_mode_never_moves() -> None:
    selector = ModeSelector(ControllerConfig(adaptive=True, hysteresis_ticks=1))
    changed = selector.update(signals(busy=0.1, waiting=0, ttft=0.2))
    assert changed == ("balanced", "busy 10% < 40%, queue empty (1 ticks)")
    assert selector.mode == "latency"
    pinned = ModeSelector(ControllerConfig(adaptive=True, controller_mode="throughput"))
    for busy in [0.0, 0.1, 0.99]:
        assert pinned.update(signals(busy=busy, waiting=0)) is None
    assert pinned.mode == "throughput"


def test_ttft_over_target_asks_for_throughput() -> None:
    selector = ModeSelector(ControllerConfig(adaptive=True, ttft_target=0.5))
    mode, cause = selector.wanted(signals(busy=0.3, ttft=0.82))
    assert mode == "throughput" and cause == "ttft_p95 0.82 s > 0.50 s"


# -- transitions -----------------------------------------------------------------------


def test_ramp_reaches_targets_in_three_steps_without_a_cliff() -> None:
    knobs = LiveKnobs(64, 512, 8, 32, 0.1)
    ramp = KnobRamp(3)
    ramp.retarget(knobs, {"max_num_seqs": 4, "max_num_batched_tokens": 128, "max_wait": 0.2})
    seen = []
    for _ in range(3):
        ramp.advance(knobs)
        seen.append((knobs.max_num_seqs, knobs.max_num_batched_tokens, knobs.max_wait))
    assert seen[-1] == (4, 128, 0.2)
    assert not ramp.active
    assert [s[0] for s in seen] == [44, 24, 4]  # equal thirds of 60
    assert [s[1] for s in seen] == [384, 256, 128]
    assert seen[0][2] == pytest.approx(0.1333, abs=1e-3)
    ramp.advance(knobs)  # nothing left to move
    assert (knobs.max_num_seqs, knobs.max_num_batched_tokens) == (4, 128)


def test_mode_change_completes_within_three_scheduler_steps() -> None:
    ctl = controller(request_level=True, hysteresis_ticks=1, controller_interval=1.0)
    state = {"waiting": 0, "waiting_tokens": 0, "running": 0, "kv_usage": 0.0, "busy": 0.1,
             "batch_limit": 8}
    ctl.on_step(0.0, 0, lambda: state)  # arms the first tick
    ctl.on_step(1.0, 0, lambda: state)  # tick: light load -> latency, ramp step 1
    assert ctl.mode == "latency"
    target = PRESETS["latency"].preferred_batch_size
    assert ctl.knobs.preferred_batch_size != target  # not a cliff
    ctl.on_step(1.01, 0, lambda: state)
    ctl.on_step(1.02, 0, lambda: state)
    assert ctl.knobs.preferred_batch_size == target
    assert ctl.knobs.max_wait <= PRESETS["latency"].max_wait


# -- timeout rules ---------------------------------------------------------------------


def test_low_fill_raises_max_wait_by_twenty_percent_within_the_mode_ceiling() -> None:
    ctl = controller(request_level=True, controller_mode="throughput", transition_steps=1)
    tick(ctl, signals(fill=0.3, ttft=0.1))
    assert ctl.knobs.max_wait == pytest.approx(0.12)
    for _ in range(10):
        tick(ctl, signals(fill=0.3, ttft=0.1))
    assert ctl.knobs.max_wait == PRESETS["throughput"].max_wait  # bounded


def test_latency_over_target_cuts_max_wait_by_thirty_percent_down_to_a_floor() -> None:
    ctl = controller(request_level=True, controller_mode="throughput", transition_steps=1,
                     ttft_target=0.5)
    tick(ctl, signals(fill=0.3, ttft=0.9))  # both rules fire: latency wins
    assert ctl.knobs.max_wait == pytest.approx(0.07)
    reasons = [d.reason for d in ctl.decisions if d.knob == "max_wait"]
    assert reasons == ["latency_over_target"]
    for _ in range(30):
        tick(ctl, signals(fill=0.9, ttft=0.9))
    assert ctl.knobs.max_wait == MIN_WAIT


def test_fill_in_range_and_latency_within_target_leaves_max_wait() -> None:
    ctl = controller(request_level=True, controller_mode="throughput", transition_steps=1)
    tick(ctl, signals(fill=0.5, ttft=0.1))
    assert ctl.knobs.max_wait == 0.1
    assert not [d for d in ctl.decisions if d.knob == "max_wait"]


# -- batch limit, token budget, alpha -------------------------------------------------------


def test_batch_limit_is_the_smallest_term() -> None:
    cost = linear_cost(per_token=0.002, fixed=0.01)  # a decode of n seqs: 0.01 + 0.002 n s
    ctl = controller(cost=cost, controller_mode="throughput", tpot_target=0.05)
    ctl.observe_step(9.0, None, demand=100)
    limit, cause, reason = ctl.batch_limit(signals(tokens=256.0), PRESETS["throughput"])
    # by_latency: 0.01 + 0.002 n <= LIMIT_STEP_SHARE (0.8) * 0.05 -> n = 15 (the fit's
    # small ridge bias may make it 14), in every mode; by_memory: 800 // 16 = 50; cap 64
    # (latency mode's a quarter of it, 16); peak demand x alpha: 100 x 2 = 200.
    assert reason == "by_latency" and limit in (14, 15)
    for mode in ("latency", "balanced"):
        assert ctl.batch_limit(signals(tokens=256.0), PRESETS[mode])[0] == limit
    assert "cap 16," in ctl.batch_limit(signals(tokens=256.0), PRESETS["latency"])[1]
    assert "by_memory 50" in cause and "by_demand 200" in cause and "correction 1.00" in cause
    limit, _, reason = ctl.batch_limit(signals(tokens=16000.0), PRESETS["throughput"])
    assert (limit, reason) == (1, "by_memory")


def test_request_level_batch_limit_follows_peak_demand_times_alpha() -> None:
    cost = linear_cost(per_token=0.002, fixed=0.01)
    ctl = controller(request_level=True, cost=cost, controller_mode="throughput",
                     tpot_target=0.06)  # by_latency ~19 (0.01 + 0.002 n <= 0.8 * 0.06)
    ctl.observe_step(9.0, None, demand=100)
    limit, cause, reason = ctl.batch_limit(signals(tokens=256.0), PRESETS["throughput"])
    assert reason == "by_latency" and "by_demand 200" in cause  # alpha starts at 2
    ctl.demand._samples.clear()
    ctl.observe_step(9.9, None, demand=3)
    limit, _, reason = ctl.batch_limit(signals(tokens=256.0), PRESETS["throughput"])
    assert (limit, reason) == (16, "by_demand")  # never below the mode's preferred size


def test_alpha_adapts_to_which_target_is_missed() -> None:
    ctl = controller(request_level=True, ttft_target=1.0, tpot_target=0.1)
    assert ctl.alpha == 2.0
    tick(ctl, signals(ttft=2.0, tpot=0.05))
    assert ctl.alpha == 2.0  # one tick is no trend (hysteresis_ticks 2)
    tick(ctl, signals(ttft=2.0, tpot=0.05))
    assert ctl.alpha == 2.5
    for _ in range(2):
        tick(ctl, signals(ttft=0.5, tpot=0.2))
    assert ctl.alpha == 2.0
    for _ in range(20):
        tick(ctl, signals(ttft=0.5, tpot=0.2))
    assert ctl.alpha == 1.0  # bounded: never below the peak demand
    tick(ctl, signals(ttft=2.0, tpot=0.2))  # both missed: no signal which way
    assert ctl.alpha == 1.0
    for _ in range(20):
        tick(ctl, signals(ttft=2.0, tpot=0.05))
    assert ctl.alpha == 4.0


def test_every_decision_is_logged_with_its_cause(caplog) -> None:
    ctl = controller(request_level=True, ttft_target=0.5, hysteresis_ticks=1)
    with caplog.at_level("INFO", logger="carpool.scheduler.control.controller"):
        tick(ctl, signals(ttft=0.82, busy=0.5))
    assert ("controller: mode throughput <- balanced: ttft_p95 0.82 s > 0.50 s (1 ticks)"
            in caplog.messages)
    mode = [d for d in ctl.decisions if d.knob == "mode"]
    assert [d.describe() for d in mode] == [
        "mode throughput <- balanced: ttft_p95 0.82 s > 0.50 s (1 ticks)"]
    assert ctl.decision_counts[("mode", "mode_throughput")] == 1
    assert ctl.decision_counts[("alpha", "ttft_over_target")] == 1


# -- in the scheduler ------------------------------------------------------------------------


def adaptive_scheduler(window: float = 0.5, **controller_overrides) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32, max_queue_requests=8)
    config.validate()
    controller_config = ControllerConfig(adaptive=True, controller_interval=0.1,
                                         controller_window=window, **controller_overrides)
    controller_config.validate()
    return Scheduler(config, CacheConfig(block_size=4, watermark=0.05), 24, FakeClock(),
                     controller_config)


def test_scheduler_reads_the_live_knobs_and_reports_latencies() -> None:
    scheduler = adaptive_scheduler(window=5.0, controller_mode="latency", tpot_target=0.02)
    for i in range(12):
        scheduler.record_step(8 * (i % 4 + 1), i % 4 + 1, 0.002 + 0.001 * 8 * (i % 4 + 1))
    ledger = Ledger(scheduler)
    for index in range(6):
        request = Request(f"r{index}", [1, 2, 3, 4, 5], 4, scheduler.clock())
        scheduler.add_request(request)
        ledger.accepted.append(request)
    for _ in range(60):
        ledger.step()
        assert len(scheduler.running) <= scheduler.knobs.max_num_seqs or \
            scheduler.controller.ramp.active
    assert not scheduler.has_unfinished
    assert scheduler.controller.ticks >= 1
    assert scheduler.knobs.max_num_seqs < 6  # latency mode shrank the batch
    assert scheduler.controller.window.ttft.values(scheduler.clock())


adaptive_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 3), min_size=1, max_size=20),
              st.integers(1, 6), st.integers(-1, 1)),
    st.tuples(st.just("step"), st.integers(1, 5)),
    st.tuples(st.just("abort"), st.integers(0, 60)),
    st.tuples(st.just("wait"), st.floats(0.0, 0.5)),
), min_size=5, max_size=60)


@settings(max_examples=100, deadline=None)
@given(ops=adaptive_ops, mode=st.sampled_from(["auto", "latency", "throughput"]),
       tpot=st.sampled_from([None, 0.001, 0.05]), ttft=st.sampled_from([None, 0.01, 1.0]))
def test_no_accepted_request_is_lost_while_the_controller_moves_knobs(ops, mode, tpot, ttft):
    scheduler = adaptive_scheduler(controller_mode=mode, tpot_target=tpot, ttft_target=ttft)
    ledger = Ledger(scheduler, before_step=lambda: scheduler.record_step(10, 2, 0.004))
    for index, op in enumerate(ops):
        if op[0] == "add":
            request = Request(f"r{index}", op[1], op[2], scheduler.clock(), op[3])
            try:
                scheduler.add_request(request)
                ledger.accepted.append(request)
            except RejectedError as exc:
                assert exc.reason in ("queue_full", "predicted_ttft_miss")
        else:
            ledger.run(op)
        ledger.check(scheduler.config)
    for _ in range(2000):
        if not scheduler.has_unfinished:
            break
        ledger.step()
    assert not scheduler.has_unfinished
    assert set(ledger.ended) == {r.request_id for r in ledger.accepted}
    assert all(r.status.finished for r in ledger.accepted)
    assert scheduler.kv.pool.num_free_blocks == 24
    assert RequestStatus.FINISHED_REJECTED not in {
        r.status for r in ledger.accepted if ledger.ended[r.request_id] == "finished"}
