"""The step shape, the measured (fitted) cost model and ``carpool measure``."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from carpool.machine import machine_identity
from carpool.sim.costs import StepShape, load_cost_model, save_cost_model
from carpool.sim.fitted import FittedCostModel, fit


def test_step_shape_of_spans_counts_decodes_chunks_and_context():
    spans = [SimpleNamespace(start=0, num_tokens=100), SimpleNamespace(start=40, num_tokens=1),
             SimpleNamespace(start=9, num_tokens=1), SimpleNamespace(start=200, num_tokens=50)]
    shape = StepShape.of(spans)
    assert shape == StepShape(prefill_tokens=150, decode_seqs=2,
                              context_tokens=100 + 41 + 10 + 250, seqs=4,
                              attention_pairs=100 * 100 + 41 + 10 + 50 * 250)
    assert shape.tokens == 152


def _shapes():
    return [StepShape(p, d, c, max(1, d + (p > 0)), c + p * p) for p in (0, 16, 256)
            for d in (1, 8, 32) for c in (64, 4096)]


def test_fit_recovers_known_coefficients():
    truth = FittedCostModel((0.01, 2e-4, 5e-4, 1e-7, 3e-8))
    model = fit([(s, truth.step_seconds(s)) for s in _shapes()], {"model": "x"})
    assert model.coefficients == pytest.approx(truth.coefficients, rel=1e-6, abs=1e-12)
    assert model.meta["model"] == "x" and model.meta["fit"]["median_abs_error"] < 1e-9


def test_fit_recovers_the_chunk_concave_token_wake_and_new_shape_costs():
    """The terms real steps needed (issue 16): each prefill chunk's own
    attention, the first 64 and 256 tokens dearer than the rest, a step
    after an idle gap dearer than one right after another, and a step whose
    token count is new to the process dearer than a repeat."""
    from carpool.executor.shapes import StepSample

    truth = FittedCostModel((0.02, 1.5e-4, 3e-5, 2e-6, 1e-7, 2e-3, 6e-5, 2e-5, 3e-3,
                             2e-3, 1e-4))
    samples = [StepSample(s, truth.sample_seconds(StepSample(s, 0.0, idle, new)), idle, new)
               for s in _shapes() + [StepShape(p, 0, p, 1, p * p) for p in (8, 32, 100, 512)]
               for idle in (0.0, 0.02, 1.0) for new in (False, True)]
    model = fit(samples)
    assert model.coefficients == pytest.approx(truth.coefficients, rel=1e-5, abs=1e-12)
    assert model.extra_seconds(100, 0.0, False) == 0.0
    assert model.extra_seconds(100, 10.0, False) == pytest.approx(3e-3)
    assert model.extra_seconds(100, 0.0, True) == pytest.approx(2e-3 + 100 * 1e-4)
    # without idle gaps or new shapes those terms are not guessed: they stay 0
    plain = fit([(s.shape, s.seconds) for s in samples if s.idle_s == 0 and not s.new_shape])
    assert plain.coefficients[8:] == (0.0, 0.0, 0.0)


def test_shape_memory_says_new_once_and_forgets_the_least_recently_run():
    from carpool.executor.shapes import ShapeMemory

    memory = ShapeMemory(capacity=2)
    # 9 pushes 7 out (5 ran since), then 7 pushes 5 out
    assert [memory.see(t) for t in (5, 5, 7, 5, 9, 7, 5)] == [
        True, False, True, False, True, True, True]
    with pytest.raises(ValueError):
        ShapeMemory(0)


def test_shape_memory_counts_the_rows_the_executor_pads_a_step_to():
    from carpool.executor.shapes import EXACT_ROWS, ShapeMemory, padded_rows

    assert [padded_rows(t) for t in (1, EXACT_ROWS, EXACT_ROWS + 1, 48, 49, 500)] == [
        1, EXACT_ROWS, 48, 48, 64, 512]
    assert padded_rows(37, row_bucket=1) == 37
    memory = ShapeMemory()
    # 33-48 share one bucket's kernels: new once; small steps run exact
    assert [memory.see(t) for t in (33, 40, 48, 49, 5, 6, 5)] == [
        True, False, False, True, True, True, False]
    exact = ShapeMemory(row_bucket=1)
    assert [exact.see(t) for t in (33, 40, 33)] == [True, True, False]


def test_a_cost_model_file_of_the_older_form_loads_with_the_new_terms_at_0(tmp_path):
    old = {"kind": "carpool-cost-model", "version": 1, "model_kind": "measured",
           "coefficients": {"step": 0.02, "tokens": 1e-4, "seqs": 1e-5,
                            "context_tokens": 1e-6, "attention_pairs": 1e-8}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    model = load_cost_model(tmp_path / "old.json")
    assert model.coefficients == (0.02, 1e-4, 1e-5, 1e-6, 1e-8) + (0.0,) * 6
    assert model.extra_seconds(64, 5.0, True) == 0.0


def test_fit_never_prices_work_negatively():
    # seconds fall with seqs here: ordinary least squares would give c2 < 0
    samples = [(s, 0.02 + 1e-3 * s.tokens - 5e-4 * s.seqs) for s in _shapes()]
    model = fit(samples)
    assert all(c >= 0 for c in model.coefficients) and model.coefficients[2] == 0.0
    with pytest.raises(ValueError, match="at least"):
        fit(samples[:2])


def test_cost_model_round_trips_and_bad_files_are_named(tmp_path):
    model = FittedCostModel((0.01, 2e-4, 5e-4, 1e-7, 3e-8), {"dtype": "bfloat16"})
    path = save_cost_model(model, tmp_path / "cm.json")
    loaded = load_cost_model(path)
    assert loaded.kind == "measured" and loaded.meta["dtype"] == "bfloat16"
    for shape in _shapes():
        assert loaded.step_seconds(shape) == pytest.approx(model.step_seconds(shape))
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(ValueError, match="bad.json"):
        load_cost_model(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="missing.json"):
        load_cost_model(tmp_path / "missing.json")


def test_cost_models_import_no_torch():
    code = ("import sys, carpool.sim.costs, carpool.sim.fitted; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_profile_measures_the_tiny_model_and_writes_a_fit(tiny_model_dir, tmp_path):
    out = tmp_path / "cm.json"
    result = subprocess.run([sys.executable, "-m", "carpool.cli", "measure", "--grid",
                             "smoke", "--repeats", "1", "--model", str(tiny_model_dir),
                             "--attention-backend", "torch", "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    model = load_cost_model(out)
    assert model.kind == "measured" and all(c >= 0 for c in model.coefficients)
    assert model.meta["machine"] == machine_identity()
    labels = [p["label"] for p in model.meta["points"]]
    assert "prefill 32" in labels and "mixed b=4 ctx=32 + chunk 24" in labels
    mixed = model.meta["points"][labels.index("mixed b=4 ctx=32 + chunk 24")]["shape"]
    assert mixed["prefill_tokens"] == 24 and mixed["decode_seqs"] == 4
    assert model.meta["fit"]["steps"] > len(labels) and model.meta["hardware"]["cpus"] >= 1
    assert model.step_seconds(StepShape(0, 4, 200, 4)) > 0
    assert "fit over" in result.stdout


def test_a_mixed_point_measures_the_step_it_is_named_after(tiny_model_dir):
    """The late prompt joins once every prompt is in, even when they take
    several chunks, so the point's row is its prompt beside all decodes
    (it once joined after two steps, next to a chunk of the others)."""
    import random

    from carpool.config import EngineConfig
    from carpool.engine.llm_engine import LLMEngine
    from carpool.measure.costs import Scenario, ShapeRecorder, _point_row, run_scenario

    engine = LLMEngine.from_config(EngineConfig.from_dict({
        "model": str(tiny_model_dir), "attention_backend": "torch", "kv_cache_memory": "16MiB",
        "max_num_batched_tokens": 40}))
    recorder = ShapeRecorder(engine.executor)
    engine.executor = recorder
    scenario = Scenario("mixed b=4 ctx=32 + chunk 24", 4, 32, 8, late_prompt=24)
    samples = run_scenario(engine, recorder, scenario, random.Random(0), list(range(3, 200)))
    assert sum(sample.shape.prefill_tokens for sample in samples) == 4 * 32 + 24
    truth = FittedCostModel((0.01, 2e-4, 5e-4, 1e-7, 3e-8))
    row = _point_row(scenario, samples, truth)
    assert row["steps"] == 1
    assert (row["shape"]["prefill_tokens"], row["shape"]["decode_seqs"]) == (24, 4)
    # a point with no step of its shape gets no row, never another step's
    assert _point_row(Scenario("mixed", 4, 32, 8, late_prompt=7), samples, truth) is None


def test_a_measured_model_prices_the_rows_its_process_padded_steps_to(tmp_path):
    from carpool.executor.shapes import StepSample, StepShape
    from carpool.sim.costs import load_cost_model, save_cost_model
    from carpool.sim.fitted import FittedCostModel, fit

    def prefill(tokens: int) -> StepShape:
        return StepShape(tokens, 0, tokens, 1, tokens * tokens)

    coefficients = (0.010, 1e-4)  # 10 ms a step, 100 us a row
    exact = FittedCostModel(coefficients)  # a file from before row buckets: exact rows
    padded = FittedCostModel(coefficients, {"row_bucket": 16})
    assert exact.step_seconds(prefill(33)) == pytest.approx(0.010 + 33e-4)
    assert padded.step_seconds(prefill(33)) == pytest.approx(0.010 + 48e-4)
    assert padded.step_seconds(prefill(8)) == pytest.approx(0.010 + 8e-4)  # exact below 33
    save_cost_model(padded, tmp_path / "m.json")
    assert load_cost_model(tmp_path / "m.json").row_bucket == 16
    # a fit over steps priced by their padded rows finds the per-row cost
    samples = [StepSample(prefill(t), 0.010 + 1e-4 * (-(-t // 16) * 16)) for t in range(33, 400, 7)]
    refit = fit(samples, {"row_bucket": 16})
    assert refit.coefficients[1] + refit.coefficients[6] + refit.coefficients[7] == pytest.approx(
        1e-4, rel=1e-3)
    assert refit.meta["fit"]["p90_abs_error"] < 1e-6
