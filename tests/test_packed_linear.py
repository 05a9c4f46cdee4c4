"""The packed bf16 decode linear (carpool/model/packed_linear.py and
csrc/packed_linear.cpp): the kernel against fp32 math, the module's paths,
and a model packed by the executor against the same model unpacked."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from carpool.model.cpu_kernels import load_cpu_ops
from carpool.model.packed_linear import (
    PACKED_MAX_ROWS,
    PackedDecodeLinear,
    pack_for_decode,
    pack_weight,
    packable,
    packed_bytes,
)


@pytest.fixture(scope="module")
def ops():
    kernels = load_cpu_ops()
    assert kernels is not None, "the C++ kernels must build on the CI machine"
    return kernels


def _bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error in units of bf16's spacing at the reference's size."""
    spacing = want.abs().clamp(min=1e-3) * 2.0 ** -7
    return ((got.float() - want) / spacing).abs().max().item()


# Output sizes: whole blocks of 4 groups (256), a tail group (80 = 4 + 1 groups),
# one group (16); rows: 1..4 in one pass, 5..9 in two or three passes.
@pytest.mark.parametrize("out_features,in_features", [(256, 96), (80, 64), (16, 34)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
def test_kernel_matches_fp32_math_to_a_rounding(ops, out_features, in_features, rows):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    for b in (None, bias):
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        got = ops.packed_linear(x, pack_weight(weight), b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        # fp32 sums in another order, then one rounding to bf16 (+ the bias's).
        assert _bf16_ulps(got, want) <= 2.0


def test_kernel_refuses_mismatched_inputs(ops):
    weight = pack_weight(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="inputs"):
        ops.packed_linear(torch.randn(1, 48).bfloat16(), weight, None)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.packed_linear(torch.randn(1, 64), weight, None)


def test_packable_shapes():
    assert packable(torch.zeros(32, 64, dtype=torch.bfloat16))
    assert not packable(torch.zeros(30, 64, dtype=torch.bfloat16))  # not whole groups
    assert not packable(torch.zeros(32, 63, dtype=torch.bfloat16))  # odd inputs
    assert not packable(torch.zeros(32, 64))  # fp32


class _Inactive:
    """A SwitchingCpuOps before its kernels are built."""
    active = False

    def packed_linear(self, *args):  # noqa: ANN002, ANN201
        raise AssertionError("the kernel must not run before the switch")


def test_module_runs_the_kernel_for_small_steps_only(ops, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 32, generator=gen).bfloat16()
    layer = PackedDecodeLinear(weight, None, ops)
    calls = []
    real = ops.packed_linear
    monkeypatch.setattr(layer, "kernels", type("Spy", (), {
        "packed_linear": staticmethod(lambda *a: calls.append(a[0].shape[0]) or real(*a))})())
    small = torch.randn(PACKED_MAX_ROWS, 32, generator=gen).bfloat16()
    large = torch.randn(PACKED_MAX_ROWS + 1, 32, generator=gen).bfloat16()
    assert _bf16_ulps(layer(small), F.linear(small.float(), weight.float())) <= 2.0
    assert torch.equal(layer(large), F.linear(large, weight))
    assert calls == [PACKED_MAX_ROWS]
    # Before a background build finishes: the original weight, exactly.
    waiting = PackedDecodeLinear(weight, None, _Inactive())
    assert torch.equal(waiting(small), F.linear(small, weight))


def test_packed_model_matches_the_unpacked_one(ops, tiny_model_dir):
    """The tiny model in bf16, packed and not: decode-sized steps' logits
    agree to bf16 rounding through two layers, and every layer and the
    (tied) head got a packed copy of the size `packed_bytes` predicts."""
    from carpool.model.decoder import DecoderModel
    from carpool.model.loader import load_model

    loaded = load_model(tiny_model_dir)
    config = loaded.config
    model = DecoderModel(config, 64)
    model.load_hf_weights(loaded.weights)
    model = model.to(torch.bfloat16).eval()
    hidden = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(5))
    hidden = hidden.bfloat16()
    with torch.no_grad():
        before = [layer.gate_up_proj(hidden) for layer in model.layers]
        logits_before = model.compute_logits(hidden)
        predicted = packed_bytes(model)
        assert pack_for_decode(model, ops) == predicted > 0
        # A step with a prefill: the original weights, exactly (see StepKind).
        model.step_kind.decode_only = False
        assert torch.equal(model.layers[0].gate_up_proj(hidden), before[0])
        model.step_kind.decode_only = True
        assert all(isinstance(layer.gate_up_proj, PackedDecodeLinear) for layer in model.layers)
        after = [layer.gate_up_proj(hidden) for layer in model.layers]
        logits_after = model.compute_logits(hidden)
    for a, b in zip(before, after):
        assert _bf16_ulps(b, a.float()) <= 4.0
    assert (logits_after.float() - logits_before.float()).abs().max().item() < 0.05


@pytest.mark.parametrize("out_features,in_features", [(256, 96), (80, 64), (48, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_int4_kernel_is_the_dequantized_product(ops, out_features, in_features, rows):
    """csrc/packed_int4.cpp against fp32 math on the dequantized weight
    (w = code * scale + min, scales and minimums rounded to fp16 as stored)."""
    from carpool.model.quant import INT4_GROUP, pack_int4, quantize_groups

    gen = torch.Generator().manual_seed(rows * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    codes, scale, low = quantize_groups(weight)
    scale, low = scale.half().float(), low.half().float()
    groups = in_features // INT4_GROUP
    dequantized = (codes.float().view(out_features, groups, INT4_GROUP) * scale[..., None]
                   + low[..., None]).view(out_features, in_features)
    for b in (None, bias):
        want = F.linear(x.float(), dequantized, None if b is None else b.float())
        got = ops.int4_linear(x, *pack_int4(codes, scale, low), b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        assert _bf16_ulps(got, want) <= 4.0


def test_int4_layers_run_our_kernel_until_the_step_is_large(ops):
    from carpool.model.quant import LowBitDecodeLinear

    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(64, 64, generator=gen).bfloat16()
    layer = LowBitDecodeLinear(weight, None, "int4", max_rows=4, kernels=ops)
    small, large = (torch.randn(n, 64, generator=gen).bfloat16() for n in (4, 5))
    assert torch.equal(layer(small), ops.int4_linear(small, layer.qweight, layer.scales,
                                                     layer.mins, None))
    assert torch.equal(layer(large), F.linear(large, weight))
    waiting = LowBitDecodeLinear(weight, None, "int4", max_rows=4, kernels=_Inactive())
    assert torch.equal(waiting(small), F.linear(small, weight))  # kernels still compiling
