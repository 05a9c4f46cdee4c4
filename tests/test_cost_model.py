"""The online step-cost model recovers known costs and tracks drift."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.scheduler.control.cost_model import StepCostModel


def _true_cost(tokens: int, seqs: int) -> float:
    return 0.004 + 0.0002 * tokens + 0.0005 * seqs


def test_recovers_the_coefficients_of_a_noiseless_machine():
    model = StepCostModel(window=128)
    rng = random.Random(0)
    assert model.predict(10, 1) is None and not model.ready
    for _ in range(100):
        seqs = rng.randint(1, 64)
        tokens = seqs + rng.choice([0, 0, 0, rng.randint(1, 512)])  # mostly decode steps
        model.record(tokens, seqs, _true_cost(tokens, seqs))
    c0, c1, c2 = model.coefficients
    assert (c0, c1, c2) == pytest.approx((0.004, 0.0002, 0.0005), rel=1e-3)
    assert model.predict(300, 10) == pytest.approx(_true_cost(300, 10), rel=1e-3)
    # the inverse: the biggest step with 10 sequences that fits in 50 ms
    tokens = model.max_tokens_within(0.050, 10)
    assert _true_cost(tokens, 10) <= 0.050 < _true_cost(tokens + 2, 10)


def test_pure_decode_windows_still_predict_well():
    model = StepCostModel()
    for seqs in [1, 2, 4, 8, 16, 32] * 5:
        model.record(seqs, seqs, _true_cost(seqs, seqs))
    for seqs in (3, 20, 64):
        assert model.predict(seqs, seqs) == pytest.approx(_true_cost(seqs, seqs), rel=1e-2)


def test_old_steps_leave_the_window_so_the_model_follows_drift():
    model = StepCostModel(window=32)
    for i in range(32):
        model.record(64 + i, 8, 0.001 * (64 + i))
    for i in range(32):  # the machine got twice as slow
        model.record(64 + i, 8, 0.002 * (64 + i))
    assert model.predict(80, 8) == pytest.approx(0.160, rel=1e-3)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(1, 2048), st.integers(1, 256),
                                st.floats(0.0, 10.0)), min_size=8, max_size=60))
def test_any_history_gives_finite_non_negative_predictions(steps):
    model = StepCostModel(window=16)
    for tokens, seqs, seconds in steps:
        model.record(max(tokens, seqs), seqs, seconds)
    value = model.predict(100, 10)
    assert value is not None and 0.0 <= value < float("inf")
    assert model.max_tokens_within(0.1, 10) >= 10


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4096), st.integers(1, 64),
                          st.lists(st.floats(1e-4, 2.0), min_size=1, max_size=40)),
                min_size=1, max_size=30),
       st.integers(4, 64))
def test_recording_runs_at_once_is_bit_identical_to_step_by_step(runs, window):
    """The fast-forward records a run of same-size steps in one call; the
    moments (hence every fit) must not depend on how steps are grouped."""
    one_by_one, grouped = StepCostModel(window=window), StepCostModel(window=window)
    for tokens, seqs, seconds in runs:
        for step_seconds in seconds:
            one_by_one.record(tokens, seqs, step_seconds)
        grouped.record_many(tokens, seqs, seconds)
    assert grouped._sums == one_by_one._sums
    assert grouped.coefficients == one_by_one.coefficients
