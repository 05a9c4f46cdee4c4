"""Predictive shedding: reject at arrival a request that cannot start in time.

A request with a deadline that the step-cost model predicts it would miss
is turned away when it arrives (HTTP 429 right away) instead of after
waiting in the queue for nothing; so is, under the adaptive controller, a
request predicted to get its first token later than its class's share of
the TTFT target (``ttft_allowance``). The Retry-After of such a rejection
is the minimum needed: how much later than allowed the first token would
come, i.e. how far the work ahead must drain before the same request fits.
"""
from __future__ import annotations

import math
from collections import deque

from carpool.scheduler.control.cost_model import StepCostModel
from carpool.slo import class_share


def ttft_allowance(target: float, priority: int, alone: float | None,
                   reference: float | None = None) -> float:
    """The latest first token admission accepts for a request, in seconds.

    Its class's share of the target (``carpool.slo.class_share``: low
    arrivals are shed first, high ones last), plus, for a prompt longer than
    the one the target is made for, the extra time its own prefill takes:
    ``alone`` (the cost model's unloaded TTFT of this prompt) less
    ``reference`` (the same model's unloaded TTFT of the
    ``CALIBRATION_PROMPT_TOKENS`` prompt the calibrated target comes from).
    Both come from one model, so its bias cancels: a typical prompt is held
    to the target itself (an allowance of 5x its own time let a live model
    that priced a 100-token prefill 20% high admit first tokens past the
    target), a long one gets what its extra compute needs on top, so it is
    not rejected for ever.
    """
    allowed = target * class_share(priority)
    if alone is not None and reference is not None:
        allowed += max(0.0, alone - reference)
    return allowed


def predict_first_token_delay(cost: StepCostModel, prefill_tokens_ahead: int,
                              prompt_tokens: int, decoding_seqs: int,
                              max_batched_tokens: int) -> float | None:
    """Seconds until a new request's first token, if it arrived now.

    Every step gives ``decoding_seqs`` tokens to running decodes and the
    rest of the budget to prefill, served in order: the tokens still to
    prefill ahead of it, then its own prompt. None while the cost model is
    not ready.
    """
    if not cost.ready:
        return None
    decode = min(decoding_seqs, max_batched_tokens - 1)
    per_step = max_batched_tokens - decode
    tokens = prefill_tokens_ahead + prompt_tokens
    steps = math.ceil(tokens / per_step)
    full_step = cost.predict(decode + min(tokens, per_step), decode + 1)
    return steps * full_step


def predict_slot_delay(cost: StepCostModel, remaining_tokens: list[int],
                       slots_needed: int, mean_step: float = 0.0) -> float | None:
    """Seconds until ``slots_needed`` running requests have finished, when
    each has ``remaining_tokens`` left to generate (at most: a request may
    stop early) and every step decodes one token of each. A step takes the
    cost model's pure decode step, or ``mean_step`` (the steps measured
    lately, prefill chunks included) when longer. None while the cost model
    is not ready or nothing runs."""
    if not cost.ready or not remaining_tokens or slots_needed <= 0:
        return None
    ordered = sorted(remaining_tokens)
    running = len(ordered)
    rounds, index = divmod(slots_needed - 1, running)
    steps = ordered[index] + rounds * ordered[-1]
    return steps * max(cost.predict(running, running), mean_step)


def first_broken_promise(members, now: float, step_seconds: float, lag: float,
                         margin) -> tuple[object, float] | None:
    """The first of ``members`` (requests whose first token comes in the
    next step, with a ``first_token_due``) whose promise an arrival would
    break by joining that step (``step_seconds`` long with it, starting at
    ``now``), and by how many seconds; None when it breaks none. A promise
    already past at ``now`` is no longer the arrival's to keep: it does not
    count (else one hopeless request would turn every arrival away).
    ``margin(predicted)`` is the learned error added to a prediction,
    ``lag`` the delivery lag.

    Why: arrivals taken at one step boundary share that step, and each one
    admitted lengthens it for those admitted before it. Checked on its own,
    each arrival saw the step with only its own prompt in it; the first of
    a burst of five then got its first token a ~90 ms step later than
    predicted (a 190 ms step of five prompts, priced 97 ms), which put the
    p99 TTFT of a surge past the target."""
    for member in members:
        if member.first_token_due <= now + lag:
            continue
        predicted = now - member.arrival_time + lag + step_seconds
        late = predicted + margin(predicted) - (member.first_token_due - member.arrival_time)
        if late > 0:
            return member, late
    return None


# Seconds added to both sides of the error ratio, so tiny predictions (an
# idle server: one step) do not turn small absolute misses into huge ratios.
RATIO_SLACK = 0.25


class PredictionError:
    """How late first tokens came against their prediction, learned online.

    The error is relative: r = (actual + RATIO_SLACK) / (predicted +
    RATIO_SLACK) over the last ``window`` admitted requests that had a
    prediction, and ``margin(now, predicted)`` is what the ``quantile`` (p95
    by default: over the few dozen errors of a short ``max_age`` a p99 is
    the single worst one, which then set the margin of every arrival for
    its whole age) of r adds to a prediction (never below 0). Shedding adds it,
    so a cost model that is optimistic under the current load sheds earlier
    instead of letting the admitted requests' p99 TTFT miss the target.
    Relative, because misses scale with the work ahead: seconds late when a
    surge's queue predicted seconds must not add those seconds to the
    near-empty queue of the calm after it (an absolute margin rejected half
    of that calm). With ``max_age`` (and times given) errors older than that
    many seconds no longer count: what a surge taught must not outlive it.
    """

    def __init__(self, window: int = 256, quantile: float = 0.95,
                 max_age: float | None = None) -> None:
        self.quantile = quantile
        self.max_age = max_age
        self._ratios: deque[tuple[float, float]] = deque(maxlen=window)  # (time, ratio)

    def record(self, predicted: float, actual: float, now: float = 0.0) -> None:
        self._ratios.append((now, (actual + RATIO_SLACK) / (max(0.0, predicted) + RATIO_SLACK)))

    def factor(self, now: float | None = None) -> float:
        """The late quantile of the error ratio (1 while fewer than 8 samples)."""
        if now is not None and self.max_age is not None:
            while self._ratios and self._ratios[0][0] < now - self.max_age:
                self._ratios.popleft()
        if len(self._ratios) < 8:
            return 1.0
        ordered = sorted(ratio for _, ratio in self._ratios)
        return max(1.0, ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))])

    def margin(self, now: float | None = None, predicted: float = 0.0) -> float:
        """Seconds to add to ``predicted`` for the learned error."""
        return (max(0.0, predicted) + RATIO_SLACK) * (self.factor(now) - 1.0)


class CalmTTFT:
    """The TTFT p99 of calm traffic, learned live (seconds, as the client
    sees it): first tokens of requests that arrived at least ``gap`` seconds
    away from any rejection, before or after (the requests that arrived
    while a surge filled the queue, just before the first rejection, are
    not calm), over the last ``window`` of them, at most ``max_age`` seconds
    old. None until ``min_samples`` are in.

    Admission holds an operator-SLO surge's queue to a multiple of it
    (``SchedulerConfig.surge_ttft_factor``): once the engine is saturated a
    longer queue serves no more requests per second, it only delays every
    first token, up to the whole TTFT target (12x the calm p99 in a
    simulated 3x surge under a 2 s target).
    """

    def __init__(self, gap: float = 5.0, window: int = 256, max_age: float = 300.0,
                 min_samples: int = 20) -> None:
        self.gap = gap
        self.max_age = max_age
        self.min_samples = min_samples
        self.last_rejection = -math.inf
        self._pending: deque[tuple[float, float]] = deque()  # (arrival, ttft), kept gap s
        self._calm: deque[tuple[float, float]] = deque(maxlen=window)

    def rejected(self, now: float) -> None:
        """A rejection at ``now``: requests that arrived within ``gap`` before it are not calm."""
        self.last_rejection = now
        while self._pending and self._pending[-1][0] >= now - self.gap:
            self._pending.pop()

    def record(self, arrival: float, ttft: float) -> None:
        """A first token: ``ttft`` seconds after the request arrived at ``arrival``."""
        if abs(arrival - self.last_rejection) < self.gap:
            return
        # First tokens come out of arrival order: keep pending sorted by arrival.
        if self._pending and self._pending[-1][0] > arrival:
            items = sorted([*self._pending, (arrival, ttft)])
            self._pending.clear()
            self._pending.extend(items)
        else:
            self._pending.append((arrival, ttft))

    def p99(self, now: float) -> float | None:
        while self._pending and self._pending[0][0] < now - self.gap:
            self._calm.append(self._pending.popleft())  # no rejection can disown it now
        while self._calm and self._calm[0][0] < now - self.max_age:
            self._calm.popleft()
        if len(self._calm) < self.min_samples:
            return None
        ordered = sorted(ttft for _, ttft in self._calm)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
