"""Model configuration shared by the loader, the converter and the forward pass.

`ModelConfig` is the one description of a Llama-family decoder that the rest of
carpool reads. It is built from a Hugging Face ``config.json`` dict
(`ModelConfig.from_hf_config`) and can be written back as one
(`ModelConfig.to_hf_config`), so a directory produced by the GGUF converter
loads in transformers too.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from typing import Any

# model_type -> the HF class name written into "architectures".
_ARCH_CLASSES = types.MappingProxyType({
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
})
_CLASS_TO_ARCH = types.MappingProxyType({cls: arch for arch, cls in _ARCH_CLASSES.items()})

# Keys a llama3 rope_scaling dict must carry; without them the frequencies
# cannot be computed, so a config lacking one is rejected up front.
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

_DEFAULT_MAX_POSITIONS = types.MappingProxyType({"llama": 2048, "qwen2": 32768, "mistral": 32768})


@dataclasses.dataclass
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family causal LM.

    ``architecture`` is the HF model_type: "llama", "qwen2" or "mistral"
    (SmolLM2 is "llama"). ``attention_bias`` means the q/k/v projections carry
    biases (always so for Qwen2); whether o_proj has one too (Llama with
    ``attention_bias``) is visible from the weights. ``rope_scaling`` is None
    or a dict whose "rope_type" says how to read the rest ("llama3",
    "linear", "dynamic", ...). ``sliding_window`` is None when every layer
    attends to the whole context.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, d: dict) -> "ModelConfig":
        """Build from a HF ``config.json`` dict (Llama, Qwen2, Mistral, SmolLM2).

        Raises ValueError for an unsupported architecture or a config missing a
        required field.
        """
        arch = _architecture_of(d)
        hidden = _required(d, "hidden_size")
        heads = _required(d, "num_attention_heads")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; only silu is implemented")
        if d.get("mlp_bias"):
            raise ValueError("unsupported config: mlp_bias=true")
        rope_theta, rope_scaling = _rope_of(d)
        return cls(
            architecture=arch,
            vocab_size=_required(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(d, "intermediate_size"),
            num_layers=_required(d, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[arch]),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_id_list(d.get("eos_token_id")),
            sliding_window=_sliding_window_of(arch, d),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json``-compatible dict that transformers can load."""
        eos: int | list[int] | None = self.eos_token_ids
        if len(self.eos_token_ids) == 1:
            eos = self.eos_token_ids[0]
        elif not self.eos_token_ids:
            eos = None
        out: dict[str, Any] = {
            "architectures": [_ARCH_CLASSES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": copy.deepcopy(self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": "float32",
        }
        if self.architecture == "qwen2":
            out["use_sliding_window"] = self.sliding_window is not None
            out["sliding_window"] = self.sliding_window
        else:
            out["attention_bias"] = self.attention_bias
            if self.architecture == "mistral":
                out["sliding_window"] = self.sliding_window
        return out


def _architecture_of(d: dict) -> str:
    model_type = d.get("model_type")
    classes = d.get("architectures") or []
    if model_type in _ARCH_CLASSES:
        return model_type
    for cls in classes:
        if cls in _CLASS_TO_ARCH:
            return _CLASS_TO_ARCH[cls]
    raise ValueError(
        f"unsupported model architecture (model_type={model_type!r}, architectures={classes!r}); "
        f"supported: {', '.join(sorted(_CLASS_TO_ARCH))}"
    )


def _required(d: dict, key: str) -> int:
    value = d.get(key)
    if value is None:
        raise ValueError(f"config is missing {key!r}")
    return int(value)


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _rope_of(d: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config spelling.

    transformers >= 5 writes ``rope_parameters`` (theta and scaling in one
    dict); older configs write ``rope_theta`` and ``rope_scaling``.
    """
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling")
    return theta, _normalize_rope_scaling(scaling)


def _normalize_rope_scaling(scaling: dict | None) -> dict | None:
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


def _sliding_window_of(arch: str, d: dict) -> int | None:
    window = d.get("sliding_window")
    if arch == "llama" or window is None:
        return None
    # Qwen2 configs carry a window size even when it is switched off.
    if arch == "qwen2" and not d.get("use_sliding_window", False):
        return None
    return int(window)
