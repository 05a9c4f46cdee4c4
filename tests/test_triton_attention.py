"""The Triton paged-attention kernels against the portable torch path.

Without a GPU they run in Triton's interpreter (``TRITON_INTERPRET=1``, set
by conftest.py); with ``CARPOOL_TEST_TRITON_GPU=1`` on a GPU machine they
run compiled on CUDA. Random shapes: block sizes, GQA ratios, head sizes
(powers of two or not), ragged batches of decodes and prefill chunks that
start anywhere in their context (chunk boundaries inside and across blocks).

Tolerance: float32 inputs agree with the float32 reference within 1e-4
(max abs; the kernels sum in another order); float16 inputs agree with a
float32 reference on the same (fp16-rounded) inputs within 2e-2, the
kernels rounding the softmax probabilities to fp16 for P @ V as flash
attention does.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from carpool.model.attention import SeqSpan, TorchAttention  # noqa: E402
from carpool.model.triton_attention import TritonAttention  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}


@st.composite
def batches(draw):
    """(spans ordered decodes first, block size, kv heads, group, head dim, pool blocks)."""
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    num_kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    head_dim = draw(st.sampled_from([16, 24, 32, 64]))
    decodes = draw(st.lists(st.integers(0, 150), max_size=5))  # context before the token
    chunks = draw(st.lists(st.tuples(st.integers(0, 90), st.integers(2, 80)), max_size=3))
    if not decodes and not chunks:
        decodes = [0]
    lengths = [(start, 1) for start in decodes] + chunks
    need = [-(-(start + n) // block_size) for start, n in lengths]
    pool = sum(need) + draw(st.integers(0, 4))
    order = draw(st.permutations(range(pool)))  # blocks scattered over the pool
    spans, used = [], 0
    for (start, n), blocks in zip(lengths, need):
        spans.append(SeqSpan(start, n, list(order[used:used + blocks])))
        used += blocks
    return spans, block_size, num_kv, group, head_dim, pool


def _run(spans, block_size, num_kv, group, head_dim, pool, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens, heads = sum(s.num_tokens for s in spans), num_kv * group

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q, k, v = rand(tokens, heads, head_dim), rand(tokens, num_kv, head_dim), \
        rand(tokens, num_kv, head_dim)
    k_cache, v_cache = rand(num_kv, pool, head_dim, block_size), \
        rand(num_kv, pool, block_size, head_dim)
    scale = head_dim ** -0.5
    reference = TorchAttention()
    meta = reference.build_metadata(spans, block_size, torch.device("cpu"))
    ref_k, ref_v = k_cache.float(), v_cache.float()
    expected = reference.forward(q.float(), k.float(), v.float(), ref_k, ref_v, meta, scale)
    triton_path = TritonAttention()
    on = [t.to(DEVICE) for t in (q, k, v, k_cache, v_cache)]
    got = triton_path.forward(*on, triton_path.build_metadata(spans, block_size, DEVICE), scale)
    return expected, got.float().cpu(), (ref_k, ref_v), (on[3].float().cpu(), on[4].float().cpu())


@settings(max_examples=40, deadline=None)
@given(batch=batches(), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_triton_matches_torch_path(batch, dtype):
    expected, got, ref_caches, caches = _run(*batch, dtype)
    assert torch.equal(ref_caches[0], caches[0]) and torch.equal(ref_caches[1], caches[1])
    assert (expected - got).abs().max().item() <= TOLERANCE[dtype]


def test_long_context_decode_and_chunk_over_many_tiles():
    """Contexts of several decode tiles and extend tiles (64 slots each),
    a chunk that starts mid-block after a long cached prefix."""
    block_size = 16
    spans = [SeqSpan(300, 1, list(range(0, 19))), SeqSpan(129, 1, list(range(19, 28))),
             SeqSpan(70, 150, list(range(28, 42)))]
    expected, got, _, _ = _run(spans, block_size, 2, 4, 64, 42, torch.float32)
    assert (expected - got).abs().max().item() <= TOLERANCE[torch.float32]


def test_metadata_is_one_packed_tensor():
    """Every per-step tensor of the Triton backend views one device tensor (one copy)."""
    spans = [SeqSpan(5, 1, [0]), SeqSpan(0, 3, [1]), SeqSpan(16, 20, [2, 3, 4])]
    meta = TritonAttention().build_metadata(spans, 16, torch.device("cpu"))
    base = meta.positions.untyped_storage().data_ptr()
    views = [meta.slot_blocks, meta.slot_offsets, meta.decode_blocks, meta.decode_context_lens,
             meta.extend.tables, meta.extend.tile_chunks]
    assert all(t.untyped_storage().data_ptr() == base for t in views)
    assert meta.decode_context_lens.tolist() == [6]
    assert meta.extend.q_starts.tolist() == [1, 4] and meta.extend.q_lens.tolist() == [3, 20]
    assert meta.extend.context_lens.tolist() == [3, 36]
    assert meta.extend.tables.tolist() == [[1, 0, 0], [2, 3, 4]]
