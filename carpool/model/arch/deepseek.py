"""DeepSeek-V3 (and R1, which shares it): multi-head latent attention (MLA)
and mixture-of-experts MLPs after ``first_k_dense_replace`` dense layers.

MLA: queries through a LoRA pair (``q_lora_rank``; None: one projection),
keys and values from one compressed latent per token (``kv_lora_rank``,
RMS-normalised) plus a rotary part shared by every head
(``qk_rope_head_dim``). The cache holds only that latent and rotary part:
the memory MLA exists to save. Rotary pairs are interleaved in DeepSeek's
weights (``rope_interleave``); the loader reorders those weight rows so
our half-split rotary computes the same dot products. The MoE MLP is
``MoESpec.from_deepseek_v3`` (sigmoid scores, a correction bias for
choosing, group-limited top-k, scaled weights, shared experts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from carpool.model.arch.base import (
    FULL,
    Architecture,
    check_activation,
    common_fields,
    hf_rope,
    required,
)
from carpool.model.arch.llama import SILU
from carpool.model.moe_spec import MoESpec


@dataclass(frozen=True)
class MLASpec:
    """One MLA attention's sizes; ``interleaved``: the checkpoint's rotary
    rows pair (0, 1), (2, 3), ... (the loader reorders them)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    interleaved: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What the cache holds per token and layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _deepseek_v3(d: dict) -> dict[str, Any]:
    check_activation(d, "hidden_act", SILU)
    if d.get("attention_bias"):
        raise ValueError("unsupported config: attention_bias=true for deepseek_v3")
    mla = MLASpec(kv_lora_rank=required(d, "kv_lora_rank"),
                  qk_nope_head_dim=required(d, "qk_nope_head_dim"),
                  qk_rope_head_dim=required(d, "qk_rope_head_dim"),
                  v_head_dim=int(d.get("v_head_dim") or 128),
                  q_lora_rank=None if d.get("q_lora_rank") is None else int(d["q_lora_rank"]),
                  interleaved=bool(d.get("rope_interleave", True)))
    # The rotary tables are the rope part's; the cache's sizes come from ``mla``.
    fields = common_fields({**d, "head_dim": mla.qk_rope_head_dim}, "deepseek_v3", 4096)
    fields["num_kv_heads"] = fields["num_heads"]
    fields["layer_types"] = (FULL,) * fields["num_layers"]
    fields["mla"] = mla
    dense = int(d.get("first_k_dense_replace", 3) or 0)
    freq = int(d.get("moe_layer_freq", 1) or 1)
    fields["moe"] = MoESpec.from_deepseek_v3(d)
    fields["moe_layers"] = tuple(i >= dense and i % freq == 0
                                 for i in range(fields["num_layers"]))
    if fields["rope_scaling"] is not None:
        original = fields["rope_scaling"].get("original_max_position_embeddings")
        fields["rope_scaling"].setdefault("max_position_embeddings",
                                          fields["max_position_embeddings"])
        if original is None and fields["rope_scaling"]["rope_type"] == "yarn":
            raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    return fields


def _hf_extras(c: Any) -> dict[str, Any]:
    mla, moe = c.mla, c.moe
    scaling = dict(c.rope_scaling or {})
    scaling.pop("max_position_embeddings", None)
    return {
        "kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim, "rope_interleave": mla.interleaved,
        "head_dim": mla.qk_rope_head_dim, "attention_bias": False,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_intermediate_size, "n_group": moe.n_group,
        "topk_group": moe.topk_group, "routed_scaling_factor": moe.routed_scaling_factor,
        "norm_topk_prob": moe.renormalize,
        "n_shared_experts": moe.shared_intermediate_size // moe.expert_intermediate_size,
        "first_k_dense_replace": c.moe_layers.index(True) if True in c.moe_layers
        else c.num_layers,
        "rope_parameters": hf_rope(c.rope_theta, scaling or None),
    }


DEEPSEEK_V3 = Architecture("deepseek_v3", "DeepseekV3ForCausalLM", _deepseek_v3, _hf_extras)
