"""Sampler device placement: work on the logits' device, uniforms always from the CPU."""
from __future__ import annotations

import random

import pytest
import torch

from carpool.model import row_reductions
from carpool.model.sampler import Sampler, SamplingRow, _row_uniforms
from carpool.sampling_params import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Every path: plain greedy, penalized greedy, full vocabulary, candidates, nucleus
# rejection, min-p, logprobs.
MIXED = [
    dict(temperature=0.0),
    dict(temperature=0.0, frequency_penalty=1.0, logprobs=2),
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_p=0.3),
    dict(temperature=1.3, top_k=40),
    dict(temperature=1.0, min_p=0.05, logprobs=3),
    dict(temperature=0.9, top_k=300, top_p=0.95, min_p=0.01),
    dict(temperature=1.0, top_p=0.5, repetition_penalty=1.3, presence_penalty=0.5,
         frequency_penalty=0.3, logprobs=5),
    dict(temperature=0.0, logprobs=1),
]


def mixed_batch(n: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, list[SamplingRow]]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([rng.choice([0.5, 2.0, 6.0]) for _ in range(n)]).unsqueeze(1)
    logits = torch.randn(n, vocab, generator=gen) * scales
    rows = [SamplingRow(SamplingParams(**MIXED[i % len(MIXED)]), rng.randrange(2**40),
                        rng.randrange(100), [1, 2, 3],
                        [rng.randrange(vocab) for _ in range(rng.randrange(6))])
            for i in range(n)]
    return logits, rows


def tokens_alone_and_shuffled(sampler: Sampler, logits: torch.Tensor,
                              rows: list[SamplingRow]) -> tuple[list[int], list[int]]:
    """Each row's token sampled alone, and the same rows' tokens in a shuffled batch."""
    alone = [sampler.sample(logits[i:i + 1].clone(), [rows[i]])[0].token_id
             for i in range(len(rows))]
    order = list(range(len(rows)))
    random.Random(3).shuffle(order)
    batch = [r.token_id for r in sampler.sample(logits[order], [rows[i] for i in order])]
    return [alone[i] for i in order], batch


def test_uniforms_are_drawn_on_the_cpu_under_any_default_device():
    expected = _row_uniforms(7, 3, 4)
    with torch.device("meta"):
        got = _row_uniforms(7, 3, 4)
    assert got.device.type == "cpu" and torch.equal(got, expected)


@pytest.mark.parametrize("default", ["cpu", "meta"])
def test_cpu_logits_sample_alike_under_a_default_device(default):
    """Tensors the sampler makes follow the logits, whatever the default device
    (a meta default would break any op that mixed it in)."""
    logits, rows = mixed_batch(20, 700)
    sampler = Sampler(700, candidates=32)
    expected = sampler.sample(logits, rows)
    penalized = sampler.apply_penalties(logits, rows)
    with torch.device(default):
        got = sampler.sample(logits, rows)
        assert torch.equal(sampler.apply_penalties(logits, rows), penalized)
    assert got == expected


@pytest.fixture
def device_path(monkeypatch):
    """Take the path of logits off the CPU (fixed-order reductions, no syncs) on the CPU."""
    monkeypatch.setattr(row_reductions, "off_cpu", lambda t: True)


def test_device_path_reductions_are_fixed_per_row(device_path):
    x = torch.rand(9, 1000) ** 8
    sums, cums = row_reductions.row_sum(x), row_reductions.row_cumsum(x)
    for i in range(len(x)):
        one = x[i:i + 1].clone()
        assert torch.equal(row_reductions.row_sum(one)[0], sums[i])
        assert torch.equal(row_reductions.row_cumsum(one)[0], cums[i])
    assert torch.equal(cums, x.cumsum(dim=-1))  # in order, in float64, like the CPU's
    assert torch.allclose(sums, x.double().sum(dim=-1).float(), rtol=1e-6)
    assert torch.allclose(row_reductions.softmax(x), torch.softmax(x, dim=-1), atol=1e-7)


def test_device_path_samples_like_the_cpu_path_and_ignores_batch_mates(monkeypatch):
    logits, rows = mixed_batch(40, 2000, seed=4)
    sampler = Sampler(2000, candidates=64)
    expected = [r.token_id for r in sampler.sample(logits, rows)]
    monkeypatch.setattr(row_reductions, "off_cpu", lambda t: True)
    alone, batch = tokens_alone_and_shuffled(sampler, logits, rows)
    assert batch == alone
    got = [r.token_id for r in sampler.sample(logits, rows)]
    assert sum(a == b for a, b in zip(got, expected)) >= 0.9 * len(rows)
    assert all(a == b for a, b, r in zip(got, expected, rows) if r.params.greedy)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_sampling_agrees_with_cpu(dtype):
    vocab = 5000
    logits, rows = mixed_batch(60, vocab, seed=1)
    logits = logits.to(dtype)
    sampler = Sampler(vocab, candidates=64)
    on_cpu = sampler.sample(logits, rows)
    on_gpu_logits = logits.cuda()
    before = on_gpu_logits.clone()
    on_gpu = sampler.sample(on_gpu_logits, rows)
    assert torch.equal(on_gpu_logits, before)  # never modified, also when no copy is made
    same = [a.token_id == b.token_id for a, b in zip(on_cpu, on_gpu)]
    assert sum(same) >= 0.9 * len(rows)
    for row, a, b, ok in zip(rows, on_cpu, on_gpu, same):
        if row.params.greedy:
            assert ok
        if row.params.logprobs is not None:
            assert len(b.top_logprobs) == len(a.top_logprobs) == row.params.logprobs
            assert b.top_logprobs[0][1] == pytest.approx(a.top_logprobs[0][1], abs=1e-4)
            if ok:
                assert b.logprob == pytest.approx(a.logprob, abs=1e-4)


@needs_cuda
@pytest.mark.parametrize("vocab", [1000, 50257])
def test_cuda_row_reductions_do_not_depend_on_batch(vocab):
    x = torch.rand(37, vocab, device="cuda") ** 8
    sums, cums = row_reductions.row_sum(x), row_reductions.row_cumsum(x)
    probs = row_reductions.softmax(x)
    for i in range(len(x)):
        one = x[i:i + 1].clone()
        assert torch.equal(row_reductions.row_sum(one)[0], sums[i])
        assert torch.equal(row_reductions.row_cumsum(one)[0], cums[i])
        assert torch.equal(row_reductions.softmax(one)[0], probs[i])


@needs_cuda
def test_cuda_row_token_does_not_depend_on_batch():
    logits, rows = mixed_batch(40, 5000, seed=2)
    alone, batch = tokens_alone_and_shuffled(Sampler(5000, candidates=64), logits.cuda(), rows)
    assert batch == alone
