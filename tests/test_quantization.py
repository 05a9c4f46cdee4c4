"""Weight-only INT8 decode (``--quantization int8``, carpool/model/quant.py).

The kernel against the dequantized matrix product; then the accuracy of the
scheme on the real default model against its bf16 weights:

- greedy: 16 prompts x 32 tokens through our engine with the INT8 kernel on
  every step (prefill too: the strictest case; served, only decode steps of
  up to ``INT8_MAX_ROWS`` rows use it), against the same engine in bf16;
- perplexity of a shipped text (tests/data/perplexity.txt) under
  transformers with each linear layer's weights as bf16 rounds them and as
  INT8 rounds them (both computed in fp32: the weights' error alone).

Tolerances, from what was measured (2026-12-04) with a margin: at least 6
of 16 greedy answers identical over 32 tokens and a mean common prefix of
at least 20 tokens (measured: 8 of 16, 23.8 tokens; the same engine's bf16
against its own fp32 on these prompts: 11 of 16, 25.7 tokens: a small
model's greedy text forks at the first near-tie); perplexity within 3% of
bf16's (measured: 33.85 -> 34.08, +0.7%).
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from carpool import LLM, SamplingParams
from carpool.model.quant import Int8DecodeLinear, quantize_rows

TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def test_the_int8_kernel_is_the_dequantized_product_and_large_steps_stay_bf16():
    torch.manual_seed(0)
    weight = torch.randn(96, 64).bfloat16()
    bias = torch.randn(96).bfloat16()
    layer = Int8DecodeLinear(weight, bias, max_rows=4)
    quantized, scale = quantize_rows(weight)
    assert quantized.dtype == torch.int8 and quantized.abs().max() == 127
    for rows in (1, 3, 4):
        x = torch.randn(rows, 64).bfloat16()
        expected = x.float() @ (quantized.float() * scale[:, None]).t() + bias.float()
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        assert torch.allclose(got.float(), expected, rtol=2e-2, atol=5e-2)
    wide = torch.randn(5, 64).bfloat16()  # past max_rows: the bf16 weights, exactly
    assert torch.equal(layer(wide), F.linear(wide, weight, bias))
    fp32 = torch.randn(2, 64)  # an fp32 model's activations: computed in bf16, returned fp32
    assert layer(fp32).dtype == torch.float32


def test_quantization_is_validated():
    from carpool.config import ModelSettings

    with pytest.raises(ValueError, match="quantization must be int8"):
        ModelSettings(quantization="int4").validate()


@pytest.mark.real_model
def test_int8_greedy_answers_agree_with_bf16(real_model_path):
    prompts = _prompts()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    reference = LLM(str(real_model_path), dtype="bfloat16").generate(prompts, params)
    int8 = LLM(str(real_model_path), dtype="bfloat16", quantization="int8")
    layers = [m for m in int8.engine.executor.model.modules() if isinstance(m, Int8DecodeLinear)]
    assert len(layers) == 4 * len(int8.engine.executor.model.layers) + 1  # and the LM head
    for layer in layers:
        layer.max_rows = 10**9  # the INT8 kernel on every step
    outputs = int8.generate(prompts, params)
    prefixes = [_common_prefix(a.token_ids, b.token_ids) for a, b in zip(reference, outputs)]
    identical = sum(p == 32 for p in prefixes)
    print(f"int8 vs bf16: {identical}/16 identical over 32 tokens, common prefixes {prefixes}")
    assert identical >= 6 and sum(prefixes) / len(prefixes) >= 20


@pytest.mark.real_model
def test_int8_perplexity_is_within_3_percent_of_bf16(hf_reference):
    model, tokenizer = hf_reference
    ids = tokenizer(TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids
    assert ids.shape[1] > 300
    bf16 = _perplexity(_with_linear_weights(model, lambda w: w.bfloat16().float()), ids)
    int8 = _perplexity(_with_linear_weights(model, _int8_rounded), ids)
    print(f"perplexity: bf16 weights {bf16:.3f}, int8 weights {int8:.3f}")
    assert 1.0 < bf16 < 100.0 and abs(int8 / bf16 - 1) < 0.03


def _prompts() -> list[str]:
    questions = ["What is 2 + 2?", "Name three primary colours.", "Write a haiku about buses.",
                 "Explain what a GPU is in one sentence.", "Why is the sky blue?",
                 "List the days of the week.", "What does HTTP stand for?",
                 "Summarise Romeo and Juliet in two sentences."]
    raw = ["Once upon a time", "The theory of relativity states that", "def fibonacci(n):\n",
           "The capital of France is", "In 1969, the first", "Dear diary, today",
           "The recipe calls for", "A good engineer always"]
    return questions + raw


def _common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _int8_rounded(weight: torch.Tensor) -> torch.Tensor:
    quantized, scale = quantize_rows(weight.bfloat16())
    return quantized.float() * scale.bfloat16().float()[:, None]


def _with_linear_weights(model, transform):
    """A copy of ``model`` whose decoder linear layers and LM head hold
    ``transform(weight)`` (embeddings and norms as they were)."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in copied.named_modules():
            if isinstance(module, torch.nn.Linear) and ("layers." in name or "lm_head" in name):
                module.weight = torch.nn.Parameter(transform(module.weight.detach()))
    return copied


@torch.no_grad()
def _perplexity(model, ids: torch.Tensor) -> float:
    logits = model(ids).logits[0, :-1].float()
    loss = F.cross_entropy(logits, ids[0, 1:])
    return math.exp(loss.item())
