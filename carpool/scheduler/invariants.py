"""Bookkeeping invariants of a ``Scheduler``, asserted by the tests after
every operation. Pure Python."""
from __future__ import annotations

from carpool.scheduler.request import RequestStatus


def check_invariants(scheduler) -> None:
    """Assert that blocks, queues, running set, expiries and sessions agree."""
    scheduler.kv.check_invariants()
    loading = {r.request_id for r in scheduler.loading}
    assert len(scheduler.running) + len(loading) <= scheduler.config.max_num_seqs
    assert all(r.status == RequestStatus.LOADING for r in scheduler.loading)
    assert set(scheduler.kv.block_tables) == {r.request_id for r in scheduler.running} | loading
    queued = {r.request_id for r in scheduler.waiting}
    running = {r.request_id for r in scheduler.running}
    assert not queued & running and not (queued | running) & loading
    assert queued | running | loading == set(scheduler.requests)
    scheduler.waiting.check_invariants()
    assert all(r.status == RequestStatus.FINISHED_REJECTED and r.reject_reason
               and scheduler.requests.get(r.request_id) is not r
               for r in scheduler._rejected)
    scheduler.sessions.check_invariants(scheduler.requests)
    scheduler.pins.check_invariants(scheduler.requests)
    knobs = scheduler.knobs  # the live knobs never exceed the configured caps
    assert 1 <= knobs.max_num_seqs <= scheduler.config.max_num_seqs
    assert 1 <= knobs.max_num_batched_tokens <= scheduler.config.max_num_batched_tokens
