"""Prefill/decode pools in the simulator (carpool.sim.pd)."""
from __future__ import annotations

import json
import random

import pytest

from carpool.config import EngineConfig
from carpool.sim.analytic import analytic_from_names
from carpool.sim.fleet import KVTierSettings
from carpool.sim.pd import PDSettings
from carpool.sim.simulate import SimSettings, simulate
from carpool.workload.traces import TraceRequest

COST = analytic_from_names("h100-sxm", "llama-3-8b")


def _plan(count: int, rate: float, prompt: tuple[int, int], seed: int = 4) -> list[TraceRequest]:
    rng = random.Random(seed)
    plan, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        plan.append(TraceRequest(t, rng.randrange(*prompt), rng.randrange(16, 200)))
    return plan


def _run(plan, pd: PDSettings | None, replicas: int = 4, num_blocks: int = 20000, config=None):
    return simulate(plan, config or EngineConfig(), COST, num_blocks,
                    SimSettings(replicas=replicas, routing="predicted-ttft", pd=pd))


def test_always_prefills_every_request_remotely_and_decodes_where_the_kv_went():
    plan = _plan(200, 8.0, (1000, 6000))
    run = _run(plan, PDSettings(1, "always"))
    assert all(r.status == "ok" for r in run.records)
    assert run.pd["disaggregated"] == 200 and run.pd["colocated"] == 0
    assert run.pd["in_flight_left"] == 0 and run.pd["handoffs_waiting"] == 0
    prefill, *decode = run.per_replica
    assert prefill["role"] == "prefill" and {r["role"] for r in decode} == {"decode"}
    assert prefill["external_hits"] == 0
    # Every decode leg loaded its whole prompt but the last token over the link.
    loaded = sum(r["external_hits"] for r in decode)
    assert loaded == sum((item.input_len - 1) // 16 * 16 for item in plan)
    for record, item in zip(run.records, plan):
        assert record.sent == item.arrival and record.output_tokens == item.output_len
        assert record.chunk_times[0] > record.sent
        # No prompt shares a prefix: the KV a decode leg loaded is no cache hit.
        assert record.cached_tokens == 0


def test_conditional_keeps_short_prompts_on_the_decode_replicas():
    run = _run(_plan(150, 8.0, (20, 400)), PDSettings(1, "conditional"))
    assert all(r.status == "ok" for r in run.records)
    assert run.pd["disaggregated"] == 0 and run.pd["in_flight_left"] == 0
    assert run.per_replica[0]["steps"] == 0  # the prefill pool never ran


def test_conditional_sends_long_prompts_remotely_when_decode_replicas_are_busy():
    plan = _plan(300, 6.0, (200, 16000))
    run = _run(plan, PDSettings(2, "conditional"))
    assert all(r.status == "ok" for r in run.records)
    assert 0 < run.pd["disaggregated"] < 300
    assert run.pd["mean_exposed_transfer_s"] < 0.05


def test_a_prefill_leg_turned_away_ends_its_request_so():
    config = EngineConfig()
    config.scheduler.max_queue_requests = 1  # the prefill replica sheds most of a burst
    plan = [TraceRequest(0.0, 3000, 20) for _ in range(6)]
    run = _run(plan, PDSettings(1, "always"), replicas=2, config=config)
    statuses = [r.status for r in run.records]
    assert "rejected" in statuses and "ok" in statuses
    for record in run.records:
        if record.status == "rejected":
            assert record.reason == "queue_full" and record.finished == 0.0
    assert run.pd["in_flight_left"] == 0


def test_pd_settings_are_validated():
    with pytest.raises(ValueError, match="prefill-replicas"):
        SimSettings(replicas=2, pd=PDSettings(2)).validate()
    with pytest.raises(ValueError, match="pd-mode"):
        SimSettings(replicas=3, pd=PDSettings(1, "sometimes")).validate()
    with pytest.raises(ValueError, match="KV tier"):
        SimSettings(replicas=3, pd=PDSettings(1), kv_tier=KVTierSettings()).validate()


def test_evaluate_pd_compares_equal_fleets_on_the_same_arrivals(tmp_path):
    from carpool.cli import main

    out = tmp_path / "pd.json"
    code = main(["evaluate", "pd", "--workload", "mooncake-conv", "--arrival", "trace",
                 "--num-requests", "200", "--max-input-len", "200000",
                 "--hardware", "h100-sxm", "--model-shape", "llama-3-8b",
                 "--splits", "1:3,2:2", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["colocated", "1P:3D always", "1P:3D conditional",
                                           "2P:2D always", "2P:2D conditional"]
    assert rows[0]["disaggregated_share"] == 0
    assert rows[1]["disaggregated_share"] == 1 and rows[3]["disaggregated_share"] == 1
    assert {r["requests"] for r in rows} == {200} and {r["replicas"] for r in rows} == {4}
