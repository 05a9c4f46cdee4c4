"""The day-long autoscaling evaluation: the day's load, the fluid pool, and
``carpool evaluate autoscale`` end to end on a short trace."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from carpool.cluster.autoscaler import AutoscaleConfig, PoolScaler, SchedulePolicy, make_scaler
from carpool.sim.day_load import DAY_S, HOUR_S, DayLoad, Surge, parse_surges, retime, swing
from carpool.sim.fluid import LoadPoint, ReplicaResponse, run_fluid
from carpool.sim.plan_day import DIURNAL_CURVE
from carpool.workload.traces import TraceRequest

SLO = {"ttft": 1.0, "tpot": 0.05}


def _point(rate: float, ttft: float, in_flight: float, count: int = 200) -> LoadPoint:
    times = np.linspace(0.5 * ttft, 1.5 * ttft, count)
    return LoadPoint(rate, in_flight, 0.1 * in_flight, 4.0, times, np.full(count, 0.02))


def _response() -> ReplicaResponse:
    # Faster at light load; at 10 req/s half the TTFTs are over 1 s.
    return ReplicaResponse([_point(2.0, 0.2, 8.0), _point(6.0, 0.4, 26.0),
                            _point(10.0, 1.0, 48.0)], capacity=10.0)


def _config(**overrides) -> AutoscaleConfig:
    values = dict(min_replicas=1, max_replicas=100, replica_concurrency=6.0 * 4.0,
                  target_utilization=0.7, startup_s=60.0)
    return AutoscaleConfig(**{**values, **overrides})


def test_swing_puts_the_trough_where_asked_and_keeps_the_shape():
    curve = swing(DIURNAL_CURVE, 75 / 275)
    assert min(curve) == pytest.approx(75 / 275) and max(curve) == pytest.approx(1.0)
    assert np.argmin(curve) == np.argmin(DIURNAL_CURVE)
    assert sorted(range(24), key=curve.__getitem__) == sorted(range(24),
                                                              key=DIURNAL_CURVE.__getitem__)
    with pytest.raises(ValueError):
        swing(DIURNAL_CURVE, 0.0)


def test_the_day_ramps_between_hour_midpoints_and_surges_multiply():
    curve = tuple(float(h % 2) for h in range(24))  # 0, 1, 0, 1, ...
    load = DayLoad(100.0, curve, (Surge(5 * HOUR_S, 600.0, 2.0),))
    assert load.planned_rate_at(1.5 * HOUR_S) == pytest.approx(100.0)  # hour 1's midpoint
    assert load.planned_rate_at(2.0 * HOUR_S) == pytest.approx(50.0)  # halfway to hour 2's
    assert load.planned_rate_at(DAY_S + 1.5 * HOUR_S) == pytest.approx(100.0)  # it repeats
    assert load.planned_rate_at(0.0) == pytest.approx(50.0)  # between hour 23 and hour 0
    assert load.rate_at(5 * HOUR_S + 300) == pytest.approx(
        2 * load.planned_rate_at(5 * HOUR_S + 300))
    assert load.rate_at(5 * HOUR_S + 601) == pytest.approx(load.planned_rate_at(5 * HOUR_S + 601))


def test_surges_parse_and_bad_ones_are_refused():
    assert parse_surges("13.5:20:1.5") == (Surge(13.5 * HOUR_S, 1200.0, 1.5),)
    assert parse_surges("none") == ()
    for bad in ("13:20", "25:20:1.5", "3:0:2", "a:b:c"):
        with pytest.raises(ValueError):
            parse_surges(bad)


def test_retime_follows_the_rate_keeps_order_and_cycles_the_stream():
    stream = [TraceRequest(float(i) + (0.5 if i % 3 else 0.0), 10 + i, 5) for i in range(200)]
    load = DayLoad(20.0, (1.0,) * 24, (Surge(100.0, 100.0, 3.0),))
    plan = retime(stream, load.rate_at, 0.0, 300.0)
    times = [r.arrival for r in plan]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 300.0
    in_surge = sum(1 for t in times if 100 <= t < 200)
    before = sum(1 for t in times if t < 100)
    assert in_surge == pytest.approx(3 * before, rel=0.05)
    assert len(plan) == pytest.approx(20 * 100 * 5, rel=0.02)  # > 200: the stream cycled
    assert [r.input_len for r in plan[:200]] == [r.input_len for r in stream]


def test_response_interpolates_and_a_delay_lowers_attainment():
    response = _response()
    assert response.gauges(4.0)[0] == pytest.approx(17.0)
    assert response.gauges(1.0)[0] == pytest.approx(4.0)  # under the lowest: scales
    assert response.attainment(2.0, 0.0, SLO) == 1.0
    assert response.attainment(10.0, 0.0, SLO) == pytest.approx(0.5, abs=0.01)
    values = [response.attainment(6.0, d, SLO) for d in (0.0, 0.5, 0.7, 1.0)]
    assert values == sorted(values, reverse=True) and values[-1] == 0.0


def test_a_static_pool_under_capacity_costs_its_size_and_meets_the_slo():
    config = _config()
    scaler = PoolScaler(SchedulePolicy(config, ((0.0, 10),)), config, 10)
    day = run_fluid(scaler, lambda t: 40.0, _response(), SLO, 0.0, 2 * HOUR_S)
    summary = day.summary(0.99)
    assert day.replica_seconds == pytest.approx(10 * 2 * HOUR_S)
    assert summary["slo_attainment"] == 1.0 and summary["hours_missing_slo"] == 0
    assert sum(h["arrivals"] for h in day.hourly) == pytest.approx(40 * 2 * HOUR_S, rel=0.01)


def test_an_overloaded_pool_queues_and_misses():
    config = _config()
    scaler = PoolScaler(SchedulePolicy(config, ((0.0, 4),)), config, 4)
    day = run_fluid(scaler, lambda t: 60.0, _response(), SLO, 0.0, 600.0)  # 1.5x capacity
    assert day.timeline[-1][3] > 0.4 * 20 * 600 * 0.9  # the queue grew by ~20 req/s
    assert day.summary(0.99)["slo_attainment"] < 0.2


def test_reactive_and_predictive_follow_a_step_within_their_delay():
    for name in ("reactive", "predictive", "oracle"):
        config = _config()

        def rate(t):
            return 20.0 if t < 1800 else 60.0

        scaler = make_scaler(name, config, 5, rate_at=rate)
        day = run_fluid(scaler, rate, _response(), SLO, 0.0, 3600.0)
        ready = {round(t): r for t, _, r, _ in day.timeline}
        # Sized for 60 req/s: 60 x 4 s / (24 x 0.7) = 15 replicas; the
        # oracle readies them at the step, the others within their start-up
        # plus a few ticks and a panic.
        deadline = 1800 + (0 if name == "oracle" else config.startup_s + 60)
        assert ready[round(deadline + config.tick_s)] >= 14, (name, day.timeline[180:200])
        # No runaway: the predictive policy's damped trend overshoots a step
        # (it reads one as a ramp for a few buckets) by under half.
        assert max(r for _, r, _, _ in day.timeline) <= (22 if name == "predictive" else 16), \
            name


def test_fluid_is_deterministic_given_its_seed_and_policies_see_the_same_arrivals():
    config = _config()

    def arrivals(seed, name):
        scaler = make_scaler(name, config, 5, rate_at=lambda t: 30.0)
        day = run_fluid(scaler, lambda t: 30.0, _response(), SLO, 0.0, 3600.0, seed)
        return [h["arrivals"] for h in day.hourly]

    assert arrivals(3, "reactive") == arrivals(3, "reactive") == arrivals(3, "oracle")
    assert arrivals(3, "reactive") != arrivals(4, "reactive")


def test_evaluate_autoscale_runs_every_policy_over_one_day(tmp_path):
    from carpool.cli import main

    out = tmp_path / "day.json"
    code = main(["evaluate", "autoscale", "--workload", "azure-conv", "--arrival", "trace",
                 "--num-requests", "400", "--hardware", "h100-sxm", "--model-shape",
                 "llama-3-8b", "--calibration-replicas", "2", "--calibration-loads",
                 "0.3,0.6,1.2", "--peak-replicas", "40", "--check-replicas", "1",
                 "--check-policies", "reactive", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["target_utilization"] for r in result["rows"]] == [0.7] * 5 + [0.9] * 5
    hotter = {r["policy"]: r for r in result["rows"][5:]}
    rows = {r["policy"]: r for r in result["rows"][:5]}
    assert list(rows) == ["static peak", "reactive", "predictive", "schedule", "oracle"]
    assert hotter["oracle"]["replica_hours"] < rows["oracle"]["replica_hours"]
    assert hotter["static peak"]["peak_replicas"] < rows["static peak"]["peak_replicas"]
    assert rows["static peak"]["min_replicas"] == rows["static peak"]["peak_replicas"] >= 40
    assert rows["static peak"]["scale_events"] == 0
    assert rows["oracle"]["peak_replicas"] == pytest.approx(40, abs=2)
    assert rows["oracle"]["min_replicas"] == pytest.approx(40 * 75 / 275, abs=2)
    for row in rows.values():
        assert len(row["hourly_attainment"]) == 24
        assert row["replica_hours"] <= rows["static peak"]["replica_hours"] + 1e-6 or \
            row["policy"] == "predictive"
        assert math.isclose(row["cost"], row["replica_hours"])  # the assumed $1
    assert rows["oracle"]["replica_hours"] < 0.8 * rows["static peak"]["replica_hours"]
    assert {(r["startup_s"], r["policy"]) for r in result["equal_attainment"]} == {
        (60.0, policy) for policy in rows}
    check = result["checks"][0]
    assert check["policy"] == "reactive" and check["requests"] > 400
    assert check["per_request"]["replica_seconds"] >= 1200 - 1e-6
    assert 0 < check["fluid"]["slo_attainment"] <= 1


def test_trace_arrivals_count_what_retime_makes_interval_by_interval():
    from carpool.sim.day_load import TraceArrivals

    stream = [TraceRequest(float(i) ** 1.1 * 0.3, 10, 5) for i in range(150)]
    load = DayLoad(30.0, (1.0,) * 24, (Surge(200.0, 100.0, 2.5),))
    plan = retime(stream, load.rate_at, 0.0, 600.0, step=10.0)
    counts = TraceArrivals(stream, load.rate_at)
    made = [sum(1 for r in plan if t <= r.arrival < t + 10) for t in range(0, 600, 10)]
    counted = [counts(float(t), float(t + 10)) for t in range(0, 600, 10)]
    assert sum(counted) == pytest.approx(len(plan), abs=1)
    assert all(abs(a - b) <= 1 for a, b in zip(made, counted)), (made, counted)
    with pytest.raises(ValueError):
        counts(0.0, 10.0)  # not the next interval


def test_day_policies_can_name_a_forecaster():
    from carpool.sim.evaluate_day import _policies

    assert _policies("reactive, forecast:seasonal,predictive:arima") == (
        "reactive", "forecast:seasonal", "predictive:arima")
    with pytest.raises(ValueError, match="unknown policies"):
        _policies("predictive:tea-leaves")


def test_equal_attainment_takes_each_policy_s_cheapest_run_that_meets_every_hour():
    """Per start-up: the cheapest target meeting every hour's goal, else the
    fewest hours under it; priced against reactive's own such run."""
    from carpool.sim.day_report import equal_attainment_rows, format_equal_table

    def row(startup, policy, target, hours, missed):
        return {"startup_s": startup, "policy": policy, "target_utilization": target,
                "replica_hours": hours, "hours_missing_slo": missed, "slo_attainment": 0.99,
                "worst_hour_attainment": 0.98}

    rows = [row(60, "reactive", 0.7, 100, 0), row(60, "reactive", 0.9, 80, 2),
            row(60, "predictive", 0.7, 95, 0), row(60, "predictive", 0.9, 85, 0),
            row(120, "reactive", 0.7, 110, 1), row(120, "reactive", 0.9, 90, 3),
            row(120, "predictive", 0.7, 99, 0)]
    equal = {(r["startup_s"], r["policy"]): r for r in equal_attainment_rows(rows)}
    assert equal[(60, "reactive")]["replica_hours"] == 100
    assert equal[(60, "predictive")]["target_utilization"] == 0.9
    assert equal[(60, "predictive")]["vs_reactive"] == pytest.approx(0.85)
    assert equal[(120, "reactive")]["hours_missing_slo"] == 1  # none met every hour
    assert equal[(120, "predictive")]["vs_reactive"] == pytest.approx(0.9)
    assert "| 60 s | predictive | 0.9 | 85 | 0.85 |" in format_equal_table(list(equal.values()))
