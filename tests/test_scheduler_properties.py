"""Property-based tests of the block pool, prefix cache and scheduler.

A random sequence of add / step / finish / abort runs against the real
scheduler with a fake "model" that samples a deterministic token; after
every operation the bookkeeping must be consistent.
"""
from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.cluster.kv_tier import SharedKVTier, TierClient
from carpool.config import CacheConfig, SchedulerConfig
from carpool.scheduler import (
    RejectedError,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
)
from carpool.scheduler.block_pool import BlockPool

BLOCK = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(num_blocks: int, max_seqs: int, budget: int, policy: str,
                   caching: bool = True, tier_blocks: int = 0, **config) -> Scheduler:
    """A scheduler on a ``FakeClock``; ``config`` sets further SchedulerConfig
    fields; ``tier_blocks`` > 0 gives it an external KV store of that many
    blocks whose loads take 1.5 steps (``run_step`` advances 10 ms)."""
    scheduler_config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                       policy=policy, **config)
    scheduler_config.validate()
    clock = FakeClock()
    external = None
    if tier_blocks:
        tier = SharedKVTier(tier_blocks, block_bytes=1.0, bandwidth=1e9, latency=0.015)
        external = TierClient(tier, clock)
    return Scheduler(scheduler_config,
                     CacheConfig(block_size=BLOCK, enable_prefix_caching=caching, watermark=0.05),
                     num_blocks, clock, external_kv=external)


def run_step(scheduler: Scheduler) -> list[Request]:
    """One step with a fake model; returns requests that finished."""
    return run_step_output(scheduler)[1]


def is_long(scheduler: Scheduler, request: Request) -> bool:
    return request.num_prompt_tokens > scheduler.config.long_prompt_threshold


def long_prefill_tokens(scheduler: Scheduler, out: SchedulerOutput) -> int:
    """Tokens of long prompts' spans in ``out`` that are not decodes (before commit)."""
    return sum(s.num_tokens for s in out.spans if is_long(scheduler, s.request)
               and not (s.request.num_output_tokens > 0 and s.start == s.request.num_tokens - 1))


def check_output(scheduler: Scheduler, out: SchedulerOutput, waiting_before: list[Request],
                 shorts_before: list[Request], priority_preemptions_before: int) -> None:
    """Per-step properties of priorities, preemption and the dual queue."""
    preempted = {id(r) for r in out.preempted}
    assert not preempted & {id(s.request) for s in out.spans}, "preempted and scheduled"
    if scheduler.num_priority_preemptions > priority_preemptions_before:
        was_waiting = {id(r) for r in waiting_before}
        # Admitted: into this step's batch, or to load its KV first.
        admitted = [r.priority for r in [s.request for s in out.spans] + list(scheduler.loading)
                    if id(r) in was_waiting]
        assert admitted and min(admitted) < min(r.priority for r in out.preempted), \
            "a preemption for priority admitted nothing better than its victims"
    # Expired requests never wanted the budget; every other short one did.
    if scheduler.long_prefill_cap is not None and any(
            r.status != RequestStatus.FINISHED_REJECTED for r in shorts_before):
        assert long_prefill_tokens(scheduler, out) <= scheduler.long_prefill_cap


def run_step_output(scheduler: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    """One step with a fake model: its output and the requests that finished."""
    waiting_before = list(scheduler.waiting)
    shorts_before = [r for r in waiting_before + scheduler.running if not is_long(scheduler, r)
                     and not (r.num_output_tokens > 0 and r.num_pending_tokens == 1)]
    priority_preemptions_before = scheduler.num_priority_preemptions
    out = scheduler.schedule()
    assert out.num_tokens <= scheduler.config.max_num_batched_tokens
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    ids = [s.request.request_id for s in out.spans]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    for span in out.spans:
        assert span.start == span.request.num_computed_tokens
        assert span.num_tokens > 0
        # every computed token has a block to live in
        table = scheduler.kv.block_tables[span.request.request_id]
        assert len(table) * BLOCK >= span.start + span.num_tokens
    check_output(scheduler, out, waiting_before, shorts_before, priority_preemptions_before)
    sampled = [(s.request, (s.request.num_tokens * 7) % 11) for s in out.spans if s.sample]
    scheduler.commit(out, sampled)
    finished = []
    for request, _ in sampled:
        if request.num_output_tokens >= request.max_tokens:
            scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)
            finished.append(request)
    scheduler.clock.now += 0.01
    return out, finished


prompts = st.lists(st.integers(0, 3), min_size=1, max_size=24)  # small alphabet: many prefix hits
priorities = st.integers(-1, 2)
ops = st.lists(st.one_of(
    st.tuples(st.just("add"), prompts, st.integers(1, 8), priorities),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("peer"), st.lists(st.integers(0, 3), min_size=5, max_size=16)),
), max_size=60)
# Queue knobs: aging from none to every other step, and a long-prompt class
# that the small prompts above reach.
queue_knobs = st.fixed_dictionaries({
    "aging_interval": st.sampled_from([None, 0.02, 0.1, 30.0]),
    "long_prompt_threshold": st.integers(4, 16),
    "long_prefill_share": st.sampled_from([0.25, 0.5, 1.0]),
})


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(8, 40), max_seqs=st.integers(1, 6),
       budget=st.integers(1, 32), policy=st.sampled_from(["fcfs", "priority"]),
       caching=st.booleans(), tier_blocks=st.sampled_from([0, 6, 64]), knobs=queue_knobs)
def test_random_operations_keep_bookkeeping_consistent(ops, num_blocks, max_seqs, budget,
                                                       policy, caching, tier_blocks, knobs):
    run_random_operations(ops, num_blocks, max_seqs, budget, policy, caching, tier_blocks, knobs)


@settings(max_examples=100, deadline=None)
@given(ops=ops, num_blocks=st.integers(8, 40), max_seqs=st.integers(1, 6),
       budget=st.integers(4, 32), policy=st.sampled_from(["fcfs", "priority"]),
       knobs=queue_knobs)
def test_random_operations_with_an_external_store_keep_bookkeeping_consistent(
        ops, num_blocks, max_seqs, budget, policy, knobs):
    run_random_operations(ops, num_blocks, max_seqs, budget, policy, True, 64, knobs)


def run_random_operations(ops, num_blocks, max_seqs, budget, policy, caching, tier_blocks,
                          knobs) -> None:
    """Apply ``ops``, checking the invariants after each, then run dry: every
    request finishes and every block is back in the pool."""
    scheduler = make_scheduler(num_blocks, max_seqs, budget, policy, caching, tier_blocks,
                               **knobs)
    # A peer replica on the same store and clock: what it computes, the
    # scheduler under test may load.
    peer = Scheduler(scheduler.config, CacheConfig(block_size=BLOCK), 64, scheduler.clock,
                     external_kv=scheduler.kv.external)
    added: list[Request] = []
    peer_prompts: list[list[int]] = []
    done: set[str] = set()
    for op in ops:
        if op[0] == "peer":
            if tier_blocks:
                peer_prompts.append(op[1])
                peer.add_request(Request(f"p{len(peer_prompts)}", op[1], 1, peer.clock()))
                while peer.has_unfinished:
                    run_step(peer)
        elif op[0] == "add":
            _, prompt, max_tokens, priority = op
            if peer_prompts and prompt[0] <= 1:  # continue what the peer computed
                prompt = peer_prompts[-1] + prompt
            request = Request(f"r{len(added)}", prompt, max_tokens, scheduler.clock(), priority)
            if scheduler.kv.can_ever_fit(len(prompt) + max_tokens):
                scheduler.add_request(request)
                added.append(request)
        elif op[0] == "step":
            done.update(r.request_id for r in run_step(scheduler))
        elif added:
            victim = added[op[1] % len(added)]
            if scheduler.abort_request(victim.request_id) is not None:
                done.add(victim.request_id)
        scheduler.check_invariants()

    # Liveness: with no new arrivals every request finishes in bounded steps.
    limit = 10 + sum(r.num_prompt_tokens + 2 * r.max_tokens for r in added) * 4
    for _ in range(limit):
        if not scheduler.has_unfinished:
            break
        done.update(r.request_id for r in run_step(scheduler))
        scheduler.check_invariants()
    assert not scheduler.has_unfinished, "some request never finished"
    assert done == {r.request_id for r in added}
    # Everything is back in the pool; nothing leaked.
    assert scheduler.kv.pool.num_free_blocks == num_blocks
    for request in added:
        if request.status == RequestStatus.FINISHED_LENGTH:
            assert request.num_output_tokens == request.max_tokens


overload_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), prompts, st.integers(1, 6), priorities,
              st.sampled_from([None, "a", "b"]), st.one_of(st.none(), st.floats(0.0, 0.3))),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 80)),
    st.tuples(st.just("wait"), st.floats(0.0, 2.0)),
), min_size=10, max_size=80)


class Ledger:
    """How each accepted request ended; ending twice or never fails the test."""

    def __init__(self, scheduler: Scheduler, before_step=None) -> None:
        self.scheduler = scheduler
        self.before_step = before_step  # called before every step, e.g. to feed the cost model
        self.accepted: list[Request] = []
        self.ended: dict[str, str] = {}

    def run(self, op: tuple) -> None:
        """Apply ``("step", n)``, ``("abort", index)`` or ``("wait", seconds)``."""
        if op[0] == "step":
            for _ in range(op[1]):
                self.step()
                self.check(self.scheduler.config)
        elif op[0] == "abort" and self.accepted:
            victim = self.accepted[op[1] % len(self.accepted)]
            if self.scheduler.abort_request(victim.request_id) is not None:
                self.end(victim, "abort")
        elif op[0] == "wait":
            self.scheduler.clock.now += op[1]

    def end(self, request: Request, how: str) -> None:
        assert request.request_id not in self.ended, f"{request.request_id} ended twice"
        assert request in self.accepted and request.status.finished
        self.ended[request.request_id] = how

    def step(self) -> None:
        if self.before_step is not None:
            self.before_step()
        for request in run_step(self.scheduler):
            self.end(request, "finished")
        for request in self.scheduler.pop_rejected():
            assert request.status == RequestStatus.FINISHED_REJECTED
            assert request.first_scheduled_time is None, "a scheduled request expired"
            self.end(request, request.reject_reason)

    def check(self, config: SchedulerConfig) -> None:
        self.scheduler.check_invariants()
        fresh = [r for r in self.scheduler.waiting if r.first_scheduled_time is None]
        assert len(fresh) <= config.max_queue_requests
        if config.max_queue_tokens is not None:
            assert sum(r.num_prompt_tokens for r in fresh) <= config.max_queue_tokens
        # A session's request runs only after every earlier one of it ended.
        for index, request in enumerate(self.accepted):
            if request.session_id is None or request.first_scheduled_time is None:
                continue
            assert all(e.request_id in self.ended for e in self.accepted[:index]
                       if e.session_id == request.session_id), "session order broken"


@settings(max_examples=150, deadline=None)
@given(ops=overload_ops, num_blocks=st.integers(8, 16), max_seqs=st.integers(1, 4),
       budget=st.integers(1, 16), policy=st.sampled_from(["fcfs", "priority"]),
       max_queue=st.integers(1, 6), max_queue_tokens=st.one_of(st.none(), st.integers(8, 40)),
       queue_timeout=st.one_of(st.none(), st.floats(0.05, 1.0)),
       ttl=st.sampled_from([0.0, 0.5, 1800.0]), knobs=queue_knobs)
def test_every_accepted_request_ends_exactly_once_under_overload(
        ops, num_blocks, max_seqs, budget, policy, max_queue, max_queue_tokens, queue_timeout,
        ttl, knobs):
    scheduler = make_scheduler(num_blocks, max_seqs, budget, policy,
                               max_queue_requests=max_queue, max_queue_tokens=max_queue_tokens,
                               queue_timeout=queue_timeout, session_ttl=ttl, **knobs)
    ledger = Ledger(scheduler)
    for index, op in enumerate(ops):
        if op[0] == "add":
            _, prompt, max_tokens, priority, session, slack = op
            now = scheduler.clock()
            request = Request(f"r{index}", prompt, max_tokens, now, priority, session_id=session,
                              deadline=None if slack is None else now + slack)
            if not scheduler.kv.can_ever_fit(len(prompt) + max_tokens):
                continue
            if max_queue_tokens is not None and len(prompt) > max_queue_tokens:
                with pytest.raises(ValueError, match="max_queue_tokens"):
                    scheduler.add_request(request)
                continue
            try:
                scheduler.add_request(request)
                ledger.accepted.append(request)
            except RejectedError as exc:
                assert exc.reason in ("queue_full", "queue_tokens")
                assert 1 <= exc.retry_after <= 60
        else:
            ledger.run(op)
        ledger.check(scheduler.config)

    limit = 10 + sum(r.num_prompt_tokens + 2 * r.max_tokens for r in ledger.accepted) * 4
    for _ in range(limit):
        if not scheduler.has_unfinished:
            break
        ledger.step()
        ledger.check(scheduler.config)
    assert not scheduler.has_unfinished, "some request never finished"
    assert set(ledger.ended) == {r.request_id for r in ledger.accepted}, "a request was lost"
    assert scheduler.kv.pool.num_free_blocks == num_blocks
    rejected = [how for how in ledger.ended.values() if how in ("deadline", "queue_timeout")]
    for reason in ("deadline", "queue_timeout"):
        assert rejected.count(reason) == scheduler.rejections.get(reason, 0)


def apply_pool_op(pool: BlockPool, held: list[int], op: str, arg: int) -> None:
    """Release, register or hit (lookup + acquire) on a pool; ``held`` tracks
    the references the test owns."""
    if op == "release" and held:
        pool.release([held.pop(arg % len(held))])
    elif op == "register" and held:
        key = (arg % 5, (arg % 3,))
        pool.register([held[arg % len(held)]], [key], root=key[0])
    elif op == "hit":
        block = pool.lookup((arg % 5, (arg % 3,)))
        if block is not None:
            pool.acquire([block])
            held.append(block)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "release", "register", "hit"]),
                          st.integers(0, 100)), max_size=80))
def test_block_pool_never_leaks_or_double_frees(ops):
    pool = BlockPool(12)
    held: list[int] = []
    for op, arg in ops:
        if op == "alloc" and pool.num_free_blocks:
            held += pool.allocate(1 + arg % pool.num_free_blocks)
        else:
            apply_pool_op(pool, held, op, arg)
        pool.check_invariants()
        counts = [0] * 12
        for b in held:
            counts[b] += 1
        assert counts == pool.ref_counts
    pool.release(held)
    assert pool.num_free_blocks == 12


def test_prefix_hit_reuses_blocks_and_counts():
    scheduler = make_scheduler(num_blocks=32, max_seqs=4, budget=64, policy="fcfs")
    prompt = list(range(13))  # 3 full blocks + 1 token
    first = Request("a", prompt, 1, 0.0)
    scheduler.add_request(first)
    run_step(scheduler)
    assert first.status == RequestStatus.FINISHED_LENGTH
    second = Request("b", prompt + [99], 2, 1.0)
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert second.num_cached_tokens == 12
    assert out.spans[0].start == 12 and out.spans[0].num_tokens == 2
    stats = scheduler.kv.stats()
    assert stats.prefix_queries == 13 + 14 and stats.prefix_hits == 12


def test_full_prompt_hit_still_computes_last_token():
    scheduler = make_scheduler(num_blocks=32, max_seqs=4, budget=64, policy="fcfs")
    prompt = list(range(8))  # exactly 2 blocks
    for rid in ("a", "b"):
        scheduler.add_request(Request(rid, prompt, 1, 0.0))
        out = scheduler.schedule()
        span = out.spans[0]
        assert span.sample and span.start + span.num_tokens == 8
        scheduler.commit(out, [(span.request, 5)])
        scheduler.finish_request(span.request, RequestStatus.FINISHED_LENGTH)
    assert scheduler.kv.prefix_hits == 4  # 'b' reused the first block, recomputed the second


def test_preemption_picks_lowest_priority_then_latest():
    scheduler = make_scheduler(num_blocks=6, max_seqs=4, budget=64, policy="priority")
    scheduler.kv.watermark_blocks = 0
    reqs = [Request("hi", [1] * 7, 9, 0.0, priority=0), Request("lo-old", [2] * 7, 9, 1.0, 2),
            Request("lo-new", [3] * 7, 9, 2.0, 2)]
    for r in reqs:
        scheduler.add_request(r)
    preempted = []
    for _ in range(6):
        out = scheduler.schedule()
        preempted += [r.request_id for r in out.preempted]
        scheduler.commit(out, [(s.request, 1) for s in out.spans if s.sample])
        scheduler.check_invariants()
    assert preempted and preempted[0] == "lo-new"
    assert "hi" not in preempted


def test_scheduler_does_not_import_torch():
    import subprocess
    code = ("import sys, carpool.scheduler, carpool.config; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# A first token from a wider range: most chains start uniquely (lazy runs),
# some share their first block with an earlier one (keyed on lookup).
tenant_prompts = st.tuples(st.integers(0, 12), prompts).map(lambda t: [t[0], *t[1]])
session_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), tenant_prompts, st.integers(1, 8), priorities,
              st.sampled_from([None, None, None, None, "a", "b"])),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("wait"), st.floats(0.0, 1.0)),
), max_size=60)


def _snapshot(scheduler: Scheduler, out: SchedulerOutput) -> tuple:
    kv = scheduler.kv
    return ([(s.request.request_id, s.start, s.num_tokens) for s in out.spans],
            [r.request_id for r in out.preempted], kv.prefix_hits,
            kv.pool.num_cached_blocks, kv.pool.num_free_blocks,
            sorted(kv.block_tables.items()))


@settings(max_examples=200, deadline=None)
@given(ops=session_ops, num_blocks=st.integers(10, 24), max_seqs=st.integers(1, 6),
       budget=st.integers(1, 32), policy=st.sampled_from(["fcfs", "priority"]),
       ttl=st.sampled_from([0.0, 0.5, 1800.0]))
def test_lazy_prefix_keys_behave_exactly_like_keying_every_block(ops, num_blocks, max_seqs,
                                                                 budget, policy, ttl):
    """Lazy runs only defer computing keys: the same operations give the
    same steps, hits, cache sizes and block tables as keying every block."""
    lazy, eager = (make_scheduler(num_blocks, max_seqs, budget, policy, session_ttl=ttl)
                   for _ in range(2))
    eager.kv.lazy_keys = False
    for index, op in enumerate(ops):
        for scheduler in (lazy, eager):
            if op[0] == "add":
                _, prompt, max_tokens, priority, session = op
                request = Request(f"r{index}", prompt, max_tokens, scheduler.clock(), priority,
                                  session_id=session)
                if scheduler.kv.can_ever_fit(len(prompt) + max_tokens):
                    scheduler.add_request(request)
            elif op[0] == "abort":
                scheduler.abort_request(f"r{op[1]}")
            elif op[0] == "wait":
                scheduler.clock.now += op[1]
        if op[0] == "step":
            _step_both(lazy, eager)
        lazy.check_invariants()
    for _ in range(500):  # drain: later admissions evict earlier runs' blocks
        if not lazy.has_unfinished and not eager.has_unfinished:
            break
        _step_both(lazy, eager)
        lazy.check_invariants()
    assert not lazy.has_unfinished


def _step_both(lazy: Scheduler, eager: Scheduler) -> None:
    outputs = [run_step_output(scheduler)[0] for scheduler in (lazy, eager)]
    assert _snapshot(lazy, outputs[0]) == _snapshot(eager, outputs[1])
