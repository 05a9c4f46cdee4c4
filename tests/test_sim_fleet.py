"""The cluster router inside the simulator (carpool.sim.fleet)."""
from __future__ import annotations

import random

import pytest

from carpool.cluster import POLICIES
from carpool.config import EngineConfig
from carpool.sim.analytic import analytic_from_names
from carpool.sim.simulate import SimSettings, simulate
from carpool.workload.traces import TraceRequest


def _outcome(run):
    return [(r.index, r.status, r.reason, r.sent, r.finished, r.chunk_times, r.output_tokens)
            for r in run.records]


def _conversations(count: int, rate: float, seed: int = 3) -> list[TraceRequest]:
    """Requests of 24 conversations: each turn's prompt extends the one before
    (hash ids shared with the previous turn), as Mooncake's hash ids say."""
    rng = random.Random(seed)
    history = {c: [] for c in range(24)}
    plan, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        chat = rng.randrange(24)
        history[chat] = history[chat] + [1000 * chat + len(history[chat]) + k for k in range(3)]
        plan.append(TraceRequest(t, 32 * len(history[chat]) + 20, rng.randrange(8, 64),
                                 tuple(history[chat])))
    return plan


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_one_replica_cluster_equals_the_single_replica_simulation(policy):
    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _conversations(150, 20.0)
    alone = simulate(plan, EngineConfig(), cost, 400, SimSettings(hash_block=32))
    fleet = simulate(plan, EngineConfig(), cost, 400,
                     SimSettings(routing=policy, hash_block=32))
    assert _outcome(fleet) == _outcome(alone)
    assert fleet.steps == alone.steps and fleet.per_replica == alone.per_replica


def _hit_rate(run) -> float:
    rows = run.per_replica
    return sum(r["prefix_hits"] for r in rows) / max(1, sum(r["prefix_queries"] for r in rows))


def test_cache_aware_routing_keeps_conversations_where_their_prefix_is():
    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _conversations(400, 30.0)
    runs = {policy: simulate(plan, EngineConfig(), cost, 2000,
                             SimSettings(replicas=4, routing=policy, hash_block=32))
            for policy in ("round-robin", "least-outstanding", "cache-aware", "predicted-ttft")}
    rates = {policy: _hit_rate(run) for policy, run in runs.items()}
    assert rates["cache-aware"] > rates["round-robin"] + 0.15, rates
    assert rates["predicted-ttft"] > rates["least-outstanding"] + 0.15, rates
    for run in runs.values():
        assert all(r.status == "ok" for r in run.records)
        assert sum(r["steps"] > 0 for r in run.per_replica) == 4  # nobody starved


def test_a_replica_schedule_drains_the_replicas_scaled_in():
    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _conversations(200, 40.0)
    run = simulate(plan, EngineConfig(), cost, 2000,
                   SimSettings(replicas=3, routing="predicted-ttft", hash_block=32,
                               replica_schedule=((plan[100].arrival, 1),)))
    assert all(r.status == "ok" for r in run.records)
    late = [r for r in run.records if r.index > 100]
    # After the schedule's time only replica 0 takes requests: the others'
    # steps all end by when their last early request finished.
    assert late and run.per_replica[0]["steps"] > max(row["steps"] for row in run.per_replica[1:])
