"""A TTFT model the router learns from the first tokens it sees.

The router's prediction (``policies.predict_ttft_on``) is analytic: the
prefill ahead of a request and its own, priced by the replica's step-cost
fit. What it leaves out (the engine's own queueing rules, chunking, KV
pressure, preemptions, the front's and the wire's delays) shows as its
error. ``TTFTModel`` regresses the observed TTFT on the analytic one and
the replica's state at routing time: the uncached prompt tokens, the
requests queued there, its KV usage and the requests it runs; a ridge fit
over the latest ``window`` first tokens. Once ``min_samples`` are in, the
router prices replicas with it (``Router(learn_ttft=True)``).

One model for the fleet: its replicas run one model on one kind of machine,
so each first token teaches about all of them. Pure Python, deterministic.
"""
from __future__ import annotations

from collections import deque

from carpool.scheduler.control.cost_model import solve_linear

Features = tuple[float, ...]
_RIDGE = 1e-3


def ttft_features(analytic: float, uncached_tokens: int, queued: int, kv_usage: float,
                  running: int) -> Features:
    """The regressors, the constant first (uncached tokens in thousands,
    so the ridge treats the columns alike)."""
    return (1.0, analytic, uncached_tokens / 1000.0, float(queued), kv_usage, float(running))


class TTFTModel:
    """Ridge least squares of observed TTFT on ``ttft_features``."""

    def __init__(self, window: int = 512, min_samples: int = 64, refit_every: int = 16) -> None:
        self.window, self.min_samples, self.refit_every = window, min_samples, refit_every
        self._samples: deque[tuple[Features, float]] = deque(maxlen=window)
        self._since_fit = 0
        self._coef: list[float] | None = None

    @property
    def ready(self) -> bool:
        return self._coef is not None

    @property
    def coefficients(self) -> list[float] | None:
        return None if self._coef is None else list(self._coef)

    def record(self, features: Features, observed: float) -> None:
        self._samples.append((features, observed))
        self._since_fit += 1
        if len(self._samples) >= self.min_samples and (
                self._coef is None or self._since_fit >= self.refit_every):
            self._fit()

    def predict(self, features: Features) -> float | None:
        """The learned TTFT (seconds, >= 0), None until fitted."""
        if self._coef is None:
            return None
        return max(0.0, sum(c * x for c, x in zip(self._coef, features)))

    def _fit(self) -> None:
        size = len(self._samples[0][0])
        matrix = [[0.0] * size for _ in range(size)]
        rhs = [0.0] * size
        for features, observed in self._samples:
            for i, xi in enumerate(features):
                rhs[i] += xi * observed
                row = matrix[i]
                for j in range(i, size):
                    row[j] += xi * features[j]
        for i in range(size):
            for j in range(i):
                matrix[i][j] = matrix[j][i]
        for i in range(1, size):  # the slopes only, relative to their own scale
            matrix[i][i] += _RIDGE * max(matrix[i][i], 1.0)
        self._coef = solve_linear(matrix, rhs)
        self._since_fit = 0
