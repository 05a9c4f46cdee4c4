"""Pinned prefixes, the bookkeeping (issue 42 item 4): a pin's blocks survive
any pool pressure until it is unpinned, hits are counted per pin, the
limits refuse what would not fit, and the invariants hold throughout."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler_properties import BLOCK, make_scheduler, run_step

from carpool.scheduler import Request, Scheduler
from carpool.scheduler.pinned_prefixes import (
    PinError,
    PinLimits,
    PinSpec,
    pin_id_of,
)


def run_until_done(scheduler: Scheduler, limit: int = 500) -> None:
    for _ in range(limit):
        if not scheduler.has_unfinished:
            return
        run_step(scheduler)
        scheduler.check_invariants()
    raise AssertionError("requests did not finish")


def pin(scheduler: Scheduler, tokens: list[int], salt: str | None = None,
        name: str = "sys") -> PinSpec:
    """Pin ``tokens`` as the engine does: a one-token prefill, then held."""
    spec = PinSpec(pin_id_of(tokens, salt), name, tuple(tokens), salt)
    request = Request(f"pin-{spec.pin_id}", tokens, 1, scheduler.clock(), priority=-1,
                      cache_salt=salt)
    scheduler.add_request(request)
    scheduler.pins.expect(request.request_id, spec)
    run_until_done(scheduler)
    return spec


def ask(scheduler: Scheduler, request_id: str, prompt: list[int],
        salt: str | None = None) -> Request:
    request = Request(request_id, prompt, 1, scheduler.clock(), cache_salt=salt)
    scheduler.add_request(request)
    run_until_done(scheduler)
    return request


def flood(scheduler: Scheduler, tag: int, count: int = 12) -> None:
    """Distinct 20-token prompts, enough to cycle every free block through LRU."""
    for i in range(count):
        ask(scheduler, f"x{tag}-{i}", [10_000 * tag + 30 * i + k for k in range(20)])


def test_pinned_blocks_survive_pressure_that_evicts_everything_else_until_unpinned():
    scheduler = make_scheduler(num_blocks=16, max_seqs=2, budget=64, policy="fcfs")
    system = list(range(100, 100 + 3 * BLOCK))  # 3 full blocks
    spec = pin(scheduler, system)
    ask(scheduler, "plain", list(range(500, 500 + 3 * BLOCK)) + [1])  # cached, not pinned
    assert scheduler.kv.num_held_blocks == 3
    flood(scheduler, 1)
    # The unpinned prefix is gone; the pinned one is served whole.
    assert ask(scheduler, "plain-again", list(range(500, 500 + 3 * BLOCK)) + [2]
               ).num_cached_tokens == 0
    hit = ask(scheduler, "user", system + [7, 8])
    assert hit.num_cached_tokens == 3 * BLOCK
    [stats] = scheduler.pins.stats()
    assert (stats.pin_id, stats.blocks, stats.hits, stats.hit_tokens) == (
        spec.pin_id, 3, 1, 3 * BLOCK)
    assert scheduler.pins.lookups >= 14  # the flood and both asks, not the pin's own prefill
    # Unpinned: the blocks age out like any other.
    assert scheduler.pins.unpin(spec.pin_id) and not scheduler.pins.unpin(spec.pin_id)
    scheduler.check_invariants()
    assert scheduler.kv.num_held_blocks == 0 and scheduler.pins.stats() == ()
    flood(scheduler, 2)
    assert ask(scheduler, "user-late", system + [9]).num_cached_tokens == 0


def test_a_pin_serves_only_its_own_namespace():
    scheduler = make_scheduler(num_blocks=32, max_seqs=2, budget=64, policy="fcfs")
    system = list(range(100, 100 + 2 * BLOCK))
    pin(scheduler, system, salt="tenant:a")
    assert ask(scheduler, "other", system + [1], salt="tenant:b").num_cached_tokens == 0
    assert ask(scheduler, "shared", system + [2]).num_cached_tokens == 0
    assert ask(scheduler, "mine", system + [3], salt="tenant:a").num_cached_tokens == 2 * BLOCK
    assert [s.hits for s in scheduler.pins.stats()] == [1]
    assert pin_id_of(system, "tenant:a") != pin_id_of(system, "tenant:b") != pin_id_of(
        system, None)


def test_an_aborted_prefill_holds_nothing_and_an_unpin_during_it_wins():
    scheduler = make_scheduler(num_blocks=32, max_seqs=2, budget=8, policy="fcfs")
    system = list(range(100, 100 + 6 * BLOCK))  # three steps of 8 tokens
    spec = PinSpec(pin_id_of(system, None), "sys", tuple(system))
    request = Request("pin-1", system, 1, 0.0)
    scheduler.add_request(request)
    scheduler.pins.expect("pin-1", spec)
    run_step(scheduler)  # a first chunk of 8 tokens
    assert scheduler.pins.unpin(spec.pin_id)  # before its prefill ended
    run_until_done(scheduler)
    assert scheduler.kv.num_held_blocks == 0
    other = [t + 1000 for t in system]  # not cached: its prefill takes three steps
    again = Request("pin-2", other, 1, scheduler.clock())
    scheduler.add_request(again)
    scheduler.pins.expect("pin-2", PinSpec(pin_id_of(other, None), "other", tuple(other)))
    run_step(scheduler)
    scheduler.abort_request("pin-2")
    scheduler.check_invariants()
    assert scheduler.kv.num_held_blocks == 0 and scheduler.pins.stats() == ()


def test_pinning_twice_holds_once_and_pins_sharing_blocks_count_each():
    scheduler = make_scheduler(num_blocks=32, max_seqs=2, budget=64, policy="fcfs")
    short = list(range(100, 100 + 2 * BLOCK))
    longer = short + list(range(300, 300 + BLOCK))
    a = pin(scheduler, short, name="short")
    pin(scheduler, short, name="short")  # the same prefix again: nothing new held
    b = pin(scheduler, longer, name="longer")
    assert scheduler.kv.num_held_blocks == 3  # two blocks shared
    ask(scheduler, "u", longer + [1])
    stats = {s.name: s for s in scheduler.pins.stats()}
    assert (stats["short"].hit_tokens, stats["longer"].hit_tokens) == (2 * BLOCK, 3 * BLOCK)
    scheduler.pins.unpin(a.pin_id)
    assert scheduler.kv.num_held_blocks == 3  # still the longer pin's
    scheduler.pins.unpin(b.pin_id)
    scheduler.check_invariants()


def test_limits_refuse_what_does_not_fit_with_the_kind_the_api_maps():
    limits = PinLimits.of(block_size=16, num_blocks=64, share=0.25, max_pins=2,
                          max_model_len=300)
    assert (limits.max_blocks, limits.max_tokens) == (16, 299)

    def spec(n: int, name: str, start: int = 0) -> PinSpec:
        tokens = tuple(range(start, start + n))
        return PinSpec(pin_id_of(tokens, None), name, tokens)

    cases = [(spec(10, "a"), {}, "invalid"), (spec(400, "a"), {}, "too_large"),
             (spec(17 * 16, "a"), {}, "too_large"),
             (spec(32, "a"), {"x": spec(32, "a", 1)}, "conflict"),
             (spec(32, "c"), {"x": spec(32, "a"), "y": spec(32, "b", 1)}, "full"),
             (spec(144, "c"), {"x": spec(144, "a", 1)}, "full")]
    for candidate, pins, kind in cases:
        with pytest.raises(PinError) as caught:
            limits.check(candidate, pins)
        assert caught.value.kind == kind, (candidate, kind)
    limits.check(spec(64, "b"), {"x": spec(64, "a", 1)})  # 8 + 8 blocks: exactly the cap
    # Never so many that a request of the whole context has no room beside them.
    assert PinLimits.of(16, 40, 0.5, 2, max_model_len=512, watermark_blocks=1).max_blocks == 7
    assert PinLimits.of(16, 30, 0.5, 2, max_model_len=512).max_blocks == 0
    off = PinLimits.of(16, 64, 0.25, 2, 100, prefix_caching=False)
    with pytest.raises(PinError, match="off"):
        off.check(spec(32, "a"), {})


def test_a_request_that_could_only_fit_in_pinned_blocks_is_refused_at_once():
    scheduler = make_scheduler(num_blocks=16, max_seqs=2, budget=64, policy="fcfs")
    pin(scheduler, list(range(100, 100 + 4 * BLOCK)))
    with pytest.raises(ValueError, match="more than the pool holds"):
        scheduler.add_request(Request("huge", list(range(12 * BLOCK)), 1, 0.0))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pin", "unpin", "ask", "flood"]),
                          st.integers(0, 3)), max_size=25))
def test_pins_keep_their_blocks_through_any_sequence(ops):
    scheduler = make_scheduler(num_blocks=24, max_seqs=3, budget=32, policy="fcfs")
    prefixes = [list(range(1000 * (i + 1), 1000 * (i + 1) + (i % 2 + 1) * BLOCK))
                for i in range(4)]
    pinned: dict[int, PinSpec] = {}
    for step, (op, i) in enumerate(ops):
        if op == "pin":
            pinned[i] = pin(scheduler, prefixes[i], name=f"p{i}")
        elif op == "unpin" and i in pinned:
            assert scheduler.pins.unpin(pinned.pop(i).pin_id)
        elif op == "ask":
            request = ask(scheduler, f"a{step}", prefixes[i] + [7])
            if i in pinned:
                assert request.num_cached_tokens == len(prefixes[i])
        elif op == "flood":
            flood(scheduler, step + 1, count=4)
        scheduler.check_invariants()
        held = {s.pin_id for s in scheduler.pins.stats()}
        assert held == {spec.pin_id for spec in pinned.values()}
