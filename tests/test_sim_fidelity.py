"""The fidelity procedure on a small scale: this machine's (quick) profile,
one short trace window on the real default model and in the simulator."""
from __future__ import annotations

import argparse

import pytest

from carpool.config import EngineConfig
from carpool.measure.fidelity import (
    FidelityRow,
    add_fidelity_args,
    compare,
    fidelity,
    format_rows,
)


@pytest.fixture(scope="module")
def real_engine(real_model_path):
    from carpool.engine.llm_engine import LLMEngine

    config = EngineConfig()
    config.update({"model": {"model": str(real_model_path), "dtype": "bfloat16"},
                   "cache": {"num_blocks": 256}})
    return LLMEngine.from_config(config.validate()), config


def test_fidelity_on_a_short_window_of_the_azure_trace(real_engine, tmp_path):
    from carpool.measure.costs import measure

    engine, config = real_engine
    # Two rounds of the grid: with row buckets few of its steps have a new
    # row count, and one round left the new-shape term to the noise of those
    # few (once 20 ms too much: the simulated TTFT p50 +51%).
    profile = measure(engine, config, argparse.Namespace(grid="smoke", repeats=2,
                                                         measure_seed=0))
    assert not engine.has_unfinished and engine.executor.__class__.__name__ == "TorchExecutor"
    parser = argparse.ArgumentParser()
    add_fidelity_args(parser)
    args = parser.parse_args([
        "--cost-model", "unused.json", "--workload", "azure-conv", "--arrival", "trace",
        "--token-scale", "0.03", "--max-output-len", "12", "--time-scale", "3",
        "--num-requests", "10"])
    result = fidelity(engine, config, profile, args)
    assert "step" not in vars(engine)  # the timing wrapper is gone
    real, simulated = result.real["summary"], result.simulated["summary"]
    assert real["completed"] == simulated["completed"] == 10
    assert real["output_tokens"] == simulated["output_tokens"]
    # both sides count each prompt's cached tokens (Azure prompts share none)
    assert real["cache_reported"] == simulated["cache_reported"] == 10
    assert real["prefix_hit_rate"] == simulated["prefix_hit_rate"] == 0.0
    assert {row.name for row in result.rows} >= {"TTFT p50", "TPOT p99", "output tok/s"}
    assert result.simulated["simulation"]["cost_model_kind"] == "measured"
    for doc in (result.real, result.simulated):  # compare's legend reads the scales
        assert doc["config"]["workload"]["token_scale"] == 0.03
    # A smoke grid and ten requests on a shared machine: a loose bound that
    # still fails if the simulator's timing were off by a step or more,
    # widened by how far the two real runs differ from each other (the
    # simulator cannot be held closer than the real engine repeats itself).
    by_name = {row.name: row for row in result.rows}
    for name in ("TTFT p50", "TPOT p50", "E2E p50"):
        assert abs(by_name[name].error) < 0.5 + by_name[name].spread, (name, by_name[name])
    print(format_rows(result.rows, result.busy))
    assert "cost model on the" in result.notes
    # two real runs by default, each on a fresh scheduler: the same work, a spread beside it
    assert len(result.more_real) == 1
    assert result.more_real[0]["summary"]["output_tokens"] == real["output_tokens"]
    assert all(row.spread is not None and row.spread >= 0 for row in result.rows)
    assert "machine during the real runs" in result.notes
    assert "busy" in result.real["machine_load"]


def test_real_runs_give_the_mean_and_spread_and_a_busy_machine_is_not_judged():
    def summary(scale: float) -> dict:
        doc = {m: {"p50": 1.0 * scale, "p99": 2.0 * scale} for m in ("ttft", "tpot", "e2e")}
        doc["output_throughput"] = 100.0
        return doc

    rows = {row.name: row for row in compare(summary(0.9), summary(1.05), [summary(1.1)])}
    assert rows["TTFT p50"].real == pytest.approx(1.0)
    assert rows["TTFT p50"].spread == pytest.approx(0.2) and rows["TTFT p50"].within_goal
    assert rows["output tok/s"].spread == 0.0
    assert compare(summary(1.0), summary(1.0))[0].spread is None  # one run: no spread
    over = list(compare(summary(1.0), summary(1.5)))
    assert "<- over" in format_rows(over)
    text = format_rows(over, busy="real run 1: other processes kept 1.10 cores busy")
    assert "<- over" not in text and "not judged against the goals" in text


def test_compare_rows_and_goals():
    real = {m: {"p50": 1.0, "p99": 2.0} for m in ("ttft", "tpot", "e2e")}
    simulated = {m: {"p50": 1.05, "p99": 2.5} for m in ("ttft", "tpot", "e2e")}
    real["output_throughput"], simulated["output_throughput"] = 100.0, 95.0
    rows = {row.name: row for row in compare(real, simulated)}
    assert rows["TTFT p50"].error == pytest.approx(0.05) and rows["TTFT p50"].within_goal
    assert rows["TTFT p99"].error == pytest.approx(0.25) and not rows["TTFT p99"].within_goal
    assert rows["output tok/s"].within_goal
    assert FidelityRow("x", None, 1.0, 0.1).error is None
