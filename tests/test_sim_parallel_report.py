"""``carpool evaluate batching``: the design's rows are simulated, not written in."""
from __future__ import annotations

import json

import pytest

from carpool.sim.analytic import HARDWARE, MODELS
from carpool.sim.parallel import INTERCONNECTS, ParallelShape
from carpool.sim.parallel_cost import ParallelCostModel


def _run(tmp_path, *extra):
    from carpool.cli import main

    out = tmp_path / "rows.json"
    code = main(["evaluate", "batching", "--workload", "azure-conv", "--arrival", "trace",
                 "--num-requests", "150", "--hardware", "h800", "--model-shape",
                 "qwen3-30b-a3b", "--sim-expert-parallel-size", "16", "--search-steps", "3",
                 "--max-num-seqs", "256", "--max-num-batched-tokens", "4096",
                 "--peak-nodes", "40", "--json", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


def test_evaluate_batching_simulates_every_row_and_prices_its_day(tmp_path, capsys):
    result = _run(tmp_path)
    rows = {r["regime"]: r for r in result["rows"]}
    assert list(rows) == ["static", "continuous", "overlap"]
    table = capsys.readouterr().out
    for name in ("static batching", "dynamic batching (per step)", "dynamic batching + overlap"):
        assert name in table
    for row in rows.values():
        assert row["gpus"] == 16 and row["steps"] > 0
        assert 0 < row["utilisation"] <= row["busy"] <= 1 + 1e-9
        assert row["output_tok_s_per_gpu"] == pytest.approx(row["output_tok_s"] / 16)
        assert row["e2e_mean"] > row["ttft_mean"] > 0
        if row["sized_by"] == "slo":
            assert row["slo_attainment"] >= 0.95 and row["sizing_qps"] == row["peak_qps"]
        else:
            assert row["peak_qps"] == 0 and row["sizing_qps"] == row["capacity"]
        assert row["dollars_per_day"] == pytest.approx(row["node_hours"] * 8 * 2.0)
        assert row["nodes_min"] < row["nodes_max"]
    continuous, overlap = rows["continuous"], rows["overlap"]
    assert continuous["peak_qps"] > 0 and overlap["peak_qps"] > 0
    assert continuous["exposed_of_comm"] == pytest.approx(1.0)  # nothing overlaps
    assert continuous["split_steps"] == 0 < overlap["split_steps"]
    assert overlap["exposed_of_comm"] < 1.0
    best = max(r["sizing_qps"] for r in rows.values())
    assert result["peak_rate"] == pytest.approx(40 / 2 * best)  # 16 GPUs: 2 nodes a replica


def test_evaluate_batching_needs_a_sliced_replica(capsys):
    from carpool.cli import main

    code = main(["evaluate", "batching", "--workload", "azure-conv", "--arrival", "trace",
                 "--num-requests", "20", "--hardware", "h100-sxm", "--model-shape",
                 "llama-3-8b"])
    assert code != 0 and "sliced over GPUs" in capsys.readouterr().err


def test_step_meter_counts_every_executed_step():
    from carpool.config import EngineConfig
    from carpool.sim.evaluate_batching import MeteredCost
    from carpool.sim.simulate import SimSettings, simulate
    from carpool.workload.traces import TraceRequest

    cost = ParallelCostModel(HARDWARE["h800"], MODELS["qwen3-30b-a3b"], 2, 1.0,
                             ParallelShape(1, 8, "auto"), INTERCONNECTS["h800"])
    plan = [TraceRequest(arrival=0.01 * i, input_len=64, output_len=16 + i)
            for i in range(20)]
    meters = []
    for fast_forward in (False, True):
        metered = MeteredCost(cost)
        run = simulate(plan, EngineConfig(), metered, 4096,
                       SimSettings(fast_forward=fast_forward, workers=1))
        meter = metered.meter
        assert meter.steps == run.steps > 0
        assert meter.seconds == pytest.approx(sum(r["busy_s"] for r in run.per_replica))
        assert 0 < meter.useful_s < meter.seconds
        assert 0 <= meter.exposed_s <= meter.comm_s
        meters.append(meter)
    assert meters[1].seconds == pytest.approx(meters[0].seconds)  # the same steps
    assert meters[1].useful_s == pytest.approx(meters[0].useful_s)
