"""The real default model's files: our GGUF conversion vs what transformers
itself loads from the same GGUF (weights, tokenizer, chat template)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from carpool.model import loader
from carpool.model.loader import load_model

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def ours(real_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> loader.LoadedModel:
    # A fresh cache dir on purpose: this exercises the conversion itself.
    return load_model(str(real_model_path), tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def hf(hf_reference: tuple[Any, Any]) -> tuple[Any, Any, Any]:
    """(transformers module, model, tokenizer) loaded from the GGUF by transformers itself."""
    import transformers

    return transformers, *hf_reference


STRINGS = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.", "12345", "Pi is 3.14159, not 22/7.",
    "def add(a, b):\n    return a + b\n", "for (int i = 0; i < n; ++i) { x[i] *= 2; }", "Emoji: 😀🎉👍🏽",
    "中文测试，你好世界。", "日本語のテキスト", "Ünïcödé àccents — “quotes”", "   leading spaces",
    "trailing spaces   ", "tabs\tand\nnewlines\n\n\nend", "a  b   c    d", "<|im_start|>user\nhi<|im_end|>",
    "I'm sure they'll've DONE it", "x² + y³ = ½ Ⅻ", "https://example.com/path?q=1&r=2", "$100,000.00 in 2024",
    "", "<|endoftext|> after the end",
]


def test_real_weights_match_transformers(ours: loader.LoadedModel, hf: tuple) -> None:
    _, model, _ = hf
    theirs = model.state_dict()
    if ours.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert set(ours.weights) == set(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours.weights[name], tensor.float(), rtol=0, atol=0, msg=name)


# transformers builds the "smollm" GGUF tokenizer with GPT-2's split alone, while
# llama.cpp (and SmolLM2's own tokenizer.json) isolate every \p{N} character
# first. Only a numeral next to something it can merge with tells them apart
# (" ½" is one token for transformers, two for llama.cpp); for those strings the
# reference is transformers' vocabulary and merges behind the digit split.
DIGIT_SPLIT_STRINGS = {"x² + y³ = ½ Ⅻ"}


@pytest.fixture(scope="module")
def digit_split_reference(hf: tuple) -> Any:
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    backend = Backend.from_str(hf[2].backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return backend


@pytest.mark.parametrize("text", STRINGS)
def test_real_tokenizer_matches_transformers(ours: loader.LoadedModel, hf: tuple, digit_split_reference: Any,
                                             text: str) -> None:
    _, _, tok = hf
    for add in (False, True):
        if text in DIGIT_SPLIT_STRINGS:
            expected = digit_split_reference.encode(text, add_special_tokens=add).ids
        else:
            expected = tok.encode(text, add_special_tokens=add)
        assert ours.tokenizer.encode(text, add_special_tokens=add) == expected
    ids = ours.tokenizer.encode(text)
    assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert ours.tokenizer.decode(ids) == tok.decode(ids, skip_special_tokens=True)


def test_real_chat_template_matches_transformers(ours: loader.LoadedModel, hf: tuple) -> None:
    _, _, tok = hf
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
         {"role": "user", "content": "And 3+3?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.tokenizer.apply_chat_template(messages, add_generation_prompt=gen) == expected
    assert ours.tokenizer.eos_token_ids == [tok.eos_token_id]
    assert ours.tokenizer.bos_token_id == tok.bos_token_id


def test_real_converted_dir_loads_in_transformers(ours: loader.LoadedModel, hf: tuple) -> None:
    transformers, model, tok = hf
    converted = transformers.AutoModelForCausalLM.from_pretrained(str(ours.path)).eval()
    ids = torch.tensor([tok.encode("The capital of France is", add_special_tokens=False)])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, model(ids).logits, rtol=0, atol=1e-4)
