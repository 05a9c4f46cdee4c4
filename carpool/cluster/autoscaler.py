"""Autoscaling a pool of replicas: reactive, predictive, scheduled, oracle.

Each policy turns what the pool looks like at a tick (``PoolSignals``)
into the replica count it wants and why. ``PoolScaler`` owns the count:
it clamps a want to [min, max], applies it at once when it is more
(start-up takes time, so a scale-out is never held back beyond its
cooldown) and only when the *highest* want of the last
``scale_in_window`` seconds is less (the stabilisation window of
Kubernetes' autoscaler: a dip in a noisy load cannot start a scale-in,
so a flat load never oscillates), and logs every change with its cause.

With ``min_replicas`` 0 a pool whose traffic stopped scales to zero, but
only after a whole ``scale_in_window`` without a request; any request at
zero wants one replica at once (``PoolScaler.wake``: the live front holds
the request until it is up, rather than turning it away).

Pure Python: the simulator and a live fleet tick it with their own clock.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from carpool.cluster.forecast import Forecaster, HoltForecaster, make_forecaster


@dataclass(frozen=True)
class PoolSignals:
    """A pool at one tick, as the driver measured it."""

    now: float
    replicas: int  # ready and starting
    ready: int
    backlog: int  # requests waiting for a batch slot, over the pool
    in_flight: int  # requests the pool holds (waiting and running)
    arrivals: int  # requests that arrived since the previous tick
    utilization: float  # share of the ready replicas' slots in use, 0-1
    service_time: float | None = None  # mean seconds a request stays, learned


@dataclass
class AutoscaleConfig:
    """Thresholds and sizes; the defaults are the seeds' rules."""

    min_replicas: int = 1
    max_replicas: int = 64
    tick_s: float = 10.0
    scale_out_backlog: int = 100  # scale out when more than this many wait ...
    # ... and they would wait longer than this: backlog / the arrival rate of
    # the last panic window, in seconds (0: the seeds' count alone). A count
    # alone grows with the fleet: by Little's law a pool where every request
    # waits a little (behind long prefills) holds rate x wait waiting at any
    # size, so at 190 req/s "100 waiting" is ~0.5 s of ordinary wait.
    scale_out_wait_s: float = 1.0
    scale_in_utilization: float = 0.5  # scale in when under this ...
    scale_in_after_s: float = 300.0  # ... for this long
    scale_out_cooldown_s: float = 30.0
    scale_in_window_s: float = 300.0  # stabilisation window for scale-in
    panic_window_s: float = 10.0  # arrivals over this short window ...
    panic_factor: float = 2.0  # ... wanting this many times the pool: act now
    startup_s: float = 60.0  # a replica's start-up time
    target_utilization: float = 0.7
    # A want within this share of the pool is no reason to move: scale out
    # when demand > replicas x (1 + tolerance), in to a count that demand
    # fills to at most (1 - tolerance); the gap keeps a load at a rounding
    # edge from moving the pool back and forth.
    tolerance: float = 0.1
    replica_concurrency: float = 32.0  # requests one replica serves within the SLO
    forecast_horizon_s: float = 900.0
    forecast_bucket_s: float = 60.0

    def validate(self) -> AutoscaleConfig:
        if not (0 <= self.min_replicas <= self.max_replicas and self.max_replicas >= 1):
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, "
                             f"got {self.min_replicas} and {self.max_replicas}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got "
                             f"{self.target_utilization}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")
        if self.tick_s <= 0 or self.replica_concurrency <= 0:
            raise ValueError("tick_s and replica_concurrency must be > 0")
        return self


def demand(rate: float, service_time: float, config: AutoscaleConfig) -> float:
    """``rate x service_time / (replica_concurrency x target_utilization)``:
    Little's law for the requests in flight at ``rate``, over what one
    replica holds at the target utilisation (not rounded)."""
    return rate * service_time / (config.replica_concurrency * config.target_utilization)


def replicas_for(rate: float, service_time: float, config: AutoscaleConfig) -> int:
    """``ceil(demand(...))``: the replicas the pool needs at ``rate``."""
    return math.ceil(demand(rate, service_time, config) - 1e-9)


@dataclass(frozen=True)
class Want:
    replicas: int
    cause: str
    urgent: bool = False  # skips the scale-out cooldown (a panic)
    demand: float | None = None  # the unrounded replicas behind ``replicas``, if sized


class ScalingPolicy(Protocol):
    name: str

    def want(self, signals: PoolSignals, rates: RateHistory) -> Want: ...


class RateHistory:
    """Arrival counts per tick, kept for the panic window and the forecast."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._ticks: deque[tuple[float, int]] = deque()  # (time, arrivals since the last)
        self.buckets: list[float] = []  # arrival rate per forecast bucket, oldest first
        self._bucket_start: float | None = None
        self._bucket_count = 0

    def add(self, now: float, arrivals: int) -> None:
        self._ticks.append((now, arrivals))
        keep = max(self.config.panic_window_s, self.config.tick_s) + self.config.tick_s
        while self._ticks and self._ticks[0][0] < now - keep:
            self._ticks.popleft()
        size = self.config.forecast_bucket_s
        if self._bucket_start is None:
            self._bucket_start = now - self.config.tick_s
        self._bucket_count += arrivals
        while now - self._bucket_start >= size:
            self.buckets.append(self._bucket_count / size)
            self._bucket_count = 0
            self._bucket_start += size

    def remember(self, rates: Sequence[float]) -> None:
        """Rates of buckets before the first tick (a previous day's, oldest
        first), for forecasters that learn from history longer than the run."""
        if self._bucket_start is not None:
            raise ValueError("history goes in before the first tick")
        self.buckets[:0] = list(rates)

    def rate(self, now: float, window: float) -> float:
        """Arrivals per second over the last ``window`` seconds (ticks in it)."""
        inside = [(t, n) for t, n in self._ticks if t > now - window - 1e-9]
        if not inside:
            return 0.0
        span = max(self.config.tick_s * len(inside), 1e-9)
        return sum(n for _, n in inside) / span


def _service(signals: PoolSignals) -> float:
    return signals.service_time if signals.service_time else 1.0


class ReactivePolicy:
    """Scale out by one replica per ``scale_out_backlog`` waiting requests
    when they would wait over ``scale_out_wait_s``;
    scale in to the target utilisation once utilisation has stayed under
    ``scale_in_utilization`` for ``scale_in_after_s``; panic when the short
    window's arrivals want ``panic_factor`` x the pool."""

    name = "reactive"

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._low_since: float | None = None

    def want(self, signals: PoolSignals, rates: RateHistory) -> Want:
        config = self.config
        # Unrounded: at one replica a ceil would read any noise as 2x.
        short = demand(rates.rate(signals.now, config.panic_window_s), _service(signals),
                       config)
        if short >= config.panic_factor * max(1, signals.replicas):
            return Want(math.ceil(short), f"panic: {config.panic_window_s:.0f} s of arrivals "
                                          f"want {short:.1f} replicas", urgent=True,
                        demand=short)
        if self._backlog_waits(signals, rates):
            # Counted from the ready replicas: those still starting will take
            # this backlog, and counting from the total added replicas for the
            # same backlog at every tick of a start-up (a 12x step went to 11
            # replicas where 7 served everything).
            more = math.ceil(signals.backlog / config.scale_out_backlog)
            return Want(max(signals.replicas, signals.ready + more),
                        f"backlog {signals.backlog} > {config.scale_out_backlog}"
                        + self._wait_cause(signals, rates))
        if signals.utilization < config.scale_in_utilization:
            self._low_since = signals.now if self._low_since is None else self._low_since
            if signals.now - self._low_since >= config.scale_in_after_s:
                needed = signals.ready * signals.utilization / config.target_utilization
                return Want(math.ceil(needed), f"utilization {signals.utilization:.0%} < "
                                    f"{config.scale_in_utilization:.0%} for "
                                    f"{signals.now - self._low_since:.0f} s",
                            demand=needed)
        else:
            self._low_since = None
        return Want(signals.replicas, "steady")

    def _wait(self, signals: PoolSignals, rates: RateHistory) -> float:
        """Seconds the backlog would wait at the recent arrival rate (Little's law)."""
        rate = rates.rate(signals.now, self.config.panic_window_s)
        return signals.backlog / rate if rate > 0 else math.inf

    def _backlog_waits(self, signals: PoolSignals, rates: RateHistory) -> bool:
        config = self.config
        return signals.backlog > config.scale_out_backlog and (
            config.scale_out_wait_s <= 0 or self._wait(signals, rates) > config.scale_out_wait_s)

    def _wait_cause(self, signals: PoolSignals, rates: RateHistory) -> str:
        if self.config.scale_out_wait_s <= 0:
            return ""
        return f", {self._wait(signals, rates):.1f} s wait > {self.config.scale_out_wait_s:g} s"


class PredictivePolicy:
    """Forecast the arrival rate over the next ``startup_s +
    forecast_horizon_s`` (a ``Forecaster`` over per-bucket rates; default
    damped Holt) and size the pool for the forecast peak; with ``reactive``
    (the default) never below a scale-out the reactive rules want now, so a
    forecast that misses a surge is caught as the reactive policy would
    (``predictive+reactive``; scaling in is the forecast's alone); without,
    the forecast alone decides."""

    name = "predictive"

    def __init__(self, config: AutoscaleConfig, forecaster: Forecaster | None = None,
                 reactive: bool = True) -> None:
        self.config = config
        self.forecaster = forecaster if forecaster is not None else HoltForecaster()
        self.reactive = ReactivePolicy(config) if reactive else None

    def forecast_peak(self, rates: RateHistory) -> float | None:
        """The highest rate forecast over the next start-up and horizon."""
        steps = math.ceil((self.config.startup_s + self.config.forecast_horizon_s)
                          / self.config.forecast_bucket_s)
        values = self.forecaster.forecast(rates.buckets, steps)
        return None if values is None else max(values)

    def want(self, signals: PoolSignals, rates: RateHistory) -> Want:
        floor = (self.reactive.want(signals, rates) if self.reactive is not None
                 else Want(signals.replicas, "no forecast yet"))
        peak = self.forecast_peak(rates)
        if peak is None:
            return floor
        current = rates.rate(signals.now, self.config.forecast_bucket_s)
        needed = demand(max(peak, current), _service(signals), self.config)
        replicas = math.ceil(needed - 1e-9)  # as replicas_for: no replica for float dust
        # The reactive rules are a floor for scaling out only (a panic, or a
        # backlog that waits): their "steady" would hold every replica the
        # forecast no longer needs, and their scale-in (utilisation under
        # half for 5 minutes) comes later than the forecast's.
        if self.reactive is not None and (floor.urgent or floor.replicas > max(
                replicas, signals.replicas)):
            return floor
        ahead = (self.config.startup_s + self.config.forecast_horizon_s) / 60
        return Want(replicas, f"forecast peak {peak:.1f} req/s within {ahead:.0f} min "
                              f"({self.forecaster.name}; now {current:.1f} req/s)",
                    demand=needed)


class SchedulePolicy:
    """A replica count per time of day: ``(seconds after midnight, replicas)``."""

    name = "schedule"

    def __init__(self, config: AutoscaleConfig, table: Sequence[tuple[float, int]],
                 day_s: float = 86400.0) -> None:
        if not table:
            raise ValueError("a schedule needs at least one (time, replicas) entry")
        self.config, self.day_s = config, day_s
        self.table = sorted(table)

    def want(self, signals: PoolSignals, rates: RateHistory) -> Want:
        # Look one start-up ahead, so the replicas are ready when the hour comes.
        at = (signals.now + self.config.startup_s) % self.day_s
        count = self.table[-1][1]
        for start, replicas in self.table:
            if start <= at:
                count = replicas
        return Want(count, f"schedule: {count} at {at / 3600:.2f} h")


class OraclePolicy:
    """Knows the future arrival rate (``rate_at(t)``): the reference no real
    policy can beat. Sizes for the peak over the next start-up and tick."""

    name = "oracle"

    def __init__(self, config: AutoscaleConfig, rate_at: Callable[[float], float],
                 step_s: float = 10.0) -> None:
        self.config, self.rate_at, self.step_s = config, rate_at, step_s

    def want(self, signals: PoolSignals, rates: RateHistory) -> Want:
        end = signals.now + self.config.startup_s + self.config.tick_s
        samples = math.ceil((end - signals.now) / self.step_s) + 1
        peak = max(self.rate_at(signals.now + i * self.step_s) for i in range(samples))
        return Want(replicas_for(peak, _service(signals), self.config),
                    f"oracle: {peak:.1f} req/s ahead")


@dataclass
class ScaleEvent:
    time: float
    replicas_from: int
    replicas_to: int
    cause: str


@dataclass
class PoolScaler:
    """Applies a policy's wants to a pool's replica count (see the module
    docstring); ``tick`` returns the count the pool should have now."""

    policy: ScalingPolicy
    config: AutoscaleConfig
    replicas: int = 1
    events: list[ScaleEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.config.validate()
        self.replicas = min(self.config.max_replicas, max(self.config.min_replicas,
                                                          self.replicas))
        self.rates = RateHistory(self.config)
        self._wants: deque[tuple[float, int]] = deque()  # (time, want) in the window
        self._last_out = -math.inf
        self._last_busy: float | None = None  # the latest tick with work (or a wake)

    def wake(self, now: float) -> bool:
        """A request came while the pool is at zero: one replica, now (no
        cooldown). False: the pool is not at zero."""
        self._last_busy = now
        if self.replicas:
            return False
        self._change(now, 1, "a request at zero replicas")
        self._last_out = now
        return True

    def tick(self, signals: PoolSignals) -> int:
        self.rates.add(signals.now, signals.arrivals)
        want = self.policy.want(signals, self.rates)
        config = self.config
        wanted = want.replicas
        if want.demand is not None:  # the tolerance band (see AutoscaleConfig)
            if wanted > self.replicas and want.demand <= self.replicas * (1 + config.tolerance):
                wanted = self.replicas
            elif wanted < self.replicas:  # in, but never past the band: not out
                wanted = min(self.replicas, max(
                    wanted, math.ceil(want.demand / (1 - config.tolerance) - 1e-9)))
        wanted = min(config.max_replicas, max(config.min_replicas, wanted, self._floor(signals)))
        if self.replicas == 0 and (signals.arrivals or signals.in_flight or signals.backlog):
            want = Want(wanted, "requests at zero replicas", urgent=True)  # as ``wake``
        self._wants.append((signals.now, wanted))
        while self._wants and self._wants[0][0] < signals.now - config.scale_in_window_s:
            self._wants.popleft()
        if wanted > self.replicas:
            if want.urgent or signals.now - self._last_out >= config.scale_out_cooldown_s:
                self._change(signals.now, wanted, want.cause)
                self._last_out = signals.now
        elif wanted < self.replicas:
            ceiling = max(w for _, w in self._wants)  # the highest want of the window
            if ceiling < self.replicas:
                self._change(signals.now, ceiling, f"{want.cause}; highest want of the last "
                                                   f"{config.scale_in_window_s:.0f} s")
        return self.replicas

    def _floor(self, signals: PoolSignals) -> int:
        """1 while the pool had work within the last ``scale_in_window_s``
        (the only way to zero is a whole window idle), else 0."""
        if signals.arrivals or signals.in_flight or signals.backlog:
            self._last_busy = signals.now
        if self._last_busy is None:  # the first tick: a window from now
            self._last_busy = signals.now
        return int(signals.now - self._last_busy < self.config.scale_in_window_s)

    def _change(self, now: float, replicas: int, cause: str) -> None:
        self.events.append(ScaleEvent(now, self.replicas, replicas, cause))
        self.replicas = replicas


def make_scaler(name: str, config: AutoscaleConfig, replicas: int = 1, *,
                schedule: Sequence[tuple[float, int]] = (),
                rate_at: Callable[[float], float] | None = None,
                forecaster: str = "holt") -> PoolScaler:
    """A ``PoolScaler`` with the policy called ``name`` (``predictive``:
    with the reactive floor; ``forecast``: the forecast alone), predicting
    with the ``forecaster`` named (``carpool.cluster.forecast``)."""
    if name == "reactive":
        policy = ReactivePolicy(config)
    elif name in ("predictive", "forecast"):
        policy = PredictivePolicy(config, make_forecaster(forecaster, config.forecast_bucket_s),
                                  reactive=name == "predictive")
        policy.name = name
    elif name == "schedule":
        policy = SchedulePolicy(config, schedule)
    elif name == "oracle":
        if rate_at is None:
            raise ValueError("the oracle autoscaler needs the future arrival rate")
        policy = OraclePolicy(config, rate_at)
    else:
        raise ValueError(f"unknown autoscaling policy {name!r}; one of reactive, predictive, "
                         f"forecast, schedule, oracle")
    return PoolScaler(policy, config, replicas)
