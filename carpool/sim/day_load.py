"""A day's arrival rate, for the autoscaling evaluation. Pure Python.

The shape: 24 hourly multipliers of the peak (by default
``plan_day.DIURNAL_CURVE``, an assumed typical diurnal shape, not data)
rescaled so that the trough is ``trough`` of the peak (default 75/275: the
seeds' day swings between 75 and 275 nodes), interpolated linearly between
hour midpoints so that the rate ramps instead of stepping. ``Surge``s
multiply it over a stretch of minutes: traffic nobody planned for (a
launch, a news event), which a schedule built from yesterday's curve does
not know and an oracle does.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

from carpool.workload.traces import TraceRequest

DAY_S = 86400.0
HOUR_S = 3600.0
SEEDS_TROUGH = 75 / 275


@dataclass(frozen=True)
class Surge:
    """``factor`` x the rate from ``start_s`` for ``duration_s`` (seconds of the day)."""

    start_s: float
    duration_s: float
    factor: float


def parse_surges(text: str) -> tuple[Surge, ...]:
    """``HOUR:MINUTES:FACTOR,...`` (``13.5:20:1.5``: from 13:30 for 20 minutes
    at 1.5x); ``none`` for no surge."""
    if text.strip().lower() == "none":
        return ()
    surges = []
    for part in text.split(","):
        fields = part.strip().split(":")
        try:
            hour, minutes, factor = (float(f) for f in fields)
        except ValueError:
            raise ValueError(f"a surge is HOUR:MINUTES:FACTOR (13.5:20:1.5), got {part!r}") \
                from None
        if not (0 <= hour < 24 and minutes > 0 and factor > 0):
            raise ValueError(f"a surge needs 0 <= HOUR < 24, MINUTES > 0, FACTOR > 0; "
                             f"got {part!r}")
        surges.append(Surge(hour * HOUR_S, minutes * 60, factor))
    return tuple(surges)


def swing(curve: tuple[float, ...], trough: float) -> tuple[float, ...]:
    """``curve`` rescaled linearly so that its lowest hour is ``trough`` and
    its highest 1 (the order of the hours and the shape between kept)."""
    if not 0 < trough <= 1:
        raise ValueError(f"the trough must be in (0, 1], got {trough}")
    low, high = min(curve), max(curve)
    if high == low:
        return tuple(1.0 for _ in curve)
    return tuple(trough + (1 - trough) * (m - low) / (high - low) for m in curve)


@dataclass(frozen=True)
class DayLoad:
    """Arrivals per second over a day (and beyond: it repeats)."""

    peak_rate: float
    curve: tuple[float, ...]  # hourly multipliers, the largest 1
    surges: tuple[Surge, ...] = ()

    def planned_rate_at(self, t: float) -> float:
        """The curve alone: what a schedule built from past days knows."""
        hours = len(self.curve)
        position = (t % DAY_S) / HOUR_S - 0.5  # hour midpoints are the knots
        low = int(position // 1)
        share = position - low
        before, after = self.curve[low % hours], self.curve[(low + 1) % hours]
        return self.peak_rate * (before + (after - before) * share)

    def rate_at(self, t: float) -> float:
        """The day's real rate: the curve times the surges under way at ``t``."""
        rate = self.planned_rate_at(t)
        for surge in self.surges:
            if surge.start_s <= t % DAY_S < surge.start_s + surge.duration_s:
                rate *= surge.factor
        return rate


def retime(stream: list[TraceRequest], rate_at, start: float, end: float,
           step: float = 1.0) -> list[TraceRequest]:
    """``stream`` (in arrival order, cycled as often as needed) re-timed to
    arrive at ``rate_at(t)`` from ``start`` to ``end``: a time change, so
    the stream's own pattern of gaps (a trace's bursts) is kept, stretched
    where the rate is low and squeezed where it is high. Arrival times are
    from ``start`` (0 is ``start``)."""
    if not stream:
        raise ValueError("retime needs a non-empty stream")
    span = max(stream[-1].arrival - stream[0].arrival, 1e-9)
    own_rate = max(len(stream) - 1, 1) / span
    # Cumulative expected arrivals on a grid, then its inverse at the
    # stream's own (cumulative) arrival counts.
    times, totals = [start], [0.0]
    while times[-1] < end:
        t = min(end, times[-1] + step)
        totals.append(totals[-1] + rate_at((times[-1] + t) / 2) * (t - times[-1]))
        times.append(t)
    out: list[TraceRequest] = []
    cycle_offset = 0.0
    index = 0
    while True:
        item = stream[index % len(stream)]
        if index and index % len(stream) == 0:
            cycle_offset += span + 1 / own_rate
        expected = (item.arrival - stream[0].arrival + cycle_offset) * own_rate
        if expected >= totals[-1]:
            return out
        at = bisect.bisect_right(totals, expected) - 1
        gap = totals[at + 1] - totals[at]
        t = times[at] + (times[at + 1] - times[at]) * ((expected - totals[at]) / gap if gap
                                                       else 0.0)
        out.append(dataclasses.replace(item, arrival=t - start))
        index += 1


class TraceArrivals:
    """How many requests of ``retime(stream, rate_at, start, ...)`` arrive in
    each interval, without making them (a full-size day is ~10^8): the
    fluid pool's arrivals are then those of the per-request simulation of
    the same stream, bursts included where an interval holds few of the
    stream's requests and smoothed where it holds many. Call with
    consecutive intervals from ``start``."""

    def __init__(self, stream: list[TraceRequest], rate_at, start: float = 0.0) -> None:
        if not stream:
            raise ValueError("TraceArrivals needs a non-empty stream")
        first = stream[0].arrival
        self._offsets = [r.arrival - first for r in stream]
        span = max(self._offsets[-1], 1e-9)
        self._own_rate = max(len(stream) - 1, 1) / span
        self._period = span + 1 / self._own_rate  # one cycle of the stream, as retime's
        self.rate_at, self._now, self._expected = rate_at, start, 0.0

    def _before(self, trace_time: float) -> int:
        """Requests of the cycled stream before ``trace_time``."""
        cycles, within = divmod(trace_time, self._period)
        return int(cycles) * len(self._offsets) + bisect.bisect_left(self._offsets, within)

    def __call__(self, begin: float, end: float) -> int:
        if abs(begin - self._now) > 1e-6:
            raise ValueError(f"intervals must follow each other: expected {self._now}, "
                             f"got {begin}")
        before = self._expected
        self._expected += self.rate_at((begin + end) / 2) * (end - begin)
        self._now = end
        return (self._before(self._expected / self._own_rate)
                - self._before(before / self._own_rate))
