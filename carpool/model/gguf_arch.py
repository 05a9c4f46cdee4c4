"""What a GGUF file's architecture means to carpool: its metadata read into
a ``ModelConfig`` and its tensor names mapped to Hugging Face ones (the
rest of the conversion, weights and tokenizer, is gguf_convert.py's).

Architectures (llama.cpp's names -> HF model_type): "llama" (Llama,
Mistral, SmolLM2 and the like; q/k rows permuted for llama.cpp's rotary,
undone here), "qwen2", "qwen3" (q/k norms per head) and "qwen3moe"
(experts stacked per layer in three tensors, split here into the hub's
per-expert names; llama.cpp renormalises the top-k weights).
"""
from __future__ import annotations

import types
from typing import Any

import gguf
import numpy as np

from carpool.model.config import ModelConfig
from carpool.model.moe_spec import MoESpec

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
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
})
# Stacked experts [E, ...] -> the per-expert HF name ({e}: the expert).
_EXPERT_TENSORS = types.MappingProxyType({
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
})
# GGUF architecture -> HF model_type. llama.cpp writes Mistral as "llama".
ARCHITECTURES = types.MappingProxyType({"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                                        "qwen3moe": "qwen3_moe"})
_NO_DEFAULT = object()


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


def gguf_model_config(reader: gguf.GGUFReader) -> ModelConfig:
    """`ModelConfig` from GGUF metadata; ValueError for an unsupported architecture."""
    arch = _meta(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    embed = _tensor(reader, "token_embd.weight")
    if embed is None:
        raise ValueError("GGUF has no token_embd.weight tensor")
    hidden = int(_meta(reader, f"{arch}.embedding_length"))
    heads = int(_meta(reader, f"{arch}.attention.head_count"))
    head_dim = int(_meta(reader, f"{arch}.attention.key_length", hidden // heads))
    theta = float(_meta(reader, f"{arch}.rope.freq_base", 10000.0))
    eos = [_meta(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    moe = _moe_spec(reader, arch)
    return ModelConfig(
        architecture=ARCHITECTURES[arch],
        vocab_size=int(embed.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(_meta(reader, f"{arch}.feed_forward_length",
                                    moe.expert_intermediate_size if moe else _NO_DEFAULT)),
        num_layers=int(_meta(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_meta(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, arch, head_dim, theta),
        max_position_embeddings=int(_meta(reader, f"{arch}.context_length")),
        tie_word_embeddings=_tensor(reader, "output.weight") is None,
        attention_bias=arch == "qwen2" or _tensor(reader, "blk.0.attn_q.bias") is not None,
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=list(dict.fromkeys(int(e) for e in eos if e is not None)),
        qk_norm=arch in ("qwen3", "qwen3moe"),
        moe=moe,
    )


def _moe_spec(reader: gguf.GGUFReader, arch: str) -> MoESpec | None:
    if arch != "qwen3moe":
        return None
    return MoESpec(num_experts=int(_meta(reader, f"{arch}.expert_count")),
                   top_k=int(_meta(reader, f"{arch}.expert_used_count")),
                   expert_intermediate_size=int(_meta(reader,
                                                      f"{arch}.expert_feed_forward_length")),
                   renormalize=True, family="qwen3_moe")


def hf_tensors(gguf_name: str, array: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """The HF tensors a GGUF tensor holds (stacked experts: one per expert),
    or None for one the HF layout has no place for."""
    if gguf_name in _GLOBAL_TENSORS:
        return [(_GLOBAL_TENSORS[gguf_name], array)]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    prefix = f"model.layers.{parts[1]}."
    if parts[2] in _LAYER_TENSORS:
        return [(prefix + _LAYER_TENSORS[parts[2]], array)]
    if parts[2] in _EXPERT_TENSORS:
        name = prefix + _EXPERT_TENSORS[parts[2]]
        return [(name.format(e=e), np.ascontiguousarray(array[e])) for e in range(array.shape[0])]
    return None
