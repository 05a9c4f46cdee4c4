"""Our forward pass vs transformers for each supported architecture variant.

Tiny random models (Llama 3 rope scaling, Llama with attention bias, Qwen2
with qkv bias, Mistral, untied head) are saved by transformers as HF
directories, loaded by carpool, and must give the same greedy tokens and
log-probabilities as transformers' own forward.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from tokenizers import Tokenizer

from carpool import LLM, SamplingParams

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
VARIANTS = {
    "llama3-rope": ("llama", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "llama-bias-untied": ("llama", {"attention_bias": True, "tie_word_embeddings": False}),
    "qwen2": ("qwen2", {"rope_theta": 1000000.0, "tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": None, "tie_word_embeddings": False}),
}
PROMPTS = ["The quick brown fox", "def add(a, b):\n    return a + b\n" * 3, "café 😀"]


def build(tmp_path, tiny_model_dir, model_type: str, extra: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).get_vocab_size()
    config = AutoConfig.for_model(model_type, vocab_size=vocab, **BASE, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger weights than HF's init: decisive argmaxes, no near-ties
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    return model


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
