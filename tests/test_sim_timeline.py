"""A simulated fleet over time, its cost and its report (carpool.sim.timeline,
carpool.report.fleet)."""
from __future__ import annotations

import json

import pytest

from carpool.cli import main
from carpool.config import EngineConfig
from carpool.report.fleet import pool_series
from carpool.sim.analytic import analytic_from_names
from carpool.sim.failures import FailureSettings
from carpool.sim.simulate import SimSettings, simulate
from tests.test_sim_failures import _plan

COST = analytic_from_names("h100-sxm", "llama-3-8b")


def test_per_replica_series_follow_a_failure_and_its_replacement():
    run = simulate(_plan(300), EngineConfig(), COST, 20000, SimSettings(
        replicas=3, routing="least-outstanding",
        failures=FailureSettings(((5.0, 1),), restart_s=10.0)))
    timeline = run.timeline
    interval, samples = timeline["interval_s"], timeline["samples"]
    series = timeline["replicas"]
    assert set(series) == {"0", "1", "2", "3"}
    for one in series.values():
        lengths = {len(one[name]) for name in ("ready", "waiting", "running", "kv_usage", "busy",
                                               "hit_rate")}
        assert len(lengths) == 1 and one["first_sample"] + lengths.pop() <= samples
        assert all(0 <= b <= 1 for b in one["busy"]) and all(0 <= k <= 1 for k in one["kv_usage"])
    assert len(series["1"]["ready"]) == int(5.0 / interval) + 1  # stops when it failed
    fresh = series["3"]
    assert fresh["first_sample"] == pytest.approx(5.0 / interval, abs=1)
    ready_from = fresh["first_sample"] + fresh["ready"].index(1)
    assert ready_from * interval == pytest.approx(15.0, abs=interval)
    _, pools = pool_series(timeline)
    assert max(pools["mixed"]["replicas"]) == 3 and min(pools["mixed"]["replicas"][1:]) >= 2
    # Paid: 0 and 2 all run, 1 until it failed, 3 from its creation.
    assert run.replica_seconds() == pytest.approx(2 * run.duration + 5.0 + run.duration - 5.0)


def test_round_robin_shares_merge_into_one_timeline_and_cost():
    run = simulate(_plan(200), EngineConfig(), COST, 20000,
                   SimSettings(replicas=3, workers=2))
    assert set(run.timeline["replicas"]) == {"0", "1", "2"}
    assert run.replica_seconds() == pytest.approx(3 * run.duration)


def test_simulate_writes_the_fleet_cost_and_pool_plots(tmp_path):
    out, report = tmp_path / "run.json", tmp_path / "report"
    code = main(["simulate", "--workload", "mooncake-conv", "--arrival", "trace",
                 "--num-requests", "120", "--max-input-len", "200000",
                 "--hardware", "h100-sxm", "--model-shape", "llama-3-8b", "--replicas", "3",
                 "--routing", "predicted-ttft", "--fail", "10:2", "--price-per-hour", "4",
                 "--json", str(out), "--html", str(report)])
    assert code == 0
    simulation = json.loads(out.read_text())["simulation"]
    cost = simulation["cost"]
    assert cost["price_per_hour"] == 4 and not cost["price_assumed"]
    assert cost["dollars"] == pytest.approx(4 * cost["replica_hours"])
    assert [e["event"] for e in simulation["failures"]][:2] == ["failed", "replacing 2"]
    page = (report / "report.html").read_text()
    assert "<h2>Fleet</h2>" in page and "fleet.png" in page and (report / "fleet.png").exists()
