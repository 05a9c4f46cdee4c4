"""The analytic (roofline) cost model: parameter counts, which bound a step
hits, monotonicity, presets and the saved form."""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.model.config import ModelConfig
from carpool.sim.analytic import (
    HARDWARE,
    MODELS,
    AnalyticCostModel,
    HardwareSpec,
    ModelShape,
    analytic_from_names,
)
from carpool.sim.costs import StepShape, load_cost_model, save_cost_model

# A spec with round numbers so the expected times below are easy to derive.
TEST_GPU = HardwareSpec("test-gpu", peak_flops=1e15, mem_bandwidth=4e12, flops_efficiency=0.5,
                        bandwidth_efficiency=0.75, step_overhead_s=0.003)
LLAMA_8B = MODELS["llama-3-8b"]
# Llama-3-8B by hand: one layer has q and o (4096 x 4096 each), k and v
# (4096 x 1024 each, 8 KV heads of 128), the SwiGLU MLP (3 x 4096 x 14336)
# and two norms; the body adds the final norm; the table is 128256 x 4096.
LLAMA_8B_LAYER = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
LLAMA_8B_BODY = 32 * LLAMA_8B_LAYER + 4096
LLAMA_8B_TABLE = 128256 * 4096


def _decode(seqs: int, context_each: int) -> StepShape:
    return StepShape(prefill_tokens=0, decode_seqs=seqs, context_tokens=seqs * context_each, seqs=seqs)


def _prefill(tokens: int) -> StepShape:
    return StepShape(prefill_tokens=tokens, decode_seqs=0, context_tokens=tokens, seqs=1)


def test_parameter_counts_match_the_published_models():
    assert LLAMA_8B.params == LLAMA_8B_BODY + 2 * LLAMA_8B_TABLE
    assert LLAMA_8B.params == pytest.approx(8.0e9, rel=0.02)
    assert MODELS["smollm2-135m"].params == pytest.approx(1.35e8, rel=0.03)
    # The Hugging Face safetensors totals of each checkpoint.
    assert LLAMA_8B.params == 8_030_261_248
    assert MODELS["smollm2-135m"].params == 134_515_008
    assert MODELS["qwen2-7b"].params == 7_615_616_512
    assert MODELS["llama-3-70b"].params == 70_553_706_496


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer():
    assert LLAMA_8B.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2
    assert MODELS["smollm2-135m"].kv_bytes_per_token(1) == 2 * 30 * 3 * 64


def test_shape_from_a_model_config_matches_the_preset():
    config = ModelConfig.from_hf_config({
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "tie_word_embeddings": False,
    })
    shape = ModelShape.from_config(config, name="llama-3-8b")
    assert shape == LLAMA_8B


def test_single_sequence_decode_is_memory_bound_and_priced_by_hand():
    model = AnalyticCostModel(TEST_GPU, LLAMA_8B)
    shape = _decode(1, 1000)
    weights = (LLAMA_8B_BODY + LLAMA_8B_TABLE) * 2  # the input table is only gathered
    kv = 2 * 32 * 8 * 128 * 2 * 1000
    expected = 0.003 + (weights + kv) / (4e12 * 0.75)
    assert model.memory_seconds(shape) > 10 * model.compute_seconds(shape)
    assert model.step_seconds(shape) == pytest.approx(expected, rel=1e-6)


def test_h100_decode_of_an_8b_model_takes_about_the_weight_read():
    model = analytic_from_names("h100-sxm", "llama-3-8b")
    seconds = model.step_seconds(_decode(1, 1))
    read = 15.0e9 / (3.35e12 * 0.8)  # ~15 GB of bf16 weights at 80% of HBM3
    assert read < seconds < read + 0.005


def test_large_prefill_is_compute_bound_and_priced_by_hand():
    model = AnalyticCostModel(TEST_GPU, LLAMA_8B)
    shape = _prefill(8192)
    flops = (2 * LLAMA_8B_BODY * 8192
             + 4 * 32 * 4096 * (8192 + 8192 * 8191 / 2)  # causal block of one fresh prompt
             + 2 * 4096 * 128256)  # the LM head, once
    assert model.compute_seconds(shape) > 10 * model.memory_seconds(shape)
    assert model.step_seconds(shape) == pytest.approx(0.003 + flops / (1e15 * 0.5), rel=1e-6)
    # compute-bound: twice the tokens costs at least twice the bound
    doubled = model.step_seconds(_prefill(16384)) - 0.003
    assert doubled >= 2 * (model.step_seconds(shape) - 0.003)


def test_mixed_step_prices_every_sequence_head_and_context():
    model = AnalyticCostModel(TEST_GPU, LLAMA_8B)
    # 63 decodes at 1000 tokens of context each, plus a fresh 512-token prompt
    shape = StepShape(prefill_tokens=512, decode_seqs=63, context_tokens=63 * 1000 + 512, seqs=64)
    pairs = 63 * 1000 + 512 * 513 / 2  # one query per decode key, a causal 512-token block
    flops = 2 * LLAMA_8B_BODY * 575 + 4 * 32 * 4096 * pairs + 64 * 2 * 4096 * 128256
    read = (LLAMA_8B_BODY + LLAMA_8B_TABLE) * 2 + 2 * 32 * 8 * 128 * 2 * 63_512
    assert model.compute_seconds(shape) == pytest.approx(flops / 5e14, rel=1e-9)
    assert model.memory_seconds(shape) == pytest.approx(read / 3e12, rel=1e-9)
    assert model.step_seconds(shape) == pytest.approx(0.003 + max(flops / 5e14, read / 3e12), rel=1e-9)


def test_batched_decode_amortises_the_weight_read():
    model = analytic_from_names("h100-sxm", "llama-3-8b")
    one = model.decode_tokens_per_second(1, 1000)
    assert one == pytest.approx(1 / model.step_seconds(_decode(1, 1000)))
    assert model.decode_tokens_per_second(32, 1000) > 20 * one


def test_an_empty_step_costs_nothing():
    model = analytic_from_names("h100-sxm", "llama-3-8b")
    assert model.step_seconds(StepShape(0, 0, 0, 0)) == 0.0
    with pytest.raises(ValueError, match="negative"):
        model.step_seconds(StepShape(-1, 0, 0, 0))


_COUNTS = st.integers(min_value=0, max_value=20_000)


@settings(max_examples=300, deadline=None)
@given(base=st.tuples(_COUNTS, _COUNTS, _COUNTS, _COUNTS), grow=st.tuples(_COUNTS, _COUNTS, _COUNTS, _COUNTS),
       names=st.sampled_from([("h100-sxm", "llama-3-8b"), ("l4", "smollm2-135m"), ("a100-80gb", "qwen2-7b")]))
def test_step_time_never_drops_when_any_field_grows(base, grow, names):
    model = analytic_from_names(*names)
    before = StepShape(*base)
    after = StepShape(*(b + g for b, g in zip(base, grow)))
    assert model.step_seconds(after) >= model.step_seconds(before)


def test_faster_hardware_is_never_slower():
    shapes = [_decode(1, 100), _decode(64, 4000), _prefill(8192), StepShape(512, 63, 63_512, 64)]
    for name in MODELS:
        h100, a100, h200 = (analytic_from_names(hw, name) for hw in ("h100-sxm", "a100-80gb", "h200"))
        for shape in shapes:
            assert h100.step_seconds(shape) < a100.step_seconds(shape)
            assert h200.step_seconds(shape) <= h100.step_seconds(shape)


def test_presets_carry_the_datasheet_numbers():
    assert (HARDWARE["h100-sxm"].peak_flops, HARDWARE["h100-sxm"].mem_bandwidth) == (989e12, 3.35e12)
    assert (HARDWARE["h200"].peak_flops, HARDWARE["h200"].mem_bandwidth) == (989e12, 4.8e12)
    assert HARDWARE["a100-80gb"].peak_flops == 312e12
    assert (HARDWARE["l4"].peak_flops, HARDWARE["l4"].mem_bandwidth) == (121e12, 300e9)
    with pytest.raises(TypeError):
        HARDWARE["mine"] = TEST_GPU  # type: ignore[index]


def test_kv_capacity_leaves_room_for_the_weights():
    model = analytic_from_names("h100-sxm", "llama-3-8b")
    expected = (80e9 * 0.9 - 8_030_261_248 * 2) // 131072
    assert model.max_kv_tokens() == expected
    assert analytic_from_names("l4", "llama-3-70b").max_kv_tokens() == 0


def test_round_trips_through_save_and_load(tmp_path):
    model = AnalyticCostModel(TEST_GPU, MODELS["qwen2-7b"], dtype_bytes=1)
    description = model.describe()
    assert description["model_kind"] == "analytic" and "max(" in description["form"]
    loaded = load_cost_model(save_cost_model(model, tmp_path / "costs" / "h.json"))
    assert isinstance(loaded, AnalyticCostModel) and loaded.kind == "analytic"
    assert loaded == model
    shape = StepShape(300, 20, 40_000, 22)
    assert loaded.step_seconds(shape) == model.step_seconds(shape)


def test_malformed_descriptions_are_rejected():
    good = analytic_from_names("l4", "smollm2-135m").describe()
    with pytest.raises(ValueError, match="model_kind"):
        AnalyticCostModel.from_dict({**good, "model_kind": "measured"})
    with pytest.raises(ValueError, match="malformed"):
        AnalyticCostModel.from_dict({k: v for k, v in good.items() if k != "hardware"})
    with pytest.raises(ValueError, match="efficiency"):
        AnalyticCostModel.from_dict({**good, "hardware": {**good["hardware"], "flops_efficiency": 1.5}})


def test_invalid_specs_are_rejected():
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ModelShape("bad", 2, 64, 4, 3, 128, 100, True)
    with pytest.raises(ValueError, match="positive"):
        HardwareSpec("bad", 0, 1e12)
    with pytest.raises(ValueError, match="dtype_bytes"):
        AnalyticCostModel(TEST_GPU, LLAMA_8B, dtype_bytes=0)


def test_unknown_names_list_the_choices():
    with pytest.raises(ValueError, match="h100-sxm") as exc:
        analytic_from_names("tpu-v9", "llama-3-8b")
    assert "tpu-v9" in str(exc.value) and "a100-80gb" in str(exc.value)
    with pytest.raises(ValueError, match="smollm2-135m") as exc:
        analytic_from_names("h100-sxm", "gpt-9")
    assert "gpt-9" in str(exc.value)


def test_importing_the_module_does_not_import_torch():
    code = "import carpool.sim.analytic, sys; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
