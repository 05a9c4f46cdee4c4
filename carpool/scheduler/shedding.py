"""Predictive shedding: reject at arrival a request that cannot start in time.

A request with a deadline that the step-cost model predicts it would miss
is turned away when it arrives (HTTP 429 right away) instead of after
waiting in the queue for nothing. The estimate is deliberately optimistic
(it ignores sequence-slot and KV limits), so shedding only happens when
even the best case is late.
"""
from __future__ import annotations

import math

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
