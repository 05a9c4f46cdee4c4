"""The Triton attention backend: paged decode and prefill/extend kernels
(``carpool/model/triton_kernels.py``) that read K/V blocks in place.

Its step metadata is built on the host as one flat int64 list and sent to
the device in a single copy; every per-step tensor is a view of it. Its
decode path reads nothing but tensors (block tables, context lengths), so
a captured CUDA graph replays it for any context (``carpool/executor/
cuda_graphs.py``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from carpool.model.attention import (
    AttentionMetadata,
    SeqSpan,
    TorchAttention,
    count_decodes,
    positions_and_slots,
)

#: Slots of context one decode program reads per loop iteration when a KV
#: block is smaller (tl.dot wants >= 16); larger blocks are read one a tile.
DECODE_MIN_TILE = 16
#: Query rows and key slots of one extend tile.
EXTEND_BLOCK_M = 64
EXTEND_BLOCK_N = 64
#: Largest head size the kernels take (registers hold a query group's rows).
MAX_HEAD_DIM = 256


def _pow2(n: int, floor: int = 16) -> int:
    """The smallest power of two >= max(n, floor): tl.dot wants >= 16."""
    size = floor
    while size < n:
        size *= 2
    return size


@dataclass
class ExtendBatch:
    """The step's prefill chunks, packed for ``paged_extend``."""

    tables: torch.Tensor  # [C, W] block table of each chunk (0-padded)
    q_starts: torch.Tensor  # [C] first row of the chunk in the flattened batch
    q_lens: torch.Tensor  # [C]
    context_lens: torch.Tensor  # [C] tokens attended to, the chunk's own included
    tile_chunks: torch.Tensor  # [tiles] chunk of each query tile
    tile_rows: torch.Tensor  # [tiles] first row of the tile inside its chunk


def _decode_layout(spans: Sequence[SeqSpan], block_size: int) -> tuple[list[int], list[int], int]:
    """Context lengths, 0-padded block tables (flat), and the table width."""
    lens = [s.start + 1 for s in spans]
    width = -(-max(lens) // block_size)
    return lens, _padded_tables(spans, width), width


def _padded_tables(spans: Sequence[SeqSpan], width: int) -> list[int]:
    """The spans' block tables cut or 0-padded to ``width``, row after row."""
    flat: list[int] = []
    for span in spans:
        row = list(span.block_table[:width])
        flat += row + [0] * (width - len(row))
    return flat


def _extend_layout(spans: Sequence[SeqSpan], q_offset: int, block_size: int,
                   block_m: int) -> tuple[list[list[int]], int]:
    """Per-chunk lists (starts, lens, contexts, tile chunks, tile rows) and the table width."""
    contexts = [s.start + s.num_tokens for s in spans]
    width = -(-max(contexts) // block_size)
    starts, lens, tile_chunks, tile_rows = [], [], [], []
    for index, span in enumerate(spans):
        starts.append(q_offset)
        lens.append(span.num_tokens)
        q_offset += span.num_tokens
        for row in range(0, span.num_tokens, block_m):
            tile_chunks.append(index)
            tile_rows.append(row)
    tables = _padded_tables(spans, width)
    return [tables, starts, lens, contexts, tile_chunks, tile_rows], width


class TritonAttention(TorchAttention):
    """Decodes and prefill chunks through the Triton kernels, on a GPU (or on
    the CPU in Triton's interpreter, for tests)."""

    name = "triton"
    #: Decode steps read only tensors: a captured graph replays them.
    graph_safe = True

    def __init__(self) -> None:
        from carpool.model import triton_kernels

        self._kernels = triton_kernels

    def build_metadata(self, spans: Sequence[SeqSpan], block_size: int,
                       device: torch.device) -> AttentionMetadata:
        """Spans ordered decodes first (``build_metadata``'s contract)."""
        num_decodes = count_decodes(spans)
        positions, slots = positions_and_slots(spans, block_size)
        parts = [positions, [s // block_size for s in slots], [s % block_size for s in slots]]
        decode_width = extend_width = 0
        if num_decodes:
            lens, tables, decode_width = _decode_layout(spans[:num_decodes], block_size)
            parts += [lens, tables]
        if num_decodes < len(spans):
            extend_parts, extend_width = _extend_layout(spans[num_decodes:], num_decodes,
                                                        block_size, EXTEND_BLOCK_M)
            parts += extend_parts
        flat = torch.tensor([v for part in parts for v in part], dtype=torch.long, device=device)
        views = iter(flat.split([len(part) for part in parts]))
        meta = AttentionMetadata(positions=next(views), slot_blocks=next(views),
                                 slot_offsets=next(views), num_decodes=num_decodes)
        if num_decodes:
            meta.decode_context_lens = next(views)
            meta.decode_blocks = next(views).view(num_decodes, decode_width)
        if num_decodes < len(spans):
            tables, *rest = list(views)
            meta.extend = ExtendBatch(tables.view(len(spans) - num_decodes, extend_width), *rest)
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None = None) -> torch.Tensor:
        """As ``TorchAttention.forward``: new K/V written first, then every
        decode and chunk attends over its blocks. No sliding windows:
        ``select_backend`` keeps models with them off this backend."""
        if window is not None:
            raise ValueError("the Triton attention backend has no sliding-window layers")
        self.store_kv(k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
        out = torch.empty_like(q)
        if meta.num_decodes:
            self.decode(q[:meta.num_decodes], k_cache, v_cache, meta.decode_blocks,
                        meta.decode_context_lens, scale, out[:meta.num_decodes])
        if meta.extend is not None:
            self.extend(q, k_cache, v_cache, meta.extend, scale, out)
        return out

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
        """k, v: [T, KVH, D] into their slots (block, offset) of the caches."""
        tokens, heads, dim = k.shape
        if tokens == 0:
            return
        self._kernels._store_kv_kernel[(tokens, heads)](
            k, v, k_cache, v_cache, blocks, offsets, k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            HEAD_DIM=dim, BLOCK_D=_pow2(dim, 1))

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
               out: torch.Tensor) -> None:
        """q: [B, H, D] one token per sequence; writes out [B, H, D]."""
        batch, heads, dim = q.shape
        num_kv, block_size = k_cache.shape[0], k_cache.shape[3]
        group = heads // num_kv
        self._kernels._paged_decode_kernel[(batch, num_kv)](
            q, k_cache, v_cache, out, tables, context_lens, scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
            *k_cache.stride()[:3], *v_cache.stride()[:3],
            GROUP=group, BLOCK_G=_pow2(group), HEAD_DIM=dim, BLOCK_D=_pow2(dim),
            BLOCK_SIZE=block_size, TILE=max(block_size, DECODE_MIN_TILE),
            PRECISION=_precision(q.dtype))

    def extend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               batch: ExtendBatch, scale: float, out: torch.Tensor) -> None:
        """Every chunk of ``batch`` (rows of q / out at its q_start), causal."""
        heads, dim = q.shape[1], q.shape[2]
        num_kv, block_size = k_cache.shape[0], k_cache.shape[3]
        self._kernels._paged_extend_kernel[(batch.tile_chunks.shape[0], heads)](
            q, k_cache, v_cache, out, batch.tables, batch.q_starts, batch.q_lens,
            batch.context_lens, batch.tile_chunks, batch.tile_rows, scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), batch.tables.stride(0),
            *k_cache.stride()[:3], *v_cache.stride()[:3],
            GROUP=heads // num_kv, HEAD_DIM=dim, BLOCK_D=_pow2(dim), BLOCK_SIZE=block_size,
            BLOCK_M=EXTEND_BLOCK_M, BLOCK_N=EXTEND_BLOCK_N, PRECISION=_precision(q.dtype))


def _precision(dtype: torch.dtype) -> str:
    """float32 dot products in full precision (TF32 would change greedy
    tokens against the reference); 16-bit inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def triton_unavailable(device: torch.device, head_dim: int) -> str | None:
    """Why the Triton backend cannot run here, or None when it can."""
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} > {MAX_HEAD_DIM}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if device.type != "cuda":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            return "no GPU (on the CPU the kernels need TRITON_INTERPRET=1: tests only)"
    return None
