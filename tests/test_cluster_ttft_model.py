"""The TTFT model the router learns from first tokens (carpool.cluster.ttft_model)."""
from __future__ import annotations

import random

import pytest
from test_cluster_router import fleet, request

from carpool.cluster.ttft_model import TTFTModel, ttft_features


def test_the_model_recovers_what_the_analytic_prediction_leaves_out():
    """Observed = 1.3 x analytic + 40 ms per queued request + noise: the
    fit finds it, and predicts far better than the analytic value."""
    rng = random.Random(0)
    model = TTFTModel(min_samples=64)
    assert model.predict(ttft_features(0.1, 100, 0, 0.0, 0)) is None
    for _ in range(400):
        analytic, queued = rng.uniform(0.01, 0.5), rng.randrange(0, 20)
        observed = 1.3 * analytic + 0.04 * queued + rng.gauss(0, 0.005)
        model.record(ttft_features(analytic, rng.randrange(1, 4000), queued,
                                   rng.random(), rng.randrange(0, 32)), observed)
    assert model.ready
    coef = model.coefficients
    assert coef[1] == pytest.approx(1.3, abs=0.05) and coef[3] == pytest.approx(0.04, abs=0.005)
    features = ttft_features(0.2, 500, 10, 0.5, 8)
    assert model.predict(features) == pytest.approx(1.3 * 0.2 + 0.4, abs=0.02)


def test_learned_ttft_routes_by_the_model_once_fitted_and_reports_both_errors():
    """Every replica's real TTFT is twice the analytic prediction: the
    learned model's error falls far below the analytic one's, and the
    learned policy's predictions match the replica."""
    router = fleet("learned-ttft", replicas=2)
    now = 0.0
    for i in range(200):
        decision = router.route(request(i, 256 + (i % 7) * 64), now)
        assert decision.replica_id in router.views
        routed = router._routed[f"q{i}"]
        observed = 2.0 * routed.features[1]
        router.first_token(f"q{i}", now + observed)
        router.finished(f"q{i}", now + observed + 0.01)
        now += 1.0
    errors = router.ttft_errors_by_model()
    assert errors["samples"] > 100
    assert errors["analytic"] == pytest.approx(0.5, abs=0.01)  # |x - 2x| / 2x
    assert errors["learned"] < 0.05
    late = router.route(request(999, 512), now)
    routed = router._routed["q999"]
    assert late.predicted_ttft == pytest.approx(2.0 * routed.features[1], rel=0.05)
