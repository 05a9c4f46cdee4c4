"""How alpha moves: the fixed rule or a contextual bandit.

Alpha is the headroom of the batch limit over peak demand (``controller``:
the by_demand term, peak waiting + running x alpha, under request-level
batching, and under continuous batching with an operator's TPOT or E2E
target). The fixed rule
(``AdaptiveController._adapt_alpha``) moves it x1.25 when TTFT is over its
target and TPOT within, x0.8 the other way round. ``AlphaBandit`` learns the
move instead, online, from what each move earned:

- context: which targets the window misses (TTFT p95, TPOT p95: ``late`` /
  ``ok``) and the queue (``none``, ``some``, or ``deep``: more waiting than
  the preferred batch);
- arms: the moves x0.8, x1 and x1.25;
- reward: the goodput share of the interval after the move: requests that
  finished within both targets per request that arrived meanwhile (so
  rejections and a growing queue cost, as late finishes do);
- choice: UCB1, deterministic (no random draws: the scheduler replays
  exactly), each arm of a context starting from a prior, the fixed rule's
  move with a head start so an untrained bandit behaves like the rule and
  only leaves it for what it measured better; or from a table trained in
  the simulator (``prior``: ``table()`` of a bandit that ran, as
  ``scripts/train_alpha_bandit.py`` does), its pulls capped at
  ``TRAINED_PULLS`` so live goodput still moves it. None ships: trained on
  12 simulated surges it earned 0.993x the rule's goodput on 8 held-out
  ones (untrained 0.997x), since alpha >= 1 rarely binds (see
  ``controller``).

Pure Python; times come from the caller.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from carpool.scheduler.control.live_window import Signals

ALPHA_RANGE = (1.0, 4.0)
ALPHA_START = 2.0
ARMS = (0.8, 1.0, 1.25)
# The prior: every arm starts as if it had earned PRIOR_REWARD PRIOR_PULLS
# times; the fixed rule's move for the context as if RULE_REWARD.
PRIOR_PULLS = 2
PRIOR_REWARD = 0.5
RULE_REWARD = 0.7
EXPLORATION = 0.3  # UCB1's exploration weight, on rewards in 0..1
# A trained arm counts as at most this many pulls: the prior's weight.
TRAINED_PULLS = 20


def context_of(ttft_late: bool, tpot_late: bool, waiting: int, preferred: int) -> str:
    queue = "none" if waiting == 0 else ("deep" if waiting > preferred else "some")
    return f"ttft {'late' if ttft_late else 'ok'}, tpot {'late' if tpot_late else 'ok'}, " \
           f"queue {queue}"


def rule_arm(ttft_late: bool, tpot_late: bool) -> float:
    """The fixed rule's move: x1.25 for late first tokens, x0.8 for late tokens."""
    if ttft_late and not tpot_late:
        return 1.25
    if tpot_late and not ttft_late:
        return 0.8
    return 1.0


class AlphaBandit:
    """UCB1 over ``ARMS`` per context, rewarded with the goodput share."""

    def __init__(self, exploration: float = EXPLORATION,
                 prior: Mapping | None = None) -> None:
        self.exploration = exploration
        self._stats: dict[tuple[str, float], list[float]] = {}  # (ctx, arm) -> [sum, pulls]
        self._pending: tuple[str, float] | None = None  # the last move, not yet rewarded
        self.moves = 0
        for context, arms in (prior or {}).get("contexts", {}).items():
            for arm, (total, pulls) in arms.items():
                if float(arm) in ARMS and pulls > 0:
                    weight = min(float(pulls), TRAINED_PULLS)
                    self._stats[(context, float(arm))] = [total / pulls * weight, weight]

    def table(self) -> dict:
        """What it learned, per context and arm: [reward sum, pulls] (JSON)."""
        contexts: dict[str, dict[str, list[float]]] = {}
        for (context, arm), (total, pulls) in sorted(self._stats.items()):
            contexts.setdefault(context, {})[f"{arm:g}"] = [round(total, 6), pulls]
        return {"arms": [f"{arm:g}" for arm in ARMS], "contexts": contexts}

    def _entry(self, context: str, arm: float, rule: float) -> list[float]:
        key = (context, arm)
        if key not in self._stats:
            prior = RULE_REWARD if arm == rule else PRIOR_REWARD
            self._stats[key] = [prior * PRIOR_PULLS, float(PRIOR_PULLS)]
        return self._stats[key]

    def choose(self, context: str, rule: float) -> float:
        """The move for ``context`` (``rule``: the fixed rule's, for the prior)."""
        entries = {arm: self._entry(context, arm, rule) for arm in ARMS}
        total = sum(pulls for _, pulls in entries.values())

        def score(arm: float) -> tuple[float, float]:
            reward, pulls = entries[arm]
            bonus = self.exploration * math.sqrt(math.log(total) / pulls)
            return (reward / pulls + bonus, -abs(arm - 1.0))  # ties: the smaller move

        arm = max(ARMS, key=score)
        self._pending = (context, arm)
        self.moves += 1
        return arm

    def reward(self, value: float) -> None:
        """What the last move earned (0..1); ignored before the first move."""
        if self._pending is None:
            return
        entry = self._stats[self._pending]
        entry[0] += min(1.0, max(0.0, value))
        entry[1] += 1.0
        self._pending = None

    def skip(self) -> None:
        """The last move earned nothing measurable (no arrival since): forget it."""
        self._pending = None

    def value(self, context: str, arm: float) -> float | None:
        """The mean reward learned for ``arm`` in ``context`` (prior included)."""
        entry = self._stats.get((context, arm))
        return None if entry is None else entry[0] / entry[1]


def _over(value: float | None, target: float | None) -> bool:
    return value is not None and target is not None and value > target


class AlphaControl:
    """Owns alpha (``ALPHA_RANGE``) and moves it at the controller's ticks:
    by the fixed rule (``policy`` rule) or the bandit (bandit). Each move
    needs ``hold`` ticks: in a row asking the same way (rule), or since the
    last move (bandit, which needs an interval to judge a move by). The
    controller counts ``arrivals`` and ``good`` finishes (within both
    targets) into the bandit's interval."""

    def __init__(self, policy: str, hold: int, prior: Mapping | None = None) -> None:
        self.value = ALPHA_START
        self.hold = hold
        self.bandit = AlphaBandit(prior=prior) if policy == "bandit" else None
        self.arrivals = self.good = 0  # since the bandit's last move
        self._ticks = 0  # the bandit's, since its last move
        self._streak = (0, 0)  # the rule's: (direction +1 / -1, ticks in a row)

    def update(self, s: Signals, ttft_target: float | None, tpot_target: float | None,
               preferred: int) -> tuple[float, float, str, str] | None:
        """One tick; (old, new, reason, cause) when alpha moved."""
        ttft_over, tpot_over = _over(s.ttft_p95, ttft_target), _over(s.tpot_p95, tpot_target)
        if self.bandit is not None:
            move = self._bandit_move(ttft_over, tpot_over, s.waiting, preferred)
            if move is None:
                return None
            factor, reason, cause = move
        else:
            move = self._rule_move(s, ttft_over, tpot_over, ttft_target, tpot_target)
            if move is None:
                return None
            factor, reason, cause = move
        old = self.value
        self.value = min(max(old * factor, ALPHA_RANGE[0]), ALPHA_RANGE[1])
        return None if self.value == old else (old, self.value, reason, cause)

    def _rule_move(self, s: Signals, ttft_over: bool, tpot_over: bool,
                   ttft_target: float | None, tpot_target: float | None,
                   ) -> tuple[float, str, str] | None:
        if ttft_over == tpot_over:
            self._streak = (0, 0)  # no signal which way: a streak must be unbroken
            return None
        if ttft_over:
            factor, reason, cause = 1.25, "ttft_over_target", (
                f"ttft_p95 {s.ttft_p95:.2f} s > target {ttft_target:.2f} s, tpot within target")
        else:
            factor, reason, cause = 0.8, "tpot_over_target", (
                f"tpot_p95 {s.tpot_p95:.3f} s > target {tpot_target:.3f} s, ttft within target")
        # Hysteresis: a move needs ``hold`` ticks in a row asking for the same
        # direction, so alternating misses never flap the batch size.
        direction = 1 if factor > 1 else -1
        streak = self._streak[1] + 1 if self._streak[0] == direction else 1
        self._streak = (direction, streak)
        if streak < self.hold:
            return None
        self._streak = (0, 0)
        return factor, reason, cause + f" ({streak} ticks)"

    def _bandit_move(self, ttft_over: bool, tpot_over: bool, waiting: int,
                     preferred: int) -> tuple[float, str, str] | None:
        """Every ``hold`` ticks: reward the last move with the goodput share
        of its interval, then let the bandit pick the next."""
        self._ticks += 1
        if self._ticks < self.hold:
            return None
        if self.arrivals:
            self.bandit.reward(self.good / self.arrivals)
        else:
            self.bandit.skip()
        self._ticks = self.arrivals = self.good = 0
        context = context_of(ttft_over, tpot_over, waiting, preferred)
        move = self.bandit.choose(context, rule_arm(ttft_over, tpot_over))
        learned = self.bandit.value(context, move)
        return move, "bandit", f"{context}: x{move:g} (learned goodput share {learned:.2f})"
