"""The mixture-of-experts MLP of Mixtral, Qwen3-MoE and DeepSeek-V3 over a
flat token batch: routing (``route``) and the experts (``MoEBlock``), with
the weights of every expert stacked into two tensors.

Three execution paths over the same weights, chosen by ``MoEBlock.impl``:

* ``"grouped"`` (default): sort the T*k (token, expert) pairs by expert,
  gather their rows once into one contiguous buffer, run each expert's
  gate_up and down on its slice of it (one ``torch._grouped_mm`` call for
  all experts where it works, else one mm per active expert; one
  act-and-mul over the whole buffer between), scale by the routing weights
  and scatter-add back.
* ``"loop"``: transformers' eager reference, a boolean mask per expert.
* ``"triton"``: the fused Triton kernels (carpool/model/triton_moe.py) on
  the same sorted layout; on the CPU only in Triton's interpreter (tests).
  ``"grouped"`` takes them itself on a CUDA device where Triton imports
  and ``gemm`` is ``"auto"`` (without autograd: they have no backward).

Numerics follow transformers 5.25 (see ``route`` and ``MoESpec``'s
``router_fp32`` / ``weights_in_model_dtype``): in fp32 the paths and
transformers agree to rounding (tests/test_moe_block.py).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from carpool.model.moe_cpu import BlockedExperts, PackedExperts, packable_experts, segments_of
from carpool.model.moe_spec import (
    FUSED,
    PER_EXPERT,
    MoESpec,
    detect_layout,
    expected_moe_shapes,
    moe_weight_names,
)

IMPLS = ("grouped", "loop", "triton")


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_moe_unavailable(device: torch.device) -> str | None:
    """Why ``impl="triton"`` cannot run on ``device``, or None when it can."""
    if not _triton_imports():
        return "triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "no GPU (on the CPU the kernels need TRITON_INTERPRET=1: tests only)"
    return None


def route(router_logits: torch.Tensor, spec: MoESpec,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's experts: router_logits [T, E] (fp32) -> (weights
    [T, k] fp32, expert ids [T, k] int64). ``bias`` [E] shifts the scores
    used to choose experts only; the weights come from the unbiased scores."""
    if spec.correction_bias and bias is None:
        raise ValueError("this MoESpec routes with a correction bias; pass bias")
    logits = router_logits.float()
    if spec.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = logits.sigmoid()
    if bias is None and spec.n_group == 1:
        # Mixtral / Qwen3-MoE: the top-k of the scores themselves, sorted.
        weights, ids = torch.topk(scores, spec.top_k, dim=-1)
    else:
        choice = scores if bias is None else scores + bias.float()
        if 1 < spec.n_group and spec.topk_group < spec.n_group:
            choice = _limit_to_groups(choice, spec)
        ids = torch.topk(choice, spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    if spec.renormalize:
        # DeepSeek-V3 guards the sum with 1e-20 (sigmoid scores can all be ~0);
        # softmax top-k sums are > 0, and transformers adds nothing there.
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if spec.scoring == "sigmoid" else total)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids


def _limit_to_groups(choice: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """``choice`` [T, E] with every expert outside the token's ``topk_group``
    best groups set to -inf; a group scores the sum of its two best experts."""
    tokens, per_group = choice.shape[0], spec.num_experts // spec.n_group
    grouped = choice.view(tokens, spec.n_group, per_group)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, spec.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(tokens, spec.num_experts)


def _tracks_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _segment_mm(rows: torch.Tensor, weight: torch.Tensor,
                segments: list[tuple[int, int, int]]) -> torch.Tensor:
    """rows [N, in] lying in expert-contiguous ``segments`` (expert, start,
    end) times weight [E, out, in] -> [N, out], expert by expert."""
    if _tracks_grad(rows, weight):
        return torch.cat([F.linear(rows[s:e], weight[x]) for x, s, e in segments])
    # No autograd: write each product into its slice (no concatenation copy).
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    for expert, start, end in segments:
        torch.mm(rows[start:end], weight[expert].t(), out=out[start:end])
    return out


def _grouped_mm_matches_mm(weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm (torch >= 2.9 has a CPU kernel; CUDA needs a
    recent GPU and aligned shapes) runs on ``weight``'s device, dtype and
    shape, an empty group included, and agrees with mm."""
    if not hasattr(torch, "_grouped_mm") or weight.shape[0] < 2:
        return False
    rows = torch.randn(3, weight.shape[2], generator=torch.Generator().manual_seed(0))
    rows = rows.to(weight.device, weight.dtype)
    offs = torch.tensor([0, 3], dtype=torch.int32, device=weight.device)  # expert 0: none
    try:
        with torch.no_grad():
            got = torch._grouped_mm(rows, weight[:2].transpose(-2, -1), offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    want = rows @ weight[1].t()
    return got.shape == want.shape and torch.allclose(got.float(), want.float(),
                                                      rtol=1e-2, atol=1e-3)


class MoEBlock(nn.Module):
    """A mixture-of-experts MLP: x [T, H] -> [T, H] (any leading dims).

    Weights: router ``gate`` (H -> E, no bias); ``e_score_correction_bias``
    [E] (fp32 buffer) when ``spec.correction_bias``; ``w_gate_up`` [E, 2I, H]
    (each expert's gate rows, then its up rows) and ``w_down`` [E, H, I];
    shared experts as one MLP ``shared_gate_up`` (H -> 2S) and ``shared_down``.
    After each forward ``last_expert_counts`` is a CPU int64 [E]: the
    (token, expert) pairs each expert took (they sum to T * top_k)."""

    def __init__(self, spec: MoESpec, hidden_size: int, impl: str = "grouped") -> None:
        super().__init__()
        e, i, s = spec.num_experts, spec.expert_intermediate_size, spec.shared_intermediate_size
        self.spec, self.hidden_size = spec, hidden_size
        self.impl = impl
        # The grouped path's expert GEMMs: "mm" (one per active expert),
        # "grouped_mm" (torch._grouped_mm, one call) or "auto": the Triton
        # kernels on CUDA where Triton imports, else grouped_mm where a first
        # call on this device and dtype shows it works, else mm.
        self.gemm = "auto"
        # The Triton kernels' tile sizes (triton_moe.BlockSizes); None: picked per call.
        self.triton_blocks = None
        self._grouped_mm_works: dict[tuple[str, torch.dtype], bool] = {}
        self.gate = nn.Linear(hidden_size, e, bias=False)
        if spec.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        # Zeros until load_hf_weights fills them (cheap to allocate at any size).
        self.w_gate_up = nn.Parameter(torch.zeros(e, 2 * i, hidden_size))
        self.w_down = nn.Parameter(torch.zeros(e, hidden_size, i))
        self.shared_gate_up = nn.Linear(hidden_size, 2 * s, bias=False) if s else None
        self.shared_down = nn.Linear(s, hidden_size, bias=False) if s else None
        self.last_expert_counts = torch.zeros(e, dtype=torch.int64)
        # CPU bf16: the experts' weights laid out for their kernel once at
        # load (carpool/model/moe_cpu.py: ``block_experts`` or ``pack_experts``),
        # the plain stacked ones then dropped; None: plain.
        self.cpu_experts: BlockedExperts | PackedExperts | None = None
        # Expert parallel (carpool/parallel/experts.py): sends each token's
        # picks to the ranks holding those experts and combines the answers;
        # None: every expert is here.
        self.dispatch = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl not in IMPLS:
            raise ValueError(f"MoEBlock.impl {self.impl!r} is not one of {IMPLS}")
        shape = x.shape
        x = x.reshape(-1, self.hidden_size)
        weights, ids = route(self.router_logits(x), self.spec, self.e_score_correction_bias)
        if self.spec.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        counts = torch.bincount(ids.flatten(), minlength=self.spec.num_experts)
        self.last_expert_counts = counts.cpu()
        if self.dispatch is not None:  # expert parallel: the experts are on several ranks
            return self.dispatch(self, x, weights, ids).view(shape)
        out = self.routed(x, weights, ids, counts, self.last_expert_counts)
        return self.with_shared(x, out).view(shape)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               counts: torch.Tensor, counts_cpu: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted outputs for ``x``'s rows [T, H]: ``ids``
        [T, k] index this block's experts, ``counts`` [E] their rows."""
        if isinstance(self.cpu_experts, PackedExperts):
            return self.cpu_experts.forward(x, weights, ids, counts_cpu)
        if self._uses_triton(x):
            return self._triton(x, weights, ids, counts)
        if self.impl == "grouped":
            return self._grouped(x, weights, ids, counts, counts_cpu)
        return self._loop(x, weights, ids)

    def with_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus the shared experts' output on ``x`` (after the routed
        experts, as transformers adds it)."""
        if self.shared_gate_up is None:
            return out
        gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
        return out + self.shared_down(F.silu(gate) * up)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[T, E] fp32. Mixtral and Qwen3-MoE run the router in the model's
        dtype and widen its logits; DeepSeek-V3 runs it in fp32."""
        if self.spec.router_fp32:
            return F.linear(x.float(), self.gate.weight.float())
        return F.linear(x, self.gate.weight.to(x.dtype)).float()

    def _uses_triton(self, x: torch.Tensor) -> bool:
        """impl "triton" always (or an error saying why it cannot); "grouped"
        on CUDA with gemm "auto", when Triton imports and nothing needs grad."""
        device, grad = x.device, _tracks_grad(x, self.w_gate_up, self.w_down)
        if self.impl == "triton":
            why = triton_moe_unavailable(device) or (grad and "it has no backward")
            if why:
                raise ValueError(f"MoEBlock.impl 'triton' cannot run: {why}")
            return True
        return (self.impl == "grouped" and self.gemm == "auto" and device.type == "cuda"
                and not grad and _triton_imports())

    def _triton(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        from carpool.model.triton_moe import fused_experts

        return fused_experts(x, self.w_gate_up, self.w_down, weights, ids, counts,
                             self.triton_blocks)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 counts: torch.Tensor, counts_cpu: torch.Tensor) -> torch.Tensor:
        k, inter = ids.shape[1], self.spec.expert_intermediate_size
        out = torch.zeros_like(x)
        if x.shape[0] == 0:
            return out
        # A stable sort keeps each expert's tokens in ascending order, the
        # order the loop path (and transformers) feeds them in.
        order = torch.sort(ids.flatten(), stable=True)[1]
        token_of = order // k
        matmul = self._expert_matmul(counts, counts_cpu)
        gate_up = matmul(x.index_select(0, token_of), self.w_gate_up)
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        row_weights = weights.flatten()[order, None]
        if _tracks_grad(gate_up):
            scaled = (matmul(F.silu(gate) * up, self.w_down) * row_weights).to(x.dtype)
        else:
            # In place: no [N, I] or [N, H] temporaries. down's rows are gate's
            # (row stride 2I, which mm takes as is). mul_ of a bf16 tensor by
            # fp32 weights multiplies in fp32 and rounds once, as (a * w).to(bf16).
            scaled = matmul(F.silu(gate, inplace=True).mul_(up), self.w_down).mul_(row_weights)
        # One index_add_ adds each token's k rows in expert order, as the loop's
        # per-expert ones do. In bf16 torch's CPU kernel sums them in fp32 and
        # rounds once: bit for bit the loop's (and transformers') for top_k <= 2,
        # closer to the fp32 result than their k roundings above that.
        return out.index_add_(0, token_of, scaled)

    def block_experts(self) -> int:
        """Lay each expert's weights out once in oneDNN's blocked format
        (bit-identical to mm in bf16, and 1.1-1.6x faster per expert from 2
        to 256 rows on a 2-core AMX Xeon), dropping the stacked plain ones;
        returns the bytes made. CPU bf16 inference only: the grouped path is
        then the one path."""
        if self.cpu_experts is not None:
            return 0
        self.cpu_experts = BlockedExperts(self.w_gate_up, self.w_down)
        return self._drop_plain_experts()

    def pack_experts(self, kernels) -> int:  # noqa: ANN001 - the CPU ops or a SwitchingCpuOps
        """Pack every expert once for our fused kernel (moe_cpu.PackedExperts),
        dropping the stacked plain weights; returns the bytes made (0 where
        the weights do not fit the kernel's shapes, or are laid out already)."""
        if self.cpu_experts is not None or not packable_experts(self.w_gate_up, self.w_down):
            return 0
        self.cpu_experts = PackedExperts(self.w_gate_up, self.w_down, kernels)
        return self._drop_plain_experts()

    def _drop_plain_experts(self) -> int:
        made = (self.w_gate_up.numel() + self.w_down.numel()) * self.w_gate_up.element_size()
        empty = torch.empty(0, dtype=self.w_gate_up.dtype)
        self.w_gate_up, self.w_down = nn.Parameter(empty), nn.Parameter(empty.clone())
        return made

    def plain_expert_weights(self) -> dict[str, torch.Tensor]:
        """The stacked expert weights by parameter name, read back from the
        laid-out copies where there are (for fingerprints)."""
        if self.cpu_experts is None:
            return {"w_gate_up": self.w_gate_up, "w_down": self.w_down}
        return self.cpu_experts.plain()

    def _expert_matmul(self, counts: torch.Tensor, counts_cpu: torch.Tensor):  # noqa: ANN202
        """(rows [N, in] sorted by expert, weight [E, out, in]) -> [N, out]
        for the expert ``counts`` [E] of this forward (``counts_cpu``: the
        same on the host), by ``self.gemm`` (blocked experts: their own
        oneDNN products, expert by expert)."""
        if isinstance(self.cpu_experts, BlockedExperts):
            segments = segments_of(counts_cpu)
            which = {id(self.w_gate_up): 0, id(self.w_down): 1}
            return lambda rows, w: self.cpu_experts.matmul(rows, which[id(w)], segments)
        if self._pick_gemm(counts.device) == "grouped_mm":
            # One call for all experts: on CPU (torch 2.13) 1-6% faster than mm
            # per expert from 8 tokens up (scripts/moe_bench.py), same results.
            offs = counts.cumsum(0).to(torch.int32)
            return lambda rows, w: torch._grouped_mm(rows, w.transpose(-2, -1), offs=offs)
        segments = segments_of(counts_cpu)
        return lambda rows, w: _segment_mm(rows, w, segments)

    def _pick_gemm(self, device: torch.device) -> str:
        if self.gemm not in ("auto", "mm", "grouped_mm"):
            raise ValueError(f"MoEBlock.gemm {self.gemm!r} is not 'auto', 'mm' or 'grouped_mm'")
        if self.gemm != "auto":
            return self.gemm
        key = (str(device), self.w_gate_up.dtype)
        if key not in self._grouped_mm_works:
            self._grouped_mm_works[key] = all(
                _grouped_mm_matches_mm(w) for w in (self.w_gate_up, self.w_down))
        return "grouped_mm" if self._grouped_mm_works[key] else "mm"

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The reference: each expert takes the tokens its boolean mask selects."""
        out = torch.zeros_like(x)
        for expert in range(self.w_gate_up.shape[0]):  # this block's experts
            token_idx, slot = torch.nonzero(ids == expert, as_tuple=True)
            if token_idx.numel() == 0:
                continue
            gate, up = F.linear(x[token_idx], self.w_gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w_down[expert])
            out.index_add_(0, token_idx, (y * weights[token_idx, slot, None]).to(x.dtype))
        return out

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001
        """Casting the block (``.to(bf16)``) keeps DeepSeek-V3's router weight
        and the correction bias in fp32, as transformers keeps them
        (``_keep_in_fp32_modules_strict``); device moves still apply."""
        kept = {}
        if self.spec.router_fp32 and self.gate.weight.dtype == torch.float32:
            kept["gate"] = self.gate.weight.detach()
        bias = self.e_score_correction_bias
        if bias is not None and bias.dtype == torch.float32:
            kept["bias"] = bias
        super()._apply(fn, recurse)
        if "gate" in kept and self.gate.weight.dtype != torch.float32:
            self.gate.weight.data = kept["gate"].to(self.gate.weight.device)
        if "bias" in kept and self.e_score_correction_bias.dtype != torch.float32:
            device = self.e_score_correction_bias.device
            self.e_score_correction_bias = kept["bias"].to(device)
        return self

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor], prefix: str) -> str:
        """Copy layer ``prefix``'s MoE tensors in (``prefix`` e.g.
        ``"model.layers.3."``), from either layout (see carpool/model/moe_spec.py):
        per-expert hub names, stacked here expert by expert, or transformers'
        fused ones. Checks names and shapes first; returns the layout found.
        ``weights`` may be any mapping (a lazy safetensors view): only this
        layer's names are read, one tensor at a time."""
        spec = self.spec
        layout = detect_layout(weights.keys(), spec, prefix)
        expected = expected_moe_shapes(spec, self.hidden_size, prefix, layout)
        missing = [n for n in expected if n not in weights]
        if missing:
            raise ValueError(f"{layout} MoE checkpoint lacks {len(missing)} tensor(s), "
                             f"e.g. {missing[:3]}")
        wrong = [f"{n}: {tuple(weights[n].shape)} != {shape}" for n, shape in expected.items()
                 if tuple(weights[n].shape) != shape]
        if wrong:
            raise ValueError(f"MoE tensor shapes differ from the spec: {wrong[:3]}")
        names = moe_weight_names(spec, prefix, layout)
        self.gate.weight.copy_(weights[names["router"]])
        if spec.correction_bias:
            self.e_score_correction_bias.copy_(weights[names["bias"]])
        if self.shared_gate_up is not None:
            self.shared_gate_up.weight.copy_(
                torch.cat([weights[names["shared_gate"]], weights[names["shared_up"]]]))
            self.shared_down.weight.copy_(weights[names["shared_down"]])
        if layout == FUSED:
            self.w_gate_up.copy_(weights[names["gate_up"]])
            self.w_down.copy_(weights[names["down"]])
            return layout
        inter = spec.expert_intermediate_size
        for e in range(spec.num_experts):  # expert by expert: no stacked temporary
            self.w_gate_up[e, :inter].copy_(weights[names[f"gate.{e}"]])
            self.w_gate_up[e, inter:].copy_(weights[names[f"up.{e}"]])
            self.w_down[e].copy_(weights[names[f"down.{e}"]])
        return PER_EXPERT
