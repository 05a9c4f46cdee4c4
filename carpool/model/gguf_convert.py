"""Convert a llama.cpp GGUF file into a Hugging Face style model directory.

The output holds config.json, generation_config.json, model.safetensors (every
tensor dequantized to float32, under HF names, then stored in the dtype asked
for: the one the model will be served in), tokenizer.json and
tokenizer_config.json (with the chat template), so the rest of carpool, and
transformers, load it like any HF checkpoint.

Supported: GGUF architectures "llama" (Llama, Mistral, SmolLM2 and the like)
and "qwen2", with a byte-level BPE vocabulary (``tokenizer.ggml.model`` =
"gpt2").
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

_GLOBAL_TENSORS = types.MappingProxyType({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
})
_LAYER_TENSORS = types.MappingProxyType({
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
})
# GGUF architecture -> HF model_type. llama.cpp writes Mistral as "llama".
_ARCHITECTURES = types.MappingProxyType({"llama": "llama", "qwen2": "qwen2"})
# llama.cpp token types.
_CONTROL, _USER_DEFINED = 3, 4
_NO_DEFAULT = object()
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


def _meta(reader: gguf.GGUFReader, key: str, default: Any = _NO_DEFAULT) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _NO_DEFAULT:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def _tensor(reader: gguf.GGUFReader, name: str) -> Any:
    for tensor in reader.tensors:
        if tensor.name == name:
            return tensor
    return None


def gguf_model_config(reader: gguf.GGUFReader) -> ModelConfig:
    """`ModelConfig` from GGUF metadata; ValueError for an unsupported architecture."""
    arch = _meta(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}")
    embed = _tensor(reader, "token_embd.weight")
    if embed is None:
        raise ValueError("GGUF has no token_embd.weight tensor")
    hidden = int(_meta(reader, f"{arch}.embedding_length"))
    heads = int(_meta(reader, f"{arch}.attention.head_count"))
    head_dim = int(_meta(reader, f"{arch}.attention.key_length", hidden // heads))
    theta = float(_meta(reader, f"{arch}.rope.freq_base", 10000.0))
    context = int(_meta(reader, f"{arch}.context_length"))
    eos = [_meta(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    return ModelConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=int(embed.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(_meta(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_meta(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_meta(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, arch, head_dim, theta),
        max_position_embeddings=context,
        tie_word_embeddings=_tensor(reader, "output.weight") is None,
        attention_bias=arch == "qwen2" or _tensor(reader, "blk.0.attn_q.bias") is not None,
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=list(dict.fromkeys(int(e) for e in eos if e is not None)),
    )


def _rope_scaling(reader: gguf.GGUFReader, arch: str, head_dim: int, theta: float) -> dict | None:
    freqs = _tensor(reader, "rope_freqs.weight")
    if freqs is not None:
        factors = gguf.quants.dequantize(freqs.data, freqs.tensor_type).astype(np.float64).reshape(-1)
        return llama3_scaling_from_factors(factors, head_dim, theta)
    kind = _meta(reader, f"{arch}.rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    factor = float(_meta(reader, f"{arch}.rope.scaling.factor"))
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    original = _meta(reader, f"{arch}.rope.scaling.original_context_length", None)
    if original is not None and kind != "linear":
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def llama3_scaling_from_factors(factors: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """Recover a llama3 ``rope_scaling`` dict from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores Llama 3.1's scaling as one divisor per frequency: 1 for
    short wavelengths, ``factor`` for long ones and, in the band between,
    ``1 / ((1 - s) / factor + s)`` with ``s = old_len / wavelen / (high - low)
    - low / (high - low)``. The band fixes ``old_len / (high - low)`` and
    ``low / (high - low)`` only; every (old_len, low, high) sharing those gives
    the same frequencies, so old_len is taken as 8192 (Llama 3.1's own).
    """
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    tol = 1e-5 * factor
    band = (factors > 1.0 + tol) & (factors < factor - tol)
    if band.sum() < 2:
        raise ValueError("cannot recover the rope scaling from rope_freqs (too few interpolated frequencies)")
    smooth = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(inv_freq[band] / (2 * np.pi), smooth, 1)
    old_len = 8192
    width = old_len / slope
    low = -intercept * width
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(f"{low:.6g}"),
        "high_freq_factor": float(f"{low + width:.6g}"),
        "original_max_position_embeddings": old_len,
    }


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows for its interleaved rotary layout.

    llama.cpp stores each head's rows as (half, pair) swapped to (pair, half);
    this restores HF's half-split order. Works for weights and 1-D biases.
    """
    half = weight.shape[0] // num_heads // 2
    restored = weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(restored.reshape(weight.shape))


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None for one the HF layout has no place for."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None


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
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ValueError(f"unexpected tensor {tensor.name!r} for a {config.architecture} model")
        array = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, copy=True)
        expected = tuple(int(n) for n in reversed(tensor.shape))
        if array.shape != expected:
            array = array.reshape(expected)
        if permuted and ".self_attn.q_proj." in name:
            array = unpermute_qk(array, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            array = unpermute_qk(array, config.num_kv_heads)
        weights[name] = torch.from_numpy(array).to(dtype)
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
