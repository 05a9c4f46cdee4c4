"""Online cost model of one scheduler step, fitted while the engine runs.

``step_seconds ≈ c0 + c1 * tokens + c2 * seqs``: a fixed per-step cost
(Python, kernel launches), a cost per token computed (the linear layers,
which dominate), and a cost per sequence (attention over its context,
sampling). Fitted by ridge-regularised least squares over the last
``window`` steps, so it follows the machine as load and context lengths
drift. Pure Python: the scheduler, the admission controller and the
simulator use it alike.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

_FEATURES = 3
# Ridge on the slopes only: pure-decode windows have tokens == seqs, and
# without it the two slopes would be undetermined.
_RIDGE = 1e-6


def _features(tokens: int, seqs: int) -> tuple[float, float, float]:
    return (1.0, float(tokens), float(seqs))


class StepCostModel:
    """Least squares over a sliding window of (tokens, seqs, seconds) steps.

    Invariant: ``_sums`` holds the moments of the steps in ``_steps``
    (added on record, subtracted on eviction): n, sum t, sum s, sum t*t,
    sum t*s, sum s*s, sum y, sum t*y, sum s*y; so a fit costs a 3x3 solve,
    not a pass over the window. Recording is on every step's path (millions
    of times in a simulation), hence the unrolled arithmetic.
    """

    def __init__(self, window: int = 256, min_steps: int = 8) -> None:
        self.window = window
        self.min_steps = min_steps
        self._steps: deque[tuple[int, int, float]] = deque()
        self._sums = [0.0] * 9
        # Moments of steps measured before serving (``add_prior``), never evicted.
        self._prior = [0.0] * 9
        self._prior_steps = 0
        self._coef: list[float] | None = None

    @property
    def ready(self) -> bool:
        """Whether enough steps were seen for predictions to mean something."""
        return len(self._steps) + self._prior_steps >= self.min_steps

    @property
    def num_prior_steps(self) -> int:
        """Steps given by ``add_prior`` (kept in every fit)."""
        return self._prior_steps

    def add_prior(self, steps: Iterable[tuple[int, int, float]]) -> None:
        """Steps (tokens, seqs, seconds) measured before serving, kept in
        every fit beside the sliding window: batch sizes the live load has
        not reached yet are then priced from measurements. Without them a
        fresh server fitted only its first small batches, overpriced bigger
        ones, kept its limit (and so its batches) small, and never learned
        otherwise."""
        prior = self._prior
        for t, s, y in steps:
            for i, value in enumerate((1, t, s, t * t, t * s, s * s, y, t * y, s * y)):
                prior[i] += value
            self._prior_steps += 1
        self._coef = None

    def steps(self) -> list[tuple[int, int, float]]:
        """The steps of the sliding window, oldest first."""
        return list(self._steps)

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(seconds per step, per token, per sequence), or None before ``ready``."""
        coef = self._fit()
        return None if coef is None else (coef[0], coef[1], coef[2])

    def record(self, tokens: int, seqs: int, seconds: float) -> None:
        """Add one measured step."""
        self.record_many(tokens, seqs, (seconds,))

    def record_many(self, tokens: int, seqs: int, seconds: Iterable[float]) -> None:
        """Add measured steps of one size, oldest first; the moments come
        out bit-identical to recording them one at a time.

        The moments without seconds are sums of integers, exact in floating
        point at these magnitudes (< 2**53), so they are added once at the
        end; those with seconds are summed step by step in the same order
        as ``record`` (add the new step, then drop the evicted one).
        """
        steps, sums, window = self._steps, self._sums, self.window
        added = 0
        gone_n = gone_t = gone_s = gone_tt = gone_ts = gone_ss = 0
        for y in seconds:
            sums[6] += y
            sums[7] += tokens * y
            sums[8] += seqs * y
            steps.append((tokens, seqs, y))
            added += 1
            if len(steps) > window:
                t, s, y = steps.popleft()
                sums[6] -= y
                sums[7] -= t * y
                sums[8] -= s * y
                gone_n += 1
                gone_t += t
                gone_s += s
                gone_tt += t * t
                gone_ts += t * s
                gone_ss += s * s
        sums[0] += added - gone_n
        sums[1] += added * tokens - gone_t
        sums[2] += added * seqs - gone_s
        sums[3] += added * tokens * tokens - gone_tt
        sums[4] += added * tokens * seqs - gone_ts
        sums[5] += added * seqs * seqs - gone_ss
        self._coef = None

    def predict(self, tokens: int, seqs: int) -> float | None:
        """Predicted seconds of a step with this many tokens and sequences."""
        coef = self._fit()
        if coef is None:
            return None
        x = _features(tokens, seqs)
        return max(0.0, sum(c * v for c, v in zip(coef, x)))

    def max_tokens_within(self, seconds: float, seqs: int) -> int | None:
        """The most tokens a step with ``seqs`` sequences can take and still
        finish within ``seconds`` (at least ``seqs``: every sequence gets one)."""
        coef = self._fit()
        if coef is None:
            return None
        per_token = max(coef[1], 1e-12)
        room = seconds - coef[0] - coef[2] * seqs
        return max(seqs, int(room / per_token))

    def _fit(self) -> list[float] | None:
        if not self.ready:
            return None
        if self._coef is None:
            n, st, ss, stt, sts, sss, sy, sty, ssy = (
                a + b for a, b in zip(self._sums, self._prior))
            matrix = [[n, st, ss], [st, stt, sts], [ss, sts, sss]]
            for i in range(1, _FEATURES):  # scale-free: relative to the feature's own moment
                matrix[i][i] += _RIDGE * max(matrix[i][i], 1.0)
            self._coef = solve_linear(matrix, [sy, sty, ssy])
        return self._coef


def solve_linear(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (small n; changes its arguments)."""
    n = len(rhs)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(matrix[r][col]))
        matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
        rhs[col], rhs[pivot] = rhs[pivot], rhs[col]
        if abs(matrix[col][col]) < 1e-30:
            matrix[col][col] = 1e-30  # degenerate window: that coefficient becomes ~0
        for row in range(col + 1, n):
            factor = matrix[row][col] / matrix[col][col]
            for k in range(col, n):
                matrix[row][k] -= factor * matrix[col][k]
            rhs[row] -= factor * rhs[col]
    coef = [0.0] * n
    for row in reversed(range(n)):
        total = rhs[row] - sum(matrix[row][k] * coef[k] for k in range(row + 1, n))
        coef[row] = total / matrix[row][row]
    return coef
