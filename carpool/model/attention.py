"""Paged attention over a ragged batch, behind a small backend interface.

Layout: per layer, a V cache ``[num_kv_heads, num_blocks, block_size,
head_dim]`` and a K cache ``[num_kv_heads, num_blocks, head_dim, block_size]``
(each block transposed, so query-key scores of a whole block are plain
vector multiply-adds, with no horizontal sums). Token slot ``s`` lives at
block ``s // block_size``, offset ``s % block_size``.

A step's tokens are flattened into one ragged batch, single-token spans
(decodes) first, then multi-token spans (prefill chunks); nothing is padded
across sequences in the batch itself. Decodes are attended together (the C++
kernel reads their blocks in place; the portable path gathers them, padded
and masked only inside attention); each prefill chunk attends over its own
context.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class SeqSpan:
    """What attention needs of one scheduled span."""

    start: int  # position of the first new token
    num_tokens: int
    block_table: Sequence[int]


@dataclass
class PrefillChunk:
    q_start: int  # offset in the flattened batch
    q_len: int
    context_len: int  # tokens attended to, new ones included
    gather_blocks: torch.Tensor  # [context_len] block of each context position
    gather_offsets: torch.Tensor  # [context_len] offset in that block
    causal_mask: torch.Tensor | None  # [q_len, context_len] bool; None when context == chunk


@dataclass
class AttentionMetadata:
    """Built once per step, shared by every layer."""

    slot_blocks: torch.Tensor  # [T] block of each new token's K/V
    slot_offsets: torch.Tensor  # [T] offset in that block
    positions: torch.Tensor  # [T]
    num_decodes: int  # the first num_decodes tokens are single-token spans
    decode_blocks: torch.Tensor | None = None  # [B, max_blocks] block tables, padded
    decode_mask: torch.Tensor | None = None  # [B, max_blocks * block_size] True where attended
    decode_context_lens: torch.Tensor | None = None  # [B]
    prefills: list[PrefillChunk] = field(default_factory=list)
    extend: Any = None  # the Triton backend's packed prefill chunks (triton_attention.py)
    # Masks of sliding-window layers, by window: built by the first such
    # layer of the step, shared by the rest (``decode_window_mask``).
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)


def decode_window_mask(meta: AttentionMetadata, window: int) -> torch.Tensor:
    """The decodes' mask for a layer that sees the last ``window`` positions
    (its own included: a key at ``p`` counts for the query at ``q`` iff
    ``q - window < p <= q``, transformers' sliding window)."""
    mask = meta.window_masks.get(window)
    if mask is None:
        padded_len = meta.decode_mask.shape[1]
        first = (meta.decode_context_lens - window)[:, None]  # the query is at len - 1
        mask = meta.decode_mask & (torch.arange(padded_len, device=first.device)[None, :] >= first)
        meta.window_masks[window] = mask
    return mask


def prefill_window_mask(chunk: PrefillChunk, window: int) -> torch.Tensor:
    """A prefill chunk's causal mask, narrowed to each query's window."""
    start = chunk.context_len - chunk.q_len
    device = chunk.gather_offsets.device
    keys = torch.arange(chunk.context_len, device=device)[None, :]
    queries = torch.arange(start, chunk.context_len, device=device)[:, None]
    return (keys <= queries) & (keys > queries - window)


def build_metadata(spans: Sequence[SeqSpan], block_size: int,
                   device: torch.device) -> AttentionMetadata:
    """Metadata for spans ordered decodes (num_tokens == 1) first."""
    num_decodes = count_decodes(spans)
    positions, slots = positions_and_slots(spans, block_size)
    slots_t = torch.tensor(slots, dtype=torch.long, device=device)
    meta = AttentionMetadata(
        slot_blocks=slots_t // block_size, slot_offsets=slots_t % block_size,
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        num_decodes=num_decodes)
    if num_decodes:
        _add_decode_metadata(meta, spans[:num_decodes], block_size, device)
    q_start = num_decodes
    for span in spans[num_decodes:]:
        meta.prefills.append(_prefill_chunk(span, q_start, block_size, device))
        q_start += span.num_tokens
    return meta


def count_decodes(spans: Sequence[SeqSpan]) -> int:
    """How many leading spans are single-token (decodes); the rest must not be."""
    num_decodes = 0
    while num_decodes < len(spans) and spans[num_decodes].num_tokens == 1:
        num_decodes += 1
    assert all(s.num_tokens > 1 for s in spans[num_decodes:]), "decodes must come first"
    return num_decodes


def positions_and_slots(spans: Sequence[SeqSpan], block_size: int) -> tuple[list[int], list[int]]:
    """Every new token's position and its KV slot (block * block_size + offset)."""
    positions: list[int] = []
    slots: list[int] = []
    for span in spans:
        table = span.block_table
        for pos in range(span.start, span.start + span.num_tokens):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return positions, slots


def _add_decode_metadata(meta: AttentionMetadata, spans: Sequence[SeqSpan], block_size: int,
                         device: torch.device) -> None:
    context_lens = [s.start + 1 for s in spans]
    max_blocks = -(-max(context_lens) // block_size)
    # Gather whole blocks (rows of block_size * head_dim), not single slots:
    # far fewer, larger copies. Padding points at block 0 and is masked.
    tables = [list(s.block_table[:max_blocks]) for s in spans]
    tables = [t + [0] * (max_blocks - len(t)) for t in tables]
    lens_t = torch.tensor(context_lens, dtype=torch.long, device=device)
    meta.decode_blocks = torch.tensor(tables, dtype=torch.long, device=device)
    padded_len = max_blocks * block_size
    meta.decode_mask = torch.arange(padded_len, device=device)[None, :] < lens_t[:, None]
    meta.decode_context_lens = lens_t


def _prefill_chunk(span: SeqSpan, q_start: int, block_size: int,
                   device: torch.device) -> PrefillChunk:
    context_len = span.start + span.num_tokens
    positions = torch.arange(context_len, device=device)
    table = torch.tensor(list(span.block_table[:-(-context_len // block_size)]),
                         dtype=torch.long, device=device)
    mask = None
    if span.start > 0:
        query_pos = torch.arange(span.start, context_len, device=device)
        mask = positions[None, :] <= query_pos[:, None]
    return PrefillChunk(q_start, span.num_tokens, context_len, table[positions // block_size],
                        positions % block_size, mask)


class TorchAttention:
    """Portable path: correct on any device for any mix of chunk and context
    lengths. Decodes use batched matmuls with GQA folded into the query (no
    K/V head repetition); prefill chunks use SDPA one chunk at a time."""

    name = "torch"
    #: Whether decode steps read only tensors of fixed shape (CUDA graphs).
    graph_safe = False

    def build_metadata(self, spans: Sequence[SeqSpan], block_size: int,
                       device: torch.device) -> AttentionMetadata:
        """This backend's step metadata (spans ordered decodes first)."""
        return build_metadata(spans, block_size, device)

    def decode_block(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                     kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                     heads: int, kv_heads: int, scale: float) -> torch.Tensor | None:
        """A layer's rotary, cache write and attention in one fused call,
        where the backend has one and the step allows it: qkv [T, (H + 2
        KVH) * D] -> [T, H * D]. None: the caller goes op by op."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches as in the module docstring.
        Writes the new K/V into the caches, returns [T, H, D]. ``window``:
        a sliding-window layer's (every position is kept in the cache, so
        prefix reuse and KV transfer stay exact; only the mask narrows),
        which this portable path serves for every backend."""
        # Every new K/V is written before any attention, so a chunk can
        # attend to tokens written in this very step. (Advanced indices split
        # by a slice put the token dimension first: [T, KVH, D] on both sides.)
        k_cache[:, meta.slot_blocks, :, meta.slot_offsets] = k
        v_cache[:, meta.slot_blocks, meta.slot_offsets, :] = v.transpose(0, 1)
        out = torch.empty_like(q)
        decodes = slice(0, meta.num_decodes)
        if meta.num_decodes and window is None:
            out[decodes] = self._decode(q[decodes], k_cache, v_cache, meta, scale)
        elif meta.num_decodes:
            out[decodes] = TorchAttention._masked_decode(
                self, q[decodes], k_cache, v_cache, meta, scale, decode_window_mask(meta, window))
        for chunk in meta.prefills:
            rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
            mask = chunk.causal_mask if window is None else prefill_window_mask(chunk, window)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, chunk, scale, mask)
        return out

    def latent_forward(self, q: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, value_dim: int) -> torch.Tensor:
        """Multi-head latent attention (carpool/model/mla.py) on every backend:
        q [T, H, D]; ``rows`` [T, 1, D], the step's latent rows, written to
        ``cache`` [1, blocks, block_size, D] (V's layout) first; each head
        attends with the whole row as key and its first ``value_dim``
        values as value. Returns [T, H, value_dim]."""
        cache[:, meta.slot_blocks, meta.slot_offsets, :] = rows.transpose(0, 1)
        out = q.new_empty(q.shape[0], q.shape[1], value_dim)
        if meta.num_decodes:
            n = meta.num_decodes
            keys = self._gather_blocks(cache, meta).flatten(2, 3)[0]  # [B, L, D]
            scores = torch.matmul(q[:n], keys.transpose(1, 2)).float() * scale  # [B, H, L]
            scores.masked_fill_(~meta.decode_mask[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            out[:n] = torch.matmul(probs, keys[..., :value_dim])
        for chunk in meta.prefills:
            span = slice(chunk.q_start, chunk.q_start + chunk.q_len)
            keys = cache[:, chunk.gather_blocks, chunk.gather_offsets, :][None]  # [1, 1, L, D]
            attended = F.scaled_dot_product_attention(
                q[span].transpose(0, 1)[None], keys, keys[..., :value_dim],
                attn_mask=chunk.causal_mask, is_causal=chunk.causal_mask is None, scale=scale,
                enable_gqa=True)
            out[span] = attended[0].transpose(0, 1)
        return out

    @staticmethod
    def _gather_blocks(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[KVH, B, max_blocks, *block] blocks of the decodes' contexts."""
        num_kv, num_blocks = cache.shape[:2]
        batch, max_blocks = meta.decode_blocks.shape
        # index_select over whole blocks is several times faster on CPU than
        # advanced indexing of a middle dimension.
        rows = cache.view(num_kv, num_blocks, -1)
        picked = rows.index_select(1, meta.decode_blocks.view(-1))
        return picked.view(num_kv, batch, max_blocks, *cache.shape[2:])

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [KVH, B, L, D] of the decodes (padded to whole blocks)."""
        keys = self._gather_blocks(k_cache, meta).transpose(3, 4).flatten(2, 3)
        values = self._gather_blocks(v_cache, meta).flatten(2, 3)
        return keys, values

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return TorchAttention._masked_decode(self, q, k_cache, v_cache, meta, scale,
                                             meta.decode_mask)

    def _masked_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float,
                       mask: torch.Tensor) -> torch.Tensor:
        """Decodes attending where ``mask`` [B, padded context] is True."""
        batch, num_heads, head_dim = q.shape
        num_kv = k_cache.shape[0]
        keys, values = self._gather(k_cache, v_cache, meta)
        # [KVH, B, G, D]: the G query heads sharing a KV head are one matrix.
        queries = q.view(batch, num_kv, num_heads // num_kv, head_dim).transpose(0, 1)
        scores = torch.matmul(queries, keys.transpose(2, 3)).float() * scale  # [KVH, B, G, L]
        scores.masked_fill_(~mask[None, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs, values)  # [KVH, B, G, D]
        return out.transpose(0, 1).reshape(batch, num_heads, head_dim)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 chunk: PrefillChunk, scale: float,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """One chunk over its context; ``mask`` [Q, context] (None: causal
        over a context that is the chunk itself)."""
        blocks, offsets = chunk.gather_blocks, chunk.gather_offsets
        keys = k_cache[:, blocks, :, offsets].transpose(0, 1)[None]  # [1, KVH, L, D]
        values = v_cache[:, blocks, offsets, :][None]
        queries = q.transpose(0, 1)[None]  # [1, H, Q, D]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=True)
        return out[0].transpose(0, 1)


class SdpaAttention(TorchAttention):
    """CUDA path: decodes through fused SDPA with a padding mask."""

    name = "sdpa"

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        keys, values = self._gather(k_cache, v_cache, meta)
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [B, KVH, L, D]
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values,
                                             attn_mask=meta.decode_mask[:, None, None, :],
                                             scale=scale, enable_gqa=True)
        return out[:, :, 0, :]


class CpuPagedAttention(TorchAttention):
    """CPU path: decodes through our C++ kernel (``csrc/paged_attention.cpp``),
    which reads K/V straight from the blocks instead of gathering them."""

    name = "cpu"

    def __init__(self, kernel) -> None:  # noqa: ANN001 - the compiled extension module
        self._kernel = kernel

    def decode_block(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                     kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                     heads: int, kv_heads: int, scale: float) -> torch.Tensor | None:
        """Decode-only steps: ``decode_attention_block`` (csrc/decode_block.cpp),
        identical to the op-by-op path."""
        if meta.prefills or not meta.num_decodes:
            return None
        cos, sin = rope
        return self._kernel.decode_attention_block(
            qkv, cos.flatten(1), sin.flatten(1), kv[0], kv[1], meta.slot_blocks,
            meta.slot_offsets, meta.decode_blocks, meta.decode_context_lens, heads, kv_heads,
            scale)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._kernel.paged_decode_attention(q, k_cache, v_cache, meta.decode_blocks,
                                                   meta.decode_context_lens, scale)
