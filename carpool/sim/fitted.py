"""The measured cost model: a least-squares fit of real step times.

Form: ``seconds = c0 + c1*tokens + c2*seqs + c3*context_tokens +
c4*attention_pairs + c5*prefill_chunks + c6*min(tokens, 64) +
c7*min(tokens, 256) + c8*wake(idle) + new_shape*(c9 + c10*tokens)``:

- c0, a fixed cost per step (Python, scheduling, kernel launches; the
  weights read once);
- c1, a cost per row the linear layers compute: the step's tokens padded
  to the executor's row bucket (``carpool.executor.shapes.padded_rows``,
  the ``row_bucket`` the file records; 1, exact tokens, in files from
  before it); c6 and c7 make that cost concave, as measured: on a 2-core AVX-512 CPU a 32-token prefill
  costs ~300 us a token over the fixed cost, a 512-token one ~230 us (the
  matrix kernels block better over more rows), which one linear term priced
  5-10% low in the middle and 12% high at the end;
- c2, a cost per sequence (sampling, per-row bookkeeping);
- c3, a cost per token of context held (reading the cached K/V);
- c4, a cost per query x key pair (attention scores: what makes a long
  prefill chunk grow faster than linearly);
- c5, a cost per prefill chunk: each chunk's attention runs on its own, layer
  by layer, where decodes share one batched kernel;
- c8, the wake cost: a step that starts after the engine idled costs more
  (measured ~3 ms, +7% on a 40 ms prefill, after >= 0.3 s idle; half of it
  after ~0.05 s), ``wake(idle) = 1 - exp(-idle / WAKE_TAU_S)``. Real traffic
  starts most of its first-token steps after an idle gap, a grid run back to
  back never does: without the term a fit priced real prefills 10-14% low.
- c9 and c10, a step whose row count is new to the process
  (``carpool.executor.shapes.ShapeMemory``: the matrix kernels are built
  per shape on first use): measured 5-18 ms more, growing with the tokens.

``carpool measure`` measures the steps and fits it; the fit's error on the
measured steps is kept with it. Files from before the last four terms load
with them at 0 (the form they were fitted with).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from carpool.executor.shapes import StepSample, StepShape, as_samples, padded_rows

FEATURES = ("step", "tokens", "seqs", "context_tokens", "attention_pairs", "prefill_chunks",
            "first_64_tokens", "first_256_tokens", "wake", "new_shape", "new_shape_tokens")
_OPTIONAL = FEATURES[5:]  # absent from files fitted before them: 0
KNOTS = (64, 256)
WAKE_TAU_S = 0.1  # idle seconds for the wake cost to reach 63% of its whole
FORM = ("seconds = c0 + c1*rows + c2*seqs + c3*context_tokens + c4*attention_pairs "
        "+ c5*prefill_chunks + c6*min(rows,64) + c7*min(rows,256) "
        f"+ c8*(1-exp(-idle/{WAKE_TAU_S}s)) + new_shape*(c9 + c10*tokens) "
        "(rows: the tokens padded to row_bucket; least squares of the relative error, "
        "coefficients >= 0)")


def wake_fraction(idle_s: float) -> float:
    """Share of the whole wake cost a step pays after ``idle_s`` idle."""
    return 1.0 - math.exp(-idle_s / WAKE_TAU_S) if idle_s > 0 else 0.0


def features(sample: StepSample, row_bucket: int = 1) -> tuple[float, ...]:
    shape = sample.shape
    tokens = shape.tokens
    rows = padded_rows(tokens, row_bucket)
    new = 1.0 if sample.new_shape else 0.0
    return (1.0, float(rows), float(shape.seqs), float(shape.context_tokens),
            float(shape.attention_pairs), float(shape.seqs - shape.decode_seqs),
            float(min(rows, KNOTS[0])), float(min(rows, KNOTS[1])),
            wake_fraction(sample.idle_s), new, new * tokens)


@dataclass
class FittedCostModel:
    """Step seconds from the fitted coefficients (one per ``FEATURES``; a
    shorter tuple is the older form, the rest 0)."""

    coefficients: tuple[float, ...]
    meta: dict = field(default_factory=dict)  # hardware, model, dtype, fit error
    kind: str = "measured"

    @property
    def row_bucket(self) -> int:
        """The row bucket of the process it was measured on (``meta``; 1,
        exact rows, for files from before row buckets)."""
        return int(self.meta.get("row_bucket", 1))

    def __post_init__(self) -> None:
        if len(self.coefficients) > len(FEATURES):
            raise ValueError(f"{len(self.coefficients)} coefficients for {len(FEATURES)} terms")
        self.coefficients = tuple(self.coefficients) + (0.0,) * (
            len(FEATURES) - len(self.coefficients))

    def step_seconds(self, shape: StepShape) -> float:
        """A step of ``shape`` right after another (no wake cost)."""
        return self._seconds(shape.tokens, shape.seqs, shape.context_tokens,
                             shape.attention_pairs, shape.seqs - shape.decode_seqs)

    def decode_step_seconds(self, seqs: int, context_tokens: int) -> float:
        """``step_seconds`` of ``seqs`` decodes holding ``context_tokens`` in
        all, without building the shape (the simulator's hot path)."""
        return self._seconds(seqs, seqs, context_tokens, context_tokens, 0)

    def extra_seconds(self, tokens: int, idle_s: float, new_shape: bool) -> float:
        """What a step of ``tokens`` costs more after ``idle_s`` idle and
        when its token count is new to the process."""
        c8, c9, c10 = self.coefficients[8:]
        return c8 * wake_fraction(idle_s) + (c9 + c10 * tokens if new_shape else 0.0)

    def sample_seconds(self, sample: StepSample) -> float:
        """The price of a timed step in its circumstances."""
        return self.step_seconds(sample.shape) + self.extra_seconds(
            sample.shape.tokens, sample.idle_s, sample.new_shape)

    def _seconds(self, tokens: int, seqs: int, context_tokens: int, pairs: int,
                 chunks: int) -> float:
        c0, c1, c2, c3, c4, c5, c6, c7 = self.coefficients[:8]
        rows = padded_rows(tokens, self.row_bucket)
        return (c0 + c1 * rows + c2 * seqs + c3 * context_tokens + c4 * pairs + c5 * chunks
                + c6 * min(rows, KNOTS[0]) + c7 * min(rows, KNOTS[1]))

    def describe(self) -> dict:
        return {"model_kind": self.kind, "form": FORM,
                "coefficients": dict(zip(FEATURES, self.coefficients)), **self.meta}

    @classmethod
    def from_dict(cls, data: dict) -> FittedCostModel:
        coefficients = data.get("coefficients") or {}
        missing = [name for name in FEATURES if name not in coefficients
                   and name not in _OPTIONAL]
        if missing:
            raise ValueError(f"cost model lacks coefficients {missing}")
        meta = {k: v for k, v in data.items()
                if k not in ("kind", "version", "model_kind", "form", "coefficients")}
        return cls(tuple(float(coefficients.get(name, 0.0)) for name in FEATURES), meta)


def fit(samples: Sequence[tuple], meta: dict | None = None) -> FittedCostModel:
    """Non-negative least squares of the relative error over timed steps
    (``StepSample`` or (shape, seconds[, idle_s]) tuples): each step weighs
    1/seconds, so a 30 ms decode counts as much as a 700 ms prefill (a
    simulator's error is relative too). A coefficient that comes out
    negative (a negative cost per token would make big steps look free
    outside the measured range) is fixed at 0, the most negative first, and
    the rest refitted; so is a term no sample exercises."""
    import numpy as np

    timed = as_samples(samples)
    if len(timed) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} steps to fit, got {len(timed)}")
    row_bucket = int((meta or {}).get("row_bucket", 1))
    x = np.array([features(s, row_bucket) for s in timed])
    y = np.array([s.seconds for s in timed])
    weight = 1.0 / np.maximum(y, 1e-9)
    active = [i for i in range(len(FEATURES)) if np.ptp(x[:, i]) > 0 or i == 0]
    coef = np.zeros(len(FEATURES))
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active] * weight[:, None], y * weight, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        del active[int(np.argmin(solution))]
    model = FittedCostModel(tuple(float(c) for c in coef), dict(meta or {}))
    errors = np.abs(x @ coef - y) * weight
    model.meta["fit"] = {"steps": len(timed), "median_abs_error": float(np.median(errors)),
                         "p90_abs_error": float(np.percentile(errors, 90))}
    return model
