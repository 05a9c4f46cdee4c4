"""The emergency switch: a degrade mode entered under sustained overload.

Overload means the waiting queue at or over ``queue_threshold`` requests,
or the engine busy more than ``busy_threshold`` of the time, continuously
for ``sustain_s`` seconds. Degrade mode ends (hysteresis) only once the
queue is under half the threshold *and* busy under ``busy_threshold -
0.1``, so the switch does not flap at the boundary. While degraded the
scheduler sheds the lowest priorities first (see ``Scheduler``).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from carpool.scheduler.request import Request

# Degrade mode turns away arrivals of a priority worse than this ("low").
SHED_ABOVE_PRIORITY = 0


class BusyWindow:
    """Fraction of the last ``window_s`` clock seconds spent running steps."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, float]] = deque()  # (end time, seconds)
        self._total = 0.0

    def record(self, now: float, seconds: float) -> None:
        self.record_many((now,), (seconds,))

    def record_many(self, ends: Iterable[float], seconds: Iterable[float]) -> None:
        """Steps that ended at ``ends`` and took ``seconds``, oldest first
        (the same arithmetic, in the same order, as one ``record`` each)."""
        steps, window_s = self._steps, self.window_s
        total = self._total
        for now, step_seconds in zip(ends, seconds):
            steps.append((now, step_seconds))
            total += step_seconds
            while steps and steps[0][0] < now - window_s:
                total -= steps.popleft()[1]
        self._total = total

    def fraction(self, now: float) -> float:
        self._prune(now)
        return min(1.0, self._total / self.window_s)

    def mean_step(self, now: float) -> float:
        """Mean seconds of the steps in the window (0 without any)."""
        self._prune(now)
        return self._total / len(self._steps) if self._steps else 0.0

    def _prune(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._total -= self._steps.popleft()[1]


class OverloadGuard:
    """Tracks whether the replica is in degrade mode, and why."""

    def __init__(self, queue_threshold: int, busy_threshold: float = 0.9,
                 sustain_s: float = 5.0) -> None:
        self.queue_threshold = queue_threshold
        self.busy_threshold = busy_threshold
        self.sustain_s = sustain_s
        self.degraded = False
        self.reason = ""
        self._overloaded_since: float | None = None
        self.switches = 0

    def before_step(self, now: float, scheduler) -> None:
        """The scheduler's hook at the start of each step: feed the queue
        length and the busy fraction of the window."""
        self.update(now, len(scheduler.waiting), scheduler.admission.busy.fraction(now))

    def update(self, now: float, queue_len: int, busy: float) -> bool:
        """Feed the current state; return True when the mode changed."""
        overloaded = queue_len >= self.queue_threshold or busy > self.busy_threshold
        if not self.degraded:
            if not overloaded:
                self._overloaded_since = None
                return False
            if self._overloaded_since is None:
                self._overloaded_since = now
            if now - self._overloaded_since < self.sustain_s:
                return False
            self.degraded, self.switches = True, self.switches + 1
            self.reason = (f"queue {queue_len} >= {self.queue_threshold}"
                           if queue_len >= self.queue_threshold
                           else f"busy {busy:.0%} > {self.busy_threshold:.0%}")
            return True
        calm = (queue_len < self.queue_threshold / 2
                and busy < self.busy_threshold - 0.1)
        if calm:
            self.degraded, self.switches, self.reason = False, self.switches + 1, ""
            self._overloaded_since = None
            return True
        return False


def shed_victim(waiting: Iterable[Request], arrival: Request) -> Request | None:
    """The waiting request a better ``arrival`` displaces from a full queue:
    the worst priority, then the latest arrival; None if none is worse."""
    worse = [r for r in waiting if r.priority > arrival.priority]
    return max(worse, key=lambda r: (r.priority, r.arrival_time)) if worse else None
