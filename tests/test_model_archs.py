"""Our forward pass vs transformers for each supported architecture variant.

Tiny random models (Llama 3 rope scaling, Llama with attention bias, Qwen2
with qkv bias, Mistral, untied head, sliding windows shorter than the
prompts, Qwen3, Gemma 3) are saved by transformers as HF
directories, loaded by carpool, and must give the same greedy tokens and
log-probabilities as transformers' own forward.
"""
from __future__ import annotations

import pytest
import torch

from carpool import LLM, SamplingParams
from tests.arch_models import save_random_model

# DeepSeek-V3 in small: MLA with LoRA'd queries, 8 routed experts in 4
# groups (2 kept), one shared expert, the first layer dense.
DEEPSEEK = {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
            "v_head_dim": 12, "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "num_key_value_heads": 4}
VARIANTS = {
    "llama3-rope": ("llama", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "llama-bias-untied": ("llama", {"attention_bias": True, "tie_word_embeddings": False}),
    "qwen2": ("qwen2", {"rope_theta": 1000000.0, "tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": None, "tie_word_embeddings": False}),
    # Windows shorter than the prompts, so the masks matter (chunks of 16
    # tokens attend across block boundaries and past the window).
    "mistral-window": ("mistral", {"sliding_window": 7, "tie_word_embeddings": False}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 5,
                               "max_window_layers": 1}),
    "qwen3": ("qwen3", {"head_dim": 32, "rope_theta": 1000000.0, "tie_word_embeddings": True}),
    "qwen3-bias-window": ("qwen3", {"head_dim": 16, "attention_bias": True,
                                    "use_sliding_window": True, "sliding_window": 6,
                                    "max_window_layers": 1}),
    "gemma3": ("gemma3_text", {
        "head_dim": 32, "num_hidden_layers": 3, "sliding_window": 5, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "final_logit_softcapping": 3.0, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}}}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                            "tie_word_embeddings": False}),
    "qwen3-moe": ("qwen3_moe", {"head_dim": 16, "num_hidden_layers": 3, "num_experts": 6,
                                "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "mlp_only_layers": [1], "norm_topk_prob": True}),
    "qwen3-moe-unnormed": ("qwen3_moe", {"head_dim": 16, "num_experts": 4,
                                         "num_experts_per_tok": 3, "moe_intermediate_size": 24,
                                         "norm_topk_prob": False}),
    "deepseek-v3": ("deepseek_v3", {**DEEPSEEK, "rope_interleave": True}),
    "deepseek-v3-no-q-lora": ("deepseek_v3", {**DEEPSEEK, "q_lora_rank": None,
                                              "rope_interleave": False, "n_group": 1,
                                              "topk_group": 1, "first_k_dense_replace": 0}),
    "deepseek-v3-yarn": ("deepseek_v3", {**DEEPSEEK, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
        "rope_theta": 10000.0}}),
}
PROMPTS = ["The quick brown fox", "def add(a, b):\n    return a + b\n" * 3, "café 😀"]


def build(tmp_path, tiny_model_dir, model_type: str, extra: dict):
    return save_random_model(tmp_path, tiny_model_dir, model_type, extra)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_forward_matches_transformers(variant, tmp_path, tiny_model_dir):
    model_type, extra = VARIANTS[variant]
    reference = build(tmp_path, tiny_model_dir, model_type, extra)
    llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params)
    with torch.inference_mode():
        for out in outputs:
            ids = list(out.prompt_token_ids)
            for step, token_id in enumerate(out.token_ids):
                logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0, -1], -1)
                assert token_id == int(logprobs.argmax()), f"{variant}: token {step} differs"
                assert out.logprobs[step].logprob == pytest.approx(
                    logprobs[token_id].item(), abs=1e-4)
                ids.append(token_id)
