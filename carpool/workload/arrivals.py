"""Seeded arrival schedules for the benchmarks.

Three processes: ``constant`` (evenly spaced, gap 1/rate), ``poisson``
(exponential gaps) and ``gamma`` with a burstiness factor, as vLLM defines
it: shape = burstiness, scale = 1 / (rate * burstiness), so the mean rate
is the same and burstiness < 1 is burstier than Poisson (1).

The rate may change over time: a ``Surge`` multiplies it by a constant
factor over a window, a ``Ramp`` by a factor that moves linearly over a
window; overlapping multipliers multiply. Each gap is drawn at the rate in
force where it starts. Pure Python; the same seed gives the same schedule.
"""
from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PROCESSES = ("constant", "poisson", "gamma")

_NUMBER = r"([0-9]+\.?[0-9]*|\.[0-9]+)"


def _parse_window(kind: str, pattern: str, form: str, example: str,
                  text: str) -> list[float]:
    """The numbers of a surge or ramp spec; factors and the duration must be
    > 0 (the start, second to last, may be 0)."""
    match = re.fullmatch(rf"\s*{pattern}\s*", text)
    if not match:
        raise ValueError(f"cannot parse {kind} {text!r}; expected {form} in seconds, "
                         f"e.g. {example}")
    numbers = [float(g) for g in match.groups()]
    if any(v <= 0 for v in numbers[:-2]) or numbers[-1] <= 0:
        raise ValueError(f"{kind} {text!r}: factors and duration must be > 0")
    return numbers


@dataclass(frozen=True)
class Surge:
    """The rate is multiplied by ``factor`` from ``start`` for ``duration`` seconds."""

    factor: float
    start: float
    duration: float

    @classmethod
    def parse(cls, text: str) -> Surge:
        """``FACTORx@START+DURATION`` in seconds, e.g. ``3x@20+30``."""
        factor, start, duration = _parse_window(
            "surge", rf"{_NUMBER}x@{_NUMBER}\+{_NUMBER}", "FACTORx@START+DURATION", "3x@20+30", text)
        return cls(factor, start, duration)

    def covers(self, t: float) -> bool:
        """Whether ``t`` (seconds) falls in ``[start, start + duration)``."""
        return self.start <= t < self.start + self.duration

    def factor_at(self, t: float) -> float:
        """The multiplier this surge applies at ``t`` (1 outside its window)."""
        return self.factor if self.covers(t) else 1.0

    def to_dict(self) -> dict:
        """JSON-able description, for reports."""
        return {"kind": "surge", "factor": self.factor, "start": self.start,
                "duration": self.duration, "text": str(self)}

    def __str__(self) -> str:
        return f"{self.factor:g}x@{self.start:g}+{self.duration:g}"


@dataclass(frozen=True)
class Ramp:
    """The rate multiplier moves linearly from ``start_factor`` to ``end_factor``
    over ``[start, start + duration)``; no effect outside that window."""

    start_factor: float
    end_factor: float
    start: float
    duration: float

    @classmethod
    def parse(cls, text: str) -> Ramp:
        """``FROMx-TOx@START+DURATION`` in seconds, e.g. ``1x-3x@10+20``."""
        start_factor, end_factor, start, duration = _parse_window(
            "ramp", rf"{_NUMBER}x-{_NUMBER}x@{_NUMBER}\+{_NUMBER}", "FROMx-TOx@START+DURATION",
            "1x-3x@10+20", text)
        return cls(start_factor, end_factor, start, duration)

    def covers(self, t: float) -> bool:
        """Whether ``t`` (seconds) falls in ``[start, start + duration)``."""
        return self.start <= t < self.start + self.duration

    def factor_at(self, t: float) -> float:
        """The multiplier this ramp applies at ``t`` (1 outside its window)."""
        if not self.covers(t):
            return 1.0
        progress = (t - self.start) / self.duration
        return self.start_factor + (self.end_factor - self.start_factor) * progress

    def to_dict(self) -> dict:
        """JSON-able description, for reports."""
        return {"kind": "ramp", "start_factor": self.start_factor, "end_factor": self.end_factor,
                "start": self.start, "duration": self.duration, "text": str(self)}

    def __str__(self) -> str:
        return f"{self.start_factor:g}x-{self.end_factor:g}x@{self.start:g}+{self.duration:g}"


@dataclass(frozen=True)
class RateShape:
    """Surges and ramps together: the rate multiplier at any time is the
    product of every one of them in force then."""

    surges: tuple[Surge, ...] = ()
    ramps: tuple[Ramp, ...] = ()

    def factor_at(self, t: float) -> float:
        """The combined multiplier at ``t`` seconds."""
        factor = 1.0
        for change in (*self.surges, *self.ramps):
            factor *= change.factor_at(t)
        return factor

    def to_dict(self) -> dict:
        """JSON-able description, for reports."""
        return {"surges": [s.to_dict() for s in self.surges],
                "ramps": [r.to_dict() for r in self.ramps]}


def rate_at(base_rate: float, surges: Iterable[Surge], t: float,
            ramps: Iterable[Ramp] = ()) -> float:
    """The rate in force at ``t``: ``base_rate`` times every surge and ramp covering it."""
    return base_rate * RateShape(tuple(surges), tuple(ramps)).factor_at(t)


def arrival_offsets(count: int, rate: float, seed: int, burstiness: float = 1.0,
                    surges: Sequence[Surge] | None = None, *,
                    ramps: Sequence[Ramp] | None = None,
                    process: str = "gamma") -> list[float]:
    """``count`` arrival times (seconds from 0, the first at 0).

    ``process`` is ``gamma`` (shape ``burstiness``; 1 = Poisson, the
    default), ``poisson`` (burstiness ignored) or ``constant`` (gap exactly
    1/rate). Each gap uses the rate in force where it starts, surges and
    ramps included.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate} and {burstiness}")
    if process not in PROCESSES:
        raise ValueError(f"unknown arrival process {process!r}; choose from {', '.join(PROCESSES)}")
    shape = {"gamma": burstiness, "poisson": 1.0}.get(process)
    rng = random.Random(seed)
    rate_shape = RateShape(tuple(surges or ()), tuple(ramps or ()))
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        current = rate * rate_shape.factor_at(now)
        if shape is None:
            now += 1.0 / current
        else:
            now += rng.gammavariate(shape, 1.0 / (current * shape))
    return offsets


def describe_process(process: str, burstiness: float) -> str:
    """A short human label: ``constant``, ``Poisson`` or ``gamma (burstiness B)``."""
    if process == "constant":
        return "constant"
    if process == "poisson" or burstiness == 1:
        return "Poisson"
    return f"gamma (burstiness {burstiness:g})"


def rescale_offsets(offsets: list[float], rate: float) -> list[float]:
    """``offsets`` re-based to 0 with their gaps stretched (or squeezed) so the
    schedule offers ``rate`` requests per second on average; the shape of
    the arrival process (bursts, surges, a trace's pattern) is kept. With no
    span (all at once) the result is evenly spaced at ``rate``."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    span = offsets[-1] - offsets[0] if len(offsets) > 1 else 0.0
    if span <= 0:
        return [i / rate for i in range(len(offsets))]
    factor = (len(offsets) - 1) / span / rate
    return [(t - offsets[0]) * factor for t in offsets]
