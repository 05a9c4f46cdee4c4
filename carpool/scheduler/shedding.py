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

from carpool.scheduler.cost_model import StepCostModel
from carpool.slo import TTFT_MULTIPLE, class_share


def ttft_allowance(target: float, priority: int, alone: float | None) -> float:
    """The latest first token admission accepts for a request, in seconds.

    Its class's share of the target (``carpool.slo.class_share``: low
    arrivals are shed first, high ones last). A prompt so long that its
    prefill alone (``alone``: the cost model's unloaded TTFT for it) takes
    more than target / TTFT_MULTIPLE is held to TTFT_MULTIPLE x that
    instead, the rule the target itself comes from: a request that would
    miss the target even on an idle server is not rejected for ever.
    """
    allowed = target * class_share(priority)
    if alone is not None:
        allowed = max(allowed, TTFT_MULTIPLE * alone)
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


class PredictionError:
    """How late first tokens came against their prediction, learned online.

    ``margin`` is the 99th percentile (``quantile``) of (actual - predicted)
    TTFT over the last ``window`` admitted requests that had a prediction
    (never below 0): shedding adds it to every prediction, so a cost model
    that is optimistic under the current load sheds earlier instead of
    letting the admitted requests' p99 TTFT miss the target. With
    ``max_age`` (and times given) errors older than that many seconds no
    longer count: what a surge taught must not outlive it, above all when
    it made the server shed everything (then no new error comes to
    displace the old ones).
    """

    def __init__(self, window: int = 256, quantile: float = 0.99,
                 max_age: float | None = None) -> None:
        self.quantile = quantile
        self.max_age = max_age
        self._errors: deque[tuple[float, float]] = deque(maxlen=window)  # (time, error)

    def record(self, predicted: float, actual: float, now: float = 0.0) -> None:
        self._errors.append((now, actual - predicted))

    def margin(self, now: float | None = None) -> float:
        if now is not None and self.max_age is not None:
            while self._errors and self._errors[0][0] < now - self.max_age:
                self._errors.popleft()
        if len(self._errors) < 8:
            return 0.0
        ordered = sorted(error for _, error in self._errors)
        return max(0.0, ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))])
