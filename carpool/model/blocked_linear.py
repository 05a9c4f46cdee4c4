"""bf16 linear layers on weights laid out once in oneDNN's blocked format
(``--blocked-weights``).

Why: ``F.linear`` hands oneDNN a plain [out, in] weight, and oneDNN's AMX /
AVX512 matrix kernel re-lays it out into its tiles on every call. Measured
on the default model's 121 linear layers and LM head on a 2-core Xeon with
AMX (``scripts/blocked_linear_bench.py``): one step of 64 rows takes 31.8
ms through ``F.linear`` and 20.9 ms on weights reordered once with
``mkldnn._reorder_linear_weight``; 1.35-1.52x from 1 to 256 rows. The
results are bit-identical to ``F.linear``'s in bf16 (same kernel, same
summation order; the tests check it), so this changes speed only, never
tokens. In fp32 oneDNN's blocked path rounds differently, so fp32 (the
path checked against transformers) keeps ``F.linear``.

How: every plain decoder linear layer becomes a ``BlockedLinear``, and the
modules that run a small-step kernel of their own (``PackedDecodeLinear``,
``LowBitDecodeLinear``) get one as their ``dense`` path for larger steps;
the plain weight is then dropped, so the blocked copy costs no memory,
except for the LM head: its plain weight is the embedding table (tied) or
``lm_head``, both kept.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PlainLinear(nn.Module):
    """``F.linear`` on a plain weight: the dense path of a layer by default."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class BlockedLinear(nn.Module):
    """A bf16 linear layer whose weight is held in oneDNN's blocked layout
    (an opaque ``torch._mkldnn`` tensor: it can only be multiplied)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()

    @property
    def nbytes(self) -> int:
        """Bytes of the blocked weight."""
        return self.out_features * self.in_features * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.blocked, self.bias, "none", [], "")


def blocked_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why blocked weights cannot serve here, or None."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return f"it is a CPU bf16 path (device {device}, dtype {dtype})"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn,
                                                              "_linear_pointwise"):
        return f"this torch ({torch.__version__}) has no oneDNN linear"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bf16 kernels for this CPU"
    return None




def _dense_of(module: nn.Module) -> nn.Module:
    """``module`` with its dense path on blocked weights (a replacement
    for a plain ``nn.Linear``; the same module, re-pointed, otherwise)."""
    if type(module) is nn.Linear:
        return BlockedLinear(module.weight, module.bias)
    dense = getattr(module, "dense", None)
    if type(dense) is PlainLinear:
        module.dense = BlockedLinear(dense.weight, dense.bias)
        module.weight = None  # the plain copy is no longer read: let it go
    return module


def block_weights(model: nn.Module) -> int:
    """Put every dense linear path of ``model`` (a bf16 ``DecoderModel``) on
    blocked weights; returns the bytes of blocked weights made."""
    made = 0
    for layer in model.layers:
        if layer.moe is not None:
            made += layer.moe.block_experts()
        for name in layer.linear_names():
            replacement = _dense_of(getattr(layer, name))
            setattr(layer, name, replacement)
            made += _blocked_bytes(replacement)
    if model.head is None:
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        model.head = BlockedLinear(head, None)
    else:
        model.head = _dense_of(model.head)
    return made + _blocked_bytes(model.head)


def _blocked_bytes(module: nn.Module) -> int:
    if isinstance(module, BlockedLinear):
        return module.nbytes
    dense = getattr(module, "dense", None)
    return dense.nbytes if isinstance(dense, BlockedLinear) else 0
