"""The CPU kernel's ``row_argmax`` (the sampler's all-greedy batches) gives
exactly torch.max(dim)'s indices: the first of tied maxima, the first NaN,
any width (not only whole chunks of 64), padded rows (a column slice) and
rows of -inf; other dtypes go through torch."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.model.cpu_kernels import load_cpu_ops
from carpool.model.sampler import Sampler, SamplingRow
from carpool.sampling_params import SamplingParams

SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 3.5]


@pytest.fixture(scope="module")
def ops():
    kernels = load_cpu_ops()
    assert kernels is not None, "the CPU kernels did not build"
    return kernels


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 5), width=st.integers(1, 300), pad=st.integers(0, 3),
       seed=st.integers(0, 2**31 - 1), specials=st.integers(0, 12),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]))
def test_row_argmax_is_torch_max_dims_index(ops, rows, width, pad, seed, specials, dtype):
    gen = torch.Generator().manual_seed(seed)
    # Few distinct values: ties are common, the first one must win.
    x = torch.randint(-4, 5, (rows, width + pad), generator=gen).float() / 2
    flat = x.view(-1)
    for _ in range(specials):
        index = int(torch.randint(0, flat.numel(), (1,), generator=gen))
        flat[index] = SPECIAL[int(torch.randint(0, len(SPECIAL), (1,), generator=gen))]
    logits = x.to(dtype)[:, :width]  # padding columns: rows strided past their width
    assert torch.equal(ops.row_argmax(logits), logits.max(dim=-1).indices)


def test_all_minus_inf_rows_and_long_rows(ops):
    x = torch.full((3, 1000), float("-inf"), dtype=torch.bfloat16)
    x[1, 999] = -1e30
    x[2, 640:700] = 7.0  # a tie spanning two chunks
    assert ops.row_argmax(x).tolist() == x.max(dim=-1).indices.tolist() == [0, 999, 640]
    wide = torch.randn(64, 49152, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(ops.row_argmax(wide), wide.max(dim=-1).indices)


def test_the_sampler_uses_it_for_all_greedy_batches(ops):
    calls = []
    sampler = Sampler(100)
    sampler.row_argmax = lambda x: calls.append(x.shape) or ops.row_argmax(x)
    logits = torch.randn(4, 128).bfloat16()
    rows = [SamplingRow(SamplingParams(temperature=0), seed=0, step=0) for _ in range(4)]
    tokens = [r.token_id for r in sampler.sample(logits, rows)]
    assert calls == [(4, 100)] and tokens == logits[:, :100].max(dim=-1).indices.tolist()
