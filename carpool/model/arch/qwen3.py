"""Qwen3 (dense): Qwen2's decoder without q/k/v biases, with an RMSNorm over
each head of q and of k before rotary (``qk_norm``)."""
from __future__ import annotations

from typing import Any

from carpool.model.arch.base import Architecture, check_activation, common_fields
from carpool.model.arch.llama import SILU, qwen_window_keys, qwen_windows


def _qwen3(d: dict) -> dict[str, Any]:
    check_activation(d, "hidden_act", SILU)
    if d.get("head_dim") is None:  # Qwen3's own default, not hidden / heads
        d = {**d, "head_dim": 128}
    fields = common_fields(d, "qwen3", 32768)
    fields["qk_norm"] = True
    qwen_windows(d, fields)
    return fields


QWEN3 = Architecture("qwen3", "Qwen3ForCausalLM", _qwen3,
                     lambda c: {"attention_bias": c.attention_bias, **qwen_window_keys(c)})
