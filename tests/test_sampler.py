"""Sampler: greedy, seeded reproducibility, filters, penalties, logprobs."""
from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.model.sampler import Sampler, SamplingRow
from carpool.sampling_params import SamplingParams


def make_row(seed: int = 0, step: int = 0, prompt=(), output=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, step, list(prompt), list(output))


def sample_tokens(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return [r.token_id for r in sampler.sample(logits, rows)]


def logits_for(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


# -- greedy ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(16, 500) * 3).to(dtype)
    before = logits.clone()
    tokens = sample_tokens(Sampler(500), logits, [make_row(temperature=0.0)] * 16)
    assert tokens == logits.float().argmax(dim=-1).tolist()
    assert torch.equal(logits, before)


def test_greedy_slow_path_is_argmax_and_ties_take_lowest_id():
    logits = torch.zeros(3, 50)
    logits[0, [7, 3, 40]] = 5.0
    logits[1, 11] = 1.0
    logits[2, [2, 9]] = -1.0
    rows = [make_row(temperature=0.0, logprobs=2), make_row(temperature=0.0),
            make_row(seed=5, temperature=0.0, logprobs=0)]
    assert sample_tokens(Sampler(50), logits, rows) == [3, 11, 0]


def test_padding_columns_are_ignored():
    logits = torch.zeros(2, 12)
    logits[:, 10:] = 100.0
    logits[:, 4] = 1.0
    rows = [make_row(temperature=0.0), make_row(seed=3, temperature=0.5, top_k=1)]
    assert sample_tokens(Sampler(10), logits, rows) == [4, 4]


@pytest.mark.parametrize("dtype,width", [(torch.float32, 300), (torch.float32, 320),
                                         (torch.bfloat16, 300)])
def test_logits_are_never_modified(dtype, width):
    torch.manual_seed(2)
    logits = torch.randn(6, width).to(dtype)
    before = logits.clone()
    rows = [make_row(seed=1, temperature=0.7, top_p=0.9, output=[1, 2], repetition_penalty=1.2),
            make_row(seed=2, temperature=1.3),
            make_row(seed=3, temperature=0.0, presence_penalty=1.0, output=[5]),
            make_row(seed=4, temperature=0.9, min_p=0.1, top_k=5),
            make_row(seed=5, temperature=0.0),
            make_row(seed=6, temperature=2.0, top_p=0.95, frequency_penalty=0.5, output=[7, 7])]
    sampler = Sampler(300)
    sampler.sample(logits, rows)
    sampler.sample(logits[:2], rows[:2])
    assert torch.equal(logits, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_sample_like_cpu_logits():
    torch.manual_seed(4)
    logits = torch.randn(5, 1000) * 2
    rows = [make_row(seed=s, temperature=0.8, top_p=0.9, logprobs=2, output=[3],
                     repetition_penalty=1.2) for s in range(4)] + [make_row(temperature=0.0)]
    sampler = Sampler(1000)
    on_cpu = sampler.sample(logits, rows)
    on_gpu = sampler.sample(logits.cuda(), rows)
    assert [r.token_id for r in on_gpu] == [r.token_id for r in on_cpu]
    greedy = [make_row(temperature=0.0)] * 5
    assert sample_tokens(sampler, logits.cuda(), greedy) == logits.argmax(dim=-1).tolist()


def test_bad_shape_is_rejected():
    with pytest.raises(ValueError):
        Sampler(10).sample(torch.zeros(2, 9), [make_row(), make_row()])
    with pytest.raises(ValueError):
        Sampler(10).sample(torch.zeros(3, 10), [make_row()])
    assert Sampler(10).sample(torch.zeros(0, 10), []) == []


# -- seeds ------------------------------------------------------------------------------

ROW_KINDS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_p=0.3),
    dict(temperature=1.3, top_k=40),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.9, top_k=300, top_p=0.95, min_p=0.01),
    dict(temperature=1.0, top_p=0.5, repetition_penalty=1.3, presence_penalty=0.5,
         frequency_penalty=0.3, logprobs=3),
    dict(temperature=0.0, frequency_penalty=1.0),
]


def _random_row(rng: random.Random, vocab: int) -> tuple[torch.Tensor, SamplingRow]:
    scale = rng.choice([0.5, 2.0, 6.0])  # flat rows reach the full-vocabulary paths
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    kind = rng.choice(ROW_KINDS)
    output = [rng.randrange(vocab) for _ in range(rng.randrange(6))]
    row = make_row(rng.randrange(2**40), rng.randrange(100), [1, 2, 3], output, **kind)
    return logits * scale, row


@pytest.mark.parametrize("vocab,candidates,chunk_rows,n_rows", [
    (1000, 16, 1000, 40), (1000, 256, 7, 30), (50_000, 64, 3, 8), (50_000, 256, 1000, 8)])
def test_row_token_does_not_depend_on_batch(vocab, candidates, chunk_rows, n_rows):
    rng = random.Random(vocab + candidates)
    sampler = Sampler(vocab, candidates=candidates)
    sampler.CHUNK_ELEMENTS = chunk_rows * vocab
    items = [_random_row(rng, vocab) for _ in range(n_rows)]
    alone = [sample_tokens(sampler, x.unsqueeze(0), [row])[0] for x, row in items]
    for _ in range(3):
        order = list(range(n_rows))
        rng.shuffle(order)
        order = order[:rng.randrange(2, n_rows + 1)]
        logits = torch.stack([items[i][0] for i in order])
        tokens = sample_tokens(sampler, logits, [items[i][1] for i in order])
        assert tokens == [alone[i] for i in order]


def test_same_seed_and_step_repeat_and_different_seeds_spread():
    sampler = Sampler(100)
    logits = torch.zeros(1, 100)
    row = make_row(seed=42, step=7, temperature=1.0)
    assert len({sample_tokens(sampler, logits, [row])[0] for _ in range(5)}) == 1
    by_seed = sample_tokens(sampler, logits.expand(300, -1),
                            [make_row(seed=s, step=7, temperature=1.0) for s in range(300)])
    by_step = sample_tokens(sampler, logits.expand(300, -1),
                            [make_row(seed=42, step=s, temperature=1.0) for s in range(300)])
    # 300 uniform draws over 100 tokens: about 95 distinct values expected.
    assert len(set(by_seed)) > 80 and len(set(by_step)) > 80
    assert by_seed != by_step


# -- filters --------------------------------------------------------------------------


def test_top_k_one_and_tiny_top_p_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(64, 700) * 2
    argmax = logits.argmax(dim=-1).tolist()
    sampler = Sampler(700, candidates=32)
    assert sample_tokens(sampler, logits, [make_row(seed=s, temperature=1.5, top_k=1)
                                           for s in range(64)]) == argmax
    assert sample_tokens(sampler, logits, [make_row(seed=s, temperature=1.5, top_p=1e-6)
                                           for s in range(64)]) == argmax


def test_min_p_filters_low_probability_tokens():
    logits = logits_for([0.5, 0.3, 0.15, 0.05]).expand(400, -1)
    rows = [make_row(seed=s, temperature=1.0, min_p=0.2) for s in range(400)]
    assert set(sample_tokens(Sampler(4), logits, rows)) == {0, 1, 2}


def _frequencies(tokens: list[int], vocab: int) -> list[float]:
    return [tokens.count(t) / len(tokens) for t in range(vocab)]


def test_temperature_frequencies_follow_softmax():
    raw = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0]])
    n = 4000
    tokens = sample_tokens(Sampler(5), raw.expand(n, -1),
                           [make_row(seed=s, temperature=0.7) for s in range(n)])
    expected = torch.softmax(raw[0] / 0.7, dim=-1).tolist()
    for got, want in zip(_frequencies(tokens, 5), expected):
        # 4000 draws: one standard deviation is at most 0.008.
        assert abs(got - want) < 0.03


def test_top_p_renormalizes_the_nucleus():
    n = 3000
    tokens = sample_tokens(Sampler(4), logits_for([0.1, 0.4, 0.2, 0.3]).expand(n, -1),
                           [make_row(seed=s, temperature=1.0, top_p=0.6) for s in range(n)])
    got = _frequencies(tokens, 4)
    assert got[0] == 0 and got[2] == 0
    assert abs(got[1] - 4 / 7) < 0.03 and abs(got[3] - 3 / 7) < 0.03


@pytest.mark.parametrize("candidates", [4, 256])
def test_full_vocabulary_path_frequencies(candidates):
    vocab, n = 1000, 3000
    probs = torch.full((vocab,), 1e-9)
    probs[[3, 500, 517, 999]] = torch.tensor([0.2, 0.3, 0.1, 0.4])
    logits = probs.log().unsqueeze(0).expand(n, -1)
    sampler = Sampler(vocab, candidates=candidates, block=64)
    tokens = sample_tokens(sampler, logits, [make_row(seed=s, temperature=1.0, min_p=1e-4)
                                             for s in range(n)])
    assert set(tokens) <= {3, 500, 517, 999}
    for tok, want in [(3, 0.2), (500, 0.3), (517, 0.1), (999, 0.4)]:
        assert abs(tokens.count(tok) / n - want) < 0.03


# -- penalties ------------------------------------------------------------------------


def test_penalties_match_hand_computed_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    rows = [make_row(prompt=[0, 1], output=[3, 3, 4], repetition_penalty=2.0,
                     frequency_penalty=0.5, presence_penalty=0.25),
            make_row(prompt=[0, 1], output=[3, 3, 4], repetition_penalty=2.0)]
    got = Sampler(6).apply_penalties(logits, rows)
    # Row 0: repetition over {0, 1, 3, 4}; then token 3 (count 2) loses 2*0.5 + 0.25,
    # token 4 (count 1) loses 0.5 + 0.25.
    assert got[0].tolist() == pytest.approx([1.0, -2.0, 0.5, 0.25, -4.75, 0.0])
    assert got[1].tolist() == pytest.approx([1.0, -2.0, 0.5, 1.5, -4.0, 0.0])
    assert logits[0, 0] == 2.0


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 1.0, -5.0]])
    sampler = Sampler(4)
    assert sample_tokens(sampler, logits, [make_row(temperature=0.0, output=[0],
                                                    presence_penalty=0.2)]) == [1]
    assert sample_tokens(sampler, logits, [make_row(temperature=0.0, prompt=[0],
                                                    repetition_penalty=1.1)]) == [1]
    # Presence/frequency ignore the prompt.
    assert sample_tokens(sampler, logits, [make_row(temperature=0.0, prompt=[0],
                                                    frequency_penalty=2.0)]) == [0]


# -- logprobs ---------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    torch.manual_seed(3)
    logits = torch.randn(4, 300) * 2
    rows = [make_row(seed=1, temperature=0.5, top_k=10, logprobs=5, repetition_penalty=1.5,
                     output=[1, 2]),
            make_row(seed=2, temperature=0.0, logprobs=20),
            make_row(seed=3, temperature=1.0),
            make_row(seed=4, temperature=1.0, logprobs=0)]
    results = Sampler(300).sample(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    for i, n in [(0, 5), (1, 20), (3, 0)]:
        res = results[i]
        assert res.logprob == pytest.approx(ref[i, res.token_id].item(), abs=1e-5)
        assert len(res.top_logprobs) == n
        values = [v for _, v in res.top_logprobs]
        assert values == sorted(values, reverse=True)
        want_vals, want_ids = ref[i].topk(n)
        assert [t for t, _ in res.top_logprobs] == want_ids.tolist()
        assert values == pytest.approx(want_vals.tolist(), abs=1e-5)
    assert results[2].logprob is None and results[2].top_logprobs is None


# -- property: the drawn token is always allowed ---------------------------------------------


def allowed_tokens(logits: list[float], temperature: float, top_k: int, top_p: float,
                   min_p: float) -> set[int]:
    """Reference filter in float64, a little looser than the sampler at the edges."""
    m = max(logits)
    weights = [math.exp((v - m) / temperature) for v in logits]
    total = sum(weights)
    probs = [w / total for w in weights]
    ranked = sorted(probs, reverse=True)
    floor = min_p * ranked[0]
    if top_k > 0:
        floor = max(floor, ranked[min(top_k, len(ranked)) - 1])
    kept = [p for p in ranked if p >= floor * (1 - 1e-5)]
    need = min(1.0, top_p + 1e-5) * sum(kept)
    acc, cut = 0.0, kept[-1]
    for p in kept:
        acc += p
        if acc >= need:
            cut = p
            break
    cut = max(floor, cut) * (1 - 1e-5)
    return {i for i, p in enumerate(probs) if p >= cut}


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(st.one_of(st.floats(-6, 6), st.integers(-3, 3).map(float)),
                    min_size=1, max_size=80),
    temperature=st.floats(0.05, 3.0),
    top_k=st.one_of(st.sampled_from([0, -1]), st.integers(1, 90)),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    seed=st.integers(0, 2**63),
    candidates=st.sampled_from([1, 3, 256]),
    attempts=st.sampled_from([0, 32]),
)
def test_sampled_token_is_always_allowed(logits, temperature, top_k, top_p, min_p, seed,
                                         candidates, attempts):
    vocab = len(logits)
    sampler = Sampler(vocab, candidates=candidates, block=7)
    sampler.ATTEMPTS = attempts  # 0 sends large nuclei straight to the sorting fallback
    row = make_row(seed=seed, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    token = sample_tokens(sampler, torch.tensor([logits]), [row])[0]
    assert token in allowed_tokens(logits, temperature, top_k, top_p, min_p)


# -- any validated parameters, however extreme, sample a real token -------------------

_EXTREMES = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 1e-300, 9.9e-6, 1e-5, 1e-3, 1.0, 2.0, 100.0]),
    "top_k": st.sampled_from([-1, 0, 1, 2, 10**9]),
    "top_p": st.sampled_from([5e-324, 1e-9, 0.5, 1.0]),
    "min_p": st.sampled_from([0.0, 0.5, 1.0]),
    "repetition_penalty": st.sampled_from([0.01, 1.0, 10.0]),
    "presence_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "frequency_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "logprobs": st.sampled_from([None, 0, 20]),
})


@settings(max_examples=150, deadline=None)
@given(params=st.lists(_EXTREMES, min_size=1, max_size=4), scale=st.sampled_from([1.0, 50.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**32))
def test_validated_extremes_never_break_the_sampler(params, scale, dtype, seed):
    vocab = 64
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(len(params), vocab, generator=generator) * scale).to(dtype)
    rows = [make_row(seed=i, prompt=[1, 2, 3], output=[4, 4, 5], max_tokens=4, **p)
            for i, p in enumerate(params)]
    for row, result in zip(rows, Sampler(vocab).sample(logits, rows)):
        assert 0 <= result.token_id < vocab
        if row.params.logprobs is not None:
            assert math.isfinite(result.logprob) or result.logprob == -math.inf
