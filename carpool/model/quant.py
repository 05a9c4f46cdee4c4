"""Weight-only INT8 / INT4 for CPU decode (``--quantization int8|int4``).

Why: one sequence decoding on a CPU streams every weight from memory once
per token, and that stream is the step. Measured on the default model
(135M parameters, bf16) on a 2-core Xeon: the linear layers take 25 ms of a
34 ms token (85% of the samples in a torch.profiler trace are ``aten::mm``),
~11 GB/s of weights. INT8 weights halve the bytes: the same 121 linear
layers of one token run in 13.3-13.7 ms against 25.2-26.6 ms in bf16, and
INT4 (groups of 32) in 5.6-5.7 ms.

How: INT8 quantizes each linear layer's weight per output channel,
symmetrically (``scale = max|w| / 127``, ``q = round(w / scale)``); INT4
per group of 32 inputs, asymmetrically (``w ~ q * scale + min``, as
llama.cpp's Q4_1). A step of at most ``max_rows`` rows (a decode of a few
sequences) multiplies by them with ATen's weight-only kernels
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``: bf16
activations). They are matrix-vector products per row: past ~4 rows they
are slower than the bf16 matrix kernel (INT8: 216 against 93 us for a
576x1536 layer at 16 rows), so larger steps (prefill, batched decode) keep
the bf16 weights. The copy adds half (INT8) or a quarter (INT4) of the
bf16 weights' memory: it buys latency, not memory.

Accuracy (tests/test_quantization.py, the default model): see docs/numbers/cpu.md.
"""
from __future__ import annotations

import torch
from torch import nn

from carpool.model.blocked_linear import PlainLinear

QUANTIZATIONS = ("int8", "int4")
# Rows up to which the low-bit kernels beat bf16 (576x1536, 2-core Xeon, in
# cache: INT8 1 row 26 vs 81 us, 4 rows 51 vs 89, 16 rows 216 vs 93; INT4
# 1 row 30 vs 77, 4 rows 52 vs 77, 8 rows 104 vs 75).
LOW_BIT_MAX_ROWS = 4
# INT4: weights in groups of 32 along the input, as llama.cpp's Q4_0/Q4_1
# blocks (the default model's own GGUF is Q4_1: its values come back
# almost exactly).
INT4_GROUP = 32


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [out, in], fp32 scale [out]): symmetric per output row."""
    wide = weight.detach().float()
    scale = wide.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    quantized = torch.round(wide / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized.contiguous(), scale


def quantize_groups(weight: torch.Tensor, group: int = INT4_GROUP
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes 0..15 as int32 [out, in], scale and minimum [out, in / group]):
    asymmetric 4-bit per group of ``group`` inputs, w ~ code * scale + min."""
    out_features, in_features = weight.shape
    grouped = weight.detach().float().reshape(out_features, in_features // group, group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp(min=1e-12)
    codes = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15)
    return codes.to(torch.int32).reshape(out_features, in_features), scale, low


class LowBitDecodeLinear(nn.Module):
    """A linear layer whose small steps use INT8 or INT4 weights (module
    docstring). ``weight`` and ``bias`` are the original layer's (kept for
    large steps); the low-bit copy lives in buffers. The output is in
    ``x``'s dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: str = "int8",
                 max_rows: int = LOW_BIT_MAX_ROWS, kernels=None,  # noqa: ANN001
                 step_kind=None) -> None:  # noqa: ANN001
        """``kernels``: our compiled CPU ops (or a ``SwitchingCpuOps``) for
        INT4 in our own layout (``pack_int4``); None: ATen's kernels.
        ``step_kind``: the model's ``StepKind``: low-bit weights on
        decode-only steps only (see layers.py); None: on any small step."""
        super().__init__()
        self.weight, self.bias, self.scheme, self.max_rows = weight, bias, scheme, max_rows
        self.dense = PlainLinear(weight, bias)  # larger steps (blocked_linear.py may swap it)
        self.step_kind = step_kind
        self.kernels = kernels if scheme == "int4" else None
        if scheme == "int8":
            quantized, scale = quantize_rows(weight)
            self.register_buffer("qweight", quantized, persistent=False)
            # The kernel applies the scales in the activations' dtype.
            self.register_buffer("scales", scale.to(torch.bfloat16), persistent=False)
        elif scheme == "int4" and self.kernels is not None:
            codes, scales, mins = pack_int4(*quantize_groups(weight))
            self.register_buffer("qweight", codes, persistent=False)
            self.register_buffer("scales", scales, persistent=False)
            self.register_buffer("mins", mins, persistent=False)
        elif scheme == "int4":
            codes, scale, low = quantize_groups(weight)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            self.register_buffer("qweight", packed, persistent=False)
            # The kernel's convention: w = (code - 8) * scale + zero, [groups, out, 2].
            zero = low + 8 * scale
            self.register_buffer("scales", torch.stack([scale, zero], dim=-1).transpose(0, 1)
                                 .contiguous().to(torch.bfloat16), persistent=False)
        else:
            raise ValueError(f"unknown quantization {scheme!r}; one of {', '.join(QUANTIZATIONS)}")

    @property
    def nbytes(self) -> int:
        """Bytes of the low-bit copy."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows or not (self.step_kind is None
                                               or self.step_kind.decode_only):
            return self.dense(x)
        if self.kernels is not None:
            if x.dtype != torch.bfloat16 or not getattr(self.kernels, "active", True):
                return self.dense(x)  # e.g. still compiling: bf16
            return self.kernels.int4_linear(x, self.qweight, self.scales, self.mins, self.bias)
        rows = x.to(torch.bfloat16).contiguous()
        if self.scheme == "int8":
            out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, INT4_GROUP,
                                                             self.scales)
        out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_groups``' output in our kernel's layout (csrc/packed_int4.cpp):
    codes uint8 [out/16, in/4, 32] (byte 2r + s of quad u: row r's inputs
    4u + s in the low nibble, 4u + 2 + s in the high one), scales and
    minimums fp16 [out/16, in/32, 16]."""
    out_features, in_features = codes.shape
    quads = codes.to(torch.uint8).view(out_features // 16, 16, in_features // 4, 2, 2)
    packed = (quads[..., 0, :] | (quads[..., 1, :] << 4)).permute(0, 2, 1, 3).contiguous()
    packed = packed.view(out_features // 16, in_features // 4, 32)

    def by_group(values: torch.Tensor) -> torch.Tensor:
        return (values.view(out_features // 16, 16, in_features // INT4_GROUP).permute(0, 2, 1)
                .to(torch.float16).contiguous())

    return packed, by_group(scale), by_group(low)


_KERNELS = {"int8": ("_weight_int8pack_mm",),
            "int4": ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")}


def low_bit_unavailable(scheme: str, device: torch.device) -> str | None:
    """Why ``scheme`` decode cannot run here, or None."""
    if device.type != "cpu":
        return f"it is a CPU decode path (device {device})"
    missing = [name for name in _KERNELS[scheme] if not hasattr(torch.ops.aten, name)]
    if missing:
        return f"this torch ({torch.__version__}) lacks aten::{missing[0]}"
    return None


def quantize_for_decode(model: nn.Module, scheme: str, max_rows: int = LOW_BIT_MAX_ROWS,
                        kernels=None) -> int:  # noqa: ANN001
    """Give ``model`` (a ``DecoderModel``) low-bit decode copies of every
    decoder linear layer and of the LM head; returns the bytes they take.
    An INT4 layer whose inputs are not a multiple of the group stays bf16.
    Under INT4 the LM head is INT8, as llama.cpp's Q4 files keep their
    output matrix at 8 bits or more (the default model's GGUF: Q4_1 layers,
    a Q8_0 embedding): 4-bit logits forked 5 of 16 greedy answers at their
    first token.

    ``kernels`` (INT4 only): run our INT4 kernel (csrc/packed_int4.cpp)
    instead of ATen's, and leave the LM head to ``pack_for_decode`` (bf16
    through our packed kernel: faster here than ATen's INT8 and exact)."""
    def low_bit(weight: torch.Tensor, bias: torch.Tensor | None,
                kind: str = scheme) -> nn.Module | None:
        if kind == "int4" and (weight.shape[1] % INT4_GROUP
                               or (kernels is not None and weight.shape[0] % 16)):
            return None
        return LowBitDecodeLinear(weight, bias, kind, max_rows, kernels, model.step_kind)

    added = 0
    for layer in model.layers:
        for name in layer.linear_names():
            linear = getattr(layer, name)
            replacement = low_bit(linear.weight, linear.bias)
            if replacement is not None:
                setattr(layer, name, replacement)
                added += replacement.nbytes
    if kernels is not None and scheme == "int4":
        return added
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.head = low_bit(head, None, "int8")
    added += 0 if model.head is None else model.head.nbytes
    return added
