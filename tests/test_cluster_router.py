"""Fleet routing policies (carpool.cluster): properties and decisions."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.cluster import (
    POLICIES,
    Health,
    ReplicaView,
    Router,
    RouteRequest,
    RoutingError,
)
from carpool.cluster.hashring import HashRing, stable_hash
from carpool.cluster.prefix_index import ApproximatePrefixIndex, FleetPrefixIndex
from carpool.scheduler.control.cost_model import StepCostModel


def cost_model(per_token: float = 1e-4, per_step: float = 0.01) -> StepCostModel:
    model = StepCostModel()
    for tokens in (1, 8, 64, 256, 512, 1024):
        for seqs in (1, 4, 16):
            model.record(tokens, seqs, per_step + per_token * tokens + 1e-4 * seqs)
    return model


def fleet(policy: str, replicas: int = 4, **kwargs) -> Router:
    router = Router(policy, **kwargs)
    for index in range(replicas):
        router.add_replica(ReplicaView(f"r{index}", cost_model=cost_model()))
    return router


def request(index: int, tokens: int = 256, hashes=(), session=None) -> RouteRequest:
    return RouteRequest(f"q{index}", tokens, tuple(hashes), session)


def test_every_policy_is_deterministic_and_counts_what_it_routes():
    for name in POLICIES:
        picks = []
        for _ in range(2):
            router = fleet(name)
            chosen = [router.route(request(i, session=f"s{i % 5}"), float(i)).replica_id
                      for i in range(40)]
            picks.append(chosen)
            assert sum(v.in_flight for v in router.views.values()) == 40
            for i in range(40):
                router.finished(f"q{i}", 40.0 + i)
            assert all(v.in_flight == 0 and v.prefilling == 0 and v.pending_prefill_tokens == 0
                       and v.active_blocks == 0 for v in router.views.values()), name
        assert picks[0] == picks[1], name


# Operations on a fleet of 5: route, finish the oldest, or change one's health.
_OPS = st.lists(st.one_of(
    st.tuples(st.just("route"), st.integers(0, 9), st.integers(1, 2000)),
    st.tuples(st.just("finish"), st.integers(0, 0), st.integers(0, 0)),
    st.tuples(st.sampled_from(["ready", "draining", "dead"]), st.integers(0, 4),
              st.integers(0, 0))), max_size=60)


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(sorted(POLICIES)), ops=_OPS)
def test_never_routes_to_a_dead_or_draining_replica(policy, ops):
    router = fleet(policy, replicas=5)
    live: list[str] = []
    for step, (op, arg, tokens) in enumerate(ops):
        now = float(step)
        if op == "route":
            try:
                decision = router.route(request(step, tokens, range(arg), f"s{arg}"), now)
            except RoutingError:
                assert not any(v.routable for v in router.views.values())
                continue
            assert router.views[decision.replica_id].health is Health.READY
            live.append(f"q{step}")
        elif op == "finish":
            if live:
                router.finished(live.pop(0), now)
        else:
            router.set_health(f"r{arg}", Health(op))
    assert sum(v.in_flight for v in router.views.values()) == len(live)


def _hot_prefix_loads(policy: str, load_bound: float, check_each: bool = False) -> list[int]:
    """Replicas' in-flight counts after 200 requests that share one long
    prefix cached only on r0, in one session, the polled stats stale."""
    router = fleet(policy, replicas=4, load_bound=load_bound)
    shared = list(range(100, 132))
    router.blocks_stored("r0", shared)
    for i in range(200):
        router.route(request(i, 600, shared + [10_000 + i], session="one"), 0.0)
        if check_each:
            total = sum(v.in_flight for v in router.views.values())
            limit = math.ceil(router.load_bound * total / 4) + 1
            assert max(v.in_flight for v in router.views.values()) <= limit
    return sorted(v.in_flight for v in router.views.values())


@pytest.mark.parametrize("policy", ["predicted-ttft", "cache-aware", "session",
                                    "approx-cache-aware"])
def test_a_hot_cache_and_stale_stats_cannot_collapse_traffic(policy):
    """One shared system prompt must not draw every request to the replica
    that caches it: each replica stays within the load bound the router
    counts itself, whatever the cache and the (stale) polled stats say."""
    loads = _hot_prefix_loads(policy, 1.5, check_each=policy != "approx-cache-aware")
    assert loads[-1] <= math.ceil(1.5 * 200 / 4), loads  # none takes it all
    if policy != "session":  # the session ring fills replicas in its walk's order
        assert loads[0] >= 30, loads
    # The bound is the guard: without it the cache (or the session) takes
    # most of the traffic to r0 (the approximate policy balances on its own).
    if policy != "approx-cache-aware":
        assert _hot_prefix_loads(policy, 1e9)[-1] > 1.5 * 200 / 4


@pytest.mark.parametrize("replicas", [2, 4, 8, 16])
def test_adding_a_replica_moves_about_one_in_n_plus_one_sessions(replicas):
    ring = HashRing([f"r{i}" for i in range(replicas)])
    sessions = [f"session-{i}" for i in range(4000)]
    before = {s: ring.home(s) for s in sessions}
    ring.add(f"r{replicas}")
    after = {s: ring.home(s) for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(after[s] == f"r{replicas}" for s in moved)  # only to the new replica
    assert len(moved) / len(sessions) <= 1.4 / (replicas + 1)


def test_a_session_moves_only_when_its_replica_leaves_or_is_overloaded():
    router = fleet("session", replicas=4)
    home = router.route(request(0, session="chat"), 0.0).replica_id
    router.finished("q0", 1.0)
    for i in range(1, 20):  # light load: it stays
        assert router.route(request(i, session="chat"), float(i)).replica_id == home
        router.finished(f"q{i}", float(i))
    router.set_health(home, Health.DRAINING)
    moved = router.route(request(100, session="chat"), 100.0).replica_id
    assert moved != home
    router.finished("q100", 101.0)
    router.set_health(home, Health.READY)
    assert router.route(request(101, session="chat"), 102.0).replica_id == home


@settings(max_examples=40, deadline=None)
@given(sessions=st.lists(st.integers(0, 30), min_size=1, max_size=150),
       replicas=st.integers(1, 6))
def test_bounded_load_holds_for_session_routing(sessions, replicas):
    router = fleet("session", replicas=replicas)
    for i, session in enumerate(sessions):
        total = sum(v.in_flight for v in router.views.values())
        limit = math.ceil(router.load_bound * (total + 1) / replicas)
        chosen = router.route(request(i, session=f"s{session}"), 0.0).replica_id
        assert router.views[chosen].in_flight <= limit


def test_predicted_ttft_takes_the_cache_hit_unless_its_queue_costs_more():
    router = fleet("predicted-ttft", replicas=2)
    prefix = list(range(1, 33))  # 32 blocks of 16 tokens = 512 tokens
    router.blocks_stored("r1", prefix)
    first = router.route(request(0, 520, prefix + [999]), 0.0)
    assert (first.replica_id, first.cached_tokens) == ("r1", 512)
    assert "predicted TTFT" in first.cause
    # Prompts still prefilling on r1 (as the router counts them) outweigh its hit.
    router.views["r1"].pending_prefill_tokens = 20_000
    later = router.route(request(9, 520, prefix + [998]), 0.0)
    assert later.replica_id == "r0" and later.cached_tokens == 0


def test_fleet_admission_rejects_when_no_replica_can_meet_the_target():
    router = fleet("predicted-ttft", replicas=2, ttft_target=0.5)
    for view in router.views.values():
        view.pending_prefill_tokens = 50_000  # ~5 s of prefill queued on each
    with pytest.raises(RoutingError) as caught:
        router.route(request(0), 0.0)
    assert caught.value.reason == "predicted_ttft_miss"
    assert 1 <= caught.value.retry_after <= 60
    assert sum(v.in_flight for v in router.views.values()) == 0  # nothing counted
    assert router.decisions[-1]["cause"].startswith("rejected")


def test_response_time_sends_fewer_to_the_slow_replica():
    router = fleet("response-time", replicas=2)
    router.views["r0"].service_time, router.views["r1"].service_time = 4.0, 1.0
    picks = [router.route(request(i), 0.0).replica_id for i in range(10)]
    assert picks.count("r1") == 8  # waits 1x(k+1) vs 4x(k+1): 8 to 2


def test_removing_a_replica_returns_its_requests_and_forgets_its_blocks():
    router = fleet("round-robin", replicas=2)
    router.blocks_stored("r0", [1, 2, 3])
    for i in range(4):
        router.route(request(i), 0.0)
    assert sorted(router.remove_replica("r0")) == ["q0", "q2"]
    assert router.prefix_index.matches([1, 2, 3]) == {}
    assert router.replica_of("q1") == "r1"


def test_a_restarted_engine_s_first_events_clear_what_the_router_held_for_it():
    """A replica whose engine restarted under the same id (the router never
    saw it leave) has an empty cache: its first drained events are a reset,
    and the router forgets the blocks its index held for it, so no prompt is
    sent there for a hit that is gone."""
    from carpool.scheduler.kv_manager import KVCacheManager

    router = fleet("cache-aware", replicas=2)
    stale = list(range(40, 48))
    router.blocks_stored("r0", stale)
    assert router.route(request(0, 256, stale), 0.0).cached_tokens == 128
    restarted = KVCacheManager(num_blocks=16, block_size=2).event_buffer()
    batch = restarted.drain()
    router.block_events("r0", batch.stored, batch.evicted, batch.reset)
    assert router.prefix_index.matches(stale) == {}
    assert router.route(request(1, 256, stale), 0.0).cached_tokens == 0
    router.block_events("r1", [7], [], reset=False)  # a plain batch keeps the rest
    router.block_events("r1", [8], [], reset=False)
    assert router.prefix_index.matches([7]) == {"r1": 1}


def test_a_first_token_resyncs_an_index_that_missed_block_events():
    """Lost or late block events: r0's evictions of two prefixes never
    reached the router. A first token says how much of the prompt its
    replica found cached; fewer blocks than the index claimed means its
    entries there are in doubt, and the router resyncs them from the
    replica's cache (at most once a second), so the next requests are
    routed on the truth. (Without the count, the index keeps claiming.)"""
    truth: dict[str, list[int]] = {"r0": [], "r1": []}
    asked: list[str] = []

    def resync(replica_id: str) -> None:
        asked.append(replica_id)
        router.block_events(replica_id, truth[replica_id], [], reset=True)

    router = fleet("cache-aware", replicas=2)
    router.resync_index = resync
    gone, also_gone, loaded = list(range(50, 58)), list(range(70, 78)), list(range(60, 68))
    router.blocks_stored("r0", gone + also_gone)  # their eviction events were lost
    first = router.route(request(0, 200, gone), 0.0)
    assert (first.replica_id, first.cached_tokens) == ("r0", 128)
    router.first_token("q0", 0.5, cached_tokens=0)  # the engine found nothing
    truth["r0"] = gone  # it computed them again
    assert asked == ["r0"] and router.index_corrections == 1
    assert router.prefix_index.matches(also_gone) == {}  # the other stale entries too
    router.finished("q0", 1.0)
    blind = fleet("cache-aware", replicas=2)  # no count with the first token
    blind.blocks_stored("r0", gone + also_gone)
    blind.route(request(0, 200, gone), 0.0)
    blind.first_token("q0", 0.5)
    blind.finished("q0", 1.0)
    assert blind.route(request(1, 200, also_gone), 1.0).cached_tokens == 128
    # Another miss within the second: counted, not resynced again.
    router.blocks_stored("r0", also_gone)
    router.route(request(2, 200, also_gone), 1.0)
    router.first_token("q2", 1.2, cached_tokens=0)
    assert asked == ["r0"] and router.index_corrections == 2
    # More than the index knew (loaded from a shared store): it holds them now.
    third = router.route(request(3, 200, loaded), 2.0)
    router.first_token("q3", 2.5, cached_tokens=5 * 16 + 3)
    assert router.prefix_index.matches(loaded) == {third.replica_id: 5}
    assert router.index_corrections == 3
    # As the engine counts: the last prompt token is always computed, so a
    # prompt of whole blocks all cached reports one block fewer; no correction.
    router.blocks_stored("r1", loaded[:4])
    router.route(request(4, 64, loaded[:4]), 3.0)
    held = 48 if router.replica_of("q4") == "r1" else 0
    router.first_token("q4", 3.1, cached_tokens=held)
    assert router.index_corrections == 3 and asked == ["r0"]


def test_the_router_reports_its_ttft_prediction_error():
    router = fleet("predicted-ttft", replicas=2)
    assert router.ttft_error is None
    decision = router.route(request(0, 256), 0.0)
    assert decision.predicted_ttft is not None and decision.predicted_ttft > 0
    router.first_token("q0", 2 * decision.predicted_ttft)  # it took twice the prediction
    assert router.ttft_error == pytest.approx(0.5)
    router.route(request(1, 256), 0.0)
    router.first_token("q1", 0.0)  # no time passed: nothing to divide by, not counted
    assert len(router.ttft_errors) == 1
    # One rejected a moment after routing left with no first token: no TTFT.
    router.route(request(2, 256), 1.0)
    router.finished("q2", 1.0001, learn=False)
    assert len(router.ttft_errors) == 1 and router.error_totals["decided"][1] == 1
    assert router.views[router.decisions[-1]["replica"]].prefilling == 0


def test_kv_cost_weighs_the_blocks_to_prefill_against_the_blocks_active():
    """Dynamo-style: r0 caches 8 of a 10-block prompt; it wins while its
    active blocks stay under the 8 blocks of prefill it saves, then r1 does."""
    router = fleet("kv-cost", replicas=2)
    shared = list(range(70, 80))
    router.blocks_stored("r0", shared[:8])
    first = router.route(request(0, 160, shared), 0.0)
    assert first.replica_id == "r0" and first.cached_tokens == 128
    assert router.views["r0"].active_blocks == 10
    # r0: 2 to prefill + 10 active + 10 = 22; r1: 10 + 0 + 10 = 20
    assert router.route(request(1, 160, shared), 0.0).replica_id == "r1"
    router.finished("q0", 1.0)
    router.finished("q1", 1.0)
    assert router.views["r0"].active_blocks == router.views["r1"].active_blocks == 0


def test_a_second_front_prices_the_queue_the_first_front_built_from_polled_stats():
    """Several API fronts each count only what they sent. Front A sent a
    tenant's long shared prompt 40 times (to its cache on r0, the rest to
    r1, whose queue is now the longer in tokens); front B, with fresh
    prompts, sees both replicas idle by its own count. The replicas' polled
    queues (every front's) are the guard: B prices them and sends most to
    the shorter queue, so the fleet's longest prefill queue is shorter."""
    def run(polled: bool) -> tuple[int, int]:
        a, b = fleet("predicted-ttft", replicas=2), fleet("predicted-ttft", replicas=2)
        shared = list(range(100, 580))  # 7,680 of 8,000 tokens cached on r0
        a.blocks_stored("r0", shared)
        for i in range(40):
            a.route(request(i, 8000, shared + [10_000 + i]), 0.0)
        if polled:
            for rid, view in a.views.items():
                b.update_stats(rid, 0.0, waiting=view.in_flight, running=0,
                               waiting_tokens=view.pending_prefill_tokens)
        for i in range(20):
            b.route(request(100 + i, 2000), 0.0)
        queues = [a.views[r].pending_prefill_tokens + b.views[r].pending_prefill_tokens
                  for r in ("r0", "r1")]
        return b.views["r0"].in_flight, max(queues)

    blind_r0, blind_longest = run(polled=False)
    guarded_r0, guarded_longest = run(polled=True)
    assert blind_r0 == 10  # an even split: r0 and r1 look alike to B
    assert guarded_r0 > blind_r0 and guarded_longest < blind_longest


def test_fleet_prefix_index_matches_leading_blocks_only():
    index = FleetPrefixIndex()
    index.stored("a", [1, 2, 3, 4])
    index.stored("b", [1, 2])
    index.stored("c", [2, 3])  # no block 1: a chained hash never starts mid-prompt
    assert index.matches([1, 2, 3, 9]) == {"a": 3, "b": 2}
    index.evicted("a", [2])
    assert index.matches([1, 2, 3]) == {"a": 1, "b": 2}
    index.remove_replica("b")
    assert index.matches([1, 2]) == {"a": 1}
    assert index.num_blocks("b") == 0


def test_approximate_index_forgets_least_recently_sent_first():
    index = ApproximatePrefixIndex(capacity_blocks=4)
    index.sent("a", [1, 2, 3])
    index.sent("a", [1, 7, 8])
    assert index.size("a") == 4 and index.match("a", [1, 2]) == 1  # 2 evicted, 1 refreshed


def test_stable_hash_is_keyed_and_the_same_across_processes():
    import subprocess
    import sys
    code = ("from carpool.cluster.hashring import stable_hash; "
            "print(stable_hash('session-1', b'k'))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert int(other.stdout) == stable_hash("session-1", b"k") != stable_hash("session-1")


def test_unknown_policy_and_bad_bound_are_clear_errors():
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router("fastest")
    with pytest.raises(ValueError, match="load_bound"):
        Router(load_bound=0.5)


class _Listener:
    """Block events of one replica into a fleet index."""

    def __init__(self, index: FleetPrefixIndex, replica_id: str) -> None:
        self.index, self.replica_id = index, replica_id

    def stored(self, hashes):
        self.index.stored(self.replica_id, hashes)

    def evicted(self, hashes):
        self.index.evicted(self.replica_id, hashes)


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 3), min_size=4, max_size=24), max_size=30),
       num_blocks=st.integers(4, 12))
def test_block_events_keep_the_fleet_index_equal_to_the_pool(prompts, num_blocks):
    """Whatever is cached and evicted, the index fed by a pool's events holds
    exactly the chained hashes of the blocks the pool caches."""
    from carpool.scheduler.block_pool import ROOT_HASH, BlockKeyChain, BlockPool

    index = FleetPrefixIndex()
    pool = BlockPool(num_blocks)
    pool.events = _Listener(index, "r0")
    chain = BlockKeyChain(2)
    for tokens in prompts:
        full = len(tokens) // 2
        keys, hashes = chain.keys(ROOT_HASH, tokens, 0, full)
        take = min(full, pool.num_free_blocks)
        blocks = pool.allocate(take)
        pool.register(blocks, keys[:take], keys[0])
        pool.release(blocks)
        assert index.matches(hashes[:take]).get("r0", 0) == take
        held = {hash(key) for key in pool._cached}
        assert index._held.get("r0", set()) == held
    pool.check_invariants()


def test_a_kv_manager_reporting_blocks_keys_them_at_once():
    from carpool.scheduler.kv_manager import KVCacheManager

    manager = KVCacheManager(num_blocks=8, block_size=4)
    index = FleetPrefixIndex()
    manager.report_blocks_to(_Listener(index, "r0"))
    assert manager.lazy_keys is False and manager.pool.events is not None


def test_predicted_ttft_keeps_the_longest_cached_prefix_within_its_affinity():
    """A short prompt whose 2-block prefix r1 holds: r1's small extra queue
    (within AFFINITY_FACTOR of the best) keeps it there, a long one does not."""
    router = fleet("predicted-ttft", replicas=2)
    router.blocks_stored("r1", [1, 2])
    router.views["r1"].pending_prefill_tokens = 40  # ~4 ms more than r0's empty queue
    kept = router.route(request(0, 40, [1, 2]), 0.0)
    assert kept.replica_id == "r1" and kept.cause.startswith("longest cached prefix")
    router.views["r1"].pending_prefill_tokens = 5000  # ~0.5 s more: r0's miss is cheaper
    assert router.route(request(1, 40, [1, 2]), 0.0).replica_id == "r0"


def test_the_affinity_gate_explores_a_seeded_share_of_what_it_keeps():
    """``explore`` sends that share of the requests the gate would keep on
    their cached prefix to the lowest predicted TTFT instead (the same
    requests for the same seed); 0 keeps every one, and a penalty over the
    gate is dropped whatever the draw."""
    from carpool.cluster.policies import AffinityGate, PredictedTTFTPolicy

    def kept_on_r1(explore: float, seed: int = 0) -> tuple[list[str], int]:
        policy = PredictedTTFTPolicy(AffinityGate(explore=explore), seed=seed)
        router = fleet(policy, replicas=2)
        router.blocks_stored("r1", [1, 2])
        picks = []
        for i in range(400):
            router.views["r1"].pending_prefill_tokens = 40  # within the gate
            router.views["r0"].pending_prefill_tokens = 0
            picks.append(router.route(request(i, 40, [1, 2]), 0.0).replica_id)
            router.finished(f"q{i}", 0.0, learn=False)
        return picks, policy.explored

    picks, explored = kept_on_r1(0.0)
    assert set(picks) == {"r1"} and explored == 0
    picks, explored = kept_on_r1(0.1)
    assert picks.count("r0") == explored and 20 <= explored <= 60
    assert kept_on_r1(0.1) == (picks, explored)  # seeded: the same requests
    assert kept_on_r1(0.1, seed=1)[0] != picks
    router = fleet(PredictedTTFTPolicy(AffinityGate(explore=0.1)), replicas=2)
    router.blocks_stored("r1", [1, 2])
    router.views["r1"].pending_prefill_tokens = 5000  # over the gate: never kept
    assert router.route(request(0, 40, [1, 2]), 0.0).replica_id == "r0"


@pytest.mark.parametrize("name, replica", [("predicted-ttft/no-affinity", "r0"),
                                           ("predicted-ttft/no-gate", "r1")])
def test_the_ablations_drop_the_affinity_or_its_gate(name, replica):
    """Without affinity the lowest predicted TTFT wins even for a small
    penalty; without the gate the cached prefix wins even for a large one."""
    from carpool.cluster.policies import ABLATIONS

    router = fleet(name, replicas=2)
    assert name in ABLATIONS
    router.blocks_stored("r1", [1, 2])
    router.views["r1"].pending_prefill_tokens = 40 if replica == "r0" else 50_000
    assert router.route(request(0, 40, [1, 2]), 0.0).replica_id == replica
