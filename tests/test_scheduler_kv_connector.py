"""The scheduler side of a KV connector (carpool.scheduler.kv_connector):
prompt blocks loaded from an external store while other requests step."""
from __future__ import annotations

from carpool.cluster.kv_tier import SharedKVTier, TierClient
from carpool.config import CacheConfig, SchedulerConfig
from carpool.scheduler import Request, RequestStatus, Scheduler
from tests.test_scheduler_properties import BLOCK, FakeClock, run_step

LOAD_S = 0.025  # 2.5 steps of run_step's 10 ms


def make_pair(num_blocks: int = 32, checkpoint_batches: int = 5,
              ) -> tuple[Scheduler, Scheduler, SharedKVTier]:
    """Two replicas' schedulers sharing one tier and one clock."""
    clock = FakeClock()
    tier = SharedKVTier(1000, block_bytes=1.0, bandwidth=1e12, latency=LOAD_S)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, watermark=0.0,
                        kv_session_checkpoint_batches=checkpoint_batches)
    return tuple(Scheduler(config, cache, num_blocks, clock, external_kv=TierClient(tier, clock))
                 for _ in range(2)) + (tier,)


def finish_all(scheduler: Scheduler, limit: int = 200) -> None:
    for _ in range(limit):
        if not scheduler.has_unfinished:
            return
        run_step(scheduler)
        scheduler.check_invariants()
    raise AssertionError("requests left unfinished")


def test_a_prefix_computed_on_one_replica_loads_on_another_without_stalling_its_steps():
    first, second, tier = make_pair()
    prompt = list(range(1, 22))  # 21 tokens: 5 full blocks, the last token always computed
    first.add_request(Request("a", prompt, 2, first.clock()))
    finish_all(first)
    assert tier.num_blocks >= 5  # written through as they were computed

    second.add_request(Request("busy", [90, 91, 92], 20, second.clock()))
    run_step(second)
    second.add_request(Request("b", prompt, 2, second.clock()))
    loaded_at = second.clock() + LOAD_S
    out = second.schedule()
    b = second.requests["b"]
    assert b.status == RequestStatus.LOADING and b.num_computed_tokens == 0
    assert [s.request.request_id for s in out.spans] == ["busy"]  # the other request steps on
    assert b.num_cached_tokens == 20 and second.kv.stats().external_hits == 20
    second.check_invariants()
    second.commit(out, [(s.request, 7) for s in out.spans if s.sample])
    while second.clock() < loaded_at:
        second.clock.now += 0.01
        out = second.schedule()
        if b.status == RequestStatus.LOADING:
            assert b not in {s.request for s in out.spans}
        second.commit(out, [(s.request, 7) for s in out.spans if s.sample])
    # Loaded: only the last prompt token is computed (one span of one token).
    span = next(s for s in out.spans if s.request is b)
    assert (span.start, span.num_tokens) == (20, 1)
    # The loaded blocks are now cached here: a third request hits locally.
    finish_all(second)
    second.add_request(Request("c", prompt, 1, second.clock()))
    second.schedule()
    c = second.requests["c"]
    assert c.status == RequestStatus.RUNNING and c.num_computed_tokens == 20


def test_a_request_aborted_while_loading_frees_everything():
    first, second, _ = make_pair()
    prompt = list(range(1, 18))
    first.add_request(Request("a", prompt, 1, first.clock()))
    finish_all(first)
    second.add_request(Request("b", prompt, 4, second.clock()))
    second.schedule()
    assert second.requests["b"].status == RequestStatus.LOADING
    assert second.abort_request("b").status == RequestStatus.FINISHED_ABORTED
    second.check_invariants()
    assert not second.has_unfinished and not second.loading
    assert second.kv.pool.num_free_blocks == second.kv.pool.num_blocks


def test_loading_requests_hold_sequence_slots():
    first, second, _ = make_pair(num_blocks=64)
    prompts = [[k] * 4 + list(range(10, 19)) for k in range(1, 6)]  # 5 distinct prefixes
    for index, prompt in enumerate(prompts):
        first.add_request(Request(f"a{index}", prompt, 1, first.clock()))
    finish_all(first)
    for index, prompt in enumerate(prompts):
        second.add_request(Request(f"b{index}", prompt, 1, second.clock()))
    second.schedule()
    assert len(second.loading) == 4 and len(second.waiting) == 1  # max_num_seqs 4
    second.check_invariants()
    finish_all(second)


def test_without_a_store_nothing_loads_and_admission_is_unchanged():
    clock = FakeClock()
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    scheduler = Scheduler(config, CacheConfig(block_size=BLOCK), 32, clock)
    scheduler.add_request(Request("a", list(range(1, 22)), 1, clock()))
    out = scheduler.schedule()
    assert [(s.start, s.num_tokens) for s in out.spans] == [(0, 21)]
    assert not scheduler.loading and scheduler.kv.stats().external_hits == 0


def test_a_sessions_generated_blocks_are_checkpointed_for_its_next_turn_elsewhere():
    """With checkpoints (every 5 batches, and at the turn's end) a session's
    next turn on another replica loads its last turn's answer too; without,
    only its prompt. A request outside a session saves its prompt only."""
    cached = {}
    for batches in (5, 0):
        first, second, tier = make_pair(checkpoint_batches=batches)
        prompt = list(range(1, 10))  # 9 tokens: 2 full blocks of 4
        turn1 = Request("t1", prompt, 12, first.clock(), session_id="s")
        first.add_request(turn1)
        first.add_request(Request("other", list(range(30, 39)), 12, first.clock()))
        finish_all(first)
        # Turn 1 computed 9 + 12 - 1 = 20 tokens: 5 full blocks (other: its 2 prompt blocks).
        assert tier.num_blocks == (5 if batches else 2) + 2
        turn2 = list(turn1.token_ids) + [50, 51]  # its answer, then the user's next words
        second.add_request(Request("t2", turn2, 1, second.clock(), session_id="s"))
        second.schedule()
        cached[batches] = second.requests["t2"].num_cached_tokens
        second.check_invariants()
    assert cached == {5: 20, 0: 8}
