"""``--micro-batches auto`` under tensor parallelism: one batch or two,
chosen per step shape by what each measured on this replica.

Two micro-batches hide one's communication behind the other's compute,
but each half reads every weight again and makes its own collectives, so
whether a split pays depends on the step (decodes or prefills, how many
tokens), the link and the cores: on the 2-core CPU it wins at every shape
measured, on GPUs small decode steps lose (the sums are latency-sized and
twice as many). The choice is a small bandit per shape (``StepShape``:
decode-only or not, tokens rounded up to a power of two): each shape first
runs ``trials`` steps each way, alternating, then takes the way of the
lower median step time, and still runs the other way one step in
``explore_every`` so a change of load or of machine state is seen. Rank 0
chooses and its step message carries the choice: every rank must issue the
same collectives. Plain Python, deterministic given the times.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

StepShape = tuple[bool, int]  # (decode-only, tokens rounded up to a power of two)


def step_shape(decode_only: bool, tokens: int) -> StepShape:
    return decode_only, 1 << max(0, tokens - 1).bit_length()


@dataclass
class _ShapeTimes:
    """Recent step times of one shape, one way and the other."""

    whole: deque = field(default_factory=lambda: deque(maxlen=16))
    split: deque = field(default_factory=lambda: deque(maxlen=16))
    steps: int = 0

    def of(self, split: bool) -> deque:
        return self.split if split else self.whole


@dataclass
class MicroBatchChoice:
    """The live choice (module docstring). ``trials``: steps each way before
    the first choice; ``explore_every``: after it, one step in that many
    runs the other way."""

    trials: int = 3
    explore_every: int = 32
    shapes: dict[StepShape, _ShapeTimes] = field(default_factory=dict)

    def choose(self, shape: StepShape) -> bool:
        """Whether the next step of ``shape`` runs as two micro-batches."""
        times = self.shapes.setdefault(shape, _ShapeTimes())
        times.steps += 1
        if not self._decided(times):
            return len(times.split) < len(times.whole)  # alternate: whole first
        best = self.prefers_split(shape)
        if times.steps % self.explore_every == 0:
            return not best
        return best

    def prefers_split(self, shape: StepShape) -> bool:
        """The way of the lower median step time so far (ties: one batch)."""
        times = self.shapes[shape]
        return statistics.median(times.split) < statistics.median(times.whole)

    def record(self, shape: StepShape, split: bool, seconds: float) -> bool | None:
        """A step of ``shape`` took ``seconds``, split or not; returns the
        shape's choice where this step changed it (the first one included),
        else None."""
        times = self.shapes.setdefault(shape, _ShapeTimes())
        before = self._decided(times) and self.prefers_split(shape)
        was_decided = self._decided(times)
        times.of(split).append(seconds)
        if not self._decided(times):
            return None
        after = self.prefers_split(shape)
        return after if not was_decided or after != before else None

    def _decided(self, times: _ShapeTimes) -> bool:
        return len(times.whole) >= self.trials and len(times.split) >= self.trials

    def summary(self) -> dict[str, dict]:
        """Per shape seen: its steps, the median each way (ms), the choice."""
        out = {}
        for (decode_only, tokens), times in sorted(self.shapes.items()):
            decided = self._decided(times)
            out[f"{'decode' if decode_only else 'mixed'}-{tokens}"] = {
                "steps": times.steps,
                "whole_ms": round(statistics.median(times.whole) * 1e3, 3) if times.whole
                else None,
                "split_ms": round(statistics.median(times.split) * 1e3, 3) if times.split
                else None,
                "split": self.prefers_split((decode_only, tokens)) if decided else None}
        return out
