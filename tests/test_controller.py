"""The adaptive controller on a fake clock: hysteresis, ramps, timeout
rules, the batch-limit formula, alpha, decision logging, and that no
accepted request is lost while it moves the knobs."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.config import CacheConfig, ControllerConfig, SchedulerConfig
from carpool.scheduler import RejectedError, Request, RequestStatus, Scheduler
from carpool.scheduler.controller import (
    MIN_WAIT,
    AdaptiveController,
    KnobRamp,
    LiveKnobs,
)
from carpool.scheduler.cost_model import StepCostModel
from carpool.scheduler.live_window import Signals, percentile
from carpool.scheduler.modes import PRESETS, ModeSelector
from carpool.scheduler.slo_policy import latency_limit
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
    # by_latency: 0.01 + 0.002 n <= 0.9 * 0.05 -> n = 17 (the fit's small ridge bias may
    # make it 16); by_memory: 800 // 16 = 50; cap 64. Demand plays no part.
    assert reason == "by_latency" and limit in (16, 17)
    assert "by_memory 50" in cause and "by_demand" not in cause and "correction 1.00" in cause
    limit, _, reason = ctl.batch_limit(signals(tokens=16000.0), PRESETS["throughput"])
    assert (limit, reason) == (1, "by_memory")


def test_request_level_batch_limit_follows_peak_demand_times_alpha() -> None:
    cost = linear_cost(per_token=0.002, fixed=0.01)
    ctl = controller(request_level=True, cost=cost, controller_mode="throughput",
                     tpot_target=0.05)
    ctl.observe_step(9.0, None, demand=100)
    limit, cause, reason = ctl.batch_limit(signals(tokens=256.0), PRESETS["throughput"])
    assert reason == "by_latency" and "by_demand 200" in cause  # alpha starts at 2
    ctl.demand._samples.clear()
    ctl.observe_step(9.9, None, demand=3)
    limit, _, reason = ctl.batch_limit(signals(tokens=256.0), PRESETS["throughput"])
    assert (limit, reason) == (16, "by_demand")  # never below the mode's preferred size


def test_batch_limit_counts_the_prefill_that_comes_with_each_decode() -> None:
    """The step of a full batch also carries the prefill of the requests that
    replace finished ones; a limit sized on decode steps alone (as before)
    lets a surge of arrivals push TPOT over its target."""
    cost = linear_cost(per_token=0.001, fixed=0.01)
    ctl = controller(cost=cost, controller_mode="balanced", tpot_target=0.1)
    base = signals(tokens=148.0)  # no prompt sizes known: decode steps only
    decode_only, _, _ = ctl.batch_limit(base, PRESETS["balanced"])
    assert decode_only == pytest.approx(64, abs=1)  # 0.01 + 0.001 n <= 0.08 -> 70, cap 64
    with_prefill = replace(base, prefill_ratio=100 / 48)  # 100-token prompts, 48 out
    limit, cause, reason = ctl.batch_limit(with_prefill, PRESETS["balanced"])
    # 0.01 + 0.001 * n * (1 + 100 / 48) <= 0.08 -> n = 22
    assert reason == "by_latency" and limit in (21, 22)
    step = cost.predict(round(limit * (1 + 100 / 48)), limit)
    assert step <= 0.08 * 1.01


def test_latency_limit_caps_the_prefill_at_the_step_budget() -> None:
    cost = linear_cost(per_token=0.001, fixed=0.01)
    assert latency_limit(cost, 0.08, 64, None, 512) == 64  # 70 fit, the cap binds
    # Prompts 50x the output: without the budget the limit would be 1; the
    # budget (100 tokens a step) bounds a step at 0.11 s whatever the batch.
    assert latency_limit(cost, 0.115, 64, 50.0, 100) == 64
    assert latency_limit(cost, 0.001, 64, 0.0, 512) == 1  # never below one sequence


def test_token_budget_keeps_a_step_within_the_mode_share_of_the_tpot_target() -> None:
    ctl = controller(cost=linear_cost(per_token=0.0005, fixed=0.01), tpot_target=0.1,
                     controller_mode="latency", transition_steps=1)
    ctl.observe_step(9.0, None, demand=4)
    tick(ctl, signals(tpot=0.05))  # within 60 ms: the full budget stays
    assert ctl.knobs.max_num_batched_tokens == 512
    tick(ctl, signals(tpot=0.07))
    # Over 0.6 * 0.1 s = 60 ms: (0.06 - 0.01) / 0.0005 = 100 tokens.
    assert 95 <= ctl.knobs.max_num_batched_tokens <= 100  # the fit's ridge bias
    assert ctl.knobs.max_num_seqs == 50  # by_memory: demand no longer sizes the batch
    cut = ctl.knobs.max_num_batched_tokens
    tick(ctl, signals(tpot=0.055))  # within 60 ms but not well within (70%): held
    assert ctl.knobs.max_num_batched_tokens == cut
    tick(ctl, signals(tpot=0.03))
    tick(ctl, signals(tpot=0.03))  # two calm ticks in a row: back to the full budget
    assert ctl.knobs.max_num_batched_tokens == 512


def test_a_queue_beyond_the_batch_limit_brings_the_tick_forward() -> None:
    ctl = controller(controller_interval=10.0)
    state = {"waiting": 200, "waiting_tokens": 0, "running": 64, "kv_usage": 0.0, "busy": 0.9,
             "batch_limit": 64}
    ctl.on_step(0.0, 0, lambda: state)
    ctl.on_step(0.05, 200, lambda: state)
    assert ctl.ticks == 0  # at most every EARLY_TICK
    ctl.on_step(0.2, 10, lambda: state)
    assert ctl.ticks == 0  # the queue is within the limit: wait for the interval
    ctl.on_step(0.3, 200, lambda: state)
    assert ctl.ticks == 1
    ctl.on_step(10.3, 0, lambda: state)
    assert ctl.ticks == 2


def test_slow_tokens_cut_the_limit_once_per_cut_that_took_effect() -> None:
    cost = linear_cost(per_token=0.001, fixed=0.01)
    ctl = controller(cost=cost, controller_mode="balanced", tpot_target=0.1, transition_steps=1)
    tick(ctl, signals(tokens=148.0))
    assert ctl.knobs.max_num_seqs == 64 and ctl.correction.factor == 1.0
    # Requests finish at 110 ms a token (> the 100 ms target): the model is optimistic.
    slow = replace(signals(tokens=148.0, running=64, waiting=10), recent_tpot=0.11)
    tick(ctl, slow)
    assert ctl.correction.factor == 1.0  # one tick is no trend
    tick(ctl, slow)
    assert ctl.correction.factor == pytest.approx(0.8) and ctl.knobs.max_num_seqs == 51
    # More requests still run than the new limit allows: no second cut yet.
    for _ in range(3):
        tick(ctl, slow)
    assert ctl.correction.factor == pytest.approx(0.8)
    for _ in range(2):
        tick(ctl, replace(slow, running=51))  # in effect and still slow
    assert ctl.correction.factor == pytest.approx(0.64)
    reasons = [d.reason for d in ctl.decisions if d.knob == "latency_correction"]
    assert reasons == ["step_over_target"] * 2
    # Well within (< 70% of 100 ms) with demand over the limit, two ticks in a row: grow;
    # but not while the steps of right now are over the target.
    calm = replace(slow, running=ctl.knobs.max_num_seqs, recent_tpot=0.04)
    for _ in range(3):
        tick(ctl, replace(calm, step_time=0.12))
    assert ctl.correction.factor == pytest.approx(0.64)
    tick(ctl, calm)
    tick(ctl, calm)
    assert ctl.correction.factor == pytest.approx(0.704)


def test_tokens_within_the_target_never_cut_the_limit() -> None:
    """TPOT over the mode's step share (80 ms of 100) but within the target:
    the batch stays; cutting it (as before) starved a calm server of slots
    while its TPOT was fine, and the queue then cost first tokens."""
    cost = linear_cost(per_token=0.001, fixed=0.01)
    ctl = controller(cost=cost, controller_mode="balanced", tpot_target=0.1, transition_steps=1)
    tick(ctl, signals(tokens=148.0))
    busy = replace(signals(tokens=148.0, running=64, waiting=10), recent_tpot=0.09)
    for _ in range(6):
        tick(ctl, busy)
    assert ctl.correction.factor == 1.0 and ctl.knobs.max_num_seqs == 64


def test_alternating_signals_do_not_make_the_knobs_oscillate() -> None:
    """Signals flipping every tick (step time over / under target, TTFT and
    TPOT misses taking turns) leave every knob moving one way at most."""
    cost = linear_cost(per_token=0.001, fixed=0.01)
    ctl = controller(cost=cost, controller_mode="balanced", tpot_target=0.1,
                     ttft_target=0.5, transition_steps=1)
    seen = {"max_num_seqs": [], "max_num_batched_tokens": []}
    for i in range(40):
        running = ctl.knobs.max_num_seqs
        over = i % 2 == 0
        tick(ctl, replace(signals(tokens=148.0, running=running, waiting=5,
                                  ttft=0.9 if over else 0.2, tpot=0.05 if over else 0.2),
                          step_time=0.09 if over else 0.05, prefill_ratio=1.0,
                          recent_tpot=0.09 if over else 0.05))
        for knob, values in seen.items():
            values.append(getattr(ctl.knobs, knob))
    for knob, values in seen.items():
        moves = [b - a for a, b in zip(values, values[1:]) if b != a]
        assert all(m < 0 for m in moves) or all(m > 0 for m in moves), (knob, values)
    # Request-level batching: alternating TTFT / TPOT misses never move alpha.
    level = controller(request_level=True, ttft_target=0.5, tpot_target=0.1)
    for i in range(20):
        tick(level, signals(ttft=0.9, tpot=0.05) if i % 2 else signals(ttft=0.2, tpot=0.2))
    assert level.alpha == 2.0 and not [d for d in level.decisions if d.knob == "alpha"]


def _state(waiting: int = 0, running: int = 0) -> dict:
    return {"waiting": waiting, "waiting_tokens": 0, "running": running, "kv_usage": 0.0,
            "busy": 0.5, "batch_limit": 64}


def test_an_arrival_surge_is_acted_on_within_a_second() -> None:
    ctl = controller(controller_interval=10.0, controller_fast_window=2.0)
    now = 0.0
    ctl.on_step(now, 0, _state)
    for _ in range(60):  # 2 arrivals per second for 30 s: steady, no early tick
        now += 0.5
        ctl.observe_arrival(now, 148, 100)
        ctl.on_step(now, 0, _state)
    assert ctl.ticks == 3 and not ctl.early_ticks  # the interval's ticks only
    surge_start = now
    while ctl.ticks == 3:  # then 6 per second
        now += 1 / 6
        ctl.observe_arrival(now, 148, 100)
        ctl.on_step(now, 0, _state)
    assert now - surge_start <= 1.0 and ctl.early_ticks == {"arrivals": 1}


def test_queue_growth_and_slow_steps_bring_the_tick_forward() -> None:
    ctl = controller(controller_interval=10.0, tpot_target=0.1)
    now = 0.0
    for _ in range(15):  # 64 running at the limit, steps of 20 ms
        ctl.on_step(now, 0, _state, 64)
        now += 0.02
    assert ctl.ticks == 0
    ctl.on_step(now, 3, _state, 64)  # 3 waiting behind a full batch, and growing
    assert ctl.early_ticks == {"queue": 1}
    for _ in range(15):
        now += 0.02
        ctl.on_step(now, 3, _state, 64)  # the queue holds still: no event
    assert ctl.ticks == 1
    slow_since = now
    while ctl.ticks == 1:  # steps of 150 ms while requests run: over 0.8 x 100 ms
        now += 0.15
        ctl.on_step(now, 3, _state, 64)
    # once the fast window's (2 s) mean step is over the step target
    assert now - slow_since <= 2.0 and ctl.early_ticks["steps"] == 1


def test_step_time_counts_only_gaps_between_busy_steps() -> None:
    ctl = controller(controller_fast_window=10.0)
    for now, running in [(0.0, 2), (0.05, 2), (0.1, 0), (5.0, 1), (5.07, 1)]:
        ctl.on_step(now, 0, _state, running)
    # 0.05 and 0.07; the idle stretch from 0.1 to 5.0 is no step.
    assert ctl.window.steps.values(5.07) == pytest.approx([0.05, 0.07])
    assert ctl.window.step_time(5.07) == pytest.approx(0.06)
    assert ctl.window.step_time(20.0) is None  # out of the fast window


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
    with caplog.at_level("INFO", logger="carpool.scheduler.controller"):
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
