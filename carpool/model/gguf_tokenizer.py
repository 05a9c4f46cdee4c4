"""A GGUF file's vocabulary rebuilt as Hugging Face ``tokenizers`` files
(tokenizer.json and tokenizer_config.json), for the two kinds llama.cpp's
converter writes for the families carpool reads:

* ``tokenizer.ggml.model`` = "gpt2": byte-level BPE (tokens and merges),
  split first by the regexes llama.cpp assigns to ``tokenizer.ggml.pre``.
* "llama": SentencePiece (Mixtral, Gemma 3). llama.cpp's SPM tokenizer
  (llama-vocab.cpp) turns spaces into "▁", prepends one (``add_space_prefix``)
  to each stretch of text between special tokens, merges adjacent pieces
  highest score first into tokens of the vocabulary and spells what no
  token covers as its UTF-8 bytes (``<0xNN>`` tokens). The HF equivalent,
  as transformers' own SentencePiece conversion builds it: a BPE model
  whose merges are every split of a token into two tokens, ranked by the
  merged token's score, with byte fallback.
"""
from __future__ import annotations

import types
from typing import Any

import gguf

from carpool.model.gguf_families import meta

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3: digits in threes, then runs of CJK ideographs and kana, then
# a GPT-4-like split that keeps punctuation apart from letters.
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# tokenizer.ggml.pre -> (split regexes applied in order, ignore_merges), as
# llama.cpp's llama-vocab.cpp assigns them. A name not listed gets GPT-2's.
_PRE_TOKENIZERS = types.MappingProxyType({
    **{name: ((_LLAMA3_SPLIT,), True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{name: ((_LLAMA3_SPLIT,), False) for name in ("smaug-bpe", "dbrx")},
    **{name: ((_QWEN2_SPLIT,), False) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2")},
    **{name: (_DEEPSEEK3_SPLITS, False) for name in ("deepseek-v3", "hunyuan-dense")},
    # StarCoder-style vocabularies split every digit off before the GPT-2 regex.
    **{name: ((r"\p{N}", _GPT2_SPLIT), False)
       for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")},
})

# llama.cpp token types.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_SPACE = "▁"  # SentencePiece's visible space


def gguf_tokenizer_files(reader: gguf.GGUFReader) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) contents from GGUF metadata."""
    model = meta(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(f"unsupported GGUF tokenizer model {model!r}; supported: byte-level "
                         "BPE ('gpt2') and SentencePiece ('llama')")
    tokens: list[str] = meta(reader, "tokenizer.ggml.tokens")
    kinds = meta(reader, "tokenizer.ggml.token_type", None) or [_NORMAL] * len(tokens)
    add_bos = bool(meta(reader, "tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(meta(reader, "tokenizer.ggml.add_eos_token", False))
    special_ids = _special_token_ids(reader, len(tokens))
    framing = [(tokens[special_ids[name]], special_ids[name]) if flag and name in special_ids else None
               for name, flag in (("bos_token", add_bos), ("eos_token", add_eos))]
    if model == "gpt2":
        tokenizer_json = _byte_level_bpe(reader, tokens)
    else:
        unk = tokens[special_ids["unk_token"]] if "unk_token" in special_ids else None
        tokenizer_json = _sentencepiece_bpe(reader, tokens, kinds, unk)
    tokenizer_json.update({"version": "1.0", "truncation": None, "padding": None,
                           "added_tokens": _added_tokens(tokens, kinds),
                           "post_processor": _post_processor(*framing, byte_level=model == "gpt2")})
    arch = meta(reader, "general.architecture")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta(reader, f"{arch}.context_length", 2048)),
        "chat_template": meta(reader, "tokenizer.chat_template", None),
        **{name: tokens[token_id] for name, token_id in special_ids.items()},
    }
    return tokenizer_json, tokenizer_config


def _bpe_model(vocab: dict[str, int], merges: list, *, unk: str | None, byte_fallback: bool,
               ignore_merges: bool) -> dict:
    return {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": byte_fallback, "byte_fallback": byte_fallback,
            "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges}


def _byte_level_bpe(reader: gguf.GGUFReader, tokens: list[str]) -> dict:
    merges = [merge.split(" ", 1) for merge in meta(reader, "tokenizer.ggml.merges")]
    splits, ignore_merges = _PRE_TOKENIZERS.get(meta(reader, "tokenizer.ggml.pre", "default"),
                                                ((), False))
    prefix_space = bool(meta(reader, "tokenizer.ggml.add_space_prefix", False))
    return {
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(splits, prefix_space),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": _bpe_model({tok: i for i, tok in enumerate(tokens)}, merges, unk=None,
                            byte_fallback=False, ignore_merges=ignore_merges),
    }


def _sentencepiece_bpe(reader: gguf.GGUFReader, tokens: list[str], kinds: list[int],
                       unk: str | None) -> dict:
    scores = meta(reader, "tokenizer.ggml.scores", None) or [0.0] * len(tokens)
    # llama.cpp's default for SPM vocabularies is to prepend the space.
    prefix_space = bool(meta(reader, "tokenizer.ggml.add_space_prefix", True))
    spaces = {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}
    normalizer = ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": _SPACE}, spaces]}
                  if prefix_space else spaces)
    decoders: list[dict] = [{"type": "Replace", "pattern": {"String": _SPACE}, "content": " "},
                            {"type": "ByteFallback"}, {"type": "Fuse"}]
    if prefix_space:  # the space encode prepended
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "normalizer": normalizer,
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": _bpe_model({tok: i for i, tok in enumerate(tokens)},
                            sentencepiece_merges(tokens, scores, kinds),
                            unk=unk, byte_fallback=True, ignore_merges=False),
    }


def sentencepiece_merges(tokens: list[str], scores: list[float], kinds: list[int]) -> list[list[str]]:
    """BPE merges equivalent to SentencePiece's score order: every split of
    a token into two tokens, the highest-scoring merged token first (ties:
    the merged token's id, then the parts' ids, as transformers orders them).
    Only ordinary and user-defined tokens take part; control, unknown,
    unused and byte tokens are never the product of a merge."""
    ids = {tok: i for i, tok in enumerate(tokens) if kinds[i] in (_NORMAL, _USER_DEFINED)}
    found = []
    for token, token_id in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((-float(scores[token_id]), token_id, ids[left], ids[right], left, right))
    found.sort(key=lambda merge: merge[:4])
    return [[left, right] for *_, left, right in found]


def _special_token_ids(reader: gguf.GGUFReader, num_tokens: int) -> dict[str, int]:
    """tokenizer_config names (bos_token, ...) -> ids, for those the file sets."""
    ids = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        token_id = meta(reader, f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None and 0 <= token_id < num_tokens:
            ids[name] = int(token_id)
    return ids


def _added_tokens(tokens: list[str], kinds: list[int]) -> list[dict]:
    """Control (and unknown) tokens as special added tokens, user-defined ones
    as plain added tokens.

    Both are matched whole in the input text, as llama.cpp does; only the
    special ones are dropped by ``decode(skip_special_tokens=True)``.
    """
    return [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": kind != _USER_DEFINED}
        for i, (tok, kind) in enumerate(zip(tokens, kinds))
        if kind in (_UNKNOWN, _CONTROL, _USER_DEFINED)
    ]


def _pre_tokenizer(splits: tuple[str, ...], add_prefix_space: bool) -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": True}
    if not splits:
        return {**byte_level, "use_regex": True}
    steps: list[dict] = [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
        for regex in splits
    ]
    return {"type": "Sequence", "pretokenizers": [*steps, {**byte_level, "use_regex": False}]}


def _post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None,
                    byte_level: bool) -> dict | None:
    """BOS/EOS framing for ``encode(add_special_tokens=True)``; ids pass through otherwise."""
    if bos is None and eos is None:
        if not byte_level:
            return None
        return {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}

    def framed(seq_id: str, type_id: int) -> list[dict[str, Any]]:
        head = [{"SpecialToken": {"id": bos[0], "type_id": type_id}}] if bos else []
        tail = [{"SpecialToken": {"id": eos[0], "type_id": type_id}}] if eos else []
        return head + [{"Sequence": {"id": seq_id, "type_id": type_id}}] + tail

    return {
        "type": "TemplateProcessing",
        "single": framed("A", 0),
        "pair": framed("A", 0) + framed("B", 1),
        "special_tokens": {
            tok: {"id": tok, "ids": [i], "tokens": [tok]} for tok, i in filter(None, (bos, eos))
        },
    }
