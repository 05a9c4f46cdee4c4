"""Sliding windows of live scheduler events, read by the adaptive controller.

Pure Python; every method takes the clock time from the caller, so the same
window runs on the engine's clock and on the simulator's virtual clock.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


class SampleWindow:
    """Values observed in the last ``window_s`` seconds (time-stamped)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float) -> None:
        self._samples.append((now, value))

    def prune(self, now: float) -> None:
        cutoff = now - self.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()

    def values(self, now: float) -> list[float]:
        self.prune(now)
        return [value for _, value in self._samples]

    def __len__(self) -> int:
        return len(self._samples)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class Signals:
    """What the controller sees at one tick. Latencies are None until the
    window holds a sample; ``fill`` is the mean occupancy of the batch limit
    (running sequences / limit per step, or batch size / preferred size
    under request-level batching)."""

    now: float
    arrival_rate: float  # requests per second over the window
    waiting: int
    waiting_tokens: int
    running: int
    kv_usage: float  # used blocks / all blocks
    busy: float  # fraction of wall time spent in steps
    ttft_p95: float | None
    tpot_p95: float | None
    fill: float | None
    mean_request_tokens: float | None  # prompt + max_tokens of recent arrivals
    batch_limit: int = 1  # the live sequence limit (continuous) or preferred batch size

    def describe(self) -> str:
        def fmt(value: float | None, unit: str = "s") -> str:
            return "n/a" if value is None else f"{value:.3f}{unit}"
        return (f"rate {self.arrival_rate:.2f}/s, waiting {self.waiting}, running {self.running}, "
                f"busy {self.busy:.0%}, kv {self.kv_usage:.0%}, ttft_p95 {fmt(self.ttft_p95)}, "
                f"tpot_p95 {fmt(self.tpot_p95)}, fill {fmt(self.fill, '')}")


class LiveWindow:
    """The controller's sliding-window metrics, fed by scheduler events."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.arrivals = SampleWindow(window_s)  # value: prompt + max_tokens
        self.ttft = SampleWindow(window_s)
        self.tpot = SampleWindow(window_s)  # per finished request: (E2E - TTFT) / (tokens - 1)
        self.fill = SampleWindow(window_s)
        self._started: float | None = None

    def observe_arrival(self, now: float, request_tokens: int) -> None:
        if self._started is None:
            self._started = now
        self.arrivals.add(now, float(request_tokens))

    def signals(self, now: float, *, waiting: int, waiting_tokens: int, running: int,
                kv_usage: float, busy: float, batch_limit: int) -> Signals:
        arrivals = self.arrivals.values(now)
        # Before a full window has passed, the rate is over the time seen so far.
        span = self.window_s if self._started is None else min(
            self.window_s, max(now - self._started, 1e-9))
        return Signals(
            now=now, arrival_rate=len(arrivals) / span, waiting=waiting,
            waiting_tokens=waiting_tokens, running=running, kv_usage=kv_usage, busy=busy,
            ttft_p95=percentile(self.ttft.values(now), 95),
            tpot_p95=percentile(self.tpot.values(now), 95),
            fill=mean(self.fill.values(now)), mean_request_tokens=mean(arrivals),
            batch_limit=batch_limit)
