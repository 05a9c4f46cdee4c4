"""Seeded arrival schedules for the benchmarks.

Poisson (exponential gaps) or gamma with a burstiness factor, as vLLM
defines it: shape = burstiness, scale = 1 / (rate * burstiness), so the
mean rate is the same and burstiness < 1 is burstier than Poisson (1).
The rate may change over time (surges): ``RateSchedule`` is piecewise
constant; each gap is drawn at the rate in force where it starts.
Pure Python; the same seed gives the same schedule.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Surge:
    """The rate is multiplied by ``factor`` from ``start`` for ``duration`` seconds."""

    factor: float
    start: float
    duration: float

    @classmethod
    def parse(cls, text: str) -> "Surge":
        """``FACTORx@START+DURATION`` in seconds, e.g. ``3x@20+30``."""
        match = re.fullmatch(r"\s*([0-9.]+)x@([0-9.]+)\+([0-9.]+)\s*", text)
        if not match:
            raise ValueError(f"cannot parse surge {text!r}; expected FACTORx@START+DURATION "
                             f"in seconds, e.g. 3x@20+30")
        factor, start, duration = (float(g) for g in match.groups())
        if factor <= 0 or duration <= 0:
            raise ValueError(f"surge {text!r}: factor and duration must be > 0")
        return cls(factor, start, duration)

    def covers(self, t: float) -> bool:
        return self.start <= t < self.start + self.duration


def rate_at(base_rate: float, surges: list[Surge], t: float) -> float:
    rate = base_rate
    for surge in surges:
        if surge.covers(t):
            rate *= surge.factor
    return rate


def arrival_offsets(count: int, rate: float, seed: int, burstiness: float = 1.0,
                    surges: list[Surge] | None = None) -> list[float]:
    """``count`` arrival times (seconds from 0): gamma gaps with shape
    ``burstiness`` (1 = Poisson) at the rate in force, surges included."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate} and {burstiness}")
    rng = random.Random(seed)
    surges = surges or []
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        current = rate_at(rate, surges, now)
        now += rng.gammavariate(burstiness, 1.0 / (current * burstiness))
    return offsets
