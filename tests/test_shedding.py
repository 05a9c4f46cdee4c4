"""Predicted time to first token from the step-cost model."""
from __future__ import annotations

import pytest

from carpool.scheduler.cost_model import StepCostModel
from carpool.scheduler.shedding import predict_first_token_delay


def _model() -> StepCostModel:
    model = StepCostModel()
    for tokens, seqs in [(8, 8), (64, 8), (256, 9), (512, 10), (16, 16), (300, 3)] * 3:
        model.record(tokens, seqs, 0.002 + 0.0001 * tokens + 0.001 * seqs)
    return model


def test_not_ready_without_history():
    assert predict_first_token_delay(StepCostModel(), 0, 100, 0, 512) is None


def test_delay_counts_the_steps_needed_to_prefill_what_is_ahead():
    model = _model()
    # 8 decodes leave 504 tokens a step; 1000 ahead + 100 own = 3 full steps
    delay = predict_first_token_delay(model, 1000, 100, 8, 512)
    step = 0.002 + 0.0001 * 512 + 0.001 * 9
    assert delay == pytest.approx(3 * step, rel=1e-3)
    # an idle engine: one step of just the prompt
    alone = predict_first_token_delay(model, 0, 100, 0, 512)
    assert alone == pytest.approx(0.002 + 0.0001 * 100 + 0.001, rel=1e-3)
    assert predict_first_token_delay(model, 5000, 100, 8, 512) > delay
