"""Model configuration shared by the loader, the converter and the forward pass.

`ModelConfig` is the one description of a decoder that the rest of carpool
reads: the shape every family shares plus the parts only some have (q/k
norms, Gemma's norms and activation, per-layer sliding windows, ...). It is
built from a Hugging Face ``config.json`` dict by the family's
``Architecture`` (carpool/model/arch/: the registry) and can be written back
as one (`ModelConfig.to_hf_config`), so a directory produced by the GGUF
converter loads in transformers too. Plain Python: no torch.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

from carpool.model.arch import ARCHITECTURES, architecture_of
from carpool.model.arch.base import FULL, SLIDING
from carpool.model.arch.deepseek import MLASpec
from carpool.model.moe_spec import MoESpec


@dataclasses.dataclass
class ModelConfig:
    """Shape and hyper-parameters of a decoder-only causal LM.

    ``architecture`` is the HF model_type (a key of ``ARCHITECTURES``;
    SmolLM2 is "llama"). ``attention_bias`` means the q/k/v projections carry
    biases (always so for Qwen2); whether o_proj has one too (Llama with
    ``attention_bias``) is visible from the weights. ``rope_scaling`` is None
    or a dict whose "rope_type" says how to read the rest ("llama3",
    "linear", ...). ``layer_types`` gives each layer's attention: "full" or
    "sliding" (the last ``sliding_window`` positions, the query's own
    included); empty means every layer full.

    The fields after ``sliding_window`` are what families beyond Llama add;
    their defaults are Llama's: ``qk_norm`` (an RMSNorm over each head of q
    and k before rotary: Qwen3, Gemma 3), ``norm_style`` ("llama": ``w *
    norm(x)`` in the model's dtype; "gemma": ``(1 + w) * norm(x)`` in fp32),
    ``hidden_act`` of the gated MLP ("silu" or "gelu_tanh"),
    ``sandwich_norms`` (a norm on the attention's and the MLP's output
    before each residual add, and ``pre_feedforward_layernorm`` before the
    MLP), ``embed_scale`` (embeddings times this, in the weights' dtype),
    ``attention_scale`` (None: head_dim ** -0.5), ``final_logit_softcap``
    (``tanh(logits / cap) * cap``) and the sliding layers' own rope
    (``local_rope_theta``; None: as the full layers). ``moe``: the
    mixture-of-experts MLP of the layers ``moe_layers`` marks (the others
    keep a dense MLP of ``intermediate_size``), or None. ``mla``: multi-head
    latent attention's sizes (DeepSeek), or None; its cache holds one latent
    per token and layer (``cache_dim`` wide) instead of K and V per KV head.
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
    layer_types: tuple[str, ...] = ()
    qk_norm: bool = False
    norm_style: str = "llama"
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attention_scale: float | None = None
    final_logit_softcap: float | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    moe: MoESpec | None = None
    moe_layers: tuple[bool, ...] = ()
    mla: MLASpec | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = (FULL,) * self.num_layers
        self.layer_types = tuple(self.layer_types)
        self.moe_layers = tuple(self.moe_layers) or (self.moe is not None,) * self.num_layers
        if len(self.moe_layers) != self.num_layers or (any(self.moe_layers) and self.moe is None):
            raise ValueError("moe_layers must mark each layer, and MoE layers need a MoESpec")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported model architecture {self.architecture!r}")

    @classmethod
    def from_hf_config(cls, d: dict) -> "ModelConfig":
        """Build from a HF ``config.json`` dict of any family in the registry.

        Raises ValueError for an unsupported architecture, a config missing a
        required field, or a feature the family's forward does not implement.
        """
        return cls(**architecture_of(d).parse(d))

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_layers[layer]

    def window_of(self, layer: int) -> int | None:
        """How many positions layer ``layer`` attends to (None: all)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def scale(self) -> float:
        """The attention's score scale (MLA: over its whole q/k head, with
        yarn's ``mscale_all_dim`` correction squared, as DeepSeek does)."""
        if self.attention_scale is not None:
            return self.attention_scale
        if self.mla is None:
            return self.head_dim ** -0.5
        scale = self.mla.qk_head_dim ** -0.5
        scaling = self.rope_scaling or {}
        if scaling.get("mscale_all_dim"):
            mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
            scale *= mscale * mscale
        return scale

    # The KV cache's geometry: per layer, ``cache_tensors`` tensors (K and V,
    # or MLA's one latent) of ``cache_heads`` x ``cache_dim`` per token.
    @property
    def cache_tensors(self) -> int:
        return 1 if self.mla is not None else 2

    @property
    def cache_heads(self) -> int:
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def cache_dim(self) -> int:
        return self.mla.latent_dim if self.mla is not None else self.head_dim

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return (self.num_layers * self.cache_tensors * self.cache_heads * self.cache_dim
                * element_bytes)

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json``-compatible dict that transformers can load."""
        eos: int | list[int] | None = self.eos_token_ids
        if len(self.eos_token_ids) == 1:
            eos = self.eos_token_ids[0]
        elif not self.eos_token_ids:
            eos = None
        arch = ARCHITECTURES[self.architecture]
        out: dict[str, Any] = {
            "architectures": [arch.hf_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu" if self.hidden_act == "silu" else "gelu_pytorch_tanh",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": copy.deepcopy(self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": "float32",
        }
        out.update(arch.hf_extras(self))
        if "rope_parameters" in out:  # the family writes rope per layer type
            del out["rope_theta"], out["rope_scaling"]
        return out


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: ``0.1 * mscale * ln(factor) + 1`` (1 below factor 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
