"""Which targets the adaptive controller enforces (issue 42): a measured
TPOT target caps no batch, an operator's does; an operator's E2E target
caps the batch at the step time that lets recent long outputs finish in
time; and the mode follows six live signals (QPS, busy share, KV usage,
queue depth, TTFT p95, TPOT / E2E p99)."""
from __future__ import annotations

import dataclasses

import pytest
from test_controller import controller, linear_cost, signals

from carpool.config import ControllerConfig
from carpool.scheduler.control.modes import PRESETS, ModeSelector
from carpool.slo import AUTO


def test_a_measured_tpot_target_caps_no_batch_an_operators_does():
    cost = linear_cost(per_token=0.002, fixed=0.01)
    measured = controller(cost=cost, controller_mode="throughput")  # tpot_target auto
    assert measured.config.batch_limit_by_tpot is False
    limit, cause, reason = measured.batch_limit(signals(tokens=256.0), PRESETS["throughput"])
    assert "by_latency" not in cause and (limit, reason) == (50, "by_memory")
    operator = controller(cost=cost, controller_mode="throughput", tpot_target=0.05)
    assert operator.config.batch_limit_by_tpot is True
    assert operator.batch_limit(signals(tokens=256.0), PRESETS["throughput"])[2] == "by_latency"
    # The lever set explicitly wins over auto either way.
    forced = controller(cost=cost, controller_mode="throughput", batch_limit_by_tpot=True)
    assert "by_latency" in forced.batch_limit(signals(tokens=256.0), PRESETS["throughput"])[1]


def test_an_e2e_target_caps_the_batch_for_the_long_outputs_of_recent_requests():
    cost = linear_cost(per_token=0.002, fixed=0.01)  # a decode step of n: 0.01 + 0.002 n s
    ctl = controller(cost=cost, controller_mode="throughput", e2e_target=2.0)
    assert ctl.config.batch_limit_by_tpot is False  # the TPOT target is a measured one
    s = dataclasses.replace(signals(tokens=256.0, ttft=0.4), long_output_tokens=51.0)
    # (2.0 - 0.4) / 50 = 32 ms a token; the limit keeps 0.8 of it: 0.01 + 0.002 n <= 0.0256
    assert ctl.limit_target(s) == pytest.approx(0.032)
    limit, _, reason = ctl.batch_limit(s, PRESETS["throughput"])
    assert reason == "by_latency" and limit in (7, 8)
    # A TTFT eating the target leaves the decode at least half of it.
    late = dataclasses.replace(s, ttft_p95=1.9)
    assert ctl.limit_target(late) == pytest.approx(1.0 / 50)
    # No finished request yet: nothing to size to.
    assert ctl.limit_target(dataclasses.replace(s, long_output_tokens=None)) is None
    # With an operator's TPOT target too, the lower of the two.
    both = controller(cost=cost, e2e_target=2.0, tpot_target=0.02)
    assert both.limit_target(s) == pytest.approx(0.02)


def test_e2e_target_is_validated_and_never_auto():
    assert ControllerConfig(e2e_target=None).validate() is None
    for bad in (0.0, -1.0, AUTO, True):
        with pytest.raises(ValueError, match="e2e_target"):
            ControllerConfig(e2e_target=bad).validate()


def _selector(**targets) -> ModeSelector:
    return ModeSelector(ControllerConfig(adaptive=True, hysteresis_ticks=1,
                                         **targets).concrete())


def test_late_tokens_or_requests_with_nobody_waiting_ask_for_latency():
    selector = _selector(tpot_target=0.1, e2e_target=2.0)  # the operator's: it counts
    busy = dict(busy=0.8, waiting=0, ttft=0.2)
    measured = _selector(e2e_target=2.0)  # tpot auto: a measured target does not
    assert measured.wanted(dataclasses.replace(signals(**busy), tpot_p99=0.5))[0] != "latency"
    slow = dataclasses.replace(signals(**busy), tpot_p99=0.15)
    assert selector.wanted(slow) == ("latency", "tpot_p99 150 ms > 100 ms, queue empty")
    late = dataclasses.replace(signals(**busy), e2e_p99=2.5)
    assert selector.wanted(late) == ("latency", "e2e_p99 2.50 s > 2.00 s, queue empty")
    # With a queue, smaller steps would only delay it: not latency.
    queued = dataclasses.replace(signals(busy=0.9, waiting=3, ttft=0.2), tpot_p99=0.15)
    assert selector.wanted(queued)[0] == "throughput"
    # Nor on a saturated engine (busy over 85%) whose queue admission keeps short.
    saturated = dataclasses.replace(signals(busy=0.95, waiting=0, ttft=0.2), tpot_p99=0.15)
    assert selector.wanted(saturated)[0] != "latency"


def test_a_surge_with_a_queue_asks_for_throughput_and_kv_pressure_is_no_light_load():
    selector = _selector(ttft_target=1.0)
    calm = signals(busy=0.5, waiting=2, ttft=0.2)
    assert selector.wanted(calm)[0] == "balanced"
    surge = dataclasses.replace(calm, arrival_rate=2.0, fast_arrival_rate=6.0)
    mode, cause = selector.wanted(surge)
    assert mode == "throughput" and cause == "arrivals 6.0/s > 1.5 x 2.0/s with 2 waiting"
    light = signals(busy=0.1, waiting=0, ttft=0.2)
    assert selector.wanted(light)[0] == "latency"
    assert selector.wanted(dataclasses.replace(light, kv_usage=0.85))[0] == "balanced"
    assert selector.wanted(dataclasses.replace(light, fast_arrival_rate=5.0))[0] == "balanced"
