"""What an architecture is to carpool, and the config readers every family
shares. Plain Python: no torch (the simulator reads model shapes too).

An ``Architecture`` turns a Hugging Face ``config.json`` dict into the
keyword arguments of ``carpool.model.config.ModelConfig`` (``parse``) and
writes back the keys only its family has (``hf_extras``), so a config read
and written again loads in transformers with the same meaning.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Keys a llama3 rope_scaling dict must carry; without them the frequencies
# cannot be computed, so a config lacking one is rejected up front.
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")
FULL, SLIDING = "full", "sliding"  # a layer's attention: the whole context or a window
_HF_LAYER_TYPES = {"full_attention": FULL, "sliding_attention": SLIDING}


@dataclass(frozen=True)
class Architecture:
    """One model family as carpool reads it.

    ``model_type``: the HF ``model_type``; ``hf_class``: the class name
    written into ``architectures``; ``parse``: a config dict -> ModelConfig
    keyword arguments (raising ValueError for what the family's forward
    does not implement); ``hf_extras``: a ModelConfig -> the family's own
    ``config.json`` keys. ``weight_prefixes``: (theirs, ours) name prefixes
    the loader renames (a multimodal checkpoint's text model); any other
    tensor under ``dropped_prefixes`` (its vision tower) is not read."""

    model_type: str
    hf_class: str
    parse: Callable[[dict], dict[str, Any]]
    hf_extras: Callable[[Any], dict[str, Any]]
    weight_prefixes: tuple[tuple[str, str], ...] = ()
    dropped_prefixes: tuple[str, ...] = ()

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as the decoder reads it, or None: not read."""
        for theirs, ours in self.weight_prefixes:
            if name.startswith(theirs):
                return ours + name[len(theirs):]
        return None if name.startswith(self.dropped_prefixes) else name


def required(d: dict, key: str) -> int:
    value = d.get(key)
    if value is None:
        raise ValueError(f"config is missing {key!r}")
    return int(value)


def id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def common_fields(d: dict, model_type: str, default_max_positions: int) -> dict[str, Any]:
    """The fields every decoder has, read the way Llama's config spells them."""
    hidden = required(d, "hidden_size")
    heads = required(d, "num_attention_heads")
    if d.get("mlp_bias"):
        raise ValueError("unsupported config: mlp_bias=true")
    quantized = d.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise ValueError(f"unsupported checkpoint: weights quantized with {method!r} "
                         "(quantization_config); carpool reads 16/32-bit safetensors or GGUF "
                         "(dequantize to bf16 first; --quantization quantizes at load)")
    rope_theta, rope_scaling = rope_of(d)
    return {
        "architecture": model_type,
        "vocab_size": required(d, "vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": required(d, "intermediate_size"),
        "num_layers": required(d, "num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": int(d.get("num_key_value_heads") or heads),
        "head_dim": int(d.get("head_dim") or hidden // heads),
        "rms_norm_eps": float(d.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(d.get("max_position_embeddings") or default_max_positions),
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
        "attention_bias": bool(d.get("attention_bias", False)),
        "bos_token_id": d.get("bos_token_id"),
        "eos_token_ids": id_list(d.get("eos_token_id")),
    }


def check_activation(d: dict, key: str, allowed: tuple[str, ...]) -> str:
    act = d.get(key) or allowed[0]
    if act not in allowed:
        raise ValueError(f"unsupported {key} {act!r}; implemented: {', '.join(allowed)}")
    return act


def rope_of(d: dict, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config spelling.

    transformers >= 5 writes ``rope_parameters`` (theta and scaling in one
    dict, per layer type for families whose layer types differ: ``layer_type``
    names which); older configs write ``rope_theta`` and ``rope_scaling``.
    """
    params = d.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling")
    return theta, normalize_rope_scaling(scaling)


def normalize_rope_scaling(scaling: dict | None) -> dict | None:
    if not scaling:
        return None
    out = dict(scaling)
    # Old configs name the kind "type"; newer ones "rope_type". Keep one.
    kind = out.pop("rope_type", None) or out.pop("type", None)
    out.pop("type", None)
    if kind is None or kind == "default":
        return None
    out["rope_type"] = kind
    if kind == "llama3":
        missing = [k for k in _LLAMA3_ROPE_KEYS if k not in out]
        if missing:
            raise ValueError(f"llama3 rope_scaling is missing {', '.join(missing)}")
    return out


def hf_rope(theta: float, scaling: dict | None) -> dict[str, Any]:
    """One layer type's ``rope_parameters`` entry as transformers 5 writes it."""
    return {"rope_type": "default", **(scaling or {}), "rope_theta": theta}


def layer_types_of(d: dict, num_layers: int,
                   default: Callable[[int], str]) -> tuple[str, ...]:
    """Each layer's attention (FULL / SLIDING): the config's ``layer_types``
    when it lists them, else ``default(index)``."""
    listed = d.get("layer_types")
    if listed is None:
        return tuple(default(i) for i in range(num_layers))
    if len(listed) != num_layers:
        raise ValueError(f"layer_types lists {len(listed)} layers, the model has {num_layers}")
    unknown = sorted({t for t in listed if t not in _HF_LAYER_TYPES})
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}; implemented: "
                         f"{', '.join(_HF_LAYER_TYPES)}")
    return tuple(_HF_LAYER_TYPES[t] for t in listed)


def hf_layer_types(layer_types: tuple[str, ...]) -> list[str]:
    back = {ours: theirs for theirs, ours in _HF_LAYER_TYPES.items()}
    return [back[t] for t in layer_types]
