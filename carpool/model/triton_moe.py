"""A fused mixture-of-experts MLP in Triton: ``MoEBlock``'s routed experts
(carpool/model/moe.py) as two GEMM kernels over expert-aligned row blocks.

1. ``align_to_blocks`` (torch, no host sync): the T*k (token, expert) pairs
   of ``ids`` [T, k] -- pair ``p`` is token ``p // k``'s slot ``p % k`` --
   sorted by expert (stably: each expert's pairs in ascending order), each
   expert's segment padded to a multiple of ``block_m`` with the sentinel
   ``T*k``. Every block of ``block_m`` sorted entries then holds one
   expert's pairs only, and ``block_experts`` names that expert.
2. ``_gate_up_act_kernel``: per (row block, tile of ``block_n`` of the I
   intermediate columns) the block's rows of x, gathered by token, times
   the expert's gate rows and up rows (two fp32 accumulators over K tiles),
   then SiLU(gate) * up, written to row ``p`` of act [T*k, I].
3. ``_down_kernel``: per (row block, tile of H output columns) act's rows
   times the expert's ``w_down``, times each pair's routing weight, written
   to row ``p`` of [T*k, H]; torch sums each token's k rows.

Rounding follows ``MoEBlock._grouped`` (fp32 accumulation; gate_up, SiLU,
its product with up, the down product and its scaling each rounded to the
model dtype where the torch path rounds), so results match it up to the
order of the fp32 sums. The grid is sized for the most padded rows any
routing can give; blocks past ``num_padded`` (a device tensor) return at
once, so nothing here waits on the device.

On the CPU these run in Triton's interpreter (``TRITON_INTERPRET=1`` set
before import; tests/test_triton_moe.py). Two interpreter flaws (Triton
3.9) are worked around for bfloat16 there only (``INTERP_BF16``): its bf16
``tl.dot`` multiplies raw bit patterns, so bf16 tiles are widened to fp32
first (exact: the same fp32-accumulated product), and its fp32 -> bf16
casts truncate, so ``_to`` adds the round-to-nearest-even bias first.
Compiled for a GPU, the flag is off and neither costs anything.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: Triton chose the interpreter at import (decoration) time, as this does.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two >= 16: tl.dot's minimum) and warps."""

    block_m: int = 16   # sorted (token, expert) rows per program: one expert each
    block_n: int = 64   # output columns per program
    block_k: int = 64   # reduction step
    num_warps: int = 4


def pick_blocks(num_pairs: int, num_experts: int, dtype: torch.dtype) -> BlockSizes:
    """A first guess, untuned: row blocks about as tall as an expert's share
    of the pairs (padding wastes up to block_m - 1 rows per active expert),
    and shorter K steps in fp32 (twice the bytes per element)."""
    per_expert = num_pairs / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    return BlockSizes(block_m=block_m, block_k=32 if dtype == torch.float32 else 64)


@dataclass
class ExpertBlocks:
    """The pairs laid out in expert-aligned blocks (``align_to_blocks``)."""

    sorted_pairs: torch.Tensor   # [capacity] int32 pair index, or T*k (padding)
    block_experts: torch.Tensor  # [capacity // block_m] int32 expert of each block
    num_padded: torch.Tensor     # [1] int32 used entries of sorted_pairs (a block multiple)
    block_m: int


def align_to_blocks(ids: torch.Tensor, num_experts: int, block_m: int,
                    counts: torch.Tensor | None = None) -> ExpertBlocks:
    """Lay the pairs of ``ids`` [T, k] out by expert, each expert's segment
    padded to a multiple of ``block_m``. ``counts`` [E]: pairs per expert
    (computed when not given). Empty experts take no block."""
    flat = ids.flatten()
    pairs, device = flat.numel(), flat.device
    if counts is None:
        counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
    counts = counts.to(torch.int64)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    # Each active expert pads at most block_m - 1 rows: a bound known on the host.
    capacity = -(-(pairs + min(pairs, num_experts) * (block_m - 1)) // block_m) * block_m
    order = torch.sort(flat, stable=True)[1]
    expert_of = flat[order]
    # Sorted entry j goes to its expert's padded start plus its rank there.
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    # Block b starts at b * block_m; its expert is the first whose padded
    # segment ends past that (empty experts end where the previous one does).
    starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, starts, right=True)
    block_experts = block_experts.clamp_(max=num_experts - 1).to(torch.int32)
    return ExpertBlocks(sorted_pairs, block_experts, padded_end[-1:].to(torch.int32), block_m)


@triton.jit
def _to(v, dtype: tl.constexpr, INTERP_BF16: tl.constexpr):
    """fp32 ``v`` rounded to ``dtype``. INTERP_BF16 (interpreted bf16 only):
    add the round-to-nearest-even bias to the bits first, so that the
    interpreter's truncating cast rounds as a GPU's does (finite v)."""
    if INTERP_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        v = (bits + 0x7FFF + ((bits >> 16) & 1)).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _gate_up_act_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                        num_pairs, hidden, inter, stride_xt, stride_we, stride_wn, stride_ot,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, INTERP_BF16: tl.constexpr, PRECISION: tl.constexpr):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the last expert's padded segment
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs  # padding holds num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    # w [E, 2I, H]: this tile's gate rows are `cols`, its up rows `inter + cols`.
    gate_w = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    up_w = gate_w + inter * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(gate_w + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(up_w + ks[:, None], mask=w_mask, other=0.0)
        if INTERP_BF16:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate = tl.dot(a, wg, gate, input_precision=PRECISION)
        up = tl.dot(a, wu, up, input_precision=PRECISION)
    # Round where the torch path rounds: gate_up, silu(gate), silu * up.
    dtype = out_ptr.dtype.element_ty
    gate = _to(gate, dtype, INTERP_BF16).to(tl.float32)
    up = _to(up, dtype, INTERP_BF16).to(tl.float32)
    silu = _to(gate / (1.0 + tl.exp(-gate)), dtype, INTERP_BF16).to(tl.float32)
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_ot + cols[None, :],
             _to(silu * up, dtype, INTERP_BF16), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, route_ptr, out_ptr, sorted_ptr, block_expert_ptr,
                 num_padded_ptr, num_pairs, hidden, inter, stride_at, stride_we, stride_wn,
                 stride_ot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, INTERP_BF16: tl.constexpr, PRECISION: tl.constexpr):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    rows = pairs.to(tl.int64)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn  # w [E, H, I]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(act_ptr + rows[:, None] * stride_at + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if INTERP_BF16:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    # The product is rounded, then scaled in fp32 and rounded once (as mul_).
    dtype = out_ptr.dtype.element_ty
    scale = tl.load(route_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = _to(acc, dtype, INTERP_BF16).to(tl.float32) * scale[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], _to(y, dtype, INTERP_BF16),
             mask=row_ok[:, None] & col_ok[None, :])


def _dot_flags(dtype: torch.dtype) -> dict:
    """fp32 dots in full precision (TF32 would drift from the torch path);
    16-bit inputs ignore the precision. INTERP_BF16: see the module doc."""
    return {"INTERP_BF16": INTERPRETED and dtype == torch.bfloat16,
            "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def _check(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
           weights: torch.Tensor, ids: torch.Tensor) -> None:
    experts, two_inter, hidden = w_gate_up.shape
    if x.dim() != 2 or x.shape[1] != hidden or two_inter % 2:
        raise ValueError(f"x {tuple(x.shape)} does not fit w_gate_up {tuple(w_gate_up.shape)}")
    if tuple(w_down.shape) != (experts, hidden, two_inter // 2):
        raise ValueError(f"w_down {tuple(w_down.shape)} != {(experts, hidden, two_inter // 2)}")
    if weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"weights {tuple(weights.shape)} / ids {tuple(ids.shape)} "
                         f"do not fit {x.shape[0]} tokens")
    if not x.dtype == w_gate_up.dtype == w_down.dtype:
        raise ValueError(f"dtypes differ: x {x.dtype}, weights {w_gate_up.dtype}/{w_down.dtype}")
    if w_gate_up.stride(-1) != 1 or w_down.stride(-1) != 1:
        raise ValueError("expert weights need contiguous rows")


def fused_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor | None = None,
                  blocks: BlockSizes | None = None) -> torch.Tensor:
    """The routed experts: x [T, H] with ``weights`` / ``ids`` [T, k] from
    ``route`` -> [T, H] in x's dtype, as ``MoEBlock``'s grouped path.
    ``w_gate_up`` [E, 2I, H] (gate rows, then up rows), ``w_down`` [E, H, I];
    ``counts`` [E]: pairs per expert, if known; ``blocks``: tile sizes
    (``pick_blocks`` when None). Inference only: no autograd."""
    _check(x, w_gate_up, w_down, weights, ids)
    tokens, top_k = ids.shape
    experts, hidden, inter = w_down.shape
    if tokens == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    pairs = tokens * top_k
    blocks = blocks or pick_blocks(pairs, experts, x.dtype)
    layout = align_to_blocks(ids, experts, blocks.block_m, counts)
    row_blocks = layout.block_experts.numel()
    common = dict(BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k,
                  num_warps=blocks.num_warps, **_dot_flags(x.dtype))
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up_act_kernel[(row_blocks, triton.cdiv(inter, blocks.block_n))](
        x, w_gate_up, act, layout.sorted_pairs, layout.block_experts, layout.num_padded,
        pairs, hidden, inter, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        act.stride(0), TOP_K=top_k, **common)
    down = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(row_blocks, triton.cdiv(hidden, blocks.block_n))](
        act, w_down, weights.contiguous().view(-1), down, layout.sorted_pairs,
        layout.block_experts, layout.num_padded, pairs, hidden, inter, act.stride(0),
        w_down.stride(0), w_down.stride(1), down.stride(0), **common)
    # Each pair's row was written once (every pair sits in exactly one block).
    # torch sums 16-bit rows in fp32 and rounds once, as the grouped path's
    # index_add_ does on the CPU.
    return down.view(tokens, top_k, hidden).sum(dim=1)
