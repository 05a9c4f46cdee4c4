"""The adaptive controller's modes: what each means for the knobs
(``PRESETS``) and when to switch (``ModeSelector``, with hysteresis).

Pure Python.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from carpool.config import ControllerConfig
from carpool.scheduler.control.live_window import Signals

MODES = ("latency", "balanced", "throughput")
# A surge for the mode: arrivals over the fast window at this multiple of
# the slow window's rate.
SURGE_QPS_RATIO = 1.5
# KV usage at or above this is no light load, whatever the busy share says.
KV_LIGHT = 0.8


@dataclass(frozen=True)
class ModePreset:
    """What a mode means for the knobs.

    ``step_share``: the fraction of the TPOT target one step may take when
    sizing the batch limit and token budget (smaller = more latency margin).
    Below 1 in every mode: the target holds for the p99 of requests' TPOT,
    and a request's TPOT is the mean of its steps, some of which carry
    prefill chunks.

    ``cap_share``: the mode's batch cap as a share of the configured one
    (``max_batch_size`` under request-level batching, ``max_num_seqs``
    under continuous); ``budget_share``: its step token budget as a share of
    ``max_num_batched_tokens`` (continuous). With the default caps (16
    requests) latency mode batches at most 4 and waits at most 50 ms,
    throughput mode 16 and 200 ms. Only latency mode cuts the budget: it is
    the mode of an empty queue, where small steps are what running decodes
    feel; with a queue a cut only delays first tokens.
    """

    preferred_batch_size: int
    max_wait: float  # ceiling of the request-level batching wait
    step_share: float
    cap_share: float
    budget_share: float


PRESETS = {
    "latency": ModePreset(preferred_batch_size=4, max_wait=0.05, step_share=0.6,
                          cap_share=0.25, budget_share=0.25),
    "balanced": ModePreset(preferred_batch_size=8, max_wait=0.1, step_share=0.8,
                           cap_share=0.5, budget_share=1.0),
    "throughput": ModePreset(preferred_batch_size=16, max_wait=0.2, step_share=0.9,
                             cap_share=1.0, budget_share=1.0),
}
# The smallest step token budget a mode's share cuts to: a prompt split
# finer pays each step's fixed cost again.
MIN_MODE_BUDGET = 64


def mode_caps(preset: ModePreset, batch_cap: int, token_budget: int) -> tuple[int, int]:
    """(batch cap, step token budget) of a mode, from the configured ones."""
    return (max(1, math.ceil(batch_cap * preset.cap_share)),
            min(token_budget, max(MIN_MODE_BUDGET, math.ceil(token_budget
                                                             * preset.budget_share))))


class ModeSelector:
    """Picks the mode with hysteresis: a mode's entry thresholds are harder
    than its exit thresholds, and a change needs ``hold_ticks`` ticks in a
    row wanting the same new mode."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config.concrete()  # auto targets: their fallbacks unless measured
        self.pinned = config.controller_mode != "auto"
        self.mode = config.controller_mode if self.pinned else "balanced"
        self._candidate: str | None = None
        self._streak = 0

    def wanted(self, s: Signals) -> tuple[str, str]:
        """The mode the signals ask for, and why. Six signals: QPS (the fast
        window's arrival rate against the slow one's), engine busy share, KV
        usage, queue depth, TTFT p95, and TPOT / E2E p99. Throughput when
        first tokens are late or demand outruns the batches (busy with a
        queue, or a surge with a queue); latency when tokens or whole
        requests run late with nobody waiting (smaller steps help them, and
        no queue pays for it), or when the load is light on every signal."""
        ttft_target = self.config.ttft_target
        staying_fast = self.mode == "throughput"
        busy_high = 0.7 if staying_fast else 0.85
        ttft_high = (0.8 if staying_fast else 1.0) * ttft_target if ttft_target else math.inf
        if s.ttft_p95 is not None and s.ttft_p95 > ttft_high:
            return "throughput", f"ttft_p95 {s.ttft_p95:.2f} s > {ttft_high:.2f} s"
        # Continuous batching is busy whenever anything runs: only busy with a
        # queue of at least half a batch means demand outruns the batches.
        queue_high = max(1, s.batch_limit // 2)
        if s.busy > busy_high and s.waiting >= queue_high:
            return "throughput", (f"busy {s.busy:.0%} > {busy_high:.0%} with {s.waiting} "
                                  f"waiting >= {queue_high}")
        surge = (s.fast_arrival_rate is not None
                 and s.fast_arrival_rate > SURGE_QPS_RATIO * max(s.arrival_rate, 1e-9))
        if surge and s.waiting >= queue_high:
            return "throughput", (f"arrivals {s.fast_arrival_rate:.1f}/s > {SURGE_QPS_RATIO:g} "
                                  f"x {s.arrival_rate:.1f}/s with {s.waiting} waiting")
        late = self._late_decode(s)
        if late is not None and s.waiting == 0 and s.busy <= busy_high:
            # Not when the engine is saturated: an empty queue then only means
            # admission keeps it short, and latency mode's caps would cut
            # the throughput a surge needs (it flapped in and out every few
            # seconds of a live surge, its 113-token budget each time).
            return "latency", f"{late}, queue empty"
        staying_light = self.mode == "latency"
        busy_low = 0.55 if staying_light else 0.4
        calm_ttft = ttft_target is None or s.ttft_p95 is None or s.ttft_p95 <= 0.5 * ttft_target
        if (s.busy < busy_low and s.waiting == 0 and calm_ttft and s.kv_usage < KV_LIGHT
                and not surge):
            return "latency", f"busy {s.busy:.0%} < {busy_low:.0%}, queue empty"
        return "balanced", f"busy {s.busy:.0%}, {s.waiting} waiting"

    def _late_decode(self, s: Signals) -> str | None:
        """Why finished requests' TPOT or E2E p99 is over an operator's
        target, or None. A measured TPOT target does not count: at the tail
        of a burst the requests that finished ran in its big batches, and
        latency mode then met the next burst with a cut budget."""
        tpot, e2e = self.config.tpot_target, self.config.e2e_target
        if not self.config.batch_limit_by_tpot:
            tpot = None
        if tpot is not None and s.tpot_p99 is not None and s.tpot_p99 > tpot:
            return f"tpot_p99 {s.tpot_p99 * 1000:.0f} ms > {tpot * 1000:.0f} ms"
        if e2e is not None and s.e2e_p99 is not None and s.e2e_p99 > e2e:
            return f"e2e_p99 {s.e2e_p99:.2f} s > {e2e:.2f} s"
        return None

    def update(self, s: Signals, fits: Callable[[str], bool] | None = None,
               ) -> tuple[str, str] | None:
        """Feed one tick; return (old mode, cause) when the mode changed.

        ``fits(mode)``: whether the present demand (waiting + running
        requests, waiting prompt tokens) is within that mode's caps. A queue
        that outgrows the current mode's caps moves it up at once, to the
        first mode that fits (else throughput): the caps are real, and a
        burst must not wait out the hysteresis behind them. A move down
        only goes to a mode that fits.
        """
        if self.pinned:
            return None
        if fits is not None and s.waiting and not fits(self.mode):
            above = MODES[MODES.index(self.mode) + 1:]
            if above:
                old = self.mode
                self.mode = next((mode for mode in above if fits(mode)), MODES[-1])
                self._candidate, self._streak = None, 0
                return old, (f"{s.waiting} waiting + {s.running} running outgrow mode "
                             f"{old}'s caps")
        mode, cause = self.wanted(s)
        if (fits is not None and MODES.index(mode) < MODES.index(self.mode)
                and not fits(mode)):
            mode = self.mode  # the demand is over the lower mode's caps
        if mode == self.mode:
            self._candidate, self._streak = None, 0
            return None
        self._streak = self._streak + 1 if mode == self._candidate else 1
        self._candidate = mode
        if self._streak < self.config.hysteresis_ticks:
            return None
        old, self.mode = self.mode, mode
        self._candidate, self._streak = None, 0
        return old, f"{cause} ({self.config.hysteresis_ticks} ticks)"
