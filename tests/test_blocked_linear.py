"""oneDNN-blocked weights (carpool/model/blocked_linear.py): a layout change
only, so every product, logit and token must be bit-identical to
``F.linear`` on the plain weights in bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from carpool import LLM
from carpool.model.blocked_linear import (
    BlockedLinear,
    PlainLinear,
    block_weights,
    blocked_unavailable,
)
from carpool.sampling_params import SamplingParams

WHY = blocked_unavailable(torch.device("cpu"), torch.bfloat16)
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"blocked weights unavailable: {WHY}")


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("out_features,in_features", [(96, 64), (1536, 576), (48, 200)])
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 130])
def test_blocked_product_is_f_linear_bit_for_bit(out_features, in_features, rows):
    weight, bias = _rand(out_features, in_features, seed=1), _rand(out_features, seed=2)
    x = _rand(rows, in_features, seed=3)
    assert torch.equal(BlockedLinear(weight, None)(x), F.linear(x, weight))
    assert torch.equal(BlockedLinear(weight, bias)(x), F.linear(x, weight, bias))
    # A column slice (qkv's split), not contiguous.
    wide = _rand(rows, 2 * in_features, seed=4)[:, :in_features]
    assert torch.equal(BlockedLinear(weight, bias)(wide), F.linear(wide, weight, bias))


def test_block_weights_rewires_every_dense_path(tiny_model_dir):
    """Plain layers become BlockedLinear; a module with its own small-step
    kernel keeps it and gets a blocked ``dense`` path (its plain weight
    dropped); the LM head too. Outputs are unchanged, and so is the KV
    connector's fingerprint of the weights."""
    from carpool.kv_transfer.blocks import weights_fingerprint
    from carpool.model.decoder import DecoderModel
    from carpool.model.loader import load_model
    from carpool.model.quant import LowBitDecodeLinear

    loaded = load_model(tiny_model_dir)
    model = DecoderModel(loaded.config, 64)
    model.load_hf_weights(loaded.weights)
    model = model.to(torch.bfloat16).eval()
    layer = model.layers[0]
    layer.o_proj = LowBitDecodeLinear(layer.o_proj.weight, layer.o_proj.bias, "int8")
    hidden = _rand(70, loaded.config.hidden_size, seed=5)
    with torch.no_grad():
        before = [(lin(hidden[:, :lin.weight.shape[1]]))
                  for lin in (layer.qkv_proj, layer.gate_up_proj)]
        o_before = layer.o_proj(_rand(70, layer.o_proj.weight.shape[1], seed=6))
        logits_before = model.compute_logits(hidden)
        fingerprint = weights_fingerprint(model, "tiny")
        assert block_weights(model) > 0
        assert all(isinstance(getattr(lay, name), BlockedLinear) for lay in model.layers[1:]
                   for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
        assert isinstance(layer.o_proj.dense, BlockedLinear) and layer.o_proj.weight is None
        after = [(lin(hidden[:, :lin.in_features]))
                 for lin in (layer.qkv_proj, layer.gate_up_proj)]
        o_after = layer.o_proj(_rand(70, layer.o_proj.dense.in_features, seed=6))
        logits_after = model.compute_logits(hidden)
        assert weights_fingerprint(model, "tiny") == fingerprint
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert torch.equal(o_before, o_after) and torch.equal(logits_before, logits_after)
    assert isinstance(model.head, BlockedLinear)
    assert not isinstance(layer.o_proj.dense, PlainLinear)


def test_generation_is_identical_with_and_without_blocked_weights(tiny_model_dir):
    """Greedy and seeded sampling over prefill and decode steps of several
    row counts: the same tokens and logprobs either way."""
    prompts = [[(5 * i + j) % 200 + 3 for j in range(6 + 9 * i)] for i in range(5)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=3)]
    results = {}
    for mode in ("off", "on"):
        llm = LLM(str(tiny_model_dir), dtype="bfloat16", kv_cache_memory="16MiB",
                  blocked_weights=mode, packed_decode="off")
        blocked = isinstance(llm.engine.executor.model.layers[0].qkv_proj, BlockedLinear)
        assert blocked == (mode == "on")
        results[mode] = [(out.token_ids, [(lp.token_id, lp.logprob) for lp in out.logprobs or []])
                         for p in params for out in llm.generate(prompts, p)]
    assert results["on"] == results["off"]


def test_blocked_experts_are_a_layout_change_only(tmp_path, tiny_model_dir):
    """A MoE block's experts on blocked weights: the same bf16 output bit for
    bit (tokens routed to several experts, some to none), and the same
    weights fingerprint (read back from the blocked copies)."""
    from carpool.kv_transfer.blocks import weights_fingerprint
    from carpool.model.decoder import DecoderModel
    from carpool.model.loader import load_model
    from tests.arch_models import save_random_model

    save_random_model(tmp_path, tiny_model_dir, "qwen3_moe", {
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 40})
    loaded = load_model(tmp_path)
    model = DecoderModel(loaded.config, 64)
    model.load_hf_weights(loaded.weights)
    model = model.to(torch.bfloat16).eval()
    moe = model.layers[0].moe
    hidden = _rand(70, loaded.config.hidden_size, seed=7)
    with torch.no_grad():
        before = moe(hidden)
        counts = moe.last_expert_counts.clone()
        fingerprint = weights_fingerprint(model, "moe")
        assert block_weights(model) > 0 and moe.cpu_experts is not None
        assert moe.w_gate_up.numel() == 0  # the plain copy is dropped
        after = moe(hidden)
        assert weights_fingerprint(model, "moe") == fingerprint
    assert int((counts > 0).sum()) > 1
    assert torch.equal(before, after)
