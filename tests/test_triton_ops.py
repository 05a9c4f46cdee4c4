"""The fused Triton kernels (RMSNorm, SwiGLU, rotary) against the torch
reference of ``carpool.model.layers``, in Triton's interpreter without a GPU
(conftest.py). float32: within 1e-5 (RMSNorm sums in another order);
float16: within one fp16 ulp at the values' scale (2e-3 relative)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from carpool.model.layers import RMSNorm, Rotary  # noqa: E402
from carpool.model.triton_ops import TritonOps  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
DTYPES = st.sampled_from([torch.float32, torch.float16])


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    rel = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(got, want, rtol=rel, atol=rel), (got - want).abs().max()


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 9), size=st.sampled_from([8, 64, 100, 576]), dtype=DTYPES)
def test_rms_norm(rows, size, dtype):
    gen = torch.Generator().manual_seed(size + rows)
    norm = RMSNorm(size, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(size, generator=gen) + 0.5)
    x = (torch.randn(rows, size, generator=gen) * 3).to(dtype)
    want = norm(x)
    got = TritonOps.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-5)
    _close(got, want, dtype)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 9), size=st.sampled_from([16, 96, 1536, 1100]), dtype=DTYPES)
def test_silu_and_mul(rows, size, dtype):
    x = (torch.randn(rows, 2 * size, generator=torch.Generator().manual_seed(size)) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    _close(TritonOps.silu_and_mul(x.to(DEVICE)), F.silu(gate) * up, dtype)


@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 7), heads=st.integers(1, 5), dim=st.sampled_from([16, 64, 80]),
       dtype=DTYPES)
def test_rotary_on_a_strided_view(tokens, heads, dim, dtype):
    """q as the model gives it: a view of the fused qkv rows (row stride > heads * dim)."""
    gen = torch.Generator().manual_seed(tokens * heads)
    qkv = torch.randn(tokens, heads * dim + 32, generator=gen).to(dtype)
    x = qkv[:, :heads * dim].view(tokens, heads, dim)
    angles = torch.rand(tokens, 1, dim // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want = Rotary.apply(x, cos, sin)
    got = TritonOps.rotary(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE))
    _close(got, want, dtype)
