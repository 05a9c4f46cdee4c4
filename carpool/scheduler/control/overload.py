"""The emergency switch: a degrade mode entered under sustained overload.

Overload means any breaker over its threshold continuously for ``sustain_s``
seconds: the waiting queue at or over ``queue_threshold`` requests, the
engine busy more than ``busy_threshold`` of the time, or the host's CPUs
busy more than ``cpu_threshold`` (the HTTP front, the detokenizer and
anything else on the box share them with the engine; read through an
injected ``cpu_source``, so the scheduler stays pure). Degrade mode
deepens in steps while the overload lasts, one more per ``sustain_s``:

1. shed the lowest priorities first (``admission``);
2. switch to static batching (``Scheduler.set_batching``): batches of the
   preferred size run to completion, a predictable step cost;
3. answer identical deterministic requests from the front's response
   cache (``EngineStats.degrade_stage`` tells the front).

It ends (hysteresis) only once the queue is under half its threshold *and*
busy and CPU are under their thresholds less 0.1, so the switch does not
flap at the boundary; then every step is undone at once.
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
    """Tracks whether the replica is in degrade mode, how deep, and why."""

    STAGES = ("normal", "shed_low_priority", "static_batching", "response_cache")

    def __init__(self, queue_threshold: int, busy_threshold: float = 0.9,
                 sustain_s: float = 5.0, cpu_threshold: float | None = None) -> None:
        self.queue_threshold = queue_threshold
        self.busy_threshold = busy_threshold
        self.cpu_threshold = cpu_threshold
        self.sustain_s = sustain_s
        # () -> host CPU utilisation 0..1, or None when unknown (set by the engine).
        self.cpu_source = None
        self.stage = 0  # index into STAGES
        self.reason = ""
        self._overloaded_since: float | None = None
        self._stage_since = 0.0
        self.switches = 0  # every change of stage

    @property
    def degraded(self) -> bool:
        return self.stage > 0

    def before_step(self, now: float, scheduler) -> None:
        """The scheduler's hook at the start of each step: feed the queue
        length, the busy fraction of the window and the host CPU; switch the
        batching regime when the stage asks for it."""
        cpu = self.cpu_source() if self.cpu_source is not None else None
        if cpu is not None and cpu != cpu:  # NaN: no reading yet
            cpu = None
        before = self.stage
        self.update(now, len(scheduler.waiting), scheduler.admission.busy.fraction(now), cpu)
        static = self.stage >= 2
        if (before >= 2) != static:
            scheduler.set_batching("static" if static else scheduler.config.batching)

    def _breaker(self, queue_len: int, busy: float, cpu: float | None) -> str | None:
        if queue_len >= self.queue_threshold:
            return f"queue {queue_len} >= {self.queue_threshold}"
        if busy > self.busy_threshold:
            return f"busy {busy:.0%} > {self.busy_threshold:.0%}"
        if cpu is not None and self.cpu_threshold is not None and cpu > self.cpu_threshold:
            return f"host CPU {cpu:.0%} > {self.cpu_threshold:.0%}"
        return None

    def update(self, now: float, queue_len: int, busy: float,
               cpu: float | None = None) -> bool:
        """Feed the current state; return True when the stage changed."""
        tripped = self._breaker(queue_len, busy, cpu)
        if not self.degraded:
            if tripped is None:
                self._overloaded_since = None
                return False
            if self._overloaded_since is None:
                self._overloaded_since = now
            if now - self._overloaded_since < self.sustain_s:
                return False
            return self._set_stage(1, now, tripped)
        calm = (queue_len < self.queue_threshold / 2 and busy < self.busy_threshold - 0.1
                and (cpu is None or self.cpu_threshold is None
                     or cpu < self.cpu_threshold - 0.1))
        if calm:
            self._overloaded_since = None
            return self._set_stage(0, now, "")
        if (tripped is not None and self.stage < len(self.STAGES) - 1
                and now - self._stage_since >= self.sustain_s):
            return self._set_stage(self.stage + 1, now, tripped)
        return False

    def _set_stage(self, stage: int, now: float, reason: str) -> bool:
        self.stage, self.reason, self._stage_since = stage, reason, now
        self.switches += 1
        return True


def shed_victim(waiting: Iterable[Request], arrival: Request) -> Request | None:
    """The waiting request a better ``arrival`` displaces from a full queue:
    the worst priority, then the latest arrival; None if none is worse."""
    worse = [r for r in waiting if r.priority > arrival.priority]
    return max(worse, key=lambda r: (r.priority, r.arrival_time)) if worse else None
