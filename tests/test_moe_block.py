"""The mixture-of-experts core (carpool/model/moe.py, moe_spec.py) against
transformers' own MoE blocks of Mixtral, Qwen3-MoE and DeepSeek-V3 loaded
from what ``save_pretrained`` writes, and its routing, paths and dtypes."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from carpool.model.moe import MoEBlock, route
from carpool.model.moe_spec import FUSED, PER_EXPERT, MoESpec, expected_moe_shapes

transformers = pytest.importorskip("transformers")

PREFIX = "model.layers.0."
FROM_CONFIG = {"mixtral": MoESpec.from_mixtral, "qwen3_moe": MoESpec.from_qwen3_moe,
               "deepseek_v3": MoESpec.from_deepseek_v3}


def _hf_model(family: str, case: dict):
    """A one-layer transformers model whose layer 0 is the MoE block."""
    common = dict(vocab_size=32, hidden_size=case["hidden"], num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2,
                  experts_implementation="eager")
    experts, k, inter = case["experts"], case["top_k"], case["inter"]
    if family == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=experts, num_experts_per_tok=k,
                                            intermediate_size=inter, **common)
        return transformers.MixtralForCausalLM(config)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=inter,
            intermediate_size=inter, norm_topk_prob=case["renorm"], head_dim=8, **common)
        return transformers.Qwen3MoeForCausalLM(config)
    config = transformers.DeepseekV3Config(
        n_routed_experts=experts, num_experts_per_tok=k, moe_intermediate_size=inter,
        intermediate_size=inter, n_group=case["n_group"], topk_group=case["topk_group"],
        n_shared_experts=case["shared"], routed_scaling_factor=case["scale"],
        norm_topk_prob=case["renorm"], first_k_dense_replace=0, q_lora_rank=None,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, **common)
    return transformers.DeepseekV3ForCausalLM(config)


@st.composite
def moe_cases(draw, family: str) -> dict:
    experts = draw(st.integers(2, 8))
    case = dict(experts=experts, top_k=draw(st.integers(1, min(4, experts))),
                hidden=draw(st.sampled_from([8, 16, 24, 32])), inter=draw(st.integers(4, 40)),
                tokens=draw(st.integers(1, 24)), seed=draw(st.integers(0, 2**16)),
                renorm=draw(st.booleans()), n_group=1, topk_group=1, shared=1, scale=1.0)
    if family == "deepseek_v3":
        n_group = draw(st.sampled_from([g for g in range(1, experts + 1)
                                        if experts % g == 0 and (g == 1 or experts // g >= 2)]))
        fewest = math.ceil(case["top_k"] / (experts // n_group))  # groups enough for top_k
        case.update(n_group=n_group, topk_group=draw(st.integers(fewest, n_group)),
                    shared=draw(st.integers(1, 2)), scale=draw(st.sampled_from([1.0, 2.5])))
    return case


def _saved(family: str, case: dict):
    """(transformers model, its saved tensors, its saved config.json as a dict)."""
    model = _hf_model(family, case)
    gen = torch.Generator().manual_seed(case["seed"])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        bias = getattr(model.model.layers[0].mlp.gate, "e_score_correction_bias", None)
        if bias is not None:  # zeros by default: make it move the choice
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.3)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
        config = json.loads((Path(tmp) / "config.json").read_text())
    return model, saved, config


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_matches_transformers_block(family, data):
    case = data.draw(moe_cases(family))
    model, saved, config = _saved(family, case)
    spec = FROM_CONFIG[family](config)
    hidden = case["hidden"]
    # save_pretrained writes per-expert names, exactly the expected set.
    moe_names = {n for n in saved if n.startswith(PREFIX) and ("mlp" in n or "sparse_moe" in n)}
    assert moe_names == set(expected_moe_shapes(spec, hidden, PREFIX, PER_EXPERT))
    block = MoEBlock(spec, hidden)
    assert block.load_hf_weights(saved, PREFIX) == PER_EXPERT
    reference = model.model.layers[0].mlp
    x = torch.randn(1, case["tokens"], hidden, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(x)[0]
        hf_logits, hf_weights, hf_ids = reference.gate(x[0])
        got = block(x[0])
        weights, ids = route(block.router_logits(x[0]), spec, block.e_score_correction_bias)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    hf_weights, hf_ids = _sorted_by_id(hf_weights, hf_ids)
    weights, ids = _sorted_by_id(weights, ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), atol=1e-6, rtol=1e-6)
    # transformers' in-memory (fused) names load to the same weights.
    fused = MoEBlock(spec, hidden)
    assert fused.load_hf_weights(model.state_dict(), PREFIX) == FUSED
    for name, tensor in block.state_dict().items():
        assert torch.equal(fused.state_dict()[name], tensor), name


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_bf16_matches_transformers_block(family):
    """In bf16 both paths round as transformers' eager block does (bit for bit
    on our CPUs; asserted to bf16's tolerance), given DeepSeek-V3's router and
    bias in fp32 as ``from_pretrained`` keeps them (a plain ``.to`` does not)."""
    deepseek = family == "deepseek_v3"
    case = dict(experts=8, top_k=2, hidden=32, inter=40, tokens=64, seed=5, renorm=True,
                n_group=4 if deepseek else 1, topk_group=2 if deepseek else 1, shared=1,
                scale=2.5 if deepseek else 1.0)
    model, saved, config = _saved(family, case)
    block = MoEBlock(FROM_CONFIG[family](config), 32)
    block.load_hf_weights(saved, PREFIX)
    reference = model.model.layers[0].mlp
    router = {n: t.detach().clone() for n, t in reference.gate.state_dict().items()}
    model.to(torch.bfloat16)
    block.to(torch.bfloat16)
    if deepseek:
        reference.gate.weight.data = router["weight"]
        reference.gate.e_score_correction_bias.data = router["e_score_correction_bias"]
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        want = reference(x[None])[0]
        for impl in ("grouped", "loop"):
            block.impl = impl
            torch.testing.assert_close(block(x), want)


def _random_block(spec: MoESpec, hidden: int, seed: int = 0) -> MoEBlock:
    block = MoEBlock(spec, hidden)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in list(block.parameters()) + list(block.buffers()):
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.3)
    return block


@pytest.mark.parametrize("gemm", ["auto", "mm", "grouped_mm"])
def test_batch_spreads_over_experts_and_paths_agree(gemm):
    if gemm == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm needs torch >= 2.9 on the CPU")
    spec = MoESpec(num_experts=8, top_k=2, expert_intermediate_size=48)
    block = _random_block(spec, 32)
    block.gemm = gemm
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        grouped = block(x)
        counts = block.last_expert_counts
        block.impl = "loop"
        loop = block(x)
    assert counts.dtype == torch.int64 and counts.device.type == "cpu"
    assert counts.sum().item() == 64 * 2 and (counts > 0).sum().item() > 1
    assert torch.equal(block.last_expert_counts, counts)
    torch.testing.assert_close(grouped, loop, atol=1e-6, rtol=1e-6)
    block.impl = "grouped"
    # With autograd on, grouped concatenates instead of writing in place.
    torch.testing.assert_close(block(x), grouped, atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        assert block(x[:0]).shape == (0, 32)
    assert block.last_expert_counts.sum().item() == 0


def test_renormalisation_on_and_off():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, -0.5, 3.0, 0.0]])
    probs = torch.softmax(logits, dim=-1)
    plain = MoESpec(num_experts=4, top_k=2, expert_intermediate_size=8, renormalize=False)
    weights, ids = route(logits, plain)
    assert ids.tolist() == [[0, 1], [2, 0]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    assert (weights.sum(-1) < 1).all()
    renormed, ids2 = route(logits, MoESpec(num_experts=4, top_k=2, expert_intermediate_size=8))
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(renormed, weights / weights.sum(-1, keepdim=True))


def _deepseek(**overrides) -> MoESpec:
    fields = dict(num_experts=8, top_k=2, expert_intermediate_size=8, scoring="sigmoid",
                  renormalize=False, n_group=4, topk_group=1, correction_bias=True,
                  family="deepseek_v3")
    return MoESpec(**{**fields, **overrides})


def test_group_limit_can_skip_the_best_expert():
    # Group 0 holds the best expert (0) beside a poor one; group 1's pair sums higher.
    logits = torch.logit(torch.tensor([[0.99, 0.01, 0.9, 0.9, 0.5, 0.1, 0.2, 0.3]]))
    weights, ids = route(logits, _deepseek(), torch.zeros(8))
    assert sorted(ids[0].tolist()) == [2, 3]
    torch.testing.assert_close(weights, torch.tensor([[0.9, 0.9]]))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), topk_group=st.integers(1, 3), top_k=st.integers(1, 4))
def test_group_limit_picks_only_from_the_best_groups(seed, topk_group, top_k):
    spec = _deepseek(num_experts=12, n_group=4, topk_group=topk_group,
                     top_k=min(top_k, 3 * topk_group))
    gen = torch.Generator().manual_seed(seed)
    logits, bias = torch.randn(16, 12, generator=gen), torch.randn(12, generator=gen) * 0.3
    _, ids = route(logits, spec, bias)
    choice = (logits.sigmoid() + bias).tolist()
    for row, chosen in zip(choice, ids.tolist()):
        groups = [sum(sorted(row[g * 3:g * 3 + 3])[-2:]) for g in range(4)]
        best = sorted(range(4), key=groups.__getitem__)[-topk_group:]
        assert {e // 3 for e in chosen} <= set(best)
        assert len(set(chosen)) == len(chosen)


def test_bias_moves_the_choice_not_the_weight():
    spec = _deepseek(n_group=1, top_k=1, routed_scaling_factor=2.5)
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    _, ids = route(logits, spec, torch.zeros(8))
    assert ids.tolist() == [[0]]
    bias = torch.zeros(8)
    bias[3] = 1.0  # sigmoid(0) + 1 = 1.5 > sigmoid(2) ~ 0.88
    weights, ids = route(logits, spec, bias)
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(weights, torch.tensor([[0.5 * 2.5]]))  # sigmoid(0), scaled
    with pytest.raises(ValueError, match="correction bias"):
        route(logits, spec)


def test_bf16_grouped_against_fp32():
    """bf16 rounds x, the weights and every product: within 3% of the output's
    scale on the tokens whose experts bf16 still picks (a near tie may flip)."""
    spec = MoESpec(num_experts=8, top_k=2, expert_intermediate_size=64, family="mixtral")
    block = _random_block(spec, 64)
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = block(x)
        ids32 = route(block.router_logits(x), spec)[1].sort(-1)[0]
        low = block.to(torch.bfloat16)
        got = low(x.bfloat16()).float()
        ids16 = route(low.router_logits(x.bfloat16()), spec)[1].sort(-1)[0]
        low.impl = "loop"
        torch.testing.assert_close(low(x.bfloat16()).float(), got, atol=0.02, rtol=0.01)
    same = (ids32 == ids16).all(-1)
    assert same.float().mean() > 0.9
    error = (got - want)[same].abs().max() / want.abs().max()
    assert error < 0.03, error


class _Compiling:
    """The CPU ops while they compile (``SwitchingCpuOps`` before ``active``)."""

    active = False


@pytest.mark.parametrize("spec", [
    MoESpec(num_experts=8, top_k=2, expert_intermediate_size=64, family="mixtral"),
    MoESpec(num_experts=8, top_k=3, expert_intermediate_size=32, num_shared_experts=1,
            shared_intermediate_size=16, scoring="sigmoid", correction_bias=True, n_group=4,
            topk_group=2, renormalize=True, routed_scaling_factor=2.5, family="deepseek_v3")], ids=["mixtral", "deepseek"])
def test_packed_experts_kernel_against_the_grouped_path(spec):
    """The fused C++ kernel on packed experts (moe_cpu.PackedExperts) rounds
    as the grouped bf16 path does at every stage; only its products sum in
    another order, so at most 1 in 1,000 outputs differ, by one bf16 step.
    Before the kernels are built, torch on the unpacked weights gives the
    grouped path's numbers exactly; the weights read back unchanged."""
    from carpool.model.cpu_kernels import load_cpu_ops
    from carpool.model.moe_cpu import PackedExperts

    block = _random_block(spec, 64).to(torch.bfloat16)
    plain = {name: t.clone() for name, t in block.plain_expert_weights().items()}
    with torch.no_grad():
        for tokens in (0, 1, 3, 70):
            x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
            x = x.bfloat16()
            block.cpu_experts = None
            block.w_gate_up, block.w_down = (torch.nn.Parameter(plain["w_gate_up"].clone()),
                                             torch.nn.Parameter(plain["w_down"].clone()))
            want = block(x)
            assert block.pack_experts(load_cpu_ops()) > 0 and block.w_gate_up.numel() == 0
            assert isinstance(block.cpu_experts, PackedExperts)
            got = block(x)
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            differ = got != want
            assert differ.float().mean() <= 1e-3 if tokens else True
            step = want.float().abs().clamp(min=1e-3) * 2 ** -7
            assert ((got.float() - want.float()).abs() <= step)[differ].all()
            block.cpu_experts.kernels = _Compiling()
            assert torch.equal(block(x), want)
            for name, tensor in block.plain_expert_weights().items():
                assert torch.equal(tensor, plain[name]), name
    assert int((block.last_expert_counts > 0).sum()) > 1


def test_experts_the_kernel_cannot_take_stay_plain():
    """The packed kernel needs 16-row groups: intermediate 40 is refused, so
    the block stays on its plain (or oneDNN-blocked) path."""
    from carpool.model.cpu_kernels import load_cpu_ops

    block = _random_block(MoESpec(num_experts=4, top_k=2, expert_intermediate_size=40),
                          32).to(torch.bfloat16)
    assert block.pack_experts(load_cpu_ops()) == 0 and block.cpu_experts is None
    assert _random_block(MoESpec(num_experts=4, top_k=2, expert_intermediate_size=32),
                         32).pack_experts(load_cpu_ops()) == 0  # fp32: not packed


def test_deepseek_router_stays_fp32_when_cast():
    block = _random_block(_deepseek(num_shared_experts=1, shared_intermediate_size=8), 16)
    low = block.to(torch.bfloat16)
    assert low.gate.weight.dtype == torch.float32
    assert low.e_score_correction_bias.dtype == torch.float32
    assert low.w_gate_up.dtype == low.shared_down.weight.dtype == torch.bfloat16
    qwen = _random_block(MoESpec(num_experts=4, top_k=2, expert_intermediate_size=8), 16)
    assert qwen.to(torch.bfloat16).gate.weight.dtype == torch.bfloat16


def test_param_counts_match_the_block():
    spec = _deepseek(num_shared_experts=2, shared_intermediate_size=16)
    block = MoEBlock(spec, 24)
    total = sum(t.numel() for t in block.parameters()) + spec.num_experts  # + bias buffer
    assert spec.total_params(24) == total
    assert spec.active_params_per_token(24) == 8 * 24 + 8 + 2 * 3 * 8 * 24 + 3 * 16 * 24
    shapes = expected_moe_shapes(spec, 24, PREFIX, FUSED)
    assert sum(math.prod(s) for s in shapes.values()) == total


@pytest.mark.parametrize("fields,message", [
    (dict(top_k=5), "top_k"),
    (dict(n_group=3, scoring="sigmoid"), "divide"),
    (dict(n_group=2, topk_group=1), "sigmoid"),
    (dict(n_group=2, topk_group=3, scoring="sigmoid"), "topk_group"),
    (dict(n_group=2, topk_group=1, top_k=3, scoring="sigmoid"), "exceeds"),
    (dict(num_shared_experts=1), "shared"),
    (dict(scoring="relu"), "scoring"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_spec_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        MoESpec(**{**dict(num_experts=4, top_k=2, expert_intermediate_size=8), **fields})


def test_specs_from_config_dicts():
    assert not MoESpec.from_qwen3_moe(
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)).renormalize
    spec = MoESpec.from_deepseek_v3(dict(n_routed_experts=16, num_experts_per_tok=4,
                                         moe_intermediate_size=32, n_shared_experts=2))
    assert (spec.n_group, spec.topk_group, spec.routed_scaling_factor) == (8, 4, 2.5)
    assert spec.shared_intermediate_size == 64 and spec.correction_bias
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoESpec.from_mixtral(dict(num_local_experts=8, intermediate_size=16))


def test_spec_module_is_torch_free():
    code = "import sys, carpool.model.moe_spec; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
