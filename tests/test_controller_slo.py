"""The SLO side of the adaptive controller: the prefill-aware batch limit,
the step budget, the TPOT feedback correction and event-driven ticks."""
from __future__ import annotations

from dataclasses import replace

import pytest

from carpool.scheduler import RejectedError, Request
from carpool.scheduler.control.live_window import LiveWindow
from carpool.scheduler.control.modes import PRESETS
from carpool.scheduler.control.slo_policy import latency_limit
from tests.test_controller import (
    adaptive_scheduler,
    controller,
    linear_cost,
    signals,
    tick,
)


def test_batch_limit_counts_the_prefill_that_comes_with_each_decode() -> None:
    """The step of a full batch also carries the prefill of the requests that
    replace finished ones; a limit sized on decode steps alone (as before)
    lets a surge of arrivals push TPOT over its target."""
    cost = linear_cost(per_token=0.001, fixed=0.01)
    ctl = controller(cost=cost, controller_mode="throughput", tpot_target=0.1)
    base = signals(tokens=148.0)  # no prompt sizes known: decode steps only
    decode_only, _, _ = ctl.batch_limit(base, PRESETS["throughput"])
    assert decode_only == pytest.approx(64, abs=1)  # 0.01 + 0.001 n <= 0.08 -> 70, cap 64
    with_prefill = replace(base, prefill_ratio=100 / 48)  # 100-token prompts, 48 out
    limit, cause, reason = ctl.batch_limit(with_prefill, PRESETS["throughput"])
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
    # Latency mode's caps: a quarter of the configured ones (16 sequences, 128 tokens).
    tick(ctl, signals(tpot=0.05, waiting=0))  # within 60 ms: the mode's budget stays
    assert ctl.knobs.max_num_batched_tokens == 128
    tick(ctl, signals(tpot=0.07, waiting=2))  # requests waiting: a cut only delays them
    assert ctl.knobs.max_num_batched_tokens == 128
    tick(ctl, signals(tpot=0.07, waiting=0))
    # Over 0.6 * 0.1 s = 60 ms: (0.06 - 0.01) / 0.0005 = 100 tokens.
    assert 95 <= ctl.knobs.max_num_batched_tokens <= 100  # the fit's ridge bias
    # The mode's preferred batch (4 < peak demand 4 x alpha 2 = 8) under cap 16, by_memory 50.
    assert ctl.knobs.max_num_seqs == 8
    cut = ctl.knobs.max_num_batched_tokens
    tick(ctl, signals(tpot=0.055, waiting=0))  # within 60 ms but not well within (70%): held
    assert ctl.knobs.max_num_batched_tokens == cut
    tick(ctl, signals(tpot=0.03, waiting=0))
    tick(ctl, signals(tpot=0.03, waiting=0))  # two calm ticks in a row: the mode's budget
    assert ctl.knobs.max_num_batched_tokens == 128


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
    ctl = controller(cost=cost, controller_mode="throughput", tpot_target=0.1, transition_steps=1)
    tick(ctl, signals(tokens=148.0))
    assert ctl.knobs.max_num_seqs == 64 and ctl.correction.factor == 1.0
    # Requests finish at 110 ms a token (> the 100 ms target): the model is optimistic.
    slow = replace(signals(tokens=148.0, running=64, waiting=10), recent_tpot=0.11)
    tick(ctl, slow)
    assert ctl.correction.factor == 1.0  # one tick is no trend
    tick(ctl, slow)
    # Proportional: the middle of the band (87.5 ms) over the 110 ms seen, on
    # the step time the limit is sized to: 0.08 s x 0.795 -> (0.0636 - 0.01) / 0.001.
    first = 0.0875 / 0.11
    assert ctl.correction.factor == pytest.approx(first)
    assert ctl.knobs.max_num_seqs == int((0.08 * first - 0.01) / 0.001 + 1e-9)
    # More requests still run than the new limit allows: no second cut yet.
    for _ in range(3):
        tick(ctl, slow)
    assert ctl.correction.factor == pytest.approx(first)
    for _ in range(2):
        tick(ctl, replace(slow, running=ctl.knobs.max_num_seqs))  # in effect, still slow
    assert ctl.correction.factor == pytest.approx(first * first)
    reasons = [d.reason for d in ctl.decisions if d.knob == "latency_correction"]
    assert reasons == ["step_over_target"] * 2
    # Far under the band (40 ms < TPOT_LOW) with demand over the limit, two ticks
    # in a row: grow, by at most CORRECTION_STEP's 1.2 however far under;
    # but not while the steps of right now are over the target.
    calm = replace(slow, running=ctl.knobs.max_num_seqs, recent_tpot=0.04)
    for _ in range(3):
        tick(ctl, replace(calm, step_time=0.12))
    assert ctl.correction.factor == pytest.approx(first * first)
    tick(ctl, calm)
    tick(ctl, calm)
    assert ctl.correction.factor == pytest.approx(first * first * 1.2)


@pytest.mark.parametrize("overhead", [1.0, 1.3, 1.8])
@pytest.mark.parametrize("model_bias", [1.0, 2.0])
def test_the_limit_settles_where_felt_tokens_meet_the_target(overhead: float,
                                                             model_bias: float) -> None:
    """A closed loop: requests feel ``overhead`` x the engine's step (HTTP,
    detokenizing), the steps measured feed the proven floor. The correction
    moved the batch count by fixed +-20% on top of that floor, which is the
    running count itself, so each move compounded (a live limit swung
    between 11 and 24); on the step time, in proportion to the miss, the
    limit settles in the band and stays there. ``model_bias``: the cost
    model prices steps that many times what they take, so the floor binds."""
    cost = linear_cost(per_token=0.001 * model_bias, fixed=0.01 * model_bias)
    ctl = controller(cost=cost, controller_mode="throughput", tpot_target=0.1,
                     transition_steps=1)
    limits, tpots = [], []
    for i in range(60):
        running = ctl.knobs.max_num_seqs  # demand always fills the limit
        step = 0.01 + 0.001 * running
        felt = overhead * step
        tick(ctl, replace(signals(now=float(i), tokens=148.0, running=running, waiting=5),
                          recent_tpot=felt, step_time=step, step_anchor=(running, step)))
        limits.append(ctl.knobs.max_num_seqs)
        tpots.append(felt)
    settled = limits[-20:]
    assert max(settled) == min(settled), limits  # no limit cycle
    # Within the band, or pinned at the cap / range end with tokens within it.
    assert tpots[-1] <= 0.095 + 1e-9, (limits, tpots)
    assert tpots[-1] >= 0.08 or limits[-1] == 64, (limits, tpots)


def test_tokens_within_the_target_never_cut_the_limit() -> None:
    """TPOT over the feed-forward's step share (80 ms of 100) but within
    TPOT_HIGH (90 ms): the batch stays; cutting it (as before) starved a calm
    server of slots while its TPOT was fine, and the queue then cost first
    tokens."""
    cost = linear_cost(per_token=0.001, fixed=0.01)
    ctl = controller(cost=cost, controller_mode="throughput", tpot_target=0.1, transition_steps=1)
    tick(ctl, signals(tokens=148.0))
    busy = replace(signals(tokens=148.0, running=64, waiting=10), recent_tpot=0.085)
    for _ in range(6):
        tick(ctl, busy)
    assert ctl.correction.factor == 1.0 and ctl.knobs.max_num_seqs == 64


def test_alternating_signals_do_not_make_the_knobs_oscillate() -> None:
    """Signals flipping every tick (step time over / under target, TTFT and
    TPOT misses taking turns) leave every knob moving one way at most."""
    cost = linear_cost(per_token=0.001, fixed=0.01)
    ctl = controller(cost=cost, controller_mode="throughput", tpot_target=0.1,
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




def test_the_limit_grows_while_tokens_are_cheap_and_the_batch_leaves_little_room() -> None:
    """Before, the limit grew only with requests queued for a slot; but
    admission sheds what would queue too long, so on a live server nothing
    queued and the limit of a calm server stayed where it shed every burst.
    Now thin headroom (under an eighth of the limit free) is demand enough."""
    cost = linear_cost(per_token=0.001, fixed=0.01)
    ctl = controller(cost=cost, controller_mode="throughput", tpot_target=0.1, transition_steps=1)
    tick(ctl, signals(tokens=148.0))
    limit = ctl.knobs.max_num_seqs
    roomy = replace(signals(tokens=148.0, running=limit // 2, waiting=0), recent_tpot=0.04)
    for _ in range(4):
        tick(ctl, roomy)
    assert ctl.correction.factor == 1.0  # plenty of free slots: nothing to grow for
    full = replace(roomy, running=limit - 1)  # 1 of 64 free, nothing waiting
    tick(ctl, full)
    tick(ctl, full)
    assert ctl.correction.factor == pytest.approx(1.2)


def test_recent_tpot_is_the_worst_of_the_last_few_even_when_none_finished_lately() -> None:
    """While every slot is held nothing finishes; the signal then falls back
    to the last RECENT_TPOTS requests of the slow window instead of going
    blank (a blank signal had reset the correction's streaks)."""
    window = LiveWindow(window_s=30.0, fast_s=2.0)
    for i, tpot in enumerate([0.05, 0.30, 0.10, 0.12, 0.11, 0.09]):
        window.observe_arrival(float(i), 100, 50)
        window.observe_tpot(float(i), tpot, float(i) - 1.0)
    state = {"waiting": 0, "waiting_tokens": 0, "running": 4, "kv_usage": 0.0, "busy": 0.5,
             "batch_limit": 4}
    assert window.signals(5.5, **state).recent_tpot == pytest.approx(0.12)  # last four
    assert window.signals(20.0, **state).recent_tpot == pytest.approx(0.12)  # none lately
    for t in (20.1, 20.2, 20.3, 20.4):
        window.observe_tpot(t, 0.06, 19.0)
    assert window.signals(20.5, **state).recent_tpot == pytest.approx(0.06)  # the fast window
    # Only requests that started after the correction's last move are its evidence.
    window.observe_tpot(20.45, 0.2, 10.0)  # ran mostly under the old limit
    assert window.signals(20.5, **state).recent_tpot == pytest.approx(0.2)
    assert window.signals(20.5, tpot_since=15.0, **state).recent_tpot == pytest.approx(0.06)
    assert window.signals(20.5, tpot_since=19.5, **state).recent_tpot is None  # none yet


def test_arrivals_turned_away_still_count_as_offered_load() -> None:
    """A surge that admission sheds must still show in the arrival rate."""
    scheduler = adaptive_scheduler(window=10.0, ttft_target=0.5, tpot_target=1.0)
    scheduler.config.max_queue_requests = 1
    scheduler.add_request(Request("a", [1] * 4, 4, scheduler.clock()))
    for i in range(5):
        with pytest.raises(RejectedError):
            scheduler.add_request(Request(f"r{i}", [1] * 4, 4, scheduler.clock()))
    window = scheduler.controller.window
    assert len(window.arrivals.values(scheduler.clock())) == 6


def test_a_limit_cut_keeps_the_slots_promised_to_requests_already_admitted() -> None:
    """Admission promised a first token at the live limit of its time; a cut
    while the request waits (TPOT feedback, a refit of the cost model) must
    not hold it back: before, such requests waited past the TTFT target (4.2
    s against 2.9 s over HTTP). Later arrivals see the new limit."""
    scheduler = adaptive_scheduler(window=10.0)
    scheduler.knobs.max_num_seqs = 3
    for name in ("a", "b"):
        scheduler.add_request(Request(name, [1] * 4, 4, scheduler.clock()))
    scheduler.knobs.max_num_seqs = 1  # cut after both were admitted
    scheduler.add_request(Request("late", [1] * 4, 4, scheduler.clock()))
    assert [r.slot_limit for r in scheduler.waiting] == [3, 3, 1]
    scheduler.schedule()
    assert sorted(r.request_id for r in scheduler.running) == ["a", "b"]
