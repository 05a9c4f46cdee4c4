"""W8A8 on VNNI (``--quantization w8a8``, carpool/model/w8a8.py and
csrc/int8_linear.cpp): the kernel against the quantized product it stands
for, rows that do not depend on their step, the portable build against the
native one, and an engine serving on it. Accuracy on the real model:
tests/test_quantization.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from carpool import LLM, SamplingParams
from carpool.machine import cpu_model_and_flags
from carpool.model.cpu_kernels import load_cpu_ops
from carpool.model.w8a8 import SPAN, W8A8Linear, pack_int8, unpack_int8

VNNI = "avx512_vnni" in cpu_model_and_flags()[1]


def fake_quantized(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies for ``x``: each 32 inputs of a row
    rounded to 255 levels of its own scale, in fp64."""
    rows, inputs = x.shape
    spans = x.double().view(rows, inputs // SPAN, SPAN)
    scale = (spans.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-300)
    return (torch.round(spans / scale).clamp(-127, 127) * scale).view(rows, inputs)


def _layer(out_features: int = 96, in_features: int = 128, bias: bool = True):
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features) * 0.05
    return weight, (torch.randn(out_features) if bias else None)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
def test_the_kernel_is_the_quantized_product(rows):
    kernels = load_cpu_ops()
    weight, bias = _layer()
    packed, scale = pack_int8(weight)
    dequantized = unpack_int8(packed, scale)
    assert (dequantized - weight).abs().max() <= scale.max() / 2 + 1e-6
    x = torch.randn(rows, 128) * 3
    x[:, 5] *= 40  # an outlier channel: only its own 32 inputs lose precision
    expected = fake_quantized(x) @ dequantized.double().t() + bias.double()
    got = kernels.w8a8_linear(x, packed, scale, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    assert (got.double() - expected).abs().max() < 1e-3
    bf16 = kernels.w8a8_linear(x.bfloat16(), packed, scale, None)
    expected = fake_quantized(x.bfloat16().float()) @ dequantized.double().t()
    assert bf16.dtype == torch.bfloat16
    assert torch.allclose(bf16.double(), expected, rtol=1e-2, atol=2e-2)


def test_a_rows_output_does_not_depend_on_its_step():
    kernels = load_cpu_ops()
    packed, scale = pack_int8(_layer(160, 96)[0])
    x = torch.randn(37, 96).bfloat16()
    together = kernels.w8a8_linear(x, packed, scale, None)
    for row in range(37):
        assert torch.equal(together[row:row + 1], kernels.w8a8_linear(x[row:row + 1], packed,
                                                                      scale, None))


def test_bad_shapes_are_refused():
    kernels = load_cpu_ops()
    packed, scale = pack_int8(_layer(32, 64)[0])
    with pytest.raises(RuntimeError, match="x has 96 inputs, the weights 64"):
        kernels.w8a8_linear(torch.randn(2, 96), packed, scale, None)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        kernels.w8a8_linear(torch.randn(2, 64).half(), packed, scale, None)


def test_the_portable_build_computes_the_same_bits(tmp_path: Path):
    """The loop a CPU without VNNI compiles, built here with VNNI switched
    off, against this machine's build: the same integer sums in the same
    float steps, so the same bits."""
    from torch.utils.cpp_extension import load

    source = Path(__file__).parents[1] / "carpool" / "model" / "csrc" / "int8_linear.cpp"
    binding = tmp_path / "portable_w8a8.cpp"
    binding.write_text(f'#include "{source}"\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n'
                       '  m.def("w8a8_linear", &w8a8_linear, "");\n'
                       '  m.def("w8a8_linear_native", &w8a8_linear_native, "");\n}\n')
    portable = load(name="carpool_portable_w8a8", sources=[str(binding)],
                    build_directory=str(tmp_path), extra_cflags=[
                        "-O2", "-march=native", "-mno-avx512vnni", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"])
    assert not portable.w8a8_linear_native()
    kernels = load_cpu_ops()
    assert kernels.w8a8_linear_native() == VNNI
    weight, bias = _layer(48, 160)
    packed, scale = pack_int8(weight)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(11, 160).to(dtype)
        assert torch.equal(portable.w8a8_linear(x, packed, scale, bias),
                           kernels.w8a8_linear(x, packed, scale, bias))


@pytest.mark.skipif(not VNNI, reason="W8A8 serves only where the CPU has AVX512-VNNI")
def test_an_engine_serves_on_w8a8_and_lets_the_bf16_weights_go(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", quantization="w8a8")
    model = llm.engine.executor.model
    layers = [getattr(layer, name) for layer in model.layers for name in layer.linear_names()]
    assert all(isinstance(layer, W8A8Linear) for layer in [*layers, model.head])
    assert llm.engine.executor.kernel_plan.batched == "w8a8 (vpdpbusd)"
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # One prompt alone, then in a batch of four: the same tokens (rows never
    # depend on their step; the attention kernels are per sequence too).
    alone = llm.generate(["the quick brown fox"], params)[0].token_ids
    batch = llm.generate(["a b c", "the quick brown fox", "hello world", "zz"], params)
    assert batch[1].token_ids == alone and len(alone) == 12
    assert all(layer.portable is None for layer in layers)  # the kernels ran: bf16 let go
