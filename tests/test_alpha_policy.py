"""Alpha learned online by a contextual bandit (issue 42): deterministic
UCB1 over the moves x0.8 / x1 / x1.25 per context, starting from the fixed
rule, rewarded with the goodput share of each move's interval."""
from __future__ import annotations

import dataclasses

import pytest
from test_controller import controller, signals

from carpool.scheduler.control.alpha_policy import (
    ALPHA_START,
    AlphaBandit,
    AlphaControl,
    context_of,
    rule_arm,
)


def test_an_untrained_bandit_moves_as_the_rule_does():
    bandit = AlphaBandit()
    for ttft, tpot in ((True, False), (False, True), (False, False), (True, True)):
        context = context_of(ttft, tpot, 3, 8)
        assert bandit.choose(context, rule_arm(ttft, tpot)) == rule_arm(ttft, tpot)
        bandit.skip()


def test_it_leaves_the_rule_for_a_move_that_earned_more():
    bandit = AlphaBandit()
    context = context_of(True, False, 20, 8)  # the rule says x1.25
    earned = {0.8: 0.2, 1.0: 0.9, 1.25: 0.3}  # ... but holding alpha pays here
    picks = []
    for _ in range(60):
        arm = bandit.choose(context, 1.25)
        picks.append(arm)
        bandit.reward(earned[arm])
    assert picks[0] == 1.25 and 1.0 in picks  # the rule first, then what pays
    assert picks[-20:].count(1.0) >= 17  # and the best one kept
    assert bandit.value(context, 1.0) > bandit.value(context, 1.25)
    # Contexts learn apart: another one still starts from its rule.
    assert bandit.choose(context_of(False, True, 0, 8), 0.8) == 0.8


def test_the_same_rewards_give_the_same_moves():
    def run() -> list[float]:
        bandit, out = AlphaBandit(), []
        for i in range(30):
            arm = bandit.choose(context_of(i % 2 == 0, False, i % 5, 4), 1.0)
            out.append(arm)
            bandit.reward((i * 37 % 11) / 10)
        return out
    assert run() == run()


def test_the_controller_rewards_each_interval_with_its_goodput_share():
    ctl = controller(request_level=True, alpha_policy="bandit", ttft_target=0.5,
                     tpot_target=0.1, hysteresis_ticks=2)
    assert isinstance(ctl.alpha_control, AlphaControl) and ctl.alpha == ALPHA_START
    for _ in range(4):
        ctl.observe_arrival(1.0, 100, 50)
    ctl.observe_finish(1.0, 1.0, 8, ttft=0.2, tpot=0.05)  # within both
    ctl.observe_finish(1.0, 1.0, 8, ttft=0.9, tpot=0.05)  # late first token
    late = dataclasses.replace(signals(ttft=0.8, tpot=0.05, waiting=20))
    ctl.tick(late)
    assert ctl.alpha == ALPHA_START  # one tick: no move yet
    ctl.tick(late)
    assert ctl.alpha == ALPHA_START * 1.25  # the untrained bandit follows the rule
    decision = next(d for d in reversed(ctl.decisions) if d.knob == "alpha")
    assert decision.reason == "bandit"
    assert "ttft late, tpot ok, queue deep" in decision.cause
    control = ctl.alpha_control
    assert (control.arrivals, control.good) == (0, 0)  # the interval is spent
    ctl.observe_arrival(2.0, 100, 50)
    ctl.tick(late)
    ctl.tick(late)  # the previous move earned 0/1
    context = context_of(True, False, 20, ctl.knobs.preferred_batch_size)
    assert control.bandit.value(context, 1.25) < 0.7  # below the rule's prior


def test_the_rule_stays_the_default():
    ctl = controller(request_level=True)
    assert ctl.config.alpha_policy == "rule" and ctl.alpha_control.bandit is None


def test_a_trained_table_is_a_capped_prior():
    trained = AlphaBandit()
    context = context_of(True, False, 3, 8)
    for _ in range(50):  # x0.8 keeps earning, x1.25 never does
        trained.choose(context, rule_arm(True, False))
        trained.reward(0.9 if trained._pending[1] == 0.8 else 0.0)
    table = trained.table()
    assert table["arms"] == ["0.8", "1", "1.25"]
    fresh = AlphaBandit(prior=table)
    assert fresh.value(context, 0.8) == pytest.approx(trained.value(context, 0.8))
    assert fresh.choose(context, rule_arm(True, False)) == 0.8  # not the rule's x1.25
    assert sum(fresh._stats[(context, arm)][1] for arm in (0.8, 1.0, 1.25)) <= 3 * 20
