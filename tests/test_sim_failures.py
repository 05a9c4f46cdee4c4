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


def test_a_failed_replica_fails_what_streamed_and_retries_the_rest():
    plan = _plan()
    run = simulate(plan, EngineConfig(), COST, 20000, SimSettings(
        replicas=3, routing="least-outstanding",
        failures=FailureSettings(((5.0, 1),), restart_s=10.0)))
    failed = [r for r in run.records if r.status == "failed"]
    assert failed and all(r.reason == "replica_failed" and r.finished == 5.0 for r in failed)
    assert all(r.status in ("ok", "failed") for r in run.records)  # nothing lost
    assert len(failed) + sum(r.status == "ok" for r in run.records) == len(plan)
    event = run.failures[0]
    assert event["event"] == "failed" and event["failed_requests"] == len(failed)
    assert event["retried"] > 0
    # The retried ones kept their arrival as the client's send time and finished elsewhere.
    assert all(r.sent == r.scheduled for r in run.records)
    rows = {row["replica"]: row for row in run.per_replica}
    assert set(rows) == {0, 1, 2, 3}  # 3 replaced 1
    assert [e["event"] for e in run.failures] == ["failed", "replacing 1", "ready"]
    assert run.failures[-1]["t"] == 15.0 and rows[3]["steps"] > 0


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
