"""The knobs the scheduler reads every step, how they move, and the record
of each move: ``LiveKnobs`` (the values), ``KnobRamp`` (a change spread
over at most three steps, never a cliff), ``Decision`` (one logged change).

Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from carpool.config import SchedulerConfig


@dataclass
class LiveKnobs:
    """The knobs the scheduler reads every step (the controller moves them)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    preferred_batch_size: int
    max_batch_size: int
    max_wait: float | None

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> "LiveKnobs":
        return cls(config.max_num_seqs, config.max_num_batched_tokens,
                   config.preferred_batch_size, config.max_batch_size, config.max_wait)

    def as_dict(self) -> dict[str, float]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: float(v) for name, v in values.items() if v is not None}


@dataclass(frozen=True)
class Decision:
    """One controller decision. ``reason`` is a short label (for metrics)."""

    time: float
    knob: str  # "mode", "alpha" or a LiveKnobs field
    old: float | str | None
    new: float | str | None
    reason: str
    cause: str

    def describe(self) -> str:
        return f"{self.knob} {_fmt(self.new)} <- {_fmt(self.old)}: {self.cause}"


def _fmt(value: float | str | None) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


class KnobRamp:
    """Moves knobs to their targets in equal increments over ``steps`` steps."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._plan: dict[str, tuple[float, float]] = {}  # knob -> (start, target)
        self._done = 0

    @property
    def active(self) -> bool:
        return bool(self._plan)

    def retarget(self, knobs: LiveKnobs, targets: dict[str, float]) -> None:
        """Start a new ramp from the current values; knobs of an unfinished
        ramp that ``targets`` leaves out keep heading for their old target."""
        targets = {**{name: end for name, (_, end) in self._plan.items()}, **targets}
        self._plan = {name: (getattr(knobs, name), value) for name, value in targets.items()
                      if getattr(knobs, name) != value}
        self._done = 0

    def advance(self, knobs: LiveKnobs) -> None:
        if not self._plan:
            return
        self._done += 1
        share = self._done / self.steps
        for name, (start, target) in self._plan.items():
            value = start + (target - start) * share
            if isinstance(target, int):
                value = int(round(value))
            setattr(knobs, name, target if self._done >= self.steps else value)
        if self._done >= self.steps:
            self._plan.clear()
