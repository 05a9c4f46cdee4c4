"""Sessions: turns of one session run in order, and a finished turn's cached
prefix survives unrelated traffic until the session's TTL passes."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler_properties import apply_pool_op, make_scheduler, run_step

from carpool.scheduler import Request, RequestStatus, Scheduler
from carpool.scheduler.block_pool import BlockPool


def run_until_done(scheduler: Scheduler, limit: int = 500) -> None:
    for _ in range(limit):
        if not scheduler.has_unfinished:
            return
        run_step(scheduler)
        scheduler.check_invariants()
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_session_turns_run_in_order_without_blocking_others(policy):
    scheduler = make_scheduler(num_blocks=64, max_seqs=4, budget=64, policy=policy)
    first = Request("t1", [1, 2, 3], 3, 0.0, priority=1, session_id="chat")
    # Even a more urgent later turn waits for the earlier one.
    second = Request("t2", [1, 2, 3, 9], 2, 0.0, priority=0, session_id="chat")
    other = Request("u", [4, 5], 2, 0.0, priority=1)
    for request in (first, second, other):
        scheduler.add_request(request)
    finished_at = {}
    for _ in range(10):
        now = scheduler.clock()
        for request in run_step(scheduler):
            finished_at[request.request_id] = now
        scheduler.check_invariants()
        if "t1" not in finished_at:
            assert second.status == RequestStatus.WAITING
    assert other.first_scheduled_time == 0.0, "the blocked turn held up an unrelated request"
    assert first.first_scheduled_time == 0.0
    assert second.first_scheduled_time > finished_at["t1"]
    assert set(finished_at) == {"t1", "t2", "u"}
    stats = scheduler.session_stats()
    assert stats.session_requests == 2 and stats.active_sessions == 1


def turn(scheduler: Scheduler, request_id: str, prompt: list[int],
         session_id: str | None) -> Request:
    """Run one request to completion alone and return it."""
    request = Request(request_id, prompt, 1, scheduler.clock(), session_id=session_id)
    scheduler.add_request(request)
    run_until_done(scheduler)
    return request


def unrelated_traffic(scheduler: Scheduler, tag: int) -> None:
    """Enough distinct 20-token prompts to cycle the whole pool through LRU."""
    for i in range(8):
        prompt = [1000 * tag + 10 * i + k for k in range(20)]
        scheduler.add_request(Request(f"x{tag}-{i}", prompt, 1, scheduler.clock()))
    run_until_done(scheduler)


@pytest.mark.parametrize("session_id", ["chat", None])
def test_session_prefix_survives_unrelated_traffic_until_ttl(session_id):
    scheduler = make_scheduler(num_blocks=16, max_seqs=2, budget=64, policy="fcfs",
                               session_ttl=100.0)
    history = list(range(100, 112))  # 3 full blocks
    first = turn(scheduler, "t1", history, session_id)
    if session_id:
        assert scheduler.session_stats().protected_blocks == 3
    unrelated_traffic(scheduler, 1)
    second = turn(scheduler, "t2", first.token_ids + [7, 7, 7], session_id)
    if session_id is None:
        assert second.num_cached_tokens == 0  # plain LRU evicted the history
        return
    assert second.num_cached_tokens == 12
    stats = scheduler.session_stats()
    assert stats.session_prefix_hit_tokens == 12 and stats.session_requests == 2
    assert stats.protected_blocks == 4 and stats.active_sessions == 1

    # Past the TTL (counted from the latest turn's finish) protection ends lazily
    # and the history is evicted like any other block.
    scheduler.clock.now += 100.5
    unrelated_traffic(scheduler, 2)
    stats = scheduler.session_stats()
    assert stats.protected_blocks == 0 and stats.active_sessions == 0
    third = turn(scheduler, "t3", second.token_ids + [8], session_id)
    assert third.num_cached_tokens == 0
    scheduler.check_invariants()


def test_protected_blocks_are_evicted_when_nothing_else_is_free():
    scheduler = make_scheduler(num_blocks=16, max_seqs=2, budget=64, policy="fcfs")
    turn(scheduler, "t1", list(range(100, 112)), "chat")
    assert scheduler.kv.pool.protected_by("chat") and scheduler.kv.pool.num_free_blocks == 16
    # 56 + 4 tokens need 15 blocks: all 13 unprotected ones and 2 protected ones.
    big = Request("big", list(range(500, 556)), 4, scheduler.clock())
    scheduler.add_request(big)
    run_until_done(scheduler)
    assert big.status == RequestStatus.FINISHED_LENGTH
    assert len(scheduler.kv.pool.protected_by("chat")) == 1
    assert scheduler.session_stats().protected_blocks == 1
    scheduler.check_invariants()


def test_aborted_and_expired_turns_unblock_the_next_turn():
    scheduler = make_scheduler(num_blocks=64, max_seqs=1, budget=64, policy="fcfs")
    scheduler.add_request(Request("runner", [1, 2], 50, 0.0))
    run_step(scheduler)
    doomed = Request("t1", [3, 4], 2, 0.0, session_id="s", deadline=0.5)
    aborted = Request("t2", [3, 4, 5], 2, 0.0, session_id="s")
    last = Request("t3", [3, 4, 5, 6], 2, 0.0, session_id="s")
    for request in (doomed, aborted, last):
        scheduler.add_request(request)
    scheduler.abort_request("t2")
    scheduler.clock.now = 1.0
    run_step(scheduler)
    assert scheduler.pop_rejected() == [doomed]
    scheduler.abort_request("runner")
    run_step(scheduler)
    assert last.status == RequestStatus.RUNNING
    scheduler.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "release", "register", "hit", "protect",
                                           "unprotect"]),
                          st.integers(0, 100)), max_size=80))
def test_block_pool_protection_keeps_invariants_and_eviction_order(ops):
    pool = BlockPool(12)
    held: list[int] = []
    owners = ("a", "b")
    for op, arg in ops:
        if op == "alloc" and pool.num_free_blocks:
            protected = pool.protected_by("a") | pool.protected_by("b")
            free_plain = {b for b in range(12) if pool.ref_counts[b] == 0 and b not in protected}
            taken = pool.allocate(1 + arg % pool.num_free_blocks)
            if set(taken) & protected:
                assert free_plain <= set(taken), "evicted a protected block first"
            held += taken
        elif op == "protect":
            pool.protect(owners[arg % 2], range(arg % 12, 12, 3))
        elif op == "unprotect":
            pool.unprotect(owners[arg % 2])
        else:
            apply_pool_op(pool, held, op, arg)
        pool.check_invariants()
        assert pool.num_free_blocks == sum(1 for c in pool.ref_counts if c == 0)
    pool.release(held)
    assert pool.num_free_blocks == 12
