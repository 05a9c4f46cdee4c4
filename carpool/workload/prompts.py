"""Prompt text of an exact token count for a given tokenizer.

The factory draws (once, seeded) a pool of words ``w`` such that
``encode(" " + w)`` is exactly one ordinary token (ASCII letters, no special
id). A prompt of n tokens is n pool words, each with its leading space, so
the text starts with a space. For byte-level BPE with whitespace
pre-tokenization (GPT-2 style, SmolLM2, Llama 3, Qwen) the count is
additive; every prompt is still checked with ``encode``, and a count that
comes out wrong is trimmed or padded word by word, or raises.

Mooncake traces name prompt prefix blocks by hash id; `prefixed_text`
rebuilds a prompt whose block i depends only on hash id i, so requests that
share leading ids share leading tokens exactly, as in the original service.
"""
from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from typing import Any, Protocol


class TokenizerLike(Protocol):
    """What the factory needs: `carpool.model.tokenizer.Tokenizer` fits, and
    so does a raw ``tokenizers.Tokenizer`` (its ``Encoding.ids`` are used)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> Any: ...

    def decode(self, ids: Sequence[int]) -> str: ...


DEFAULT_POOL_SIZE = 2048
# Trim/pad steps tried when a tokenizer does not count words additively.
_MAX_FIX_STEPS = 64


class PromptFactory:
    """Deterministic prompts of exact token counts for one tokenizer.

    ``seed`` and the tokenizer fix the word pool; a prompt is then fixed by
    its key (``text``) or by its hash ids (``prefixed_text``). Raises
    ValueError at construction when the vocabulary holds no usable words.
    """

    def __init__(self, tokenizer: TokenizerLike, seed: int = 0,
                 pool_size: int = DEFAULT_POOL_SIZE) -> None:
        self._tokenizer = tokenizer
        self.seed = seed
        self._words = _word_pool(tokenizer, seed, pool_size)
        # (hash id, block tokens) -> that block's words; Mooncake prefixes repeat a lot.
        self._blocks: dict[tuple[int, int], list[str]] = {}

    @property
    def words(self) -> list[str]:
        """The pool: each entry is " w" and encodes to exactly one token."""
        return list(self._words)

    def count(self, text: str) -> int:
        """Tokens ``text`` encodes to, without special tokens."""
        return len(self._encode(text))

    def text(self, num_tokens: int, key: Hashable) -> str:
        """A prompt of exactly ``num_tokens`` tokens, the same for the same
        (seed, key)."""
        _check_count(num_tokens)
        rng = random.Random(f"{self.seed}/text/{key!r}")
        return self._fit(rng.choices(self._words, k=num_tokens), num_tokens, rng)

    def prefixed_text(self, hash_ids: Sequence[int], block_tokens: int, num_tokens: int,
                      key: Hashable = None) -> str:
        """A prompt of exactly ``num_tokens`` tokens made of ``block_tokens``-token
        blocks, block i fixed by ``hash_ids[i]`` alone (the last one cut short
        to fit). Beyond the blocks it is padded with a tail fixed by ``key``
        (default: the hash ids), so pass a request-unique key."""
        _check_count(num_tokens)
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        words: list[str] = []
        for hash_id in hash_ids:
            if len(words) >= num_tokens:
                break
            words.extend(self._block(int(hash_id), block_tokens))
        del words[num_tokens:]
        tail_key = tuple(hash_ids) if key is None else key
        rng = random.Random(f"{self.seed}/tail/{tail_key!r}")
        words.extend(rng.choices(self._words, k=num_tokens - len(words)))
        return self._fit(words, num_tokens, rng)

    def _block(self, hash_id: int, block_tokens: int) -> list[str]:
        cached = self._blocks.get((hash_id, block_tokens))
        if cached is None:
            rng = random.Random(f"{self.seed}/block/{hash_id}")
            cached = rng.choices(self._words, k=block_tokens)
            self._blocks[(hash_id, block_tokens)] = cached
        return cached

    def _encode(self, text: str) -> list[int]:
        encoded = self._tokenizer.encode(text, add_special_tokens=False)
        return list(getattr(encoded, "ids", encoded))

    def _fit(self, words: list[str], num_tokens: int, rng: random.Random) -> str:
        """Join ``words``; if the count is off, drop or add words at the end."""
        words = list(words)
        text = "".join(words)
        count = self.count(text)
        for _ in range(_MAX_FIX_STEPS):
            if count == num_tokens:
                return text
            if count > num_tokens and words:
                words.pop()
            else:
                words.append(rng.choice(self._words))
            text = "".join(words)
            count = self.count(text)
        if count == num_tokens:
            return text
        raise ValueError(f"cannot build a prompt of exactly {num_tokens} tokens with this "
                         f"tokenizer (got {count}); its words do not tokenize additively")


def _check_count(num_tokens: int) -> None:
    if num_tokens < 0:
        raise ValueError(f"token count must be >= 0, got {num_tokens}")


def _word_pool(tokenizer: TokenizerLike, seed: int, size: int) -> list[str]:
    """Up to ``size`` distinct " w" strings, each one ordinary token, in a
    seeded order over the vocabulary."""
    vocab_size = _vocab_size(tokenizer)
    special = set(_special_ids(tokenizer))
    ids = list(range(vocab_size))
    random.Random(f"{seed}/pool").shuffle(ids)
    words: dict[str, None] = {}
    for token_id in ids:
        if len(words) >= size:
            break
        if token_id in special:
            continue
        word = tokenizer.decode([token_id]).strip()
        if not (word.isascii() and word.isalpha()):
            continue
        encoded = tokenizer.encode(" " + word, add_special_tokens=False)
        if list(getattr(encoded, "ids", encoded)) == [token_id]:
            words[" " + word] = None
    if not words:
        raise ValueError("the tokenizer has no word w for which ' w' is one ordinary token; "
                         "cannot build prompts of exact lengths")
    return list(words)


def _vocab_size(tokenizer: Any) -> int:
    size = getattr(tokenizer, "vocab_size", None)
    return int(size) if size is not None else int(tokenizer.get_vocab_size())


def _special_ids(tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "all_special_ids", None)
    if ids is not None:
        return list(ids)
    added = getattr(tokenizer, "get_added_tokens_decoder", None)
    return [i for i, token in added().items() if token.special] if added else []
