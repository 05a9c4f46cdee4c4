"""The routed experts of a ``MoEBlock`` on CPU bf16 weights laid out for
their kernel, once at load (the plain stacked copy is then dropped):

* ``BlockedExperts`` (``MoEBlock.block_experts``): each expert's two weights
  in oneDNN's blocked format; the grouped path multiplies by them expert by
  expert (bit-identical to ``mm`` in bf16). oneDNN's AMX kernels make this
  the choice on CPUs with AMX.
* ``PackedExperts`` (``MoEBlock.pack_experts``): every expert packed for our
  AVX512-BF16 kernel (``packed_moe_experts`` in csrc/moe_experts.cpp), which
  runs the whole routed part of a layer, activation, weighting and the sum
  per token included, in one call. The choice on CPUs with AVX512-BF16 but
  no AMX. Until the kernels are built (first run on a machine) the same
  numbers come from torch on the unpacked weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from carpool.model.packed_linear import GROUP, pack_weight, unpack_weight

# oneDNN builds a kernel per matrix shape on first use (5-18 ms on a 2-core
# CPU; carpool/executor/shapes.py), and each expert's row count changes
# every step: above EXACT_EXPERT_ROWS a segment is padded to a multiple of
# EXPERT_ROW_BUCKET rows, so a few dozen shapes serve every step. (The same
# rule as the dense layers' ``padded_rows``, kept here: the model layer
# does not import the executor's.)
EXACT_EXPERT_ROWS, EXPERT_ROW_BUCKET = 32, 16


def segments_of(counts: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, start, end) of each active expert's rows, sorted by expert.
    ``counts``: the CPU copy (no second device sync)."""
    segments, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            segments.append((expert, start, start + count))
            start += count
    return segments


class BlockedExperts:
    """Each expert's gate_up [2I, H] and down [H, I] in oneDNN's blocked layout."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.weights = [(reorder(w_gate_up[e].detach()), reorder(w_down[e].detach()))
                        for e in range(w_gate_up.shape[0])]

    def matmul(self, rows: torch.Tensor, which: int,
               segments: list[tuple[int, int, int]]) -> torch.Tensor:
        """rows [N, in] sorted by expert times each segment's expert weight
        (``which``: 0 gate_up, 1 down), each segment's rows padded to a
        kernel shape already built."""
        linear = torch.ops.mkldnn._linear_pointwise
        parts = []
        for expert, start, end in segments:
            count = end - start
            padded = count if count <= EXACT_EXPERT_ROWS else -(-count // EXPERT_ROW_BUCKET) * (
                EXPERT_ROW_BUCKET)
            segment = rows[start:end]
            if padded > count:  # pad rows: computed, never read
                segment = F.pad(segment, (0, 0, 0, padded - count))
            parts.append(linear(segment, self.weights[expert][which], None, "none", [], "")[:count])
        return torch.cat(parts)

    def plain(self) -> dict[str, torch.Tensor]:
        return {name: torch.stack([pair[i].to_dense() for pair in self.weights])
                for i, name in enumerate(("w_gate_up", "w_down"))}


def packable_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether the packed kernel takes these stacked expert weights."""
    inter, hidden = w_down.shape[2], w_down.shape[1]
    return (w_gate_up.dtype == torch.bfloat16 and w_down.dtype == torch.bfloat16
            and inter % GROUP == 0 and hidden % GROUP == 0)


def _interleave(w_gate_up: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] (gate rows, then up rows) -> gate and up in alternating
    groups of 16 rows, so a block of the kernel holds both halves of its columns."""
    experts, rows, hidden = w_gate_up.shape
    return (w_gate_up.view(experts, 2, rows // 2 // GROUP, GROUP, hidden)
            .transpose(1, 2).reshape(experts, rows, hidden))


def _deinterleave(w: torch.Tensor) -> torch.Tensor:
    experts, rows, hidden = w.shape
    return (w.view(experts, rows // 2 // GROUP, 2, GROUP, hidden)
            .transpose(1, 2).reshape(experts, rows, hidden))


class PackedExperts:
    """Every expert's weights packed for ``packed_moe_experts``:
    gate_up [E, 2I/16, H/2, 16, 2] (gate and up groups interleaved) and
    down [E, H/16, I/2, 16, 2]. ``kernels``: the compiled CPU ops or a
    ``SwitchingCpuOps`` (torch until it is ``active``)."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, kernels) -> None:  # noqa: ANN001
        self.kernels = kernels
        interleaved = _interleave(w_gate_up.detach())
        self.gate_up = torch.stack([pack_weight(w) for w in interleaved])
        self.down = torch.stack([pack_weight(w.detach()) for w in w_down])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        """x [T, H] bf16, routing ``weights``/``ids`` [T, k], ``counts`` [E]
        (CPU) -> the routed experts' sum per token [T, H]."""
        k = ids.shape[1]
        # A stable sort: each expert's tokens in ascending order, as the grouped path.
        order = torch.sort(ids.flatten(), stable=True)[1]
        row_tokens = order // k
        row_weights = weights.flatten()[order].float()
        if getattr(self.kernels, "active", True):
            return self.kernels.packed_moe_experts(x, row_tokens, counts, row_weights,
                                                   self.gate_up, self.down)
        return self._portable(x, row_tokens, row_weights, counts)

    def _portable(self, x: torch.Tensor, row_tokens: torch.Tensor, row_weights: torch.Tensor,
                  counts: torch.Tensor) -> torch.Tensor:
        """The kernel's numbers from torch (while the kernels compile)."""
        plain = self.plain()
        inter = plain["w_down"].shape[2]
        out = torch.zeros(x.shape, dtype=torch.float32)
        for expert, start, end in segments_of(counts):
            rows = x.index_select(0, row_tokens[start:end])
            gate, up = F.linear(rows, plain["w_gate_up"][expert]).split(inter, dim=-1)
            act = F.silu(gate) * up
            scaled = (F.linear(act, plain["w_down"][expert]) * row_weights[start:end, None])
            out.index_add_(0, row_tokens[start:end], scaled.to(x.dtype).float())
        return out.to(x.dtype)

    def plain(self) -> dict[str, torch.Tensor]:
        return {"w_gate_up": _deinterleave(torch.stack([unpack_weight(w) for w in self.gate_up])),
                "w_down": torch.stack([unpack_weight(w) for w in self.down])}
