"""Predicted time to first token from the step-cost model."""
from __future__ import annotations

import pytest

from carpool.scheduler.cost_model import StepCostModel
from carpool.scheduler.shedding import predict_first_token_delay, predict_slot_delay


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


def test_slot_delay_waits_for_the_kth_shortest_remaining_request():
    model = _model()
    decode_step = 0.002 + 0.0001 * 4 + 0.001 * 4  # 4 running, one token each
    assert predict_slot_delay(model, [30, 5, 12, 50], 1) == pytest.approx(5 * decode_step,
                                                                          rel=1e-3)
    assert predict_slot_delay(model, [30, 5, 12, 50], 3) == pytest.approx(30 * decode_step,
                                                                          rel=1e-3)
    # More slots than running requests: whole rounds of the longest on top.
    assert predict_slot_delay(model, [30, 5, 12, 50], 6) == pytest.approx(
        (12 + 50) * decode_step, rel=1e-3)
    assert predict_slot_delay(model, [], 1) is None
    assert predict_slot_delay(StepCostModel(), [3], 1) is None
