"""Predictive shedding: reject at arrival a request that cannot start in time.

A request with a deadline that the step-cost model predicts it would miss
is turned away when it arrives (HTTP 429 right away) instead of after
waiting in the queue for nothing. The estimate is deliberately optimistic
(it ignores sequence-slot and KV limits), so shedding only happens when
even the best case is late.
"""
from __future__ import annotations

import math
from collections import deque

from carpool.scheduler.cost_model import StepCostModel


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
                       slots_needed: int) -> float | None:
    """Seconds until ``slots_needed`` running requests have finished, when
    each has ``remaining_tokens`` left to generate (at most: a request may
    stop early) and every step decodes one token of each. None while the
    cost model is not ready or nothing runs."""
    if not cost.ready or not remaining_tokens or slots_needed <= 0:
        return None
    ordered = sorted(remaining_tokens)
    running = len(ordered)
    rounds, index = divmod(slots_needed - 1, running)
    steps = ordered[index] + rounds * ordered[-1]
    return steps * cost.predict(running, running)


class PredictionError:
    """How late first tokens came against their prediction, learned online.

    ``margin`` is the 99th percentile (``quantile``) of (actual - predicted)
    TTFT over the last ``window`` admitted requests that had a prediction
    (never below 0): shedding adds it to every prediction, so a cost model
    that is optimistic under the current load sheds earlier instead of
    letting the admitted requests' p99 TTFT miss the target.
    """

    def __init__(self, window: int = 256, quantile: float = 0.99) -> None:
        self.quantile = quantile
        self._errors: deque[float] = deque(maxlen=window)

    def record(self, predicted: float, actual: float) -> None:
        self._errors.append(actual - predicted)

    def margin(self) -> float:
        if len(self._errors) < 8:
            return 0.0
        ordered = sorted(self._errors)
        return max(0.0, ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))])
