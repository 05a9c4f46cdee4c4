"""Autoscaling policies (carpool.cluster.autoscaler) on a fluid pool model."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.cluster.autoscaler import (
    AutoscaleConfig,
    PoolSignals,
    demand,
    make_scaler,
    replicas_for,
)

SERVICE = 4.0  # seconds a request stays


def drive(scaler, rate_at, seconds: float, seed: int = 0, startup: float | None = None):
    """Tick ``scaler`` over a pool whose requests in flight follow Little's
    law at the offered rate (Poisson counts per tick); replicas become ready
    ``startup`` seconds after they are asked for. Returns (time, replicas) per tick."""
    config = scaler.config
    startup = config.startup_s if startup is None else startup
    rng = random.Random(seed)
    pending: list[tuple[float, int]] = []  # (ready at, replicas asked)
    ready = scaler.replicas
    history = []
    now = 0.0
    while now < seconds:
        now += config.tick_s
        rate = rate_at(now)
        arrivals = _poisson(rng, rate * config.tick_s)
        while pending and pending[0][0] <= now:
            ready = max(ready, pending.pop(0)[1])
        ready = min(ready, scaler.replicas)  # scale-in takes effect at once
        in_flight = rate * SERVICE * rng.uniform(0.9, 1.1)
        slots = ready * config.replica_concurrency
        signals = PoolSignals(now, scaler.replicas, ready, max(0, int(in_flight - slots)),
                              int(in_flight), arrivals, min(1.0, in_flight / slots), SERVICE)
        before = scaler.replicas
        after = scaler.tick(signals)
        if after > before:
            pending.append((now + startup, after))
        history.append((now, after))
    return history


def _poisson(rng, mean: float) -> int:
    if mean > 50:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    count, limit, product = 0, math.exp(-mean), rng.random()
    while product > limit:
        count += 1
        product *= rng.random()
    return count


@pytest.mark.parametrize("policy", ["reactive", "predictive"])
@settings(max_examples=12, deadline=None)
@given(rate=st.floats(5, 200), seed=st.integers(0, 1000))
def test_a_flat_noisy_load_does_not_make_the_pool_oscillate(policy, rate, seed):
    config = AutoscaleConfig(max_replicas=100)
    scaler = make_scaler(policy, config, replicas=replicas_for(rate, SERVICE, config))
    drive(scaler, lambda t: rate, 6 * 3600, seed)
    directions = [e.replicas_to > e.replicas_from for e in scaler.events]
    flips = sum(1 for a, b in zip(directions, directions[1:]) if a != b)
    assert flips <= 1, scaler.events
    assert len(scaler.events) <= 3, scaler.events


@pytest.mark.parametrize("policy", ["reactive", "predictive"])
def test_a_step_increase_is_met_within_the_stated_delay(policy):
    """A 3x step at 1 h: the pool asks for what the new rate needs within
    the panic window plus two ticks (the panic rule skips the cooldown)."""
    config = AutoscaleConfig(max_replicas=200)
    low, high = 40.0, 120.0
    scaler = make_scaler(policy, config, replicas=replicas_for(low, SERVICE, config))
    history = drive(scaler, lambda t: high if t >= 3600 else low, 7200)
    needed = replicas_for(high, SERVICE, config)
    reached = next(t for t, replicas in history if replicas >= 0.9 * needed)
    assert reached - 3600 <= config.panic_window_s + 2 * config.tick_s, scaler.events[-3:]


def test_reactive_scales_in_only_after_low_utilization_lasts():
    config = AutoscaleConfig(max_replicas=50)
    scaler = make_scaler("reactive", config, replicas=20)
    history = drive(scaler, lambda t: 30.0, 1800)  # needs ~6 replicas
    first_in = next(e for e in scaler.events if e.replicas_to < e.replicas_from)
    assert first_in.time >= config.scale_in_after_s
    assert "utilization" in first_in.cause
    assert history[-1][1] == pytest.approx(replicas_for(30.0, SERVICE, config), abs=1)


def test_predictive_scales_ahead_of_a_ramp_and_reactive_lags():
    """A linear ramp from 20 to 200 req/s over 2 h: predictive holds enough
    replicas ready (counting start-up) for more of the ramp than reactive."""
    config = AutoscaleConfig(max_replicas=300, startup_s=300)

    def rate(t):
        return 20 + 180 * min(1.0, max(0.0, (t - 1800) / 7200))

    short = {}
    for policy in ("reactive", "predictive"):
        scaler = make_scaler(policy, config, replicas=replicas_for(20, SERVICE, config))
        history = drive(scaler, rate, 3 * 3600)
        # Replicas ready at t are those asked for by t - startup.
        asked = dict(history)
        times = [t for t, _ in history]
        short[policy] = sum(
            1 for t in times if t > config.startup_s
            and asked[max(x for x in times if x <= t - config.startup_s)]
            < replicas_for(rate(t), SERVICE, config))
    assert short["predictive"] < short["reactive"], short


def test_schedule_and_oracle_and_bounds():
    config = AutoscaleConfig(min_replicas=2, max_replicas=10, startup_s=60)
    schedule = make_scaler("schedule", config, schedule=[(0, 3), (9 * 3600, 8), (18 * 3600, 40)])
    times = {t: r for t, r in drive(schedule, lambda t: 10.0, 24 * 3600)}
    assert times[8 * 3600] == 3 and times[12 * 3600] == 8
    assert times[20 * 3600] == 10  # clamped to max_replicas
    oracle = make_scaler("oracle", config, rate_at=lambda t: 100.0 if t > 1000 else 10.0)
    history = dict(drive(oracle, lambda t: 100.0 if t > 1000 else 10.0, 2000))
    assert history[1000 - 60] == 10  # asked a start-up ahead (capped at 10)
    with pytest.raises(ValueError, match="unknown autoscaling policy"):
        make_scaler("guess", config)
    with pytest.raises(ValueError, match="min_replicas"):
        make_scaler("reactive", AutoscaleConfig(min_replicas=5, max_replicas=2))


@pytest.mark.parametrize("policy", ["reactive", "predictive"])
def test_an_ordinary_wait_on_a_big_fleet_does_not_scale_it_out(policy):
    """Little's law: 200 replicas at 190 req/s where every request waits
    ~0.8 s behind long prefills hold ~150 waiting at any fleet size. That
    is no backlog to scale out for (wait under scale_out_wait_s); the same
    count at 10 req/s (a 15 s wait) is, and so is the seeds' count alone."""
    def run(rate: float, wait_s: float) -> int:
        config = AutoscaleConfig(max_replicas=1000, scale_out_wait_s=wait_s)
        scaler = make_scaler(policy, config, replicas=200)
        for tick in range(1, 60):
            utilization = min(1.0, rate * SERVICE / (200 * config.replica_concurrency))
            scaler.tick(PoolSignals(tick * config.tick_s, scaler.replicas, 200, 150, 800,
                                    round(rate * config.tick_s), max(0.5, utilization),
                                    SERVICE))
        return scaler.replicas

    # No scale-out; predictive may scale in (the forecast wants ~34 replicas).
    assert run(190.0, 1.0) == 200 if policy == "reactive" else run(190.0, 1.0) <= 200
    assert run(10.0, 1.0) > 200
    assert run(190.0, 0.0) > 200  # the seeds' rule: any 100 waiting


@pytest.mark.parametrize("policy", ["reactive", "predictive"])
def test_a_pool_whose_traffic_stops_scales_to_zero_and_wakes_for_the_next_request(policy):
    config = AutoscaleConfig(min_replicas=0, max_replicas=4, tick_s=10)
    scaler = make_scaler(policy, config, replicas=1)

    def tick(now: float, arrivals: int, in_flight: int) -> int:
        ready = scaler.replicas
        utilization = min(1.0, in_flight / (ready * config.replica_concurrency)) if ready else 0.0
        return scaler.tick(PoolSignals(now, ready, ready, 0, in_flight, arrivals, utilization,
                                       SERVICE))

    now = 0.0
    while now < 600:  # a trickle: a request every 200 s never lets it reach zero
        now += 10
        assert tick(now, int(now % 200 == 0), int(now % 200 == 0)) == 1
    stopped = now
    while now < 2000:  # then nothing
        now += 10
        tick(now, 0, 0)
    to_zero = next(e for e in scaler.events if e.replicas_to == 0)
    assert to_zero.time >= stopped - 200 + config.scale_in_window_s
    assert scaler.replicas == 0
    # A request at zero: one replica at once (the front holds it meanwhile).
    assert scaler.wake(now) and scaler.replicas == 1 and not scaler.wake(now)
    assert tick(now + 10, 0, 1) == 1  # and not straight back to zero
    # A tick that sees arrivals at zero does the same, without a cooldown.
    scaler.replicas = 0
    assert tick(now + 20, 3, 0) == 1 and scaler.events[-1].cause == "requests at zero replicas"
    with pytest.raises(ValueError, match="max_replicas >= 1"):
        AutoscaleConfig(min_replicas=0, max_replicas=0).validate()


def test_forecasters_follow_a_trend_a_daily_shape_and_an_arima_fit():
    from carpool.cluster.forecast import make_forecaster

    ramp = [float(i) for i in range(30)]  # +1 req/s per bucket
    holt = make_forecaster("holt", 60.0)
    assert holt.forecast(ramp[:2], 5) is None  # too little history
    ahead = holt.forecast(ramp, 5)
    assert len(ahead) == 6 and ahead[0] == pytest.approx(29, abs=1.5) and ahead[-1] > ahead[0]
    # A daily shape (buckets of an hour): yesterday's curve, at today's level.
    day = [10 + 10 * math.sin(2 * math.pi * h / 24) for h in range(24)]
    history = day + [2 * v for v in day[:12]]  # today runs at twice yesterday
    seasonal = make_forecaster("seasonal", 3600.0)
    assert seasonal.forecast(day[:20], 3) == holt_like(day[:20], 3)  # Holt before a day
    coming = seasonal.forecast(history, 4)
    assert coming == pytest.approx([2 * v for v in day[12:17]], rel=1e-9)
    # ARIMA on a noisy ramp: it follows the trend upward.
    rng = random.Random(0)
    noisy = [5 + 0.5 * i + rng.gauss(0, 0.3) for i in range(90)]
    arima = make_forecaster("arima", 60.0)
    assert arima.forecast(noisy[:30], 5) == holt_like(noisy[:30], 5)  # Holt before an hour
    forecast = arima.forecast(noisy, 10)
    assert len(forecast) == 11 and forecast[-1] > noisy[-1] + 2
    assert arima.forecast(noisy + [50.0], 10)[0] > forecast[0]  # a new bucket is taken in
    with pytest.raises(ValueError, match="unknown forecaster"):
        make_forecaster("tea-leaves", 60.0)


def holt_like(buckets, steps):
    from carpool.cluster.forecast import HoltForecaster

    return HoltForecaster().forecast(buckets, steps)


@pytest.mark.parametrize("forecaster", ["holt", "seasonal", "arima"])
def test_the_forecast_alone_scales_ahead_of_a_ramp(forecaster):
    config = AutoscaleConfig(max_replicas=40, startup_s=60, forecast_horizon_s=300)
    scaler = make_scaler("forecast", config, replicas=2, forecaster=forecaster)
    drive(scaler, lambda t: 10.0 + 0.05 * t, 3600)  # 10 -> 190 req/s over an hour
    # Sized for the end of the ramp (within the tolerance band that keeps a
    # want at a rounding edge from moving the pool).
    assert scaler.replicas * (1 + config.tolerance) >= demand(190.0, SERVICE, config)
    assert scaler.events and all("forecast" in e.cause or "highest want" in e.cause
                                 for e in scaler.events)


def test_a_remembered_day_lets_the_seasonal_forecast_see_the_evening_peak_coming():
    """Yesterday's buckets, remembered before the first tick, give the
    seasonal forecaster a daily shape at once: at 17:45 it sizes for the
    18:00 peak it has not seen today; without the history it is Holt's
    flat line. History after the first tick is refused."""
    config = AutoscaleConfig(max_replicas=400, forecast_horizon_s=1800)

    def day_rate(t: float) -> float:
        return 200.0 if (t % 86400) >= 18 * 3600 else 50.0

    def at_evening(remember: bool) -> int:
        scaler = make_scaler("predictive", config, replicas=10, forecaster="seasonal")
        if remember:
            scaler.rates.remember([day_rate(-86400 + 60 * i + 30) for i in range(1440)])
        for tick in range(1, 6391):  # midnight to 17:45
            now = tick * config.tick_s
            arrivals = round(day_rate(now) * config.tick_s)
            scaler.tick(PoolSignals(now, scaler.replicas, scaler.replicas, 0,
                                    round(day_rate(now) * SERVICE), arrivals, 0.6, SERVICE))
        return scaler.replicas

    assert at_evening(True) >= replicas_for(200.0, SERVICE, config)
    assert at_evening(False) < replicas_for(100.0, SERVICE, config)
    scaler = make_scaler("predictive", config)
    scaler.tick(PoolSignals(10.0, 1, 1, 0, 0, 0, 0.0, SERVICE))
    with pytest.raises(ValueError, match="before the first tick"):
        scaler.rates.remember([1.0])
