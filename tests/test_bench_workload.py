"""Prompts of exact token counts, Mooncake prefix reconstruction, and the
benchmark workload built from the command line."""
from __future__ import annotations

import argparse
import json
import time

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from carpool.model.tokenizer import Tokenizer
from carpool.workload.arrivals import arrival_offsets
from carpool.workload.command import add_workload_args, workload_spec
from carpool.workload.prompts import PromptFactory
from carpool.workload.spec import (
    BenchItem,
    WorkloadSpec,
    build_workload,
    describe_workload,
    mooncake_block_tokens,
    plan_workload,
)
from carpool.workload.traces import load_trace, scale_tokens, select_window

WORDS = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
    "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango",
    "uniform", "victor", "whiskey", "xray", "yankee", "zulu", "carpool", "batching", "prefix",
    "cache", "token", "stream",
)


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """A small byte-level BPE in which every word of WORDS is one token."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([" " + " ".join(WORDS)] * 50, trainer)
    return Tokenizer(backend, eos_token="<|end|>")


@pytest.fixture(scope="module")
def real_tokenizer() -> Tokenizer:
    from carpool.model.hub import fetch_default_model
    from carpool.model.loader import ensure_converted
    from carpool.paths import default_cache_dir

    cache = default_cache_dir()
    return Tokenizer.from_dir(ensure_converted(fetch_default_model(cache), cache))


def _word_level() -> HFTokenizer:
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return backend


class _MergingTokenizer:
    """Words are tokens, except that "a" followed by "b" is one token: counts
    are not additive, so the factory has to trim or pad."""

    vocab = ("a", "b", "c", "d", "ab")
    vocab_size = 5

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for word in text.split():
            if word == "b" and ids and ids[-1] == 0:
                ids[-1] = 4
            else:
                ids.append(self.vocab.index(word) if word in self.vocab[:4] else 99)
        return ids

    def decode(self, ids) -> str:
        return " ".join(self.vocab[i] for i in ids)


class _DoublingTokenizer(_MergingTokenizer):
    """One word is one token, more words are two tokens each: odd counts
    above 1 cannot be hit."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = super().encode(text)
        return ids if len(ids) == 1 else ids * 2


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _mooncake_pairs(ks: tuple[int, ...]) -> list[tuple[int, object, object]]:
    """(k, earlier, later) from conversation_trace.jsonl: the first pair found
    for each k whose hash ids agree on exactly k leading blocks and then differ."""
    trace = load_trace("mooncake-conv")
    seen: dict[tuple[int, ...], object] = {}
    pairs = {}
    for request in trace:
        ids = request.hash_ids
        other = next((seen[ids[:j]] for j in range(len(ids), 0, -1) if ids[:j] in seen), None)
        k = _first_difference(list(ids), list(other.hash_ids)) if other else 0
        if k in ks and k not in pairs and min(len(ids), len(other.hash_ids)) > k:
            pairs[k] = (k, other, request)
        for j in range(1, len(ids) + 1):
            seen.setdefault(ids[:j], request)
        if len(pairs) == len(ks):
            break
    assert set(pairs) == set(ks)
    return [pairs[k] for k in ks]


# ---- prompts --------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda bpe: bpe, lambda bpe: bpe.backend,
                                  lambda bpe: _word_level()], ids=["carpool", "raw", "wordlevel"])
def test_exact_counts_on_small_tokenizers(bpe, make):
    tokenizer = make(bpe)
    factory = PromptFactory(tokenizer, seed=3)
    assert all(len(getattr(e, "ids", e)) == 1
               for e in (tokenizer.encode(w, add_special_tokens=False) for w in factory.words))
    assert {" " + w for w in WORDS} <= set(factory.words)
    for n in (0, 1, 2, 7, 100, 1000):
        text = factory.text(n, key=n)
        assert factory.count(text) == n
    assert factory.text(50, "k") == PromptFactory(tokenizer, seed=3).text(50, "k")
    assert factory.text(50, "k") != factory.text(50, "other key")


def test_counts_are_fixed_when_words_merge():
    factory = PromptFactory(_MergingTokenizer())
    assert sorted(factory.words) == [" a", " b", " c", " d"]
    for n in range(1, 60):
        assert factory.count(factory.text(n, key=n)) == n
        assert factory.count(factory.prefixed_text([1, 2, 3], 4, n)) == n


def test_impossible_counts_raise():
    factory = PromptFactory(_DoublingTokenizer())
    assert factory.count(factory.text(1, "x")) == 1
    with pytest.raises(ValueError, match="exactly 3 tokens"):
        factory.text(3, "x")


def test_tokenizer_without_words_is_rejected():
    backend = HFTokenizer(models.WordLevel({"[UNK]": 0, "1": 1, "2": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match="no word"):
        PromptFactory(backend)


def test_prefixed_text_shares_blocks_by_hash_id(bpe):
    factory = PromptFactory(bpe)
    a = factory.prefixed_text([5, 6, 7], 10, 30)
    b = factory.prefixed_text([5, 6, 9], 10, 25)
    c = factory.prefixed_text([5, 8, 7], 10, 30)
    ids_a, ids_b, ids_c = bpe.encode(a), bpe.encode(b), bpe.encode(c)
    assert (len(ids_a), len(ids_b), len(ids_c)) == (30, 25, 30)
    assert ids_a[:20] == ids_b[:20] and _first_difference(ids_a, ids_b) == 20
    assert ids_a[:10] == ids_c[:10] and _first_difference(ids_a, ids_c) == 10
    assert ids_a[20:] == ids_c[20:]  # block 2 depends on its own hash id only
    # Past the blocks: a tail fixed by the key, unique per request.
    long_1 = factory.prefixed_text([5], 10, 40, key=1)
    long_2 = factory.prefixed_text([5], 10, 40, key=2)
    assert bpe.encode(long_1)[:10] == ids_a[:10]
    assert _first_difference(bpe.encode(long_1), bpe.encode(long_2)) == 10
    assert factory.count(long_1) == 40 and factory.count(long_2) == 40


@pytest.mark.real_model
def test_exact_counts_on_the_real_tokenizer(real_tokenizer):
    factory = PromptFactory(real_tokenizer)
    special = set(real_tokenizer.all_special_ids)
    for n in (1, 2, 7, 100, 1000):
        ids = real_tokenizer.encode(factory.text(n, key=("real", n)))
        assert len(ids) == n
        assert not special & set(ids)


@pytest.mark.real_model
@pytest.mark.parametrize("block_tokens,token_scale", [(64, 0.125), (512, 1.0)])
def test_mooncake_prefixes_survive_on_the_real_tokenizer(real_tokenizer, block_tokens,
                                                          token_scale):
    factory = PromptFactory(real_tokenizer)
    for k, first, second in _mooncake_pairs((1, 2, 3, 5, 8)):
        texts, encoded = [], []
        for request in (first, second):
            n = min(round(request.input_len * token_scale), (k + 2) * block_tokens)
            texts.append(factory.prefixed_text(request.hash_ids, block_tokens, n))
            encoded.append(real_tokenizer.encode(texts[-1]))
            assert len(encoded[-1]) == n
        shared = k * block_tokens
        assert encoded[0][:shared] == encoded[1][:shared]
        assert _first_difference(*encoded) == shared
        prefix = real_tokenizer.decode(encoded[0][:shared])
        assert texts[0].startswith(prefix) and texts[1].startswith(prefix)


# ---- workload -------------------------------------------------------------


def _args(*argv: str, seed_flag: str = "--seed") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_workload_args(parser, seed_flag=seed_flag)
    return parser.parse_args(list(argv))


def _spec(*argv: str) -> WorkloadSpec:
    return workload_spec(_args(*argv))


def test_defaults():
    args = _args()
    assert (args.workload, args.num_requests, args.input_len, args.output_len) == \
        ("synthetic", 100, 128, 128)
    assert (args.token_scale, args.max_input_len, args.max_output_len, args.trace_start) == \
        (1.0, 1024, 512, 0.0)
    assert (args.workload_seed, args.arrival, args.rate, args.burstiness, args.time_scale) == \
        (0, "poisson", 2.0, 1.0, 1.0)
    assert (args.surge, args.ramp) == ([], [])


def test_synthetic_workload(bpe):
    args = _args("--num-requests", "40", "--input-len", "33", "--output-len", "7",
                 "--arrival", "gamma", "--burstiness", "0.5", "--rate", "3", "--seed", "4",
                 "--surge", "2x@5+5", "--ramp", "1x-2x@0+10")
    items = build_workload(workload_spec(args), bpe)
    assert [item.index for item in items] == list(range(40))
    assert [item.offset for item in items] == arrival_offsets(
        40, 3.0, 4, 0.5, args.surge, ramps=args.ramp, process="gamma")
    assert all(len(bpe.encode(item.prompt)) == 33 for item in items)
    assert all((item.input_tokens, item.output_tokens) == (33, 7) for item in items)
    assert len({item.prompt for item in items}) == 40
    assert build_workload(workload_spec(args), bpe) == items
    args.workload_seed = 5
    other = build_workload(workload_spec(args), bpe)
    assert [i.offset for i in other] != [i.offset for i in items]
    assert [i.prompt for i in other] != [i.prompt for i in items]


def test_trace_arrivals_replay_the_window_scaled_in_time():
    args = _args("--workload", "azure-code", "--arrival", "trace", "--trace-start", "100",
                 "--time-scale", "4", "--num-requests", "50", "--token-scale", "0.5")
    plan = plan_workload(workload_spec(args))
    window = scale_tokens(select_window(load_trace("azure-code"), 100.0, max_requests=50),
                          0.5, 1024, 512)
    assert [r.arrival for r in plan] == pytest.approx([4 * w.arrival for w in window])
    assert [(r.input_len, r.output_len) for r in plan] == \
        [(w.input_len, w.output_len) for w in window]
    assert plan[0].arrival >= 0


def test_trace_lengths_with_generated_arrivals():
    args = _args("--workload", "azure-conv", "--arrival", "constant", "--rate", "4",
                 "--trace-start", "60", "--num-requests", "30", "--max-input-len", "300")
    plan = plan_workload(workload_spec(args))
    window = select_window(load_trace("azure-conv"), 60.0, max_requests=30)
    assert [r.input_len for r in plan] == [min(300, w.input_len) for w in window]
    assert [r.arrival for r in plan] == pytest.approx([i / 4 for i in range(30)])
    described = json.loads(json.dumps(describe_workload(workload_spec(args))))
    assert described["offered_rate"] == pytest.approx(4.0)
    assert described["format"] == "azure" and "Azure" in described["attribution"]
    assert described["rate"] == 4.0 and described["process"] == "constant"


def test_length_files_are_sampled_with_the_seed():
    trace = {(r.input_len, r.output_len) for r in load_trace("arxiv")}
    plans = [plan_workload(_spec("--workload", "arxiv", "--num-requests", "200", "--seed", seed,
                                 "--max-input-len", "100000", "--max-output-len", "100000"))
             for seed in ("1", "1", "2")]
    assert plans[0] == plans[1] != plans[2]
    assert {(r.input_len, r.output_len) for r in plans[0]} <= trace


def test_mooncake_workload_keeps_prefix_sharing(bpe):
    args = _args("--workload", "mooncake-synthetic", "--arrival", "trace",
                 "--token-scale", "0.0625", "--num-requests", "60", "--max-input-len", "4096")
    assert mooncake_block_tokens(args.token_scale) == 32
    items = build_workload(workload_spec(args), bpe)
    assert all(isinstance(item, BenchItem) and item.hash_ids for item in items)
    assert all(len(bpe.encode(item.prompt)) == item.input_tokens for item in items)
    first = {item.hash_ids[0]: item for item in items}
    shared = [(first[item.hash_ids[0]], item) for item in items
              if first[item.hash_ids[0]] is not item]
    assert shared
    for a, b in shared:
        k = _first_difference(list(a.hash_ids), list(b.hash_ids))
        n = min(k * 32, a.input_tokens, b.input_tokens)
        assert bpe.encode(a.prompt)[:n] == bpe.encode(b.prompt)[:n]


@pytest.mark.parametrize("argv,message", [
    (["--workload", "sharegpt", "--arrival", "trace"], "timestamps"),
    (["--arrival", "trace"], "timestamps"),
    (["--workload", "azure-conv", "--arrival", "trace", "--surge", "2x@1+1"], "--surge"),
    (["--workload", "azure-code", "--trace-start", "3400", "--num-requests", "1000"],
     "only"),
    (["--num-requests", "0"], "--num-requests"),
    (["--rate", "-1"], "--rate"),
    (["--token-scale", "0"], "--token-scale"),
    (["--workload", "azure-conv", "--trace-start", "-5"], "--trace-start"),
])
def test_bad_workloads_raise_clear_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        plan_workload(_spec(*argv))


def test_unknown_trace_and_bad_specs(capsys):
    with pytest.raises(FileNotFoundError, match="known name"):
        plan_workload(_spec("--workload", "no-such-trace"))
    with pytest.raises(SystemExit):
        _args("--ramp", "1x@0+5")
    assert "FROMx-TOx@START+DURATION" in capsys.readouterr().err


def test_seed_flag_can_be_renamed_beside_the_engine_flags():
    from carpool.cli import add_engine_flags

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    add_workload_args(parser, seed_flag="--workload-seed")
    args = parser.parse_args(["--seed", "1", "--workload-seed", "2"])
    assert (args.engine_seed, args.workload_seed) == (1, 2)


@pytest.mark.real_model
def test_two_hundred_real_prompts_build_fast(real_tokenizer):
    args = _args("--workload", "mooncake-conv", "--token-scale", "0.125",
                 "--num-requests", "200", "--arrival", "trace")
    started = time.perf_counter()
    items = build_workload(workload_spec(args), real_tokenizer)
    assert time.perf_counter() - started < 2.0
    assert all(len(real_tokenizer.encode(item.prompt)) == item.input_tokens for item in items)
    assert describe_workload(workload_spec(args), items)["num_requests"] == 200
