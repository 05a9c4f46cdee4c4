"""The adaptive controller: live batching knobs from live metrics.

At each tick (on the scheduler's clock) the controller reads sliding
windows of metrics (``live_window.Signals``) and decides:

- the mode, ``latency`` / ``balanced`` / ``throughput`` (``ModeSelector``:
  threshold bands plus a streak of ticks, so noisy metrics do not flap it);
- the batching wait under request-level batching: fill < 40% -> +20%;
  TTFT p95 over target -> -30%; bounded by ``[MIN_WAIT, mode ceiling]``;
- the latency correction (continuous batching, ``slo_policy.StepCorrection``):
  a factor on the step time the batch limit is sized to, from the TPOT
  requests really got (those finished in the fast window), moved in
  proportion to their distance from the target band: down after ticks over
  it, up only after calm ticks under it while demand exceeds the limit;
  alpha moves after ticks in a row too;
- the batch limit: ``min(cap, by_memory, by_latency, by_demand)``. cap is
  the mode's share of the configured cap (``modes.mode_caps``: latency a
  quarter, balanced half, throughput all; a queue that outgrows the mode's
  caps moves it up at once). by_memory = sequences whose KV (mean prompt +
  max_tokens of recent arrivals) fits the pool less ``memory_headroom``.
  by_latency = the largest decode batch whose step, with its steady-state
  share of prefill tokens, the online cost model (``StepCostModel``)
  predicts within ``LIMIT_STEP_SHARE`` of the TPOT target x the latency
  correction (continuous batching), present only for an operator's TPOT
  target (``batch_limit_by_tpot``) or E2E target (``limit_target``): a
  measured target steers the mode and budget but caps no batch, since with
  requests waiting a smaller batch only drains the queue slower.
  by_demand = peak demand (the most requests waiting + running in the
  window) x alpha, at least the mode's preferred batch: under request-level
  batching always, under continuous batching with an operator's TPOT or
  E2E target. A surge is met by shedding at arrival, not by slower tokens
  for everyone. Alpha (1..4, starts at 2; ``alpha_policy``: the fixed
  rule or a bandit) is the headroom over that peak: TTFT over target with
  TPOT within it means requests queue while batches have room, so alpha
  x1.25; TPOT over target with TTFT within it means batches are too big, so
  alpha x0.8. Never below 1: held under the demand it measured, a
  continuous batch lost 15-55% of its goodput in the simulator (fixed alpha
  0.5-1 on a 3x surge) and a live surge's batch fell to 13 sequences (the
  TPOT correction already sizes the batch to the target).
  Targets within ``DEADBAND`` (10%) of the current value are left alone;
- the step token budget (continuous batching): the mode's (latency mode a
  quarter of the configured one); in latency mode, while the step time is
  over the mode's share of the TPOT target, the most tokens a step with
  that many sequences takes within that share (back to the mode's budget
  after calm ticks); in the other modes the configured budget, since with
  a queue a cut only delays first tokens.

Ticks come every ``controller_interval`` (1 s; as often as every 100 ms when
asked) and earlier, at most every
``EARLY_TICK``, on events (``slo_policy.early_tick_cause``): the queue
growing past the free slots, arrivals surging in the fast window, steps
slower than the target. New knob values never land at once: ``KnobRamp``
moves them over ``transition_steps`` (at most 3) scheduler steps. Every
change is a ``Decision`` with a short reason (a metric label) and a
readable cause. Pure Python; the scheduler calls ``on_step`` once per step.
"""
from __future__ import annotations

import logging
import math
from collections import Counter, deque

from carpool.config import ControllerConfig, SchedulerConfig
from carpool.scheduler.control.alpha_policy import AlphaControl
from carpool.scheduler.control.cost_model import StepCostModel
from carpool.scheduler.control.knobs import Decision, KnobRamp, LiveKnobs
from carpool.scheduler.control.live_window import LiveWindow, SampleWindow, Signals
from carpool.scheduler.control.modes import PRESETS, ModePreset, ModeSelector, mode_caps
from carpool.scheduler.control.slo_policy import (
    LIMIT_STEP_SHARE,
    StepCorrection,
    early_tick_cause,
    latency_limit,
    proven_limit,
)
from carpool.scheduler.control.step_budget import StepBudget

logger = logging.getLogger(__name__)
MIN_WAIT = 0.005  # seconds: the timeout rules never take max_wait below this
# A knob target within this share of the current value is left alone, so
# the noise of the fitted cost model does not move the knobs every tick.
DEADBAND = 0.1
EARLY_TICK = 0.25  # seconds: the soonest an event brings the next tick forward


class AdaptiveController:
    """Owns the live knobs of one scheduler and retunes them every interval.

    ``knobs`` is the object the scheduler reads; only ``KnobRamp`` writes
    it, so no knob ever jumps by more than a third of a change in one step.
    """

    def __init__(self, config: ControllerConfig, base: SchedulerConfig, knobs: LiveKnobs,
                 num_blocks: int, block_size: int, cost_model: StepCostModel,
                 request_level: bool) -> None:
        self.config = config.concrete()  # auto targets: their fallbacks unless measured
        self.base = base
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cost_model = cost_model
        self.request_level = request_level  # static/dynamic: the batching wait applies
        self.knobs = knobs
        self.selector = ModeSelector(self.config)
        self.ramp = KnobRamp(config.transition_steps)
        self.window = LiveWindow(config.controller_window, config.controller_fast_window)
        self.demand = SampleWindow(config.controller_window)  # waiting + running per step
        # Alpha, by the fixed rule or the bandit: under request-level
        # batching always, under continuous batching with an operator's
        # TPOT or E2E target (a measured one caps no batch).
        self.alpha_control = AlphaControl(self.config.alpha_policy,
                                          self.config.hysteresis_ticks)
        self.alpha_binds = request_level or bool(
            self.config.batch_limit_by_tpot is True or self.config.e2e_target is not None)
        self.budget = StepBudget(cost_model, config.hysteresis_ticks)  # continuous only
        self.correction = StepCorrection(config.hysteresis_ticks)  # continuous only
        self.decisions: deque[Decision] = deque(maxlen=200)
        self.decision_counts: Counter[tuple[str, str]] = Counter()
        self.ticks = 0
        self.early_ticks: Counter[str] = Counter()  # by the kind of event
        self._last_tick: float | None = None
        self._last_step: float | None = None  # the previous step's start, while busy
        self._last_running = 0  # the previous step's running count
        self._waiting_at_tick = 0
        # When the limit correction last moved: its evidence is the TPOT of
        # requests that started after it, so one move is judged before the
        # next (requests live many ticks; judging by those that ran under the
        # old limit stacked moves and swung the limit 6 -> 10 -> 6).
        self._correction_moved = -math.inf
        self.last_signals: Signals | None = None

    @property
    def mode(self) -> str:
        return self.selector.mode

    @property
    def alpha(self) -> float:
        return self.alpha_control.value

    # -- events from the scheduler ------------------------------------------------

    def observe_arrival(self, now: float, request_tokens: int,
                        prompt_tokens: int | None = None) -> None:
        self.window.observe_arrival(now, request_tokens, prompt_tokens)
        self.alpha_control.arrivals += 1

    def observe_finish(self, now: float, e2e: float, output_tokens: int, ttft: float | None,
                       tpot: float | None) -> None:
        """A request finished: its end-to-end seconds, output tokens, TTFT and TPOT."""
        self.window.observe_finish(now, e2e, output_tokens)
        config = self.config
        good = ((config.ttft_target is None or (ttft is not None and ttft <= config.ttft_target))
                and (config.tpot_target is None or tpot is None or tpot <= config.tpot_target))
        self.alpha_control.good += good

    def observe_ttft(self, now: float, seconds: float) -> None:
        self.window.ttft.add(now, seconds)

    def observe_tpot(self, now: float, seconds: float, started: float | None = None) -> None:
        """A finished request's mean time per output token after the first;
        ``started``: its first token's time (default: ``now``)."""
        self.window.observe_tpot(now, seconds, now if started is None else started)

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

        self.on_step(now, len(waiting), read_state, len(running))
        if scheduler.gate is not None:
            scheduler.gate.set_limits(knobs.preferred_batch_size, knobs.max_batch_size,
                                      knobs.max_wait)

    def on_step(self, now: float, num_waiting: int, read_state, num_running: int = 0) -> None:
        """Once per scheduler step: tick when due, then move the knobs one increment.

        A tick is due every ``controller_interval``, and early (at most every
        ``EARLY_TICK`` seconds) on an event: a surge must not wait out the
        interval. ``read_state()`` returns the keyword arguments of
        ``LiveWindow.signals`` (queue, running, KV usage, busy); it is only
        called on a tick. The wall time since the previous step, while
        requests run, is the step time they feel (the fast TPOT signal).
        """
        if num_running and self._last_step is not None:
            self.window.observe_step_interval(now, self._last_running, now - self._last_step)
        self._last_step = now if num_running else None
        self._last_running = num_running
        if self._last_tick is None:
            self._last_tick = now
        elapsed = now - self._last_tick
        due = elapsed >= self.config.controller_interval - 1e-9  # clock rounding
        if not due and elapsed >= EARLY_TICK:
            cause = self._early_cause(now, num_waiting, num_running)
            if cause is not None:
                due = True
                self.early_ticks[cause.split()[0]] += 1
        if due:
            self._last_tick = now
            self._waiting_at_tick = num_waiting
            self.tick(self.window.signals(now, tpot_since=self._correction_moved,
                                          **read_state()))
        self.ramp.advance(self.knobs)

    def _early_cause(self, now: float, num_waiting: int, num_running: int) -> str | None:
        window = self.window
        fast = len(window.arrivals.recent(now, window.fast_s))
        return early_tick_cause(
            waiting=num_waiting, running=num_running, limit=self._batch_limit(),
            waiting_at_tick=self._waiting_at_tick, fast_rate=window.rate(now, window.fast_s),
            fast_arrivals=fast, slow_rate=window.rate(now, window.window_s),
            step_time=window.step_time(now), step_target=self._step_seconds(PRESETS[self.mode]))

    def _batch_limit(self) -> int:
        return self.knobs.preferred_batch_size if self.request_level else self.knobs.max_num_seqs

    # -- one tick --------------------------------------------------------------------

    def tick(self, s: Signals) -> None:
        """Decide mode, alpha / correction and knob targets from ``s``; start the ramp."""
        self.ticks += 1
        self.last_signals = s
        changed = self.selector.update(s, lambda mode: self._fits(mode, s))
        if changed is not None:
            old, cause = changed
            self._log(s.now, "mode", old, self.mode, "mode_" + self.mode, cause)
        if self.alpha_binds:
            self._adapt_alpha(s)
        if not self.request_level:
            self._adapt_correction(s)
        targets = self._targets(s)
        if targets:
            self.ramp.retarget(self.knobs, targets)

    def mode_caps(self, mode: str) -> tuple[int, int]:
        """(batch cap, step token budget) of ``mode``: its shares of the
        configured cap (``max_batch_size`` or ``max_num_seqs``) and budget."""
        cap = self.base.max_batch_size if self.request_level else self.base.max_num_seqs
        return mode_caps(PRESETS[mode], cap, self.base.max_num_batched_tokens)

    def _fits(self, mode: str, s: Signals) -> bool:
        """Whether the present demand is within ``mode``'s caps: waiting plus
        running requests within its batch cap, and (continuous) the waiting
        prompt tokens within its step budget."""
        cap, budget = self.mode_caps(mode)
        full = self.base.max_num_batched_tokens  # no mode has more: no escape for it
        return (s.waiting + s.running <= cap
                and (self.request_level or budget >= full or s.waiting_tokens <= budget))

    def _adapt_correction(self, s: Signals) -> None:
        """The feedback on the batch limit aims at the TPOT target itself: the
        mode's step share is the feed-forward term's headroom, and cutting
        whenever TPOT passed that share starved a calm server of slots (its
        TPOT was within the target while arrivals queued for first tokens)."""
        limit = self.knobs.max_num_seqs
        old = self.correction.factor
        # Demand presses on the limit when the running requests leave less
        # than an eighth of it free, not only once requests queue for a slot
        # or arrivals are shed for want of one: Poisson arrivals come in
        # bursts, and growing only after a burst was shed sheds one every
        # time (while tokens were cheap).
        short = s.running + max(1, limit // 8) >= limit
        cause = self.correction.update(s.recent_tpot, self.limit_target(s),
                                       s.running, limit, short, s.step_time)
        if cause is not None:
            self._correction_moved = s.now
            reason = "step_over_target" if self.correction.factor < old else "step_within_target"
            self._log(s.now, "latency_correction", old, self.correction.factor, reason, cause)

    def _adapt_alpha(self, s: Signals) -> None:
        change = self.alpha_control.update(s, self.config.ttft_target, self.config.tpot_target,
                                           self.knobs.preferred_batch_size)
        if change is not None:
            self._log(s.now, "alpha", *change)

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
        """The smallest of the terms (see the module docstring) within the
        configured cap; returns (limit, cause, reason of the binding term)."""
        configured = self.base.max_batch_size if self.request_level else self.base.max_num_seqs
        cap, _ = mode_caps(preset, configured, self.base.max_num_batched_tokens)
        terms = {"cap": cap}
        if s.mean_request_tokens:
            blocks_each = max(1, math.ceil(s.mean_request_tokens / self.block_size))
            usable = self.num_blocks * (1.0 - self.config.memory_headroom)
            terms["by_memory"] = max(1, int(usable // blocks_each))
        target = self.limit_target(s)
        factor = 1.0 if self.request_level else self.correction.factor
        step_limit = None if target is None else target * LIMIT_STEP_SHARE * factor
        if step_limit is not None and self.cost_model.ready:
            ratio = None if self.request_level else s.prefill_ratio
            budget = self.base.max_num_batched_tokens
            feed = latency_limit(self.cost_model, step_limit, cap, ratio, budget)
            if not self.request_level:
                feed = max(feed, proven_limit(s.step_anchor, step_limit))
            terms["by_latency"] = max(1, feed)
        if self.alpha_binds:
            # Peak demand x alpha, never below the mode's preferred batch:
            # alpha > 1 leaves batches room to grow.
            demand = self.demand.values(s.now)
            if demand:  # none measured yet: no evidence to hold anyone back
                terms["by_demand"] = max(preset.preferred_batch_size,
                                         math.ceil(max(demand) * self.alpha))
        reason = min(terms, key=lambda name: terms[name])
        limit = max(1, int(terms[reason]))
        detail = ", ".join(f"{name} {value}" for name, value in terms.items())
        knob = (f"alpha {self.alpha:.2f}" if self.request_level
                else f"correction {self.correction.factor:.2f}"
                + (f", alpha {self.alpha:.2f}" if self.alpha_binds else ""))
        return limit, f"min({detail}) ({knob})", reason

    def limit_target(self, s: Signals) -> float | None:
        """The TPOT the batch limit is sized to, or None (no latency cap):
        the TPOT target when ``batch_limit_by_tpot`` (an operator's target;
        a measured one never caps), and the TPOT an E2E target leaves the
        long outputs of recent requests (their p95 length) once the first
        token's share (TTFT p95, at most half the target) is spent;
        whichever is lower."""
        targets = []
        if self.config.batch_limit_by_tpot and self.config.tpot_target is not None:
            targets.append(self.config.tpot_target)
        e2e, outputs = self.config.e2e_target, s.long_output_tokens
        if e2e is not None and outputs is not None and outputs > 1:
            decode = max(e2e - (s.ttft_p95 or 0.0), 0.5 * e2e)
            targets.append(decode / (outputs - 1))
        return min(targets, default=None)

    def _step_seconds(self, preset: ModePreset) -> float | None:
        target = self.config.tpot_target
        return None if target is None else target * preset.step_share

    def _token_budget(self, s: Signals, limit: int, preset: ModePreset,
                      ) -> tuple[int, str, str]:
        _, full = self.mode_caps(self.mode)
        return self.budget.target(s, self.mode, full, limit, self._step_seconds(preset),
                                  self.knobs.max_num_batched_tokens)

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
