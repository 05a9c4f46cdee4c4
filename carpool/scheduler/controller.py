"""The adaptive controller: live batching knobs from live metrics.

Every ``interval`` seconds (on the scheduler's clock) the controller reads
a sliding window of metrics (``live_window.Signals``) and decides:

- the mode, ``latency`` / ``balanced`` / ``throughput`` (``ModeSelector``:
  threshold bands plus a streak of ticks, so noisy metrics do not flap it);
- the batching wait under request-level batching: fill < 40% -> +20%;
  TTFT p95 over target -> -30%; bounded by ``[MIN_WAIT, mode ceiling]``;
- the batch limit ``optimal = min(by_memory, by_latency, max(preferred,
  peak_demand * alpha))``: by_memory = sequences whose KV (mean prompt +
  max_tokens of recent arrivals) fits the pool less ``memory_headroom``;
  by_latency = the largest decode batch whose step the online cost model
  (``StepCostModel``) predicts within the mode's share of the TPOT target;
  peak_demand = the most requests waiting + running in the window; alpha
  is the headroom over that peak for arrivals until the next tick (1..4,
  starts at 2) and adapts online: TTFT over target with TPOT within it
  means requests queue while steps have room, so alpha x1.25; TPOT over
  target with TTFT within it means batches are too big, so alpha x0.8.
  Targets within ``DEADBAND`` (10%) of the current value are left alone;
- the step token budget (continuous batching): outside throughput mode and
  while TPOT p95 is over the mode's share of its target, the most tokens a
  step with that many sequences takes within that share; else the
  configured budget (throughput mode always: it prefills fastest).

New knob values never land at once: ``KnobRamp`` moves them over
``transition_steps`` (at most 3) scheduler steps. Every change is a
``Decision`` with a short reason (a metric label) and a readable cause.
Pure Python; the scheduler calls ``on_step`` once per step.
"""
from __future__ import annotations

import logging
import math
from collections import Counter, deque
from dataclasses import dataclass, fields

from carpool.config import ControllerConfig, SchedulerConfig
from carpool.scheduler.cost_model import StepCostModel
from carpool.scheduler.live_window import LiveWindow, SampleWindow, Signals
from carpool.scheduler.modes import PRESETS, ModePreset, ModeSelector

logger = logging.getLogger(__name__)
MIN_WAIT = 0.005  # seconds: the timeout rules never take max_wait below this
ALPHA_RANGE = (1.0, 4.0)
ALPHA_START = 2.0
# A knob target within this share of the current value is left alone, so
# the noise of the fitted cost model does not move the knobs every tick.
DEADBAND = 0.1
EARLY_TICK = 0.1  # seconds: the soonest a surge brings the next tick forward


@dataclass
class LiveKnobs:
    """The knobs the scheduler reads every step (the controller moves them)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    preferred_batch_size: int
    max_batch_size: int
    max_wait: float | None

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> "LiveKnobs":
        return cls(config.max_num_seqs, config.max_num_batched_tokens,
                   config.preferred_batch_size, config.max_batch_size, config.max_wait)

    def as_dict(self) -> dict[str, float]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: float(v) for name, v in values.items() if v is not None}


@dataclass(frozen=True)
class Decision:
    """One controller decision. ``reason`` is a short label (for metrics)."""

    time: float
    knob: str  # "mode", "alpha" or a LiveKnobs field
    old: float | str | None
    new: float | str | None
    reason: str
    cause: str

    def describe(self) -> str:
        return f"{self.knob} {_fmt(self.new)} <- {_fmt(self.old)}: {self.cause}"


def _fmt(value: float | str | None) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


class KnobRamp:
    """Moves knobs to their targets in equal increments over ``steps`` steps."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._plan: dict[str, tuple[float, float]] = {}  # knob -> (start, target)
        self._done = 0

    @property
    def active(self) -> bool:
        return bool(self._plan)

    def retarget(self, knobs: LiveKnobs, targets: dict[str, float]) -> None:
        """Start a new ramp from the current values; knobs of an unfinished
        ramp that ``targets`` leaves out keep heading for their old target."""
        targets = {**{name: end for name, (_, end) in self._plan.items()}, **targets}
        self._plan = {name: (getattr(knobs, name), value) for name, value in targets.items()
                      if getattr(knobs, name) != value}
        self._done = 0

    def advance(self, knobs: LiveKnobs) -> None:
        if not self._plan:
            return
        self._done += 1
        share = self._done / self.steps
        for name, (start, target) in self._plan.items():
            value = start + (target - start) * share
            if isinstance(target, int):
                value = int(round(value))
            setattr(knobs, name, target if self._done >= self.steps else value)
        if self._done >= self.steps:
            self._plan.clear()


class AdaptiveController:
    """Owns the live knobs of one scheduler and retunes them every interval.

    ``knobs`` is the object the scheduler reads; only ``KnobRamp`` writes
    it, so no knob ever jumps by more than a third of a change in one step.
    """

    def __init__(self, config: ControllerConfig, base: SchedulerConfig, knobs: LiveKnobs,
                 num_blocks: int, block_size: int, cost_model: StepCostModel,
                 request_level: bool) -> None:
        self.config = config
        self.base = base
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cost_model = cost_model
        self.request_level = request_level  # static/dynamic: the batching wait applies
        self.knobs = knobs
        self.selector = ModeSelector(config)
        self.ramp = KnobRamp(config.transition_steps)
        self.window = LiveWindow(config.controller_window)
        self.demand = SampleWindow(config.controller_window)  # waiting + running per step
        self.alpha = ALPHA_START
        self.decisions: deque[Decision] = deque(maxlen=200)
        self.decision_counts: Counter[tuple[str, str]] = Counter()
        self.ticks = 0
        self._last_tick: float | None = None
        self.last_signals: Signals | None = None

    @property
    def mode(self) -> str:
        return self.selector.mode

    # -- events from the scheduler ------------------------------------------------

    def observe_arrival(self, now: float, request_tokens: int) -> None:
        self.window.observe_arrival(now, request_tokens)

    def observe_ttft(self, now: float, seconds: float) -> None:
        self.window.ttft.add(now, seconds)

    def observe_tpot(self, now: float, seconds: float) -> None:
        """A finished request's mean time per output token after the first."""
        self.window.tpot.add(now, seconds)

    def observe_step(self, now: float, fill: float | None, demand: int) -> None:
        if fill is not None:
            self.window.fill.add(now, fill)
        self.demand.add(now, float(demand))

    def before_step(self, now: float, scheduler) -> None:
        """The scheduler's hook at the start of each step: observe it, tick
        when due, move the knobs one increment, pass them to the batch gate."""
        waiting, running, knobs = scheduler.waiting, scheduler.running, self.knobs
        fill = None if scheduler.gate else len(running) / knobs.max_num_seqs
        self.observe_step(now, fill, len(waiting) + len(running))

        def read_state() -> dict[str, float]:
            kv = scheduler.kv.stats()
            return {"waiting": len(waiting),
                    "waiting_tokens": sum(r.num_pending_tokens for r in waiting),
                    "running": len(running), "kv_usage": kv.used_blocks / kv.num_blocks,
                    "busy": scheduler.admission.busy.fraction(now),
                    "batch_limit": self._batch_limit()}

        self.on_step(now, len(waiting), read_state)
        if scheduler.gate is not None:
            scheduler.gate.set_limits(knobs.preferred_batch_size, knobs.max_batch_size,
                                      knobs.max_wait)

    def on_step(self, now: float, num_waiting: int, read_state) -> None:
        """Once per scheduler step: tick when due, then move the knobs one increment.

        A tick is due every ``controller_interval``, and early (at most every
        ``EARLY_TICK`` seconds) when the queue outgrows the batch limit: a
        surge must not wait out a 10 s interval. ``read_state()`` returns the
        keyword arguments of ``LiveWindow.signals`` (queue, running, KV
        usage, busy); it is only called on a tick.
        """
        if self._last_tick is None:
            self._last_tick = now
        elapsed = now - self._last_tick
        surge = num_waiting > self._batch_limit() and elapsed >= EARLY_TICK
        if elapsed >= self.config.controller_interval or surge:
            self._last_tick = now
            self.tick(self.window.signals(now, **read_state()))
        self.ramp.advance(self.knobs)

    def _batch_limit(self) -> int:
        return self.knobs.preferred_batch_size if self.request_level else self.knobs.max_num_seqs

    # -- one tick --------------------------------------------------------------------

    def tick(self, s: Signals) -> None:
        """Decide mode, alpha and knob targets from ``s``; start the ramp."""
        self.ticks += 1
        self.last_signals = s
        changed = self.selector.update(s)
        if changed is not None:
            old, cause = changed
            self._log(s.now, "mode", old, self.mode, "mode_" + self.mode, cause)
        self._adapt_alpha(s)
        targets = self._targets(s)
        if targets:
            self.ramp.retarget(self.knobs, targets)

    def _adapt_alpha(self, s: Signals) -> None:
        ttft_over = _over(s.ttft_p95, self.config.ttft_target)
        tpot_over = _over(s.tpot_p95, self.config.tpot_target)
        if ttft_over and not tpot_over:
            factor, reason, cause = 1.25, "ttft_over_target", (
                f"ttft_p95 {s.ttft_p95:.2f} s > target {self.config.ttft_target:.2f} s, "
                "tpot within target")
        elif tpot_over and not ttft_over:
            factor, reason, cause = 0.8, "tpot_over_target", (
                f"tpot_p95 {s.tpot_p95:.3f} s > target {self.config.tpot_target:.3f} s, "
                "ttft within target")
        else:
            return
        new = min(max(self.alpha * factor, ALPHA_RANGE[0]), ALPHA_RANGE[1])
        if new != self.alpha:
            self._log(s.now, "alpha", self.alpha, new, reason, cause)
            self.alpha = new

    def _targets(self, s: Signals) -> dict[str, float]:
        """Knob targets for this tick; logs each one that changes."""
        preset = PRESETS[self.mode]
        limit, limit_cause, limit_reason = self.batch_limit(s, preset)
        targets: dict[str, tuple[float, str, str]] = {}
        if self.request_level:
            preferred = min(preset.preferred_batch_size, limit)
            targets["preferred_batch_size"] = (preferred, "mode_" + self.mode,
                                               f"mode {self.mode} prefers batches of {preferred}")
            targets["max_batch_size"] = (max(limit, preferred), limit_reason, limit_cause)
            wait = self._tuned_wait(s, preset)
            if wait is not None:
                targets["max_wait"] = wait
        else:
            targets["max_num_seqs"] = (limit, limit_reason, limit_cause)
            targets["max_num_batched_tokens"] = self._token_budget(s, limit, preset)
        out = {}
        for knob, (value, reason, cause) in targets.items():
            current = getattr(self.knobs, knob)
            if current is None or abs(value - current) > DEADBAND * current:
                self._log(s.now, knob, current, value, reason, cause)
                out[knob] = value
        return out

    def batch_limit(self, s: Signals, preset: ModePreset) -> tuple[int, str, str]:
        """``min(by_memory, by_latency, max(preferred, peak_demand * alpha))``
        within the configured cap; returns (limit, cause, reason of the binding term)."""
        cap = self.base.max_batch_size if self.request_level else self.base.max_num_seqs
        terms = {"cap": cap}
        if s.mean_request_tokens:
            blocks_each = max(1, math.ceil(s.mean_request_tokens / self.block_size))
            usable = self.num_blocks * (1.0 - self.config.memory_headroom)
            terms["by_memory"] = max(1, int(usable // blocks_each))
        step_limit = self._step_seconds(preset)
        if step_limit is not None and self.cost_model.ready:
            terms["by_latency"] = _largest_batch_within(self.cost_model, step_limit, cap)
        peak = max(self.demand.values(s.now), default=0.0)
        terms["by_demand"] = max(preset.preferred_batch_size, math.ceil(peak * self.alpha))
        reason = min(terms, key=lambda name: terms[name])
        limit = max(1, int(terms[reason]))
        detail = ", ".join(f"{name} {value}" for name, value in terms.items())
        return limit, f"min({detail}) (alpha {self.alpha:.2f})", reason

    def _step_seconds(self, preset: ModePreset) -> float | None:
        target = self.config.tpot_target
        return None if target is None else target * preset.step_share

    def _token_budget(self, s: Signals, limit: int, preset: ModePreset,
                      ) -> tuple[int, str, str]:
        """The full budget in throughput mode, or while TPOT p95 is within
        the mode's share of its target; over it, the most tokens a step of
        ``limit`` sequences takes within that share (long prefill chunks are
        what stretch TPOT)."""
        full = self.base.max_num_batched_tokens
        if self.mode == "throughput":  # the full budget prefills most per second
            return full, "mode_throughput", "mode throughput prefills at the full budget"
        step_limit = self._step_seconds(preset)
        if step_limit is None or s.tpot_p95 is None or s.tpot_p95 <= step_limit:
            return full, "cap", "tpot within the mode's share of its target"
        within = self.cost_model.max_tokens_within(step_limit, limit)
        if within is None or within >= full:
            return full, "cap", f"the configured budget {full} fits the step target"
        budget = min(full, max(within, limit + 16, 64))
        return budget, "by_latency", (f"a step of {limit} sequences stays within "
                                      f"{step_limit * 1000:.0f} ms at {budget} tokens")

    def _tuned_wait(self, s: Signals, preset: ModePreset) -> tuple[float, str, str] | None:
        """The timeout rules (request-level batching only)."""
        current = self.knobs.max_wait
        if current is None:
            return None
        ceiling = preset.max_wait
        ttft_target = self.config.ttft_target
        if s.ttft_p95 is not None and ttft_target is not None and s.ttft_p95 > ttft_target:
            return (max(MIN_WAIT, min(current * 0.7, ceiling)), "latency_over_target",
                    f"ttft_p95 {s.ttft_p95:.2f} s > target {ttft_target:.2f} s: -30%")
        if s.fill is not None and s.fill < 0.4:
            return (min(ceiling, max(current * 1.2, MIN_WAIT)), "fill_low",
                    f"fill {s.fill:.0%} < 40%: +20%")
        if current > ceiling:
            return ceiling, "mode_" + self.mode, f"mode {self.mode} waits at most {ceiling} s"
        return None

    def _log(self, now: float, knob: str, old, new, reason: str, cause: str) -> None:
        decision = Decision(now, knob, old, new, reason, cause)
        self.decisions.append(decision)
        self.decision_counts[(knob, reason)] += 1
        logger.info("controller: %s", decision.describe())


def _over(value: float | None, target: float | None) -> bool:
    return value is not None and target is not None and value > target


def _largest_batch_within(cost: StepCostModel, seconds: float, cap: int) -> int:
    """The most decode sequences (one token each) whose step fits ``seconds``."""
    low, high = 1, cap
    while low < high:  # predict is monotone in the batch for a sane fit
        mid = (low + high + 1) // 2
        if (cost.predict(mid, mid) or 0.0) <= seconds:
            low = mid
        else:
            high = mid - 1
    return low
