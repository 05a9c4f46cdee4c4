"""Sliding windows of live scheduler events, read by the adaptive controller.

Pure Python; every method takes the clock time from the caller, so the same
window runs on the engine's clock and on the simulator's virtual clock.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# The fewest finished requests whose TPOT makes the recent TPOT signal.
RECENT_TPOTS = 4
# The fewest busy steps that anchor the batch limit (``step_anchor``).
MIN_ANCHOR_STEPS = 8


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

    def recent(self, now: float, seconds: float) -> list[float]:
        """Values of the last ``seconds`` (at most the window), newest first;
        costs O(their number), not O(the window)."""
        cutoff = now - min(seconds, self.window_s)
        out = []
        for stamp, value in reversed(self._samples):
            if stamp < cutoff:
                break
            out.append(value)
        return out

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
    # The fast window (``controller_fast_window``): arrivals per second, and
    # the mean wall time between consecutive steps while requests decode
    # (what a running request feels as its time per output token).
    fast_arrival_rate: float | None = None
    step_time: float | None = None
    mean_prompt_tokens: float | None = None  # of recent arrivals
    # The worst TPOT of the requests that finished in the fast window (at
    # least the last ``RECENT_TPOTS`` of the slow one) among those that
    # started after ``tpot_since`` (the limit correction's last move): each is
    # the mean of a request's steps over its life, so a burst of prefills
    # that lengthens a few steps moves it far less than ``step_time``.
    recent_tpot: float | None = None
    # Prompt tokens per output token of recent arrivals (mean prompt / mean
    # max_tokens): the prefill work that comes with each decoded token.
    prefill_ratio: float | None = None
    # (mean running count, mean wall seconds) of the busy steps of the slow
    # window: the batch they show within target (``slo_policy.proven_limit``).
    step_anchor: tuple[float, float] | None = None
    # The p99 TPOT and end-to-end latency of the requests that finished in
    # the slow window, and the p95 of their output lengths (what an E2E
    # target must allow for).
    tpot_p99: float | None = None
    e2e_p99: float | None = None
    long_output_tokens: float | None = None

    def describe(self) -> str:
        def fmt(value: float | None, unit: str = "s") -> str:
            return "n/a" if value is None else f"{value:.3f}{unit}"
        return (f"rate {self.arrival_rate:.2f}/s, waiting {self.waiting}, running {self.running}, "
                f"busy {self.busy:.0%}, kv {self.kv_usage:.0%}, ttft_p95 {fmt(self.ttft_p95)}, "
                f"tpot_p95 {fmt(self.tpot_p95)}, step {fmt(self.step_time)}, "
                f"fill {fmt(self.fill, '')}")


class LiveWindow:
    """The controller's sliding-window metrics, fed by scheduler events.

    Two horizons: ``window_s`` for the slow signals (latency percentiles,
    mean sizes, the arrival rate) and ``fast_s`` for what must show a surge
    within a second or two (recent arrivals, step times).
    """

    def __init__(self, window_s: float, fast_s: float | None = None) -> None:
        self.window_s = window_s
        self.fast_s = min(window_s, fast_s if fast_s is not None else window_s)
        self.arrivals = SampleWindow(window_s)  # value: prompt + max_tokens
        self.prompts = SampleWindow(window_s)  # value: prompt tokens (one per arrival)
        self.ttft = SampleWindow(window_s)
        # Per finished request, stamped at its finish: (its first token's time,
        # its TPOT = (E2E - TTFT) / (tokens - 1)).
        self.tpot = SampleWindow(window_s)
        self.fill = SampleWindow(window_s)
        self.e2e = SampleWindow(window_s)  # finished requests' end-to-end seconds
        self.outputs = SampleWindow(window_s)  # finished requests' output tokens
        self.steps = SampleWindow(self.fast_s)  # wall seconds between consecutive busy steps
        # The same over the slow window with the step's running count: (n, seconds).
        self.step_sizes = SampleWindow(window_s)
        self._started: float | None = None

    def observe_arrival(self, now: float, request_tokens: int,
                        prompt_tokens: int | None = None) -> None:
        if self._started is None:
            self._started = now
        self.arrivals.add(now, float(request_tokens))
        if prompt_tokens is not None:
            self.prompts.add(now, float(prompt_tokens))

    def rate(self, now: float, seconds: float) -> float:
        """Arrivals per second over the last ``seconds`` (or the time seen so far)."""
        span = seconds if self._started is None else min(seconds, max(now - self._started, 1e-9))
        if seconds >= self.window_s:  # the whole window: O(1) after pruning
            self.arrivals.prune(now)
            return len(self.arrivals) / span
        return len(self.arrivals.recent(now, seconds)) / span

    def observe_tpot(self, now: float, seconds: float, started: float) -> None:
        """A request finished at ``now``: its TPOT, its first token at ``started``."""
        self.tpot.add(now, (started, seconds))

    def observe_finish(self, now: float, e2e: float, output_tokens: int) -> None:
        """A request finished at ``now`` after ``e2e`` seconds with ``output_tokens``."""
        self.e2e.add(now, e2e)
        self.outputs.add(now, float(output_tokens))

    def recent_tpots(self, now: float, since: float = -math.inf) -> list[float]:
        """TPOTs of the requests that finished in the fast window, or of the
        last ``RECENT_TPOTS`` to finish in the slow one when fewer did (while
        every slot is held nothing finishes, and that is just when the limit
        correction needs to know what tokens cost); only of requests whose
        first token came at ``since`` or later: those that ran under the
        batch limit of then."""
        fast = [tpot for started, tpot in self.tpot.recent(now, self.fast_s) if started >= since]
        if len(fast) >= RECENT_TPOTS:
            return fast
        runs = [tpot for started, tpot in self.tpot.values(now) if started >= since]
        return runs[-RECENT_TPOTS:]

    def observe_step_interval(self, now: float, running: int, seconds: float) -> None:
        """A busy step of ``running`` sequences took ``seconds`` of wall time
        (to the next step's start: what a running request feels per token)."""
        self.steps.add(now, seconds)
        self.step_sizes.add(now, (running, seconds))

    def step_anchor(self, now: float) -> tuple[float, float] | None:
        """(mean running count, mean wall seconds) of the busy steps of the
        slow window, or None before ``MIN_ANCHOR_STEPS`` of them."""
        sizes = self.step_sizes.values(now)
        if len(sizes) < MIN_ANCHOR_STEPS:
            return None
        return (sum(n for n, _ in sizes) / len(sizes), sum(s for _, s in sizes) / len(sizes))

    def step_time(self, now: float) -> float | None:
        """Mean wall seconds between consecutive busy steps over the fast window."""
        return mean(self.steps.values(now))

    def signals(self, now: float, *, waiting: int, waiting_tokens: int, running: int,
                kv_usage: float, busy: float, batch_limit: int,
                tpot_since: float = -math.inf) -> Signals:
        arrivals = self.arrivals.values(now)
        prompts = self.prompts.values(now)
        request_mean, prompt_mean = mean(arrivals), mean(prompts)
        ratio = None
        if request_mean is not None and prompt_mean is not None and request_mean > prompt_mean:
            ratio = prompt_mean / (request_mean - prompt_mean)
        tpots = [tpot for _, tpot in self.tpot.values(now)]
        return Signals(
            now=now, arrival_rate=self.rate(now, self.window_s), waiting=waiting,
            waiting_tokens=waiting_tokens, running=running, kv_usage=kv_usage, busy=busy,
            ttft_p95=percentile(self.ttft.values(now), 95),
            tpot_p95=percentile(tpots, 95), tpot_p99=percentile(tpots, 99),
            e2e_p99=percentile(self.e2e.values(now), 99),
            long_output_tokens=percentile(self.outputs.values(now), 95),
            fill=mean(self.fill.values(now)), mean_request_tokens=request_mean,
            batch_limit=batch_limit, fast_arrival_rate=self.rate(now, self.fast_s),
            step_time=self.step_time(now), mean_prompt_tokens=prompt_mean, prefill_ratio=ratio,
            recent_tpot=max(self.recent_tpots(now, tpot_since), default=None),
            step_anchor=self.step_anchor(now))
