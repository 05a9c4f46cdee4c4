"""bf16 linear layers for decode steps of a few rows, on weights packed for
our C++ kernel (``packed_linear`` in ``csrc/packed_linear.cpp``).

Why: a decode step of one sequence reads every weight once, so its linear
layers are a stream of weights through a matrix-vector product. ATen's bf16
matrix kernel (oneDNN), blocked for large matrices, reaches ~11 GB/s on
such steps on a 2-core Xeon: the default model's 121 linear layers and LM
head took 24.9 ms a token. Packed as 16 output rows x 2 inputs per 64-byte
load, with one AVX512-BF16 dot-product instruction per load, the same
layers take 10.9 ms (1 row), 13.3 (4 rows), ~16.4 (8 rows); ATen wins
from ~16 rows on (it is flat, ~22-28 ms, from 1 to 64 rows), so larger steps
(prefill, batched decode) keep the original weights (tables in docs/numbers/cpu.md,
``scripts/decode_step_time.py``).

Cost: the packed copy doubles the bf16 weights' memory, so ``auto`` packs
only where the copy takes at most a quarter of the memory available.
"""
from __future__ import annotations

import torch
from torch import nn

from carpool.model.blocked_linear import PlainLinear

# Rows up to which the packed kernel beats ATen's (the module docstring).
PACKED_MAX_ROWS = 8
GROUP = 16  # output rows per 64-byte tile (csrc/packed_linear.cpp)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 -> [out / 16, in / 2, 16, 2]: group g of 16 output rows
    as one contiguous slab, each 64-byte tile 16 rows x 2 inputs."""
    out_features, in_features = weight.shape
    return (weight.detach().view(out_features // GROUP, GROUP, in_features // 2, 2)
            .permute(0, 2, 1, 3).contiguous())


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """``pack_weight``'s inverse: [out / 16, in / 2, 16, 2] -> [out, in]."""
    groups, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(groups * GROUP, pairs * 2)


def packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` has the shape and dtype the kernel takes."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.shape[0] % GROUP == 0 and weight.shape[1] % 2 == 0)


class PackedDecodeLinear(nn.Module):
    """A bf16 linear layer whose decode-only steps of up to ``max_rows``
    rows run our packed kernel, and other steps ``F.linear`` on the
    original weight.

    ``kernels``: the compiled CPU ops, or a ``SwitchingCpuOps`` (then the
    portable path runs until it is ``active``; it switches between steps
    only, so a step never mixes the two paths).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels,  # noqa: ANN001
                 step_kind=None, max_rows: int = PACKED_MAX_ROWS) -> None:  # noqa: ANN001
        super().__init__()
        self.weight, self.bias, self.kernels, self.max_rows = weight, bias, kernels, max_rows
        self.dense = PlainLinear(weight, bias)  # larger steps (blocked_linear.py may swap it)
        # The model's StepKind (layers.py): the kernel on decode-only steps
        # only; None: on any step of up to max_rows rows.
        self.step_kind = step_kind
        self.register_buffer("packed", pack_weight(weight), persistent=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copy."""
        return self.packed.numel() * self.packed.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.shape[0] <= self.max_rows and x.dtype == torch.bfloat16
                and (self.step_kind is None or self.step_kind.decode_only)
                and getattr(self.kernels, "active", True)):
            return self.kernels.packed_linear(x, self.packed, self.bias)
        return self.dense(x)


def pack_for_decode(model: nn.Module, kernels) -> int:  # noqa: ANN001
    """Give ``model`` (a bf16 ``DecoderModel``) packed decode copies of every
    plain decoder linear layer and of its LM head (unless quantization
    already replaced them); returns the bytes the copies take."""
    added = 0
    for layer in model.layers:
        for name in layer.linear_names():
            linear = getattr(layer, name)
            if type(linear) is nn.Linear and packable(linear.weight):
                packed = PackedDecodeLinear(linear.weight, linear.bias, kernels, model.step_kind)
                setattr(layer, name, packed)
                added += packed.nbytes
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if model.head is None and packable(head):
        model.head = PackedDecodeLinear(head, None, kernels, model.step_kind)
        added += model.head.nbytes
    return added


def packed_bytes(model: nn.Module) -> int:
    """Bytes ``pack_for_decode`` would add to ``model`` (bf16 weights)."""
    total = sum(getattr(layer, name).weight.numel() for layer in model.layers
                for name in layer.linear_names()
                if type(getattr(layer, name)) is nn.Linear)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return 2 * (total + (head.numel() if model.head is None else 0))
