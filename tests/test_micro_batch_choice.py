"""The live choice between one batch and two micro-batches
(carpool/executor/micro_batch_choice.py): both ways tried first, then the
faster by median, the other still sampled now and then, per step shape."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from carpool.executor.micro_batch_choice import MicroBatchChoice, step_shape


def _drive(choice: MicroBatchChoice, shape, whole_s: float, split_s: float, steps: int):
    ways, changes = [], []
    for _ in range(steps):
        split = choice.choose(shape)
        ways.append(split)
        changed = choice.record(shape, split, split_s if split else whole_s)
        if changed is not None:
            changes.append(changed)
    return ways, changes


def test_both_ways_are_tried_then_the_faster_runs_and_the_other_is_sampled():
    choice = MicroBatchChoice(trials=3, explore_every=8)
    shape = step_shape(True, 16)
    ways, changes = _drive(choice, shape, whole_s=0.040, split_s=0.031, steps=40)
    assert ways[:6] == [False, True] * 3  # the trials alternate, one batch first
    assert changes == [True]  # decided once, for the split
    later = ways[6:]
    assert later.count(False) == sum(1 for n in range(7, 41) if n % 8 == 0)  # sampled
    assert choice.summary()["decode-16"] == {"steps": 40, "whole_ms": 40.0, "split_ms": 31.0,
                                            "split": True}


def test_a_change_in_the_times_turns_the_choice_and_says_so():
    choice = MicroBatchChoice(trials=3, explore_every=4)
    shape = step_shape(False, 300)
    _, first = _drive(choice, shape, whole_s=0.010, split_s=0.020, steps=12)
    assert first == [False]
    _, turned = _drive(choice, shape, whole_s=0.050, split_s=0.020, steps=80)
    assert turned == [True]  # the sampled steps brought the new one-batch times in


def test_shapes_round_up_to_powers_of_two_and_keep_decodes_apart():
    assert step_shape(True, 5) == step_shape(True, 8) == (True, 8)
    assert step_shape(False, 8) != step_shape(True, 8)
    assert step_shape(False, 1) == (False, 1) and step_shape(False, 9) == (False, 16)


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4096)), min_size=1, max_size=200),
       st.floats(0.001, 1.0), st.floats(0.001, 1.0))
def test_each_shape_learns_alone_and_settles_on_the_faster(steps, whole_s, split_s):
    choice = MicroBatchChoice(trials=2, explore_every=5)
    for decode_only, tokens in steps:
        shape = step_shape(decode_only, tokens)
        split = choice.choose(shape)
        choice.record(shape, split, split_s if split else whole_s)
    for shape, times in choice.shapes.items():
        assert times.steps == sum(1 for d, t in steps if step_shape(d, t) == shape)
        if len(times.whole) >= 2 and len(times.split) >= 2:
            assert choice.prefers_split(shape) == (split_s < whole_s)
