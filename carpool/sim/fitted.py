"""The measured cost model: a least-squares fit of real step times.

Form: ``seconds = c0 + c1 * tokens + c2 * seqs + c3 * context_tokens +
c4 * attention_pairs``: a fixed cost per step (Python, scheduling, kernel
launches), a cost per token computed (the linear layers), a cost per
sequence (sampling, per-row bookkeeping), a cost per token of context held
(reading the cached K/V) and a cost per query x key pair (attention scores:
what makes a long prefill chunk grow faster than linearly). ``carpool
measure`` measures the steps and fits it; the fit's error on the measured
steps is kept with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from carpool.executor.shapes import StepShape

FEATURES = ("step", "tokens", "seqs", "context_tokens", "attention_pairs")
FORM = ("seconds = c0 + c1*tokens + c2*seqs + c3*context_tokens + c4*attention_pairs "
        "(least squares of the relative error, coefficients >= 0)")


def features(shape: StepShape) -> tuple[float, ...]:
    return (1.0, float(shape.tokens), float(shape.seqs), float(shape.context_tokens),
            float(shape.attention_pairs))


@dataclass
class FittedCostModel:
    """Step seconds from the fitted coefficients (one per ``FEATURES``)."""

    coefficients: tuple[float, ...]
    meta: dict = field(default_factory=dict)  # hardware, model, dtype, fit error
    kind: str = "measured"

    def step_seconds(self, shape: StepShape) -> float:
        return self._seconds(shape.tokens, shape.seqs, shape.context_tokens,
                             shape.attention_pairs)

    def decode_step_seconds(self, seqs: int, context_tokens: int) -> float:
        """``step_seconds`` of ``seqs`` decodes holding ``context_tokens`` in
        all, without building the shape (the simulator's hot path)."""
        return self._seconds(seqs, seqs, context_tokens, context_tokens)

    def _seconds(self, tokens: int, seqs: int, context_tokens: int, pairs: int) -> float:
        c0, c1, c2, c3, c4 = self.coefficients
        return c0 + c1 * tokens + c2 * seqs + c3 * context_tokens + c4 * pairs

    def describe(self) -> dict:
        return {"model_kind": self.kind, "form": FORM,
                "coefficients": dict(zip(FEATURES, self.coefficients)), **self.meta}

    @classmethod
    def from_dict(cls, data: dict) -> FittedCostModel:
        coefficients = data.get("coefficients") or {}
        missing = [name for name in FEATURES if name not in coefficients]
        if missing:
            raise ValueError(f"cost model lacks coefficients {missing}")
        meta = {k: v for k, v in data.items()
                if k not in ("kind", "version", "model_kind", "form", "coefficients")}
        return cls(tuple(float(coefficients[name]) for name in FEATURES), meta)


def fit(samples: list[tuple[StepShape, float]], meta: dict | None = None) -> FittedCostModel:
    """Non-negative least squares of the relative error over (shape,
    seconds) samples: each step weighs 1/seconds, so a 30 ms decode counts as
    much as a 700 ms prefill (a simulator's error is relative too). A
    coefficient that comes out negative (a negative cost per token would
    make big steps look free outside the measured range) is fixed at 0, the
    most negative first, and the rest refitted."""
    import numpy as np

    if len(samples) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} steps to fit, got {len(samples)}")
    x = np.array([features(shape) for shape, _ in samples])
    y = np.array([seconds for _, seconds in samples])
    weight = 1.0 / np.maximum(y, 1e-9)
    active = list(range(len(FEATURES)))
    coef = np.zeros(len(FEATURES))
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active] * weight[:, None], y * weight, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        del active[int(np.argmin(solution))]
    model = FittedCostModel(tuple(float(c) for c in coef), dict(meta or {}))
    errors = np.abs(x @ coef - y) * weight
    model.meta["fit"] = {"steps": len(samples), "median_abs_error": float(np.median(errors)),
                         "p90_abs_error": float(np.percentile(errors, 90))}
    return model
