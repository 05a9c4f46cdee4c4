"""Weight-only INT8 for CPU decode (``--quantization int8``).

Why: one sequence decoding on a CPU streams every weight from memory once
per token, and that stream is the step. Measured on the default model
(135M parameters, bf16) on a 2-core Xeon: the linear layers take 25 ms of a
34 ms token (85% of the samples in a torch.profiler trace are ``aten::mm``),
~11 GB/s of weights. INT8 weights halve the bytes: the same 121 linear
layers of one token run in 13.3-13.7 ms against 25.2-26.6 ms in bf16.

How: each linear layer's weight is quantized per output channel,
symmetrically (``scale = max|w| / 127``, ``q = round(w / scale)``), and a
step of at most ``max_rows`` rows (a decode of a few sequences) multiplies
by it with ATen's weight-only INT8 kernel (``_weight_int8pack_mm``: bf16
activations, the scales applied to the output). That kernel is a
matrix-vector product per row: past ~4 rows it is slower than the bf16
matrix kernel (216 against 93 us for a 576x1536 layer at 16 rows), so
larger steps (prefill, batched decode) keep the bf16 weights. The INT8
copy adds half the bf16 weights' memory; it buys latency, not memory.

Accuracy (tests/test_quantization.py, the default model): see the README.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("int8",)
# Rows up to which the INT8 kernel beats bf16 (measured: 1 row 26 vs 81 us,
# 4 rows 51 vs 89 us, 16 rows 216 vs 93 us for 576x1536 on a 2-core Xeon).
INT8_MAX_ROWS = 4


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [out, in], fp32 scale [out]): symmetric per output row."""
    wide = weight.detach().float()
    scale = wide.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    quantized = torch.round(wide / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized.contiguous(), scale


class Int8DecodeLinear(nn.Module):
    """A linear layer whose small steps use INT8 weights (module docstring).

    ``weight`` and ``bias`` are the original layer's (kept for large steps);
    ``qweight`` / ``scales`` the INT8 copy. The output is in ``x``'s dtype.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 max_rows: int = INT8_MAX_ROWS) -> None:
        super().__init__()
        self.weight, self.bias, self.max_rows = weight, bias, max_rows
        quantized, scale = quantize_rows(weight)
        self.register_buffer("qweight", quantized, persistent=False)
        # The kernel applies the scales in the activations' dtype.
        self.register_buffer("scales", scale.to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(),
                                                 self.qweight, self.scales).to(x.dtype)
        return out if self.bias is None else out + self.bias


def int8_unavailable(device: torch.device) -> str | None:
    """Why INT8 decode cannot run here, or None."""
    if device.type != "cpu":
        return f"it is a CPU decode path (device {device})"
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return f"this torch ({torch.__version__}) lacks aten::_weight_int8pack_mm"
    return None


def quantize_int8(model: nn.Module, max_rows: int = INT8_MAX_ROWS) -> int:
    """Give ``model`` (a ``LlamaModel``) INT8 decode copies of every decoder
    linear layer and of the LM head; returns the bytes the copies take."""
    added = 0
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            linear = getattr(layer, name)
            replacement = Int8DecodeLinear(linear.weight, linear.bias, max_rows)
            setattr(layer, name, replacement)
            added += replacement.qweight.numel() + 2 * replacement.scales.numel()
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.head = Int8DecodeLinear(head, None, max_rows)
    added += model.head.qweight.numel() + 2 * model.head.scales.numel()
    return added
