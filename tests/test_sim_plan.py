"""``carpool plan``: the first estimate, the simulated search, the cost line
and the day-long mode (analytic and constant cost models, small windows)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from sim_helpers import ConstantCost

from carpool.config import EngineConfig
from carpool.sim.plan import (
    Batching,
    PeakProblem,
    Probe,
    cost_line,
    estimate_replicas,
    fewest_replicas,
    first_estimate,
    replica_capacity,
)
from carpool.sim.plan_day import hourly_replicas, parse_curve, spread_over_curve
from carpool.sim.simulate import SimSettings
from carpool.workload.traces import TraceRequest

# An L4 serving llama-3-8b, short requests, at most 16 running per replica:
# at 60 req/s the search settles on 4 replicas in about a second.
BASE = ["plan", "--hardware", "l4", "--model-shape", "llama-3-8b", "--input-len", "64",
        "--output-len", "16", "--max-num-seqs", "16", "--peak-rate", "60", "--window", "10",
        "--slo", "ttft=200ms,tpot=90ms", "--workers", "1"]
CURVE = ",".join(["0.25"] * 8 + ["0.5"] * 8 + ["1"] * 8)


def _plan(tmp_path, *extra: str, name: str = "plan.json") -> dict:
    from carpool.cli import main

    out = tmp_path / name
    assert main([*BASE, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def _error(capsys, *argv: str) -> str:
    """The message of a failing ``carpool`` call (a ValueError or an argparse error)."""
    from carpool.cli import main

    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    return capsys.readouterr().err


def test_estimate_formula_on_hand_computed_inputs():
    # 10 req/s x 2 s = 20 in flight; 4 per replica at 80% -> 20 / 3.2 = 6.25 -> 7
    assert estimate_replicas(10, 2.0, 4, 0.8) == 7
    assert estimate_replicas(6, 2.0, 4, 1.0) == 3  # exactly 3: no rounding up past it
    assert estimate_replicas(0.01, 0.1, 128, 0.8) == 1  # never below one
    assert replica_capacity(128, 42256, 256) == 128  # max_num_seqs binds
    assert replica_capacity(128, 1000, 256) == 3  # the KV pool binds: 1000 // 256
    assert replica_capacity(4, 10, 256) == 1
    with pytest.raises(ValueError, match="utilization"):
        estimate_replicas(10, 2.0, 4, 0.0)


def test_first_estimate_measures_processing_time_one_request_at_a_time():
    # 10 ms a step: a 32-token prompt prefills in one step, then 2 decodes:
    # 30 ms alone. 64 blocks x 16 = 1024 KV tokens // 35 per request = 29.
    workload = [TraceRequest(i * 0.001, 32, 3) for i in range(50)]  # overlapping at peak
    problem = PeakProblem(workload, 1000.0, 0.05, ConstantCost(0.01), 64, SimSettings(),
                          {"ttft": 0.02}, 0.95)
    estimate = first_estimate(problem, EngineConfig(), 0.8)
    assert estimate["mean_processing_s"] == pytest.approx(0.03)
    assert estimate["processing_sample"] == 50
    assert estimate["capacity"] == 29 and estimate["kv_tokens"] == 1024
    assert estimate["replicas"] == math.ceil(1000 * 0.03 / (29 * 0.8))  # 2
    assert estimate["low_load_attainment"] == 1.0


def test_fewest_replicas_doubles_then_bisects():
    def probe(n: int) -> Probe:
        probed.append(n)
        return Probe(n, 1.0 if n >= 13 else 0.5, 0.0, None, None, 0, n >= 13)

    probed: list[int] = []
    answer, probes = fewest_replicas(probe, 3, 1024)
    assert answer == 13 and probed == [3, 6, 12, 24, 18, 15, 13]
    assert sorted(probes) == sorted(probed)
    probed.clear()
    assert fewest_replicas(probe, 40, 1024)[0] == 13  # an estimate above the answer
    assert probed[0] == 40 and len(set(probed)) == len(probed)
    with pytest.raises(ValueError, match="--max-replicas 10"):
        fewest_replicas(probe, 3, 10)


def test_answer_meets_the_slo_and_one_replica_less_does_not(tmp_path, capsys):
    doc = _plan(tmp_path)
    out = capsys.readouterr().out
    answer = doc["answer"]
    assert answer["replicas"] >= 2 and answer["confirmed"]
    assert answer["confirm"]["replicas"] == answer["replicas"]
    assert answer["confirm"]["attainment"] >= 0.95 and answer["confirm"]["meets"]
    assert answer["below"]["replicas"] == answer["replicas"] - 1
    assert answer["below"]["attainment"] < 0.95 and not answer["below"]["meets"]
    probes = {p["replicas"]: p for p in doc["candidates"][0]["probes"]}
    assert probes[answer["replicas"]]["meets"] and not probes[answer["replicas"] - 1]["meets"]
    assert doc["cost_model_kind"] == "analytic" and doc["cost_model"]["model_kind"] == "analytic"
    estimate = doc["candidates"][0]["estimate"]
    assert estimate["replicas"] == math.ceil(
        60 * estimate["mean_processing_s"] / (estimate["capacity"] * 0.8))
    assert "ceil(peak QPS x mean processing time" in out and "assumed placeholder" in out
    assert doc["inputs"]["price_is_assumption"] is True
    assert f"answer: {answer['replicas']} replicas" in out


def test_same_inputs_same_plan(tmp_path):
    first, second = (_plan(tmp_path, "--batching-candidates", "8x512,16x1024", name=name)
                     for name in ("a.json", "b.json"))
    for doc in (first, second):
        doc.pop("wall_s")
    assert first == second
    rows = first["candidates"]
    assert [row["batching"] for row in rows] == ["8x512", "16x1024"]
    best = min(rows, key=lambda row: (row["replicas"], -row["attainment"]))
    assert first["answer"]["batching"] == best["batching"]


def test_cost_line_arithmetic(tmp_path):
    line = cost_line(3, 2.5, 4.5e6)
    assert line["dollars_per_hour"] == 7.5
    assert line["dollars_per_million_output_tokens"] == pytest.approx(7.5 / 4.5)
    assert cost_line(2, 1.0, 0.0)["dollars_per_million_output_tokens"] is None
    doc = _plan(tmp_path, "--price-per-hour", "3.5")
    cost, answer = doc["cost"], doc["answer"]
    assert cost["dollars_per_hour"] == pytest.approx(answer["replicas"] * 3.5)
    tokens = answer["confirm"]["output_tokens"] * 3600 / doc["inputs"]["window_s"]
    assert cost["output_tokens_per_hour"] == pytest.approx(tokens)
    assert cost["dollars_per_million_output_tokens"] == pytest.approx(
        cost["dollars_per_hour"] / (tokens / 1e6))
    assert doc["inputs"]["price_is_assumption"] is False


def test_day_on_a_compressed_day(tmp_path, capsys):
    doc = _plan(tmp_path, "--day", "--daily-curve", CURVE, "--hour-seconds", "2")
    out = capsys.readouterr().out
    peak, day = doc["answer"]["replicas"], doc["day"]
    hours = day["hours"]
    assert len(hours) == 24 and day["curve_source"] == "--daily-curve"
    assert [row["replicas"] for row in hours] == hourly_replicas(parse_curve(CURVE), peak)
    assert [row["replicas"] for row in hours[16:]] == [peak] * 8
    assert all(row["replicas"] <= hours[16]["replicas"] for row in hours)
    assert [row["requests"] for row in hours] == [30] * 8 + [60] * 8 + [120] * 8
    assert all(row["attainment"] is not None and 0 <= row["attainment"] <= 1 for row in hours)
    assert day["requests"] == sum(row["requests"] for row in hours)
    assert day["replica_hours"] == sum(row["replicas"] for row in hours)
    assert day["dollars"] == pytest.approx(day["replica_hours"] * 1.0)
    assert day["static_replica_hours"] == 24 * peak and 0 <= day["attainment"] <= 1
    assert day["compression"] == 1800 and day["wall_s"] > 0
    assert "COMPRESSED: 1 h of the curve = 2 s simulated" in out
    assert "replicas per hour = max(1, ceil(multiplier x" in out


def test_spread_over_curve_fills_each_hour_at_its_rate():
    stream = [TraceRequest(i * 0.1, 8, 4) for i in range(40)]  # 10 req/s
    curve = (0.5, 0.0, 1.0) + (0.0,) * 21
    day = spread_over_curve(stream, 10.0, curve, 2.0)
    assert len(day) == 10 + 0 + 20
    first, third = day[:10], day[10:]
    assert all(0 <= r.arrival < 2 for r in first) and all(4 <= r.arrival < 6 for r in third)
    assert third[1].arrival - third[0].arrival == pytest.approx(0.1)  # 10 req/s
    assert first[1].arrival - first[0].arrival == pytest.approx(0.2)  # 5 req/s
    assert hourly_replicas(curve, 4)[:3] == [2, 1, 4]  # at least one replica all day


def test_trace_arrivals_are_scaled_to_the_peak_rate():
    import argparse

    from carpool.sim.plan_command import peak_workload
    from carpool.workload.command import add_workload_args

    parser = argparse.ArgumentParser()
    add_workload_args(parser, seed_flag="--workload-seed")
    args = parser.parse_args(["--workload", "azure-conv", "--arrival", "trace"])
    plan, shaped = peak_workload(args, 25.0, 200)
    assert len(plan) == 200 and shaped.trace_loop
    assert (len(plan) - 1) / (plan[-1].arrival - plan[0].arrival) == pytest.approx(25.0)


@pytest.mark.parametrize("flags,message", [
    (["--attainment", "0"], "--attainment must be in (0, 1]"),
    (["--attainment", "1.5"], "--attainment must be in (0, 1]"),
    (["--utilization", "1.2"], "--utilization must be in (0, 1]"),
    (["--day", "--daily-curve", ",".join(["1"] * 23)], "needs 24 comma-separated"),
    (["--day", "--daily-curve", ",".join(["0.5"] * 24)], "largest multiplier must be 1"),
    (["--daily-curve", CURVE], "add --day"),
    (["--batching-candidates", "64by512"], "SEQSxTOKENS"),
    (["--max-replicas", "2"], "--max-replicas 2"),
    (["--slo", "tpot=10ms"], "even at low load"),
    (["--surge", "2x@1+2"], "--surge and --ramp do not apply"),
])
def test_bad_flags_are_clear_errors(capsys, flags, message):
    assert message in _error(capsys, *BASE, *flags)


def test_batching_candidates_parse():
    assert Batching.parse_list("64x512, 128X1024,64x512") == [Batching(64, 512),
                                                              Batching(128, 1024)]
    with pytest.raises(ValueError, match="positive"):
        Batching.parse_list("0x512")


def test_plan_imports_no_torch(tmp_path):
    code = ("import sys\n"
            "from carpool.cli import main\n"
            f"assert main({BASE!r} + ['--window', '2', '--json', r'{tmp_path / 'p.json'}']) == 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
