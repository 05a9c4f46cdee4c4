"""Replica failures in the simulated fleet (carpool.sim.failures)."""
from __future__ import annotations

import random

import pytest

from carpool.cluster.autoscaler import AutoscaleConfig
from carpool.config import EngineConfig
from carpool.sim.analytic import analytic_from_names
from carpool.sim.failures import FailureSettings, parse_failures
from carpool.sim.simulate import SimSettings, simulate
from carpool.workload.traces import TraceRequest

COST = analytic_from_names("h100-sxm", "llama-3-8b")


def _plan(count: int = 600, rate: float = 20.0, seed: int = 9) -> list[TraceRequest]:
    rng = random.Random(seed)
    plan, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        plan.append(TraceRequest(t, rng.randrange(100, 3000), rng.randrange(50, 400)))
    return plan


def test_a_failed_replica_s_requests_go_on_elsewhere_streams_resumed():
    """As the live fleet's front does: what had streamed is resumed on
    another replica after its tokens, the rest routed again; nothing fails."""
    plan = _plan()
    run = simulate(plan, EngineConfig(), COST, 20000, SimSettings(
        replicas=3, routing="least-outstanding",
        failures=FailureSettings(((5.0, 1),), restart_s=10.0)))
    assert all(r.status == "ok" for r in run.records)  # nothing lost
    event = run.failures[0]
    assert event["event"] == "failed" and event["failed_requests"] == 0
    assert event["resumed"] > 0 and event["retried"] > 0
    # A resumed one kept its first token (before the failure) and all its tokens.
    across = [r for r in run.records if r.chunk_times[0] < 5.0 < r.finished]
    assert len(across) >= event["resumed"]
    assert all(r.output_tokens == r.max_tokens for r in run.records)
    # The retried ones kept their arrival as the client's send time and finished elsewhere.
    assert all(r.sent == r.scheduled for r in run.records)
    rows = {row["replica"]: row for row in run.per_replica}
    assert set(rows) == {0, 1, 2, 3}  # 3 replaced 1
    assert [e["event"] for e in run.failures] == ["failed", "replacing 1", "ready"]
    assert run.failures[-1]["t"] == 15.0 and rows[3]["steps"] > 0


def test_a_request_whose_third_replica_dies_fails():
    """Every replica dies in turn within a second: a request that was on all
    three (sent on twice) fails the third time, none sooner; with no replica
    left until the replacements are ready, the front answers 429."""
    plan = _plan(300, 20.0)
    run = simulate(plan, EngineConfig(), COST, 20000, SimSettings(
        replicas=3, routing="least-outstanding",
        failures=FailureSettings(((5.0, 0), (5.3, 1), (5.6, 2)), restart_s=10.0)))
    failed = [r for r in run.records if r.status == "failed"]
    assert failed and all(r.reason == "replica_failed" and r.finished == 5.6 for r in failed)
    assert [e["failed_requests"] for e in run.failures if e["event"] == "failed"] == \
        [0, 0, len(failed)]
    rejected = [r for r in run.records if r.status == "rejected"]
    assert all(r.reason == "no_replica" and 5.6 <= r.finished < 15.6 for r in rejected)
    assert len(failed) + len(rejected) + sum(r.status == "ok" for r in run.records) == len(plan)


def test_under_an_autoscaler_a_failure_is_not_restarted_but_stops_costing():
    plan = _plan(400, 10.0)
    settings = dict(replicas=2, autoscale="reactive",
                    autoscale_config=AutoscaleConfig(min_replicas=2, max_replicas=4,
                                                     startup_s=5.0, tick_s=1.0))
    healthy = simulate(plan, EngineConfig(), COST, 20000, SimSettings(**settings))
    broken = simulate(plan, EngineConfig(), COST, 20000, SimSettings(
        **settings, failures=FailureSettings(((3.0, 0),))))
    assert [e["event"] for e in broken.failures] == ["failed"]
    assert all(r.status in ("ok", "failed") for r in broken.records)
    # The autoscaler's floor brings a new replica: the pool gets back to 2.
    timeline = broken.scaling["timeline"]
    assert any(row["t"] > 3.0 and row["ready"] == 2 for row in timeline)
    assert broken.scaling["replica_seconds"] != healthy.scaling["replica_seconds"]


def test_failure_settings_are_parsed_and_validated():
    assert parse_failures("30:2, 10:0") == ((10.0, 0), (30.0, 2))
    with pytest.raises(ValueError, match="SECONDS:REPLICA"):
        parse_failures("soon:1")
    with pytest.raises(ValueError, match="replica in 0..1"):
        SimSettings(replicas=2, failures=FailureSettings(((1.0, 2),))).validate()
