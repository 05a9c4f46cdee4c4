"""IncrementalDetokenizer against a small byte-level BPE trained in the test.

The vocabulary is kept small so that emoji, CJK and accented characters are
split across tokens, which is what the UTF-8 hold-back has to get right.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from carpool.engine.detokenizer import IncrementalDetokenizer
from carpool.sampling_params import SamplingParams

EOS = "<|endoftext|>"
ENGLISH = ("the quick brown fox jumps over lazy dog while streaming tokens arrive one at a "
           "time and every byte matters STOP here").split()
CJK = "你好世界日本語中文字测试数据模型服务器请求批处理缓存东京大阪北京上海，。"
EMOJI = ["😀", "👍🏽", "🎉", "🚀", "❤️", "🇯🇵", "👩‍💻", "🙂"]
ACCENTED = "café naïve résumé über straße façade jalapeño crème brûlée São Ångström".split()


def corpus_line(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(4, 12)):
        r = rng.random()
        if r < 0.45:
            parts.append(rng.choice(ENGLISH))
        elif r < 0.7:
            parts.append("".join(rng.choice(CJK) for _ in range(rng.randint(1, 5))))
        elif r < 0.85:
            parts.append("".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 3))))
        else:
            parts.append(rng.choice(ACCENTED))
    return " ".join(parts) + rng.choice([".", "!", "。", "?", "\n"])


class TinyTokenizer:
    """decode/all_special_ids over a `tokenizers.Tokenizer`, as the engine's tokenizer offers."""

    def __init__(self, backend: Tokenizer) -> None:
        self.backend = backend
        self.all_special_ids = [backend.token_to_id(EOS)]

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok() -> TinyTokenizer:
    rng = random.Random(1234)
    lines = [corpus_line(rng) for _ in range(300)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(lines, trainer)
    return TinyTokenizer(backend)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    rng = random.Random(99)
    extra = ["😀👍🏽", "你好世界，日本語", "Ångström crème brûlée", "a\ufffdb", "plain ascii"]
    return extra + [" ".join(corpus_line(rng) for _ in range(rng.randint(1, 4)))
                     for _ in range(60)]


def stream(tok, ids, prompt=(), **params):
    """Feed ``ids``; return (deltas, stopped, detokenizer), flushing when not stopped."""
    detok = IncrementalDetokenizer(tok, list(prompt), SamplingParams(**params))
    deltas, stopped = [], False
    for t in ids:
        delta, stopped = detok.add_token(t)
        deltas.append(delta)
        if stopped:
            break
    if not stopped:
        deltas.append(detok.flush())
    return deltas, stopped, detok


def cut_mid_character(tok, text: str) -> list[int]:
    """The shortest token prefix of ``text`` whose decode ends inside a character."""
    ids = tok.encode(text)
    return next(ids[:i] for i in range(len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))


def test_tokenizer_splits_multibyte_characters(tok, texts):
    # Guard for the tests below: some token boundaries fall inside a character.
    split = sum(tok.decode(ids[:i]).endswith("\ufffd")
                for ids in map(tok.encode, texts) for i in range(1, len(ids)))
    assert split > 50


def test_stream_equals_full_decode(tok, texts):
    for text in texts:
        ids = tok.encode(text)
        deltas, stopped, detok = stream(tok, ids)
        assert not stopped
        assert "".join(deltas) == detok.output_text == tok.decode(ids) == text


def test_deltas_never_hold_broken_characters(tok, texts):
    for text in filter(lambda t: "\ufffd" not in t, texts):
        deltas, _, _ = stream(tok, tok.encode(text))
        emitted = ""
        for delta in deltas:
            assert "\ufffd" not in delta
            emitted += delta
            assert text.startswith(emitted)  # so it never ends mid-character


def test_prompt_context_does_not_leak_into_output(tok, texts):
    for prompt, text in zip(texts, texts[1:]):
        prompt_ids, ids = tok.encode(prompt), tok.encode(text)
        deltas, _, _ = stream(tok, ids, prompt=prompt_ids)
        assert "".join(deltas) == tok.decode(prompt_ids + ids)[len(prompt):] == text


def test_random_bytes_stream_equals_full_decode(tok, texts):
    # Arbitrary token soup: genuine U+FFFDs and long windows (sliding) included.
    rng = random.Random(7)
    vocab = tok.backend.get_vocab_size()
    for n in [1, 5, 40, 300]:
        for _ in range(20):
            ids = [rng.randrange(1, vocab) for _ in range(n)]
            prompt = tok.encode(rng.choice(texts))[:rng.randrange(12)]
            prompt_text = tok.decode(prompt)
            deltas, _, _ = stream(tok, ids, prompt=prompt)
            assert "".join(deltas) == tok.decode(prompt + ids)[len(prompt_text):]


def test_unfinished_prompt_character_stays_with_the_prompt(tok):
    prompt = cut_mid_character(tok, "hi 你好世界 😀👍🏽")
    deltas, _, _ = stream(tok, tok.encode("ok"), prompt=prompt)
    assert "".join(deltas) == "ok"


def test_trailing_replacement_char_waits_for_flush(tok):
    ids = tok.encode("ab\ufffd")
    deltas, _, detok = stream(tok, ids)
    assert "".join(deltas[:-1]) == "ab" and deltas[-1] == "\ufffd"
    partial = cut_mid_character(tok, "ok 你好世界 😀👍🏽")
    deltas, _, _ = stream(tok, partial)
    assert "".join(deltas[:-1]) == tok.decode(partial)[:-1]
    assert deltas[-1] == "\ufffd"


def test_special_tokens_skipped_or_kept(tok):
    eos = tok.all_special_ids[0]
    ids = tok.encode("hello ") + [eos] + tok.encode("world")
    assert "".join(stream(tok, ids)[0]) == "hello world"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == f"hello {EOS}world"


# -- stop strings --------------------------------------------------------------------------


def _spans_tokens(tok, ids: list[int], stop: str) -> bool:
    return not any(stop in tok.decode([t]) for t in ids)


@pytest.mark.parametrize("stop", ["世界，日本", "😀👍🏽", "brown fox", "é naï"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_truncates_exactly(tok, stop, include):
    text = "one two 你好世界，日本語 and 😀👍🏽 brown fox café naïve end"
    ids = tok.encode(text)
    assert _spans_tokens(tok, ids, stop)
    deltas, stopped, detok = stream(tok, ids, stop=[stop], include_stop_str_in_output=include)
    cut = text.index(stop) + (len(stop) if include else 0)
    assert stopped and detok.stop_reason == stop
    assert "".join(deltas) == detok.output_text == text[:cut]
    assert detok.add_token(ids[0]) == ("", True) and detok.flush() == ""


def test_held_prefix_is_released_when_it_is_not_a_stop(tok):
    pieces = ["jumps over the la", "zy", " dog"]
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["lazy cat"]))
    got = []
    for piece in pieces:
        deltas = [detok.add_token(t) for t in tok.encode(piece)]
        assert not any(stopped for _, stopped in deltas)
        got.append("".join(d for d, _ in deltas))
    assert got == ["jumps over the ", "", "lazy dog"]
    assert detok.flush() == ""


def test_flush_returns_held_stop_prefix(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["lazy cat", "日本語!"]))
    emitted = "".join(detok.add_token(t)[0] for t in tok.encode("the 日本 la"))
    assert emitted == "the 日本 "
    assert detok.flush() == "la"
    assert detok.output_text == "the 日本 la"


def test_first_completed_stop_wins(tok):
    ids = tok.encode("say abcdef now")
    _, _, detok = stream(tok, ids, stop=["abcdef", "cd"])
    assert detok.output_text == "say ab" and detok.stop_reason == "cd"
    _, _, detok = stream(tok, ids, stop=["bcd", "cd"], include_stop_str_in_output=True)
    assert detok.output_text == "say abcd" and detok.stop_reason == "bcd"


def expected_output(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Oracle: cut at the stop occurrence that ends first (the longest on a tie)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if len(s) <= end and text[end - len(s):end] == s]
        if hits:
            stop = max(hits, key=len)
            return (text[:end] if include else text[:end - len(stop)]), stop
    return text, None


ALPHABET = list("ab c.") + list("你好世界") + ["😀", "👍🏽", "é", "ñ"]


@st.composite
def text_and_stops(draw):
    text = "".join(draw(st.lists(st.sampled_from(ALPHABET), max_size=40)))
    stops = []
    for _ in range(draw(st.integers(0, 3))):
        if text and draw(st.booleans()):
            i = draw(st.integers(0, len(text) - 1))
            stops.append(text[i:draw(st.integers(i + 1, min(len(text), i + 6)))])
        else:
            stops.append("".join(draw(st.lists(st.sampled_from(ALPHABET), min_size=1,
                                               max_size=4))))
    return text, stops


@settings(max_examples=200, deadline=None)
@given(case=text_and_stops(), include=st.booleans())
def test_streamed_text_is_full_text_cut_at_first_stop(tok, case, include):
    text, stops = case
    ids = tok.encode(text)
    deltas, stopped, detok = stream(tok, ids, stop=stops, include_stop_str_in_output=include)
    want, stop = expected_output(tok.decode(ids), stops, include)
    assert "".join(deltas) == detok.output_text == want
    assert stopped == (stop is not None) and detok.stop_reason == stop
    assert all("\ufffd" not in d for d in deltas)
