"""Triton kernels for paged attention over carpool's block layout.

Layouts (``carpool/model/attention.py``): per layer a K cache ``[KVH,
num_blocks, head_dim, block_size]`` (each block transposed) and a V cache
``[KVH, num_blocks, block_size, head_dim]``; token slot ``s`` of a sequence
lives in block ``table[s // block_size]`` at offset ``s % block_size``.
Kernels read the blocks in place through the block table: nothing is
gathered into a dense tensor and nothing is padded across sequences.

- ``store_kv``: writes a step's new K/V rows into their slots.
- ``paged_decode``: one query token per sequence; one program per
  (sequence, KV head) holds that KV head's whole query group (GQA), walks
  the context a tile of ``TILE`` slots at a time (one block per tile for
  blocks of 16 slots or more, else several) with an online softmax,
  and stops at the sequence's own length (read from a tensor, so a CUDA
  graph replays it for any context length).
- ``paged_extend``: prefill chunks (``q_len`` new tokens over ``context_len
  - q_len`` cached ones plus themselves, causal); one program per (query
  tile of ``BLOCK_M`` rows of one chunk, head); a tile walks only the keys
  its last query may see.

Math is in float32 (scores, softmax, accumulators); the probabilities are
cast to the cache dtype for the P @ V product, as flash attention does.
On the CPU these run in Triton's interpreter (``TRITON_INTERPRET=1`` set
before this module is imported); the tests use that mode. The
interpreter's bfloat16 dot products are wrong, so CPU tests use float32
and float16; bfloat16 is checked on a GPU (``scripts/gpu_check.sh``).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, blocks_ptr, offsets_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kch, stride_kcb, stride_kcd,
                     stride_vch, stride_vcb, stride_vco,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    block = tl.load(blocks_ptr + token).to(tl.int64)
    offset = tl.load(offsets_ptr + token).to(tl.int64)
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=dmask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=dmask)
    tl.store(k_cache_ptr + head * stride_kch + block * stride_kcb + d * stride_kcd + offset,
             k, mask=dmask)
    tl.store(v_cache_ptr + head * stride_vch + block * stride_vcb + offset * stride_vco + d,
             v, mask=dmask)


@triton.jit
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, lens_ptr, scale,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                         stride_kh, stride_kb, stride_kd, stride_vh, stride_vb, stride_vo,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                         PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, TILE)
    heads = kv_head * GROUP + g
    qmask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qmask,
                other=0.0)
    context = tl.load(lens_ptr + seq)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, context, TILE):
        pos = start + n
        valid = pos < context
        if TILE == BLOCK_SIZE:
            # One whole block per tile: a scalar block index keeps the
            # loads contiguous (vectorized) along the block's slots.
            block = tl.load(tables_ptr + seq * stride_table + start // BLOCK_SIZE).to(tl.int64)
            offset = n
        else:
            block = tl.load(tables_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=valid,
                            other=0).to(tl.int64)
            offset = pos % BLOCK_SIZE
        k_cols = block * stride_kb + offset  # [TILE] either way
        v_rows = block * stride_vb + offset * stride_vo
        kmask = valid[None, :] & (d[:, None] < HEAD_DIM)
        k = tl.load(k_base + k_cols[None, :] + d[:, None] * stride_kd, mask=kmask,
                    other=0.0)  # [BLOCK_D, TILE]
        scores = tl.dot(q, k, input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vmask = valid[:, None] & (d[None, :] < HEAD_DIM)
        v = tl.load(v_base + v_rows[:, None] + d[None, :], mask=vmask, other=0.0)  # [TILE, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _paged_extend_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr,
                         q_starts_ptr, q_lens_ptr, context_lens_ptr, tile_chunks_ptr,
                         tile_rows_ptr, scale,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                         stride_kh, stride_kb, stride_kd, stride_vh, stride_vb, stride_vo,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    chunk = tl.load(tile_chunks_ptr + tile)
    first_row = tl.load(tile_rows_ptr + tile)
    q_start = tl.load(q_starts_ptr + chunk)
    q_len = tl.load(q_lens_ptr + chunk)
    context = tl.load(context_lens_ptr + chunk)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    rows = first_row + m
    row_ok = rows < q_len
    query_pos = context - q_len + rows  # each query sees keys at positions <= its own
    qmask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :], mask=qmask,
                other=0.0)
    table = tables_ptr + chunk.to(tl.int64) * stride_table
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The tile's last query (or the chunk's) bounds the keys any row sees.
    end = tl.minimum(context, context - q_len + first_row + BLOCK_M)
    for start in range(0, end, BLOCK_N):
        pos = start + n
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        k = tl.load(k_base + block[None, :] * stride_kb + d[:, None] * stride_kd + offset[None, :],
                    mask=valid[None, :] & (d[:, None] < HEAD_DIM), other=0.0)
        scores = tl.dot(q, k, input_precision=PRECISION) * scale
        seen = valid[None, :] & (pos[None, :] <= query_pos[:, None])
        scores = tl.where(seen, scores, float("-inf"))
        # Position 0 is in every row's first tile, so m_new is finite from there on.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + block[:, None] * stride_vb + offset[:, None] * stride_vo + d[None, :],
                    mask=valid[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qmask)
