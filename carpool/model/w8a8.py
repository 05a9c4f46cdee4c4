"""INT8 weights times INT8 activations on CPUs with AVX512-VNNI
(``--quantization w8a8``).

Why: a batched step on a CPU without AMX is bound by multiply-adds, and
VNNI's ``vpdpbusd`` does twice the multiply-adds of AVX512-BF16's
``vdpbf16ps`` per instruction; one row reads half the bytes of bf16.
Measured on a 2-core AMD EPYC (AVX512-VNNI, no AMX), one layer of the
default model (its four matmuls; ``scripts/w8a8_bench.py``): docs/numbers/cpu.md.

How: each linear layer's weight is quantized once per output channel,
symmetrically (``scale = max|w| / 127``). Each step quantizes its input
inside the kernel (``csrc/int8_linear.cpp``), one scale per 32 inputs of a
row (dynamic, as llama.cpp's Q8_0 activations: one scale per row lets the
default model's outlier channels swamp the rest), sums each 32 exactly in
int32, and scales back to the activations' dtype. A row's output is the
same bits whatever else is in its step (prefill or decode, 1 row or 256):
results do not depend on the batch. Every step uses it, so prefill and
decode agree (a seeded request samples the same whether its prompt was
cached or not).

Memory: the INT8 copy is half the bf16 weights; the bf16 weights are let go
once the kernels run (they serve only while the kernels compile).

Accuracy (tests/test_quantization.py, the default model): docs/numbers/cpu.md.
"""
from __future__ import annotations

import torch
from torch import nn

GROUP = 16  # output channels per packed group (csrc/int8_linear.cpp)
QUAD = 4    # inputs per 32-bit lane
SPAN = 32   # inputs per activation scale


def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [out/16, in/4, 16, 4], fp32 scale [out]) of a [out, in]
    weight: codes symmetric per output channel, stored + 128 (VNNI
    multiplies unsigned weights by signed activations)."""
    wide = weight.detach().float()
    scale = wide.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    codes = torch.round(wide / scale[:, None]).clamp(-127, 127).to(torch.int32) + 128
    out_features, in_features = codes.shape
    packed = (codes.to(torch.uint8).view(out_features // GROUP, GROUP, in_features // QUAD, QUAD)
              .permute(0, 2, 1, 3).contiguous())
    return packed, scale.contiguous()


def unpack_int8(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``pack_int8``'s weight as it multiplies: [out, in] fp32."""
    groups, quads = packed.shape[:2]
    codes = packed.permute(0, 2, 1, 3).reshape(groups * GROUP, quads * QUAD).float() - 128
    return codes * scale[:, None]


def w8a8_packable(weight: torch.Tensor) -> bool:
    """Whether the kernel takes ``weight``'s shape."""
    return weight.dim() == 2 and weight.shape[0] % GROUP == 0 and weight.shape[1] % SPAN == 0


class W8A8Linear(nn.Module):
    """A linear layer on INT8 weights and per-token INT8 activations
    (module docstring), for every step.

    ``kernels``: the compiled CPU ops, or a ``SwitchingCpuOps``: until it is
    ``active`` (compiling in the background), the original weights serve
    through ``F.linear``; from the first step on the kernels they are let go.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels) -> None:  # noqa: ANN001
        super().__init__()
        self.kernels = kernels
        self.out_features, self.in_features = weight.shape
        packed, scale = pack_int8(weight)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.bias = None if bias is None else bias.detach().float()
        self.portable: tuple[torch.Tensor, torch.Tensor | None] | None = (weight, bias)

    @property
    def nbytes(self) -> int:
        """Bytes of the INT8 weights and their scales."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.kernels, "active", True):
            self.portable = None  # the bf16 weights no longer serve: let them go
            return self.kernels.w8a8_linear(x, self.packed, self.scale, self.bias)
        weight, bias = self.portable
        return torch.nn.functional.linear(x, weight, bias)


def w8a8_unavailable(device: torch.device, kernels) -> str | None:  # noqa: ANN001
    """Why W8A8 cannot serve here, or None: it needs our CPU kernels built
    with AVX512-VNNI (their portable loop is exact but slow)."""
    if device.type != "cpu":
        return f"it is a CPU path (device {device})"
    if kernels is None:
        return "the CPU kernels are unavailable"
    native = getattr(kernels, "w8a8_linear_native", None)
    if native is not None and not native():
        return "this CPU lacks AVX512-VNNI"
    if native is None:  # still compiling: what the CPU has
        from carpool.machine import cpu_model_and_flags

        if "avx512_vnni" not in cpu_model_and_flags()[1]:
            return "this CPU lacks AVX512-VNNI"
    return None


def quantize_w8a8(model: nn.Module, kernels, head: bool = True) -> int:  # noqa: ANN001
    """Give every dense decoder linear layer of ``model`` (a
    ``DecoderModel``), and its LM head if ``head``, W8A8 weights; returns
    their bytes. A layer the kernel cannot take keeps its weights."""
    added = 0
    for layer in model.layers:
        for name in layer.linear_names():
            linear = getattr(layer, name)
            if type(linear) is nn.Linear and w8a8_packable(linear.weight):
                replacement = W8A8Linear(linear.weight, linear.bias, kernels)
                setattr(layer, name, replacement)
                added += replacement.nbytes
    weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if head and model.head is None and w8a8_packable(weight):
        model.head = W8A8Linear(weight, None, kernels)
        added += model.head.nbytes
    return added
