"""What a GGUF file's architecture means to carpool: llama.cpp's
architecture names mapped to the families of carpool/model/gguf_families.py,
the metadata every family shares read into a Hugging Face config, and
tensor names mapped to HF ones (the rest of the conversion, weights and
tokenizer, is gguf_convert.py's and gguf_tokenizer.py's).

Architectures (llama.cpp's names -> HF model_type): "llama" (Llama,
Mistral, SmolLM2 and the like; q/k rows permuted for llama.cpp's rotary,
undone here) and, with ``expert_count`` > 0, "mixtral" (experts stacked or
one tensor each); "qwen2", "qwen3" (q/k norms per head) and "qwen3moe"
(experts stacked per layer in three tensors, split here into the hub's
per-expert names; llama.cpp renormalises the top-k weights); "gemma3" ->
"gemma3_text" (norm weights stored as w + 1); "deepseek2" -> "deepseek_v3"
(MLA, kv_b_proj whole or split into k_b/v_b; sigmoid-routed experts only).
"""
from __future__ import annotations

import re
import types
from typing import Any

import gguf
import numpy as np

from carpool.model import gguf_families as families
from carpool.model.config import ModelConfig
from carpool.model.gguf_families import GGUFFamily, find_tensor, meta

_GLOBAL_TENSORS = types.MappingProxyType({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
})
# GGUF architecture -> its family. llama.cpp writes Mistral, and Mixtral, as
# "llama"; ``gguf_family`` tells Mixtral by its experts.
ARCHITECTURES = types.MappingProxyType({
    "llama": families.LLAMA, "qwen2": families.QWEN2, "qwen3": families.QWEN3,
    "qwen3moe": families.QWEN3_MOE, "gemma3": families.GEMMA3, "deepseek2": families.DEEPSEEK2})
_PER_EXPERT_NAME = re.compile(r"(ffn_[a-z]+)\.(\d+)\.weight")


def _rope_scaling(reader: gguf.GGUFReader, arch: str, head_dim: int, theta: float) -> dict | None:
    freqs = find_tensor(reader, "rope_freqs.weight")
    if freqs is not None:
        factors = gguf.quants.dequantize(freqs.data, freqs.tensor_type).astype(np.float64).reshape(-1)
        return llama3_scaling_from_factors(factors, head_dim, theta)
    kind = meta(reader, f"{arch}.rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    factor = float(meta(reader, f"{arch}.rope.scaling.factor"))
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    original = meta(reader, f"{arch}.rope.scaling.original_context_length", None)
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


def gguf_family(reader: gguf.GGUFReader) -> GGUFFamily:
    """The file's family; ValueError naming the supported architectures."""
    arch = meta(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    if arch == "llama" and int(meta(reader, "llama.expert_count", 0) or 0) > 0:
        return families.MIXTRAL
    return ARCHITECTURES[arch]


def gguf_hf_config(reader: gguf.GGUFReader) -> dict:
    """The HF ``config.json`` dict the file's metadata says."""
    family = gguf_family(reader)
    arch = meta(reader, "general.architecture")
    return family.hf_config(reader, arch, _shared_hf_config(reader, arch))


def gguf_model_config(reader: gguf.GGUFReader) -> ModelConfig:
    """`ModelConfig` from GGUF metadata; ValueError for an unsupported architecture."""
    return ModelConfig.from_hf_config(gguf_hf_config(reader))


def _shared_hf_config(reader: gguf.GGUFReader, arch: str) -> dict:
    """The HF config keys every family reads the same way."""
    embed = find_tensor(reader, "token_embd.weight")
    if embed is None:
        raise ValueError("GGUF has no token_embd.weight tensor")
    hidden = int(meta(reader, f"{arch}.embedding_length"))
    heads = int(meta(reader, f"{arch}.attention.head_count"))
    head_dim = int(meta(reader, f"{arch}.attention.key_length", hidden // heads))
    theta = float(meta(reader, f"{arch}.rope.freq_base", 10000.0))
    ffn = meta(reader, f"{arch}.feed_forward_length", None)
    eos = [meta(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    return {
        "vocab_size": int(embed.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": None if ffn is None else int(ffn),
        "num_hidden_layers": int(meta(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, arch, head_dim, theta),
        "max_position_embeddings": int(meta(reader, f"{arch}.context_length")),
        "tie_word_embeddings": find_tensor(reader, "output.weight") is None,
        "bos_token_id": meta(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
    }


def hf_tensors(family: GGUFFamily, gguf_name: str,
               array: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """The HF tensors a GGUF tensor holds (stacked experts: one per expert),
    or None for one the family's HF layout has no place for."""
    if gguf_name in _GLOBAL_TENSORS:
        return [(_GLOBAL_TENSORS[gguf_name], array)]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    prefix, rest = f"model.layers.{parts[1]}.", parts[2]
    if rest in family.layer_tensors:
        return [(prefix + family.layer_tensors[rest], array)]
    if rest in family.expert_tensors:
        name = prefix + family.expert_tensors[rest]
        return [(name.format(e=e), np.ascontiguousarray(array[e])) for e in range(array.shape[0])]
    one_expert = _PER_EXPERT_NAME.fullmatch(rest)
    if one_expert and f"{one_expert[1]}.{{e}}.weight" in family.per_expert_tensors:
        name = prefix + family.per_expert_tensors[f"{one_expert[1]}.{{e}}.weight"]
        return [(name.format(e=int(one_expert[2])), array)]
    return None
