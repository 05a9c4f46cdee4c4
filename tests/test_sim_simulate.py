"""``carpool simulate``: the virtual-clock replay through carpool's own scheduler."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sim_helpers import ConstantCost

from carpool.config import EngineConfig
from carpool.sim.analytic import analytic_from_names
from carpool.sim.simulate import SimSettings, simulate
from carpool.workload.traces import TraceRequest


def _outcome(run):
    return [(r.index, r.status, r.reason, r.sent, r.finished, r.chunk_times, r.output_tokens)
            for r in run.records]


def _without_speed(rows: list[dict]) -> list[dict]:
    # busy_s: a run's step times are summed before being added, so its last bits differ
    return [{k: v for k, v in row.items() if k not in ("fast_forwarded_steps", "busy_s")}
            for row in rows]


@pytest.mark.parametrize("fast_forward", [True, False])
@pytest.mark.parametrize("token_times", [True, False])
def test_single_replica_matches_hand_computed_times(fast_forward, token_times):
    # 10 ms per step. A (32 prompt tokens, 3 outputs) arrives at 0: prefill
    # 0-10 ms, decodes end at 20 and 30 ms. B (16, 2) arrives at 15 ms, in
    # A's second step, joins at the 20 ms boundary: its prefill runs with
    # A's last decode (20-30 ms), its decode 30-40 ms.
    plan = [TraceRequest(0.0, 32, 3), TraceRequest(0.015, 16, 2)]
    run = simulate(plan, EngineConfig(), ConstantCost(0.01), 64,
                   SimSettings(fast_forward=fast_forward, token_times=token_times))
    a, b = run.records
    if token_times:
        assert a.chunk_times == pytest.approx([0.01, 0.02, 0.03])
        assert b.chunk_times == pytest.approx([0.03, 0.04])
    assert a.ttft == pytest.approx(0.01) and a.e2e == pytest.approx(0.03)
    assert a.tpot == pytest.approx(0.01)
    assert b.ttft == pytest.approx(0.015) and b.e2e == pytest.approx(0.025)
    assert run.steps == 4 and run.duration == pytest.approx(0.04)
    assert (a.output_tokens, b.output_tokens) == (3, 2)


def test_round_robin_spreads_requests_over_replicas():
    plan = [TraceRequest(0.0, 32, 3), TraceRequest(0.015, 16, 2)]
    run = simulate(plan, EngineConfig(), ConstantCost(0.01), 64,
                   SimSettings(replicas=2, token_times=True))
    assert run.records[1].chunk_times == pytest.approx([0.025, 0.035])  # no waiting for A
    assert [row["steps"] for row in run.per_replica] == [3, 2]


def test_rejections_and_requests_that_can_never_fit():
    config = EngineConfig()
    config.scheduler.max_queue_requests = 1
    # 4 blocks of 16 tokens: a 100-token prompt can never fit; a burst of
    # small ones overflows the one-slot queue once the pool is busy.
    plan = [TraceRequest(0.0, 100, 4)] + [TraceRequest(0.001 * i, 20, 20) for i in range(1, 6)]
    run = simulate(plan, config, ConstantCost(0.01), 4, SimSettings())
    statuses = [r.status for r in run.records]
    assert statuses[0] == "failed" and run.records[0].reason == "http_400"
    assert "KV cache" in run.records[0].error
    assert "rejected" in statuses and statuses.count("ok") >= 1
    assert all(r.finished is not None for r in run.records)


def _mixed_plan(count: int = 120) -> list[TraceRequest]:
    import random

    rng = random.Random(7)
    plan, t = [], 0.0
    for i in range(count):
        t += rng.expovariate(40.0)
        shared = tuple(range(rng.randrange(3))) if i % 3 else ()  # some share a prefix
        plan.append(TraceRequest(t, rng.randrange(8, 200), rng.randrange(1, 60), shared))
    return plan


@pytest.mark.parametrize("routing,blocks,policy,token_times,tier", [
    ("least-outstanding", 60, "fcfs", True, False),  # a small pool: preemptions
    ("least-outstanding", 2000, "priority", False, False),
    ("round-robin", 90, "fcfs", False, False),
    ("round-robin", 90, "fcfs", True, True),  # loads from a shared tier end runs
])
def test_fast_forward_equals_step_by_step(routing, blocks, policy, token_times, tier):
    from carpool.sim.fleet import KVTierSettings

    config = EngineConfig()
    config.scheduler.policy = policy
    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _mixed_plan()
    # Slow loads (5 ms + 2 MiB at 1 GB/s per block), so that they span decode runs.
    kv_tier = KVTierSettings(1 << 34, bandwidth=1e9, latency=0.005) if tier else None

    def run(fast_forward: bool):
        return simulate(plan, config, cost, blocks, SimSettings(
            replicas=3, routing=routing, fast_forward=fast_forward, token_times=token_times,
            hash_block=32, kv_tier=kv_tier))

    jumped, stepped = run(True), run(False)
    assert jumped.fast_forwarded_steps > 0 and stepped.fast_forwarded_steps == 0
    assert _outcome(jumped) == _outcome(stepped)
    assert jumped.steps == stepped.steps
    assert _without_speed(jumped.per_replica) == _without_speed(stepped.per_replica)
    assert [r["busy_s"] for r in jumped.per_replica] == pytest.approx(
        [r["busy_s"] for r in stepped.per_replica], rel=1e-9)
    assert jumped.server_samples == stepped.server_samples
    if blocks == 60:
        assert sum(row["preemptions"] for row in jumped.per_replica) > 0
    if tier:
        assert sum(row["external_hits"] for row in jumped.per_replica) > 0
        assert jumped.kv_tier == stepped.kv_tier
    assert sum(row["prefix_hits"] for row in jumped.per_replica) > 0


def test_workers_do_not_change_the_result():
    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _mixed_plan(80)
    runs = [simulate(plan, EngineConfig(), cost, 500, SimSettings(replicas=3, workers=w))
            for w in (1, 2)]
    assert _outcome(runs[0]) == _outcome(runs[1])
    assert runs[0].server_samples == runs[1].server_samples


def test_simulator_runs_the_engines_scheduler_classes():
    from carpool.engine import llm_engine
    from carpool.scheduler import Scheduler
    from carpool.sim import replica

    assert replica.Scheduler is Scheduler is llm_engine.Scheduler
    run_replica = replica.SimReplica(0, EngineConfig(), 64, ConstantCost(0.01),
                                     replica.VirtualClock())
    assert type(run_replica.scheduler) is Scheduler


def test_simulate_imports_no_torch(tmp_path):
    code = (
        "import sys\n"
        "from carpool.cli import main\n"
        f"main(['simulate', '--hardware', 'l4', '--model-shape', 'llama-3-8b', "
        f"'--num-requests', '20', '--rate', '5', '--json', r'{tmp_path / 'r.json'}'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def _cli_json(tmp_path, name: str, *extra: str) -> dict:
    from carpool.cli import main

    out = tmp_path / name
    assert main(["simulate", "--hardware", "a100-80gb", "--model-shape", "qwen2-7b",
                 "--workload", "azure-conv", "--arrival", "trace", "--num-requests", "150",
                 "--replicas", "2", "--slo", "ttft=200ms", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_same_seed_same_report_and_compare_reads_it(tmp_path, capsys):
    first = _cli_json(tmp_path, "a.json", "--routing", "least-outstanding")
    second = _cli_json(tmp_path, "b.json", "--routing", "least-outstanding")
    for doc in (first, second):
        doc.pop("started_at")
        doc["config"].pop("json")
        doc["simulation"].pop("speed")
    assert first == second
    assert first["kind"] == "bench-serve" and first["simulation"]["cost_model_kind"] == "analytic"
    assert "(analytic)" in first["label"]
    assert first["summary"]["completed"] == 150
    # Azure prompts share no prefix; every record still says what it hit
    assert first["summary"]["prefix_hit_rate"] == 0.0
    assert all(r["cached_tokens"] == 0 for r in first["requests"])

    from carpool.cli import main

    capsys.readouterr()
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "TTFT" in out and "prefix hit %" in out


def test_default_cost_model_and_bad_ones(tmp_path, capsys):
    from carpool.cli import main

    assert main(["simulate", "--num-requests", "5", "--input-len", "32",
                 "--output-len", "8"]) == 0
    assert "(measured)" in capsys.readouterr().out  # the shipped dev-machine profile
    assert main(["simulate", "--num-requests", "5", "--hardware", "h100-sxm"]) != 0
    assert "--model-shape" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    assert main(["simulate", "--num-requests", "5", "--cost-model", str(broken)]) != 0
    assert "not a carpool cost model" in capsys.readouterr().err
