"""The analytic (roofline) cost model: parameter counts, which bound a step
hits, monotonicity, presets and the saved form."""
from __future__ import annotations

import json
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
       names=st.sampled_from([("h100-sxm", "llama-3-8b"), ("l4", "smollm2-135m"), ("a100-80gb", "qwen2-7b"),
                              ("h200", "mixtral-8x7b"), ("l4", "qwen3-30b-a3b"), ("8xh200", "deepseek-v3")]),
       imbalance=st.floats(min_value=1.0, max_value=64.0))
def test_step_time_never_drops_when_any_field_grows(base, grow, names, imbalance):
    model = analytic_from_names(*names, expert_imbalance=imbalance)
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


# -- mixture of experts and latent attention ------------------------------------------

MIXTRAL, QWEN3_MOE, DEEPSEEK_V3 = (MODELS[n] for n in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"))
# Each preset's published config.json, as ModelConfig reads it.
HF_CONFIGS = {
    "mixtral-8x7b": {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "tie_word_embeddings": False},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                      "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                      "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False},
    "deepseek-v3": {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
                    "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "n_group": 8,
                    "topk_group": 4, "tie_word_embeddings": False},
}


def test_moe_and_mla_parameter_counts_by_hand():
    # Mixtral: GQA attention as Llama's, 8 experts of 3 x 4096 x 14336 and a
    # 8 x 4096 router per layer; 2 experts run per token.
    expert, attention = 3 * 4096 * 14336, 2 * 4096 * 4096 + 2 * 4096 * 1024
    fixed = 32 * (attention + 8 * 4096 + 2 * 4096) + 4096 + 2 * 32000 * 4096
    assert (MIXTRAL.params, MIXTRAL.active_params) == (fixed + 32 * 8 * expert, fixed + 32 * 2 * expert)
    # Qwen3-30B-A3B: q 32 heads of 128 (wider than hidden), q/k norms, 128
    # experts of 3 x 2048 x 768, 8 of them per token.
    expert, attention = 3 * 2048 * 768, 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128
    fixed = 48 * (attention + 128 * 2048 + 2 * 2048) + 2048 + 2 * 151936 * 2048
    assert (QWEN3_MOE.params, QWEN3_MOE.active_params) == (fixed + 48 * 128 * expert,
                                                           fixed + 48 * 8 * expert)
    # DeepSeek-V3: MLA (q LoRA 1536 with its norm, latent 512 + rope 64 with
    # its norm, kv_b to 128 heads of nope 128 + v 128, o from 128 x 128); 3
    # dense layers; 58 MoE layers of 256 experts, one shared, a router and
    # its 256 correction biases.
    mla = (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256
           + 128 * 128 * 7168)
    expert = 3 * 7168 * 2048
    fixed = (61 * (mla + 2 * 7168) + 3 * 3 * 7168 * 18432 + 58 * (256 * 7168 + 256 + expert)
             + 7168 + 2 * 129280 * 7168)
    assert DEEPSEEK_V3.attention_params == mla
    assert (DEEPSEEK_V3.params, DEEPSEEK_V3.active_params) == (fixed + 58 * 256 * expert,
                                                               fixed + 58 * 8 * expert)
    # ... and the model cards' totals and activated counts.
    for shape, total, active in ((MIXTRAL, 46.7e9, 12.9e9), (QWEN3_MOE, 30.5e9, 3.3e9),
                                 (DEEPSEEK_V3, 671e9, 37e9)):
        assert shape.params == pytest.approx(total, rel=0.01)
        assert shape.active_params == pytest.approx(active, rel=0.03)
    assert LLAMA_8B.active_params == LLAMA_8B.params and not LLAMA_8B.is_moe


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_presets_are_what_model_config_reads_from_the_published_configs(name):
    config = ModelConfig.from_hf_config(HF_CONFIGS[name])
    shape = ModelShape.from_config(config, name=name)
    assert shape == MODELS[name]
    assert shape.kv_bytes_per_token(2) == config.kv_bytes_per_token(2)
    # the MoE MLP's counts agree with the model's own MoESpec
    moe, h = config.moe, config.hidden_size
    dense = config.num_layers - sum(config.moe_layers)
    rest = shape.params - dense * 3 * h * config.intermediate_size - shape.moe_layers * moe.total_params(h)
    assert shape.active_params == rest + dense * 3 * h * config.intermediate_size + \
        shape.moe_layers * moe.active_params_per_token(h)


def test_a_small_moe_mla_config_gives_the_hand_built_shape():
    config = ModelConfig.from_hf_config({
        **HF_CONFIGS["deepseek-v3"], "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
        "v_head_dim": 12, "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2,
        "moe_intermediate_size": 8, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1})
    assert ModelShape.from_config(config, name="tiny") == ModelShape(
        "tiny", 4, 32, 4, 4, 64, 100, False, experts=8, top_k=2, expert_intermediate=8,
        shared_intermediate=16, dense_layers=1, router_bias=True, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)


_TINY = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "tie_word_embeddings": False}


@pytest.mark.parametrize("extra", [
    {"model_type": "mixtral", "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 4,
     "num_experts_per_tok": 2},
    {"model_type": "qwen3_moe", "num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 16,
     "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "mlp_only_layers": [1]},
    *({"model_type": "deepseek_v3", "num_hidden_layers": 3, "num_key_value_heads": 4, "q_lora_rank": q,
       "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12,
       "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2, "n_group": 2,
       "topk_group": 1, "moe_intermediate_size": 8, "first_k_dense_replace": 1} for q in (None, 24))])
def test_parameter_counts_match_transformers_models(extra):
    """Every tensor of transformers' model (its state dict: the correction
    bias is a buffer) is counted, no more."""
    transformers = pytest.importorskip("transformers")
    d = {**_TINY, **extra}
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**d))
    counted = sum(t.numel() for t in model.state_dict().values())
    assert ModelShape.from_config(ModelConfig.from_hf_config(d)).params == counted


def test_mla_caches_one_latent_row_per_token_and_layer():
    assert DEEPSEEK_V3.kv_bytes_per_token(2) == 61 * (512 + 64) * 2 == 70_272
    assert (MIXTRAL.kv_bytes_per_token(2), QWEN3_MOE.kv_bytes_per_token(2)) == (131_072, 98_304)
    from carpool.sim.pd import kv_shape_of

    kv = kv_shape_of(analytic_from_names("8xh200", "deepseek-v3", 1))
    assert (kv.num_layers, kv.bytes_per_token) == (61, 35_136)
    # absorbed attention: scores over the 576-wide row, sums of 512-wide latents
    assert DEEPSEEK_V3.pair_flops == 61 * (2 * 128 * 576 + 2 * 128 * 512)


def test_decode_reads_the_experts_its_tokens_reach():
    model = AnalyticCostModel(TEST_GPU, MIXTRAL)
    expert_bytes = 32 * 3 * 4096 * 14336 * 2  # one expert of every layer, bf16
    fixed = (MIXTRAL.streamed_params - MIXTRAL.routed_params) * 2
    kv = 131_072 * 100
    assert model.step_bytes(_decode(1, 100)) == pytest.approx(fixed + 2 * expert_bytes + kv, rel=1e-12)
    # two tokens: 8 * (1 - (6/8)^2) = 3.5 experts a layer in expectation
    assert model.step_bytes(_decode(2, 100)) == pytest.approx(fixed + 3.5 * expert_bytes + 2 * kv, rel=1e-12)
    weights = [model.step_bytes(_decode(b, 0)) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert weights == sorted(weights) and len(set(weights)) == len(weights)
    assert weights[-1] == pytest.approx(MIXTRAL.streamed_params * 2, rel=1e-12)  # all experts
    # DeepSeek-V3 reads 8 of 256 experts for one token: far less than every weight
    ds = AnalyticCostModel(TEST_GPU, DEEPSEEK_V3, dtype_bytes=1)
    one, many = ds.step_bytes(_decode(1, 0)), ds.step_bytes(_decode(4096, 0))
    assert one == DEEPSEEK_V3.streamed_params - DEEPSEEK_V3.routed_params + 58 * 8 * 3 * 7168 * 2048
    assert one < 0.06 * DEEPSEEK_V3.params < many == pytest.approx(DEEPSEEK_V3.streamed_params, rel=1e-9)


def test_moe_compute_uses_active_parameters_and_the_imbalance():
    shape = _prefill(4096)
    pairs, seq = 4096 + 4096 * 4095 / 2, 2 * 4096 * 32000
    active = MIXTRAL.active_body_params
    balanced = AnalyticCostModel(TEST_GPU, MIXTRAL)
    assert balanced.step_flops(shape) == pytest.approx(2 * active * 4096 + 4 * 32 * 4096 * pairs + seq)
    skewed = AnalyticCostModel(TEST_GPU, MIXTRAL, expert_imbalance=1.5)
    extra = 2 * 0.5 * 32 * 2 * 3 * 4096 * 14336 * 4096  # half again the routed experts' FLOPs
    assert skewed.step_flops(shape) == pytest.approx(balanced.step_flops(shape) + extra)
    assert skewed.step_seconds(shape) > balanced.step_seconds(shape)
    assert skewed.step_bytes(shape) == balanced.step_bytes(shape)  # the same weights are read
    # the busiest expert takes at most every token: the factor stops at E / k = 4
    capped = AnalyticCostModel(TEST_GPU, MIXTRAL, expert_imbalance=4.0)
    assert AnalyticCostModel(TEST_GPU, MIXTRAL, expert_imbalance=50).step_flops(shape) == \
        capped.step_flops(shape)
    assert AnalyticCostModel(TEST_GPU, LLAMA_8B, expert_imbalance=3).step_flops(shape) == \
        AnalyticCostModel(TEST_GPU, LLAMA_8B).step_flops(shape)  # dense: nothing to skew
    with pytest.raises(ValueError, match="expert_imbalance"):
        AnalyticCostModel(TEST_GPU, MIXTRAL, expert_imbalance=0.5)


def test_memory_planning_holds_every_expert():
    from carpool.config import EngineConfig
    from carpool.sim.cost_flags import pool_blocks

    mixtral = analytic_from_names("h200", "mixtral-8x7b")
    assert mixtral.max_kv_tokens() == (141e9 * 0.9 - MIXTRAL.params * 2) // 131_072 == 255_542
    assert analytic_from_names("h100-sxm", "mixtral-8x7b").max_kv_tokens() == 0  # 93 GB of weights
    ds = analytic_from_names("8xh200", "deepseek-v3", dtype_bytes=1)
    assert ds.max_kv_tokens() == (8 * 141e9 * 0.9 - DEEPSEEK_V3.params) // 35_136
    config = EngineConfig.from_dict({})
    assert pool_blocks(config, ds, memory_set=False) == ds.max_kv_tokens() // config.cache.block_size
    with pytest.raises(ValueError, match="deepseek-v3's weights .1342 GB. leave no KV block"):
        pool_blocks(config, analytic_from_names("h200", "deepseek-v3"), memory_set=False)


def test_moe_models_round_trip_and_old_descriptions_still_load(tmp_path):
    model = AnalyticCostModel(HARDWARE["8xh200"], DEEPSEEK_V3, dtype_bytes=1, expert_imbalance=1.3)
    assert load_cost_model(save_cost_model(model, tmp_path / "ds.json")) == model
    # a description saved before the MoE/MLA fields existed
    old = AnalyticCostModel(TEST_GPU, MODELS["qwen2-7b"]).describe()
    old.pop("expert_imbalance")
    old["model"] = {k: old["model"][k] for k in ("name", "layers", "hidden", "heads", "kv_heads",
                                                 "intermediate", "vocab", "tied_embeddings",
                                                 "head_dim", "qkv_bias")}
    assert AnalyticCostModel.from_dict(old) == AnalyticCostModel(TEST_GPU, MODELS["qwen2-7b"])


def test_invalid_moe_and_mla_shapes_are_rejected():
    base = ("bad", 2, 64, 4, 4, 128, 100, True)
    moe = {"experts": 4, "top_k": 2, "expert_intermediate": 8}
    mla = {"kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
    for fields, message in (({"top_k": 2}, "need experts"), ({**moe, "top_k": 5}, "top_k"),
                            ({**moe, "dense_layers": 2}, "dense_layers"),
                            ({"v_head_dim": 8}, "kv_lora_rank"),
                            ({**mla, "head_dim": 16}, "MLA head_dim")):
        with pytest.raises(ValueError, match=message):
            ModelShape(*base, **fields)


def test_the_cli_lists_and_runs_every_preset(tmp_path, capsys):
    import argparse

    from carpool.cli import main
    from carpool.sim.cost_flags import add_cost_model_args

    parser = argparse.ArgumentParser()
    add_cost_model_args(parser)
    text = " ".join(parser.format_help().split())
    assert all(name in text for name in (*MODELS, *HARDWARE))
    assert main(["simulate", "--hardware", "8xh200", "--model-shape", "deepseek-v3", "--dtype-bytes", "1",
                 "--expert-imbalance", "1.5", "--num-requests", "20", "--input-len", "256",
                 "--output-len", "16", "--json", str(tmp_path / "ds.json")]) == 0
    assert "deepseek-v3 on 8xh200 (analytic)" in capsys.readouterr().out
    doc = json.loads((tmp_path / "ds.json").read_text())["simulation"]["cost_model"]
    assert doc["expert_imbalance"] == 1.5 and doc["model"] == DEEPSEEK_V3.to_dict()
    assert main(["simulate", "--hardware", "h200", "--model-shape", "deepseek-v3",
                 "--num-requests", "5"]) != 0
    assert "leave no KV block" in capsys.readouterr().err
