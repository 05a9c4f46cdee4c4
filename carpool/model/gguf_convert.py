"""Convert a llama.cpp GGUF file into a Hugging Face style model directory.

The output holds config.json, generation_config.json, model.safetensors (every
tensor dequantized to float32, under HF names, then stored in the dtype asked
for: the one the model will be served in), tokenizer.json and
tokenizer_config.json (with the chat template), so the rest of carpool, and
transformers, load it like any HF checkpoint.

Supported: the GGUF architectures of carpool/model/gguf_arch.py ("llama":
Llama, Mistral, SmolLM2 and the like; "qwen2", "qwen3", "qwen3moe"), with a
byte-level BPE vocabulary (``tokenizer.ggml.model`` = "gpt2").
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from carpool.model.config import ModelConfig
from carpool.model.gguf_arch import (
    _meta,
    gguf_model_config,
    hf_tensors,
    unpermute_qk,
)

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (split regexes applied in order, ignore_merges), as
# llama.cpp's llama-vocab.cpp assigns them. A name not listed gets GPT-2's.
_PRE_TOKENIZERS = types.MappingProxyType({
    **{name: ((_LLAMA3_SPLIT,), True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{name: ((_LLAMA3_SPLIT,), False) for name in ("smaug-bpe", "dbrx")},
    **{name: ((_QWEN2_SPLIT,), False) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2")},
    # StarCoder-style vocabularies split every digit off before the GPT-2 regex.
    **{name: ((r"\p{N}", _GPT2_SPLIT), False)
       for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")},
})

# llama.cpp token types.
_CONTROL, _USER_DEFINED = 3, 4
_STALE_TEMP_SECONDS = 6 * 3600


def convert_gguf(gguf_path: str | Path, out_dir: str | Path,
                 dtype: torch.dtype = torch.float32, progress: bool = False) -> Path:
    """Convert ``gguf_path`` into the HF-style directory ``out_dir`` and return it.

    Weights are stored in ``dtype`` (each dequantized to float32 first, then
    cast: the same values a float32 copy cast at load time would give).
    ``progress``: a progress bar over the tensors on stderr (shown on a
    terminal only). The directory appears atomically: files are written to a
    temporary sibling that is renamed into place, so an interrupted conversion
    leaves no partial ``out_dir``. If ``out_dir`` already exists (another
    process won the race) it is left alone. Raises ValueError for unsupported
    or malformed files.
    """
    out_dir = Path(out_dir)
    reader = open_gguf(gguf_path)
    config = gguf_model_config(reader)
    weights = gguf_weights(reader, config, dtype, progress)
    tokenizer_json, tokenizer_config = gguf_tokenizer_files(reader)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_json(tmp / "config.json", config.to_hf_config())
        _write_json(tmp / "generation_config.json", generation)
        _write_json(tmp / "tokenizer.json", tokenizer_json)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # mkdtemp (and safetensors) create private modes; a cache entry is ordinary.
        for written in tmp.iterdir():
            written.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not out_dir.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _remove_stale_temps(out_dir: Path) -> None:
    """Delete temporaries that killed conversions left behind (hours old, so not a live one)."""
    cutoff = time.time() - _STALE_TEMP_SECONDS
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        try:
            if stale.stat().st_mtime < cutoff:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def open_gguf(gguf_path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file, naming the likely problem when it cannot be parsed."""
    try:
        return gguf.GGUFReader(str(gguf_path))
    except (ValueError, IndexError, OverflowError) as exc:
        if "magic" in str(exc).lower():
            raise ValueError("not a GGUF file (bad magic number)") from exc
        # The reader maps every tensor up front; a short file fails while doing so.
        raise ValueError(f"truncated or corrupt GGUF file ({exc})") from exc


def gguf_weights(reader: gguf.GGUFReader, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 progress: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its HF name, q/k unpermuted for
    llama, then cast to ``dtype`` (one tensor at a time: the float32 copy of
    the whole model never exists when ``dtype`` is 16-bit)."""
    weights: dict[str, torch.Tensor] = {}
    permuted = config.architecture == "llama"  # llama.cpp leaves qwen2 q/k as HF has them
    # disable=None: the bar shows on a terminal only, never in logs.
    bar = tqdm(reader.tensors, desc="carpool: converting", unit="tensor", file=sys.stderr,
               disable=None if progress else True, leave=False)
    for tensor in bar:
        if tensor.name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling
        array = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, copy=True)
        expected = tuple(int(n) for n in reversed(tensor.shape))
        if array.shape != expected:
            array = array.reshape(expected)
        named = hf_tensors(tensor.name, array)
        if named is None:
            raise ValueError(f"unexpected tensor {tensor.name!r} for a {config.architecture} model")
        for name, part in named:
            if permuted and ".self_attn.q_proj." in name:
                part = unpermute_qk(part, config.num_heads)
            elif permuted and ".self_attn.k_proj." in name:
                part = unpermute_qk(part, config.num_kv_heads)
            weights[name] = torch.from_numpy(part).to(dtype)
    return weights


def gguf_tokenizer_files(reader: gguf.GGUFReader) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) contents from GGUF metadata."""
    model = _meta(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r}; only byte-level BPE ('gpt2') works")
    tokens: list[str] = _meta(reader, "tokenizer.ggml.tokens")
    kinds = _meta(reader, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
    merges = [merge.split(" ", 1) for merge in _meta(reader, "tokenizer.ggml.merges")]
    splits, ignore_merges = _PRE_TOKENIZERS.get(_meta(reader, "tokenizer.ggml.pre", "default"), ((), False))
    add_bos = bool(_meta(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_meta(reader, "tokenizer.ggml.add_eos_token", False))
    special_ids = _special_token_ids(reader, len(tokens))
    prefix_space = bool(_meta(reader, "tokenizer.ggml.add_space_prefix", False))
    framing = [(tokens[special_ids[name]], special_ids[name]) if flag and name in special_ids else None
               for name, flag in (("bos_token", add_bos), ("eos_token", add_eos))]
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, kinds),
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(splits, prefix_space),
        "post_processor": _post_processor(*framing),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": merges,
        },
    }
    arch = _meta(reader, "general.architecture")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_meta(reader, f"{arch}.context_length", 2048)),
        "chat_template": _meta(reader, "tokenizer.chat_template", None),
        **{name: tokens[token_id] for name, token_id in special_ids.items()},
    }
    return tokenizer_json, tokenizer_config


def _special_token_ids(reader: gguf.GGUFReader, num_tokens: int) -> dict[str, int]:
    """tokenizer_config names (bos_token, ...) -> ids, for those the file sets."""
    ids = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        token_id = _meta(reader, f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None and 0 <= token_id < num_tokens:
            ids[name] = int(token_id)
    return ids


def _added_tokens(tokens: list[str], kinds: list[int]) -> list[dict]:
    """Control tokens as special added tokens, user-defined ones as plain added tokens.

    Both are matched whole in the input text, as llama.cpp does; only control
    tokens are dropped by ``decode(skip_special_tokens=True)``.
    """
    return [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": kind == _CONTROL}
        for i, (tok, kind) in enumerate(zip(tokens, kinds)) if kind in (_CONTROL, _USER_DEFINED)
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


def _post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> dict:
    """BOS/EOS framing for ``encode(add_special_tokens=True)``; ids pass through otherwise."""
    if bos is None and eos is None:
        return {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}

    def framed(seq_id: str, type_id: int) -> list[dict]:
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


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2 if path.name != "tokenizer.json" else None)
