"""Mixture-of-experts families with ordinary attention: Mixtral (every layer's
MLP is a softmax top-k MoE, always renormalised) and Qwen3-MoE (Qwen3's
attention; MoE layers by ``decoder_sparse_step`` less ``mlp_only_layers``,
top-k renormalised only with ``norm_topk_prob``). The MoE MLP itself is
``MoESpec`` (carpool/model/moe_spec.py)."""
from __future__ import annotations

from typing import Any

from carpool.model.arch.base import FULL, SLIDING, Architecture, check_activation, common_fields
from carpool.model.arch.llama import SILU, qwen_window_keys, qwen_windows
from carpool.model.moe_spec import MoESpec


def _mixtral(d: dict) -> dict[str, Any]:
    check_activation(d, "hidden_act", SILU)
    fields = common_fields(d, "mixtral", 32768)
    window = d.get("sliding_window")
    fields["sliding_window"] = None if window is None else int(window)
    fields["layer_types"] = (FULL if window is None else SLIDING,) * fields["num_layers"]
    fields["moe"] = MoESpec.from_mixtral(d)
    fields["moe_layers"] = (True,) * fields["num_layers"]
    return fields


def _qwen3_moe(d: dict) -> dict[str, Any]:
    check_activation(d, "hidden_act", SILU)
    if d.get("head_dim") is None:
        d = {**d, "head_dim": 128}
    fields = common_fields(d, "qwen3_moe", 32768)
    fields["qk_norm"] = True
    qwen_windows(d, fields)
    spec = MoESpec.from_qwen3_moe(d)
    step = int(d.get("decoder_sparse_step", 1) or 1)
    dense = {int(i) for i in d.get("mlp_only_layers") or ()}
    fields["moe"] = spec
    fields["moe_layers"] = tuple(i not in dense and spec.num_experts > 0 and (i + 1) % step == 0
                                 for i in range(fields["num_layers"]))
    return fields


def _moe_keys(c: Any) -> dict[str, Any]:
    spec = c.moe
    return {"num_experts_per_tok": spec.top_k, "attention_bias": c.attention_bias}


def _mixtral_extras(c: Any) -> dict[str, Any]:
    return {**_moe_keys(c), "num_local_experts": c.moe.num_experts,
            "sliding_window": c.sliding_window}


def _qwen3_moe_extras(c: Any) -> dict[str, Any]:
    return {**_moe_keys(c), **qwen_window_keys(c), "num_experts": c.moe.num_experts,
            "moe_intermediate_size": c.moe.expert_intermediate_size,
            "norm_topk_prob": c.moe.renormalize, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, sparse in enumerate(c.moe_layers) if not sparse]}


MIXTRAL = Architecture("mixtral", "MixtralForCausalLM", _mixtral, _mixtral_extras)
QWEN3_MOE = Architecture("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe, _qwen3_moe_extras)
