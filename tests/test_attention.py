"""Attention backends agree with a dense reference on ragged paged batches."""
from __future__ import annotations

import pytest
import torch

from carpool.model.attention import (
    CpuPagedAttention,
    SdpaAttention,
    SeqSpan,
    TorchAttention,
    build_metadata,
)
from carpool.model.cpu_kernels import load_cpu_ops

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 32, 4


def dense_reference(q, k, v, context_len):
    """Causal attention of the last len(q) positions over the full context."""
    q_len = q.shape[0]
    keys = k.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)  # [H, L, D]
    values = v.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ keys.transpose(1, 2) / DIM ** 0.5  # [H, Q, L]
    positions = torch.arange(context_len)
    query_pos = torch.arange(context_len - q_len, context_len)
    scores = scores.masked_fill(positions[None, None, :] > query_pos[None, :, None], float("-inf"))
    return (scores.softmax(-1) @ values).transpose(0, 1)  # [Q, H, D]


def run_backend(backend, spans_spec, dtype, num_blocks: int = 64):
    """spans_spec: (context_before, new_tokens) per sequence, decodes first."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(KV_HEADS, num_blocks, DIM, BLOCK, dtype=dtype)  # blocks transposed
    v_cache = torch.zeros(KV_HEADS, num_blocks, BLOCK, DIM, dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered blocks
    spans, seqs = [], []
    for before, new in spans_spec:
        total = before + new
        table = [free.pop() for _ in range(-(-total // BLOCK))]
        k = torch.randn(total, KV_HEADS, DIM, generator=gen)
        v = torch.randn(total, KV_HEADS, DIM, generator=gen)
        q = torch.randn(new, HEADS, DIM, generator=gen)
        # The earlier context is already in the cache.
        for pos in range(before):
            slot = table[pos // BLOCK]
            k_cache[:, slot, :, pos % BLOCK] = k[pos].to(dtype)
            v_cache[:, slot, pos % BLOCK] = v[pos].to(dtype)
        spans.append(SeqSpan(before, new, table))
        seqs.append((q, k, v, total))
    meta = build_metadata(spans, BLOCK, torch.device("cpu"))
    q_all = torch.cat([s[0] for s in seqs]).to(dtype)
    k_new = torch.cat([s[1][-n:] for s, (_, n) in zip(seqs, spans_spec)]).to(dtype)
    v_new = torch.cat([s[2][-n:] for s, (_, n) in zip(seqs, spans_spec)]).to(dtype)
    out = backend.forward(q_all, k_new, v_new, k_cache, v_cache, meta, DIM ** -0.5)
    expected = torch.cat([dense_reference(q, k.to(dtype).float(), v.to(dtype).float(), total)
                          for q, k, v, total in ((s[0].to(dtype).float(), *s[1:3], s[3])
                                                 for s in seqs)])
    return out.float(), expected


SPANS = [(0, 1), (7, 1), (12, 1), (30, 1), (0, 9), (5, 6), (16, 3)]


@pytest.mark.parametrize("backend", [TorchAttention(), SdpaAttention()], ids=["torch", "sdpa"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_portable_paths_match_dense_reference(backend, dtype, tol):
    # SDPA is the CUDA path; its math is checked here on the CPU.
    out, expected = run_backend(backend, SPANS, dtype)
    assert (out - expected).abs().max().item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_cpu_kernel_matches_dense_reference(dtype, tol):
    kernel = load_cpu_ops()
    assert kernel is not None, "the C++ kernels must build on the CI machine"
    out, expected = run_backend(CpuPagedAttention(kernel), SPANS, dtype)
    assert (out - expected).abs().max().item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_cpu_kernel_long_contexts_run_on_the_thread_team_and_match(dtype, tol):
    """SPANS' short contexts run on the calling thread (kSerialContext in
    paged_attention.cpp); these decodes have enough context for the team."""
    kernel = load_cpu_ops()
    long_spans = [(700, 1), (455, 1), (300, 1), (33, 1)]
    assert sum(before + 1 for before, _ in long_spans) * KV_HEADS >= 2048
    out, expected = run_backend(CpuPagedAttention(kernel), long_spans, dtype, num_blocks=400)
    assert (out - expected).abs().max().item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_cpu_ops_match_torch(dtype, tol):
    from carpool.model.decoder import RMSNorm

    ops = load_cpu_ops()
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 96, generator=gen) * 3).to(dtype)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
        assert (norm(x, ops).float() - norm(x).float()).abs().max().item() < tol * 4
    gate_up = torch.randn(37, 2 * 48, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert (ops.silu_and_mul(gate_up).float() - expected.float()).abs().max().item() < tol * 4
