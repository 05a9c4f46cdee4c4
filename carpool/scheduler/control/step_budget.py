"""The step token budget under continuous batching (the adaptive
controller's ``max_num_batched_tokens`` knob).

The mode's budget (``modes.mode_caps``: latency mode a quarter of the
configured one, the others all of it); in latency mode, while the step time
(else TPOT p95) is over the mode's share of the TPOT target, the most tokens
a step of the batch limit's sequences takes within that share (long prefill
chunks are what stretch a step). Other modes are never cut below their
budget: with requests queueing a cut only delays their first tokens: the
same prefill work still lands in the decodes' lifetime, spread over more
steps that each pay the fixed step cost again, so their mean TPOT gains
nothing. A queue over latency mode's budget moves the mode up
(``ModeSelector``).

Pure Python.
"""
from __future__ import annotations

from carpool.scheduler.control.cost_model import StepCostModel
from carpool.scheduler.control.live_window import Signals
from carpool.scheduler.control.slo_policy import CALM_SHARE


class StepBudget:
    """Decides the budget at each tick; remembers the calm ticks that let a
    cut budget go back up (``hold`` in a row)."""

    def __init__(self, cost_model: StepCostModel, hold: int) -> None:
        self.cost_model = cost_model
        self.hold = hold
        self._calm = 0  # ticks in a row with steps well within target (a cut budget)

    def target(self, s: Signals, mode: str, full: int, limit: int,
               step_limit: float | None, current: int) -> tuple[int, str, str]:
        """(budget, reason, cause) for this tick: ``full`` is the mode's
        budget, ``step_limit`` the mode's share of the TPOT target (None: no
        target), ``current`` the live budget."""
        if mode != "latency":
            return full, "mode_" + mode, f"mode {mode} prefills at the full budget"
        if s.waiting:
            # A burst arriving in latency mode: a cut below the mode's budget
            # would only stretch the prefill of the requests it brings.
            return full, "queue", f"{s.waiting} waiting: prefill at the mode's budget {full}"
        observed = s.step_time if s.step_time is not None else s.tpot_p95
        if step_limit is None or observed is None or observed <= step_limit:
            return self._restored(full, current, observed, step_limit)
        self._calm = 0
        within = self.cost_model.max_tokens_within(step_limit, limit)
        if within is None or within >= full:
            return full, "cap", f"the mode's budget {full} fits the step target"
        # Never below a typical prompt beside the decodes: a prompt split over
        # steps pays each step's fixed cost again and its first token waits.
        prompt = int(s.mean_prompt_tokens or 0)
        budget = min(full, max(within, limit + max(16, prompt), 64))
        return budget, "by_latency", (f"a step of {limit} sequences stays within "
                                      f"{step_limit * 1000:.0f} ms at {budget} tokens")

    def _restored(self, full: int, current: int, observed: float | None,
                  step_limit: float | None) -> tuple[int, str, str]:
        """Steps within target: a cut budget goes back to the mode's one
        only after ``hold`` ticks in a row well within (CALM_SHARE), so
        steps hovering at the target do not flap it."""
        calm = step_limit is None or observed is None or observed < CALM_SHARE * step_limit
        self._calm = self._calm + 1 if calm else 0
        if current >= full or self._calm >= self.hold:
            self._calm = 0
            return full, "cap", "tpot within the mode's share of its target"
        return current, "hold", "steps near the target: the cut budget stays"
