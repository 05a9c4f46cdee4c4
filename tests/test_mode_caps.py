"""Issue 42, item 3: the modes' caps are real caps (latency 4 requests /
50 ms, throughput 16 / 200 ms under request-level batching with the default
cap of 16; the same shares of the sequence cap and step budget under
continuous batching), a queue that outgrows them moves the mode up at once,
the batch limit is min(by_memory, by_latency, demand x alpha) under
continuous batching too, and it is recomputed every 100 ms when asked."""
from __future__ import annotations

from dataclasses import replace

from carpool.config import ControllerConfig, SchedulerConfig
from carpool.scheduler.control.controller import AdaptiveController, LiveKnobs
from carpool.scheduler.control.cost_model import StepCostModel
from carpool.scheduler.control.modes import PRESETS
from tests.test_controller import linear_cost, signals, tick


def controller(request_level: bool, cost: StepCostModel | None = None,
               **overrides) -> AdaptiveController:
    """A controller over the default scheduler settings (16 requests a
    request-level batch, 128 sequences and 1024 tokens a continuous step)."""
    config = ControllerConfig(adaptive=True, transition_steps=1, **overrides)
    config.validate()
    base = SchedulerConfig(batching="dynamic" if request_level else "continuous")
    return AdaptiveController(config, base, LiveKnobs.from_config(base), num_blocks=100000,
                              block_size=16, cost_model=cost or StepCostModel(),
                              request_level=request_level)


def test_request_level_modes_cap_the_batch_and_the_wait_as_designed() -> None:
    for mode, (cap, wait) in {"latency": (4, 0.05), "balanced": (8, 0.1),
                              "throughput": (16, 0.2)}.items():
        ctl = controller(True, controller_mode=mode)
        ctl.knobs.max_wait = 1.0  # an operator's long wait: the mode's ceiling binds
        for _ in range(3):
            tick(ctl, signals(waiting=0, running=0, ttft=None, tpot=None, fill=0.9))
        assert ctl.knobs.max_batch_size == cap and ctl.knobs.preferred_batch_size == cap, mode
        assert ctl.knobs.max_wait == wait, mode
        assert ctl.mode_caps(mode)[0] == cap
    # A bigger configured cap keeps the shares: latency a quarter, throughput all of it.
    ctl = controller(True)
    ctl.base = replace(ctl.base, max_batch_size=64)
    assert ctl.mode_caps("latency")[0] == 16 and ctl.mode_caps("throughput")[0] == 64


def test_continuous_modes_cap_sequences_and_the_step_budget() -> None:
    ctl = controller(False, controller_mode="latency")
    tick(ctl, signals(waiting=0, running=2, ttft=None, tpot=None))
    assert (ctl.knobs.max_num_seqs, ctl.knobs.max_num_batched_tokens) == (32, 256)
    ctl = controller(False, controller_mode="balanced")
    tick(ctl, signals(waiting=0, running=2, ttft=None, tpot=None))
    assert (ctl.knobs.max_num_seqs, ctl.knobs.max_num_batched_tokens) == (64, 1024)
    ctl = controller(False, controller_mode="throughput")
    tick(ctl, signals(waiting=0, running=2, ttft=None, tpot=None))
    assert (ctl.knobs.max_num_seqs, ctl.knobs.max_num_batched_tokens) == (128, 1024)


def test_a_queue_over_the_modes_caps_moves_it_up_at_once() -> None:
    ctl = controller(False, hysteresis_ticks=3)
    quiet = replace(signals(waiting=0, running=1, busy=0.1, ttft=None, tpot=None),
                    fast_arrival_rate=0.5)
    for _ in range(3):
        tick(ctl, quiet)
    assert ctl.mode == "latency"
    # 40 waiting + 1 running: over latency's 32 sequences, within balanced's 64.
    burst = replace(signals(waiting=40, running=1, busy=0.1, ttft=None, tpot=None),
                    fast_arrival_rate=0.5)
    tick(ctl, burst)
    assert ctl.mode == "balanced" and ctl.knobs.max_num_seqs == 64
    mode_change = [d for d in ctl.decisions if d.knob == "mode"][-1]
    assert "outgrow mode latency's caps" in mode_change.cause
    tick(ctl, replace(burst, waiting=100))  # over balanced's 64 too: throughput
    assert ctl.mode == "throughput" and ctl.knobs.max_num_seqs == 128
    # A few prompts too long for latency mode's 256-token budget outgrow it too.
    ctl = controller(False, controller_mode="auto")
    ctl.selector.mode = "latency"
    tick(ctl, replace(quiet, waiting=3, waiting_tokens=900))
    assert ctl.mode == "balanced"


def test_a_move_down_waits_until_the_demand_fits_the_lower_mode() -> None:
    ctl = controller(False, hysteresis_ticks=1)
    ctl.selector.mode = "throughput"
    # Light on every signal but 100 sequences still running: latency's 32 do not fit.
    light = replace(signals(waiting=0, running=100, busy=0.1, ttft=None, tpot=None),
                    fast_arrival_rate=0.5)
    for _ in range(3):
        tick(ctl, light)
    assert ctl.mode == "throughput"
    tick(ctl, replace(light, running=20))
    assert ctl.mode == "latency"


def test_alpha_times_demand_bounds_a_continuous_batch_under_an_operators_target() -> None:
    # Tokens cheap enough that by_latency allows the whole cap.
    cost = linear_cost(per_token=0.0001, fixed=0.005)
    ctl = controller(False, cost=cost, controller_mode="throughput", tpot_target=0.1)
    ctl.observe_step(9.0, None, demand=40)
    limit, cause, reason = ctl.batch_limit(signals(), PRESETS["throughput"])
    assert (limit, reason) == (80, "by_demand") and "alpha 2.00" in cause
    ctl.alpha_control.value = 1.0  # the least alpha: the peak demand itself
    assert ctl.batch_limit(signals(), PRESETS["throughput"])[:1] == (40,)
    # Without an operator's TPOT or E2E target there is no demand term.
    measured = controller(False, cost=cost, controller_mode="throughput")
    measured.observe_step(9.0, None, demand=40)
    assert "by_demand" not in measured.batch_limit(signals(), PRESETS["throughput"])[1]


def test_the_limit_is_recomputed_every_100_ms_when_asked() -> None:
    ctl = controller(False, cost=linear_cost(), controller_interval=0.1,
                     controller_window=5.0, tpot_target=0.1)
    state = {"waiting": 0, "waiting_tokens": 0, "running": 2, "kv_usage": 0.1,
             "busy": 0.5, "batch_limit": 128}
    now = 10.0
    for _ in range(20):  # steps of 100 ms: a decision at every one
        ctl.on_step(now, 0, lambda: state, 2)
        now += 0.1
    assert ctl.ticks >= 19
