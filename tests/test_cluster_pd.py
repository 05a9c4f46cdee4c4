"""Prefill/decode placement (carpool.cluster.pd)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.cluster import ReplicaView, Role, Router, RouteRequest
from carpool.cluster.pd import KVShape, Link, PDPlanner, _prefill_seconds, exposed_transfer_seconds
from carpool.scheduler.control.cost_model import StepCostModel

LLAMA_8B = KVShape(num_layers=32, num_kv_heads=8, head_dim=128)  # 128 KiB per token


def cost_model(per_token: float = 2e-5) -> StepCostModel:
    model = StepCostModel()
    for tokens in (1, 64, 512, 2048, 8192):
        for seqs in (1, 8, 32):
            model.record(tokens, seqs, 0.005 + per_token * tokens + 5e-5 * seqs)
    return model


def fleet(prefill: int = 2, decode: int = 2, mixed: int = 0) -> Router:
    router = Router()
    for role, count in ((Role.PREFILL, prefill), (Role.DECODE, decode), (Role.MIXED, mixed)):
        for i in range(count):
            router.add_replica(ReplicaView(f"{role.value}{i}", role=role,
                                           max_num_batched_tokens=8192,
                                           cost_model=cost_model()))
    return router


def test_the_kv_of_llama_3_8b_is_128_kib_per_token():
    assert LLAMA_8B.bytes_per_token == 131072


def test_exposed_transfer_is_the_last_layer_or_the_excess_over_compute():
    # 32 ms of transfer behind 100 ms of compute: only the last layer's 1 ms shows.
    assert exposed_transfer_seconds(0.032, 0.100, 32) == pytest.approx(0.001)
    # 200 ms behind 100 ms: all but the 96.9 ms hidden behind layers 1-31.
    assert exposed_transfer_seconds(0.200, 0.100, 32) == pytest.approx(0.200 - 0.100 * 31 / 32)


def test_a_long_prompt_on_a_fast_link_goes_to_the_prefill_pool():
    router = fleet()
    planner = PDPlanner(router, LLAMA_8B, Link(bandwidth=50e9))
    for view in router.candidates(Role.DECODE):
        view.in_flight, view.prefilling, view.pending_prefill_tokens = 20, 2, 6000
    plan = planner.plan(RouteRequest("q", 8000), 0.0)
    assert plan.disaggregated and plan.prefill.replica_id.startswith("prefill")
    assert plan.decode.replica_id.startswith("decode")
    assert 0 < plan.exposed_s < plan.transfer_s  # most of it hidden behind compute
    assert "disaggregated" in plan.cause
    decode = router.views[plan.decode.replica_id]
    assert decode.pending_prefill_tokens == 6001  # the decode leg waits for KV, not compute
    router.finished("q:prefill", 1.0)
    router.finished("q", 2.0)
    assert sum(v.in_flight for v in router.views.values()) == 40


def test_short_prompts_slow_links_and_no_prefill_pool_stay_colocated():
    short = PDPlanner(fleet(), LLAMA_8B).plan(RouteRequest("a", 200), 0.0)
    assert not short.disaggregated and short.decode.replica_id.startswith("decode")
    slow = PDPlanner(fleet(), LLAMA_8B, Link(bandwidth=1e9)).plan(RouteRequest("b", 8000), 0.0)
    assert not slow.disaggregated  # 1 GB over 1 GB/s: longer than the 0.16 s prefill
    alone = PDPlanner(fleet(prefill=0, decode=0, mixed=2), LLAMA_8B).plan(
        RouteRequest("c", 8000), 0.0)
    assert not alone.disaggregated and alone.decode.replica_id.startswith("mixed")


def test_a_pair_with_its_own_link_is_priced_by_it():
    """One slow link (decode0 sits elsewhere): a transfer to decode0 costs
    its link's time, and one too slow to pay keeps the request colocated."""
    def plan(links):
        router = fleet(prefill=1, decode=1)
        for view in router.candidates(Role.DECODE):
            view.in_flight, view.prefilling, view.pending_prefill_tokens = 20, 2, 6000
        return PDPlanner(router, LLAMA_8B, Link(bandwidth=50e9), links=links).plan(
            RouteRequest("q", 8000), 0.0)

    fast = plan({})
    assert fast.disaggregated and fast.transfer_s == pytest.approx(
        8000 * LLAMA_8B.bytes_per_token / 50e9 + Link.latency)
    slower = plan({("prefill0", "decode0"): Link(bandwidth=25e9, latency=1e-3)})
    assert slower.disaggregated and slower.transfer_s == pytest.approx(
        8000 * LLAMA_8B.bytes_per_token / 25e9 + 1e-3)
    assert not plan({("prefill0", "decode0"): Link(bandwidth=1e9)}).disaggregated


def test_pd_links_from_the_command_line():
    from carpool.sim.command import parse_pd_links
    from carpool.sim.pd import PDSettings

    links = parse_pd_links("0:3:25,1:2:10:0.001")
    assert links == ((0, 3, 25e9, Link.latency), (1, 2, 10e9, 0.001))
    assert PDSettings(2, links=links).validate(4).link_table()[("1", "2")] == Link(10e9, 0.001)
    with pytest.raises(ValueError, match="decode replica"):
        PDSettings(2, links=((0, 1, 1e9, 0.0),)).validate(4)  # 1 is a prefill replica
    with pytest.raises(ValueError, match="P:D:GBPS"):
        parse_pd_links("0:3")


@settings(max_examples=150, deadline=None)
@given(tokens=st.integers(1, 40_000), bandwidth=st.floats(1e8, 1e11),
       latency=st.floats(0, 0.05), decode_queue=st.integers(0, 60_000),
       prefill_queue=st.integers(0, 60_000), cached_blocks=st.integers(0, 2000),
       floor=st.sampled_from([0, 512]))
def test_remote_prefill_is_never_chosen_when_the_transfer_exceeds_the_prefill_saved(
        tokens, bandwidth, latency, decode_queue, prefill_queue, cached_blocks, floor):
    router = fleet(prefill=1, decode=1)
    router.blocks_stored("decode0", range(cached_blocks))
    router.views["decode0"].pending_prefill_tokens = decode_queue
    router.views["prefill0"].pending_prefill_tokens = prefill_queue
    link = Link(bandwidth=bandwidth, latency=latency)
    request = RouteRequest("q", tokens, tuple(range(tokens // 16)))
    plan = PDPlanner(router, LLAMA_8B, link, min_remote_tokens=floor).plan(request, 0.0)
    if plan.disaggregated:
        cached = plan.decode.cached_tokens
        saved = _prefill_seconds(router.views["decode0"], tokens - cached)
        assert plan.transfer_s < saved
        assert tokens - cached >= floor
    else:
        assert plan.prefill is None and router.views["prefill0"].in_flight == 0


def test_a_plan_for_a_request_already_routed_counts_nothing():
    router = fleet()
    planner = PDPlanner(router, LLAMA_8B, min_remote_tokens=512)
    for view in router.candidates(Role.DECODE):
        view.in_flight, view.prefilling, view.pending_prefill_tokens = 20, 2, 6000
    assert not planner.plan(RouteRequest("q", 200), 0.0).disaggregated  # under the floor
    before = {rid: v.in_flight for rid, v in router.views.items()}
    with pytest.raises(ValueError, match="already routed"):
        planner.plan(RouteRequest("q", 8000), 1.0)
    assert {rid: v.in_flight for rid, v in router.views.items()} == before


def test_always_disaggregates_even_what_would_not_pay():
    conditional = PDPlanner(fleet(), LLAMA_8B)
    always = PDPlanner(fleet(), LLAMA_8B, always=True)
    short = RouteRequest("s", 40)
    assert not conditional.plan(short, 0.0).disaggregated
    plan = always.plan(short, 0.0)
    assert plan.disaggregated and plan.prefill.replica_id.startswith("prefill")
    assert plan.exposed_s > 0 and plan.decode.replica_id.startswith("decode")
    # Without a prefill pool there is nothing to disaggregate to.
    alone = PDPlanner(fleet(prefill=0), LLAMA_8B, always=True)
    assert not alone.plan(RouteRequest("t", 4000), 0.0).disaggregated


def test_a_busy_decode_replica_weighs_the_stall_a_colocated_prefill_would_cause():
    """The prefill pool is queued (its first token later than a colocated
    one), but the decode replica runs 60 decodes that a colocated prefill
    would each stall once: weighed (the default), remote prefill wins;
    without the weight, the request's own TTFT keeps it colocated."""
    def plan(stall_weight):
        router = fleet(prefill=1, decode=1)
        worker, = router.candidates(Role.PREFILL)
        worker.in_flight = worker.prefilling = 6
        worker.pending_prefill_tokens = 6 * 4000
        home, = router.candidates(Role.DECODE)
        home.in_flight = 60  # decoding, none prefilling
        return PDPlanner(router, LLAMA_8B, Link(bandwidth=50e9),
                         stall_weight=stall_weight).plan(RouteRequest("q", 4000), 0.0)

    assert not plan(0.0).disaggregated
    weighed = plan(1.0)
    assert weighed.disaggregated and weighed.predicted_ttft is not None
    with pytest.raises(ValueError, match="stall_weight"):
        PDPlanner(fleet(), LLAMA_8B, stall_weight=-1)


def _burst_of_long_prompts(router: Router, planner: PDPlanner, polled_only: bool) -> list[int]:
    """32 prompts of 32k tokens with 1-token outputs, all at one instant,
    no first token or polled stats in between; ``polled_only``: forget
    what the router counted after each (a router that knows load only from
    its replicas' stats, which come too late). Prefill legs per replica."""
    for i in range(32):
        planner.plan(RouteRequest(f"q{i}", 32_768, tuple(range(i * 10_000, i * 10_000 + 8))),
                     0.0)
        if polled_only:
            for view in router.views.values():
                view.in_flight = view.prefilling = view.pending_prefill_tokens = 0
    routed = [router.replica_of(planner.prefill_leg(f"q{i}")) for i in range(32)]
    return [routed.count(v.replica_id) for v in router.candidates(Role.PREFILL)]


def test_a_burst_of_long_prompts_spreads_over_the_prefill_pool_before_any_stats():
    """The collapse peers' users report: a burst of 32k-token prompts all
    lands on the first prefill replica, because load is updated after the
    fact. The router counts each prefill leg where it sends it, so the
    burst spreads evenly; without that count it collapses."""
    router = fleet(prefill=4, decode=2)
    planner = PDPlanner(router, LLAMA_8B, Link(bandwidth=50e9), always=True)
    assert _burst_of_long_prompts(router, planner, polled_only=False) == [8, 8, 8, 8]
    blind = fleet(prefill=4, decode=2)
    legs = _burst_of_long_prompts(blind, PDPlanner(blind, LLAMA_8B, Link(bandwidth=50e9),
                                                   always=True), polled_only=True)
    assert legs[0] == 32, legs
    # The live P/D front routes its prefill pool with its own router: the same count holds.
    pool = fleet(prefill=4, decode=0)
    for i in range(32):
        pool.route(RouteRequest(f"p{i}", 32_768, tuple(range(i * 10_000, i * 10_000 + 8))),
                   0.0, Role.PREFILL)
    assert sorted(v.in_flight for v in pool.views.values()) == [8, 8, 8, 8]
