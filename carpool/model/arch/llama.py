"""Llama, Qwen2 and Mistral (SmolLM2 is Llama): the plain pre-norm decoder
with SwiGLU that every other family here varies."""
from __future__ import annotations

from typing import Any

from carpool.model.arch.base import (
    FULL,
    SLIDING,
    Architecture,
    check_activation,
    common_fields,
    hf_layer_types,
    layer_types_of,
)

SILU = ("silu", "swish")


def _llama(d: dict) -> dict[str, Any]:
    check_activation(d, "hidden_act", SILU)
    fields = common_fields(d, "llama", 2048)
    fields["layer_types"] = (FULL,) * fields["num_layers"]
    return fields


def _mistral(d: dict) -> dict[str, Any]:
    check_activation(d, "hidden_act", SILU)
    fields = common_fields(d, "mistral", 32768)
    window = d.get("sliding_window")
    fields["sliding_window"] = None if window is None else int(window)
    # Mistral's window, when it has one, covers every layer.
    fields["layer_types"] = (FULL if window is None else SLIDING,) * fields["num_layers"]
    return fields


def qwen_windows(d: dict, fields: dict[str, Any]) -> None:
    """Qwen2 / Qwen3: a window only with ``use_sliding_window`` (their
    configs carry a size even when it is off), on the layers from
    ``max_window_layers`` on."""
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    first = int(d.get("max_window_layers", 28))
    fields["layer_types"] = layer_types_of(
        d, fields["num_layers"], lambda i: SLIDING if window is not None and i >= first else FULL)
    fields["sliding_window"] = (int(window) if window is not None and SLIDING in
                                fields["layer_types"] else None)


def _qwen2(d: dict) -> dict[str, Any]:
    check_activation(d, "hidden_act", SILU)
    fields = common_fields(d, "qwen2", 32768)
    fields["attention_bias"] = True  # Qwen2's q/k/v always carry biases (o_proj none)
    qwen_windows(d, fields)
    return fields


def qwen_window_keys(config: Any) -> dict[str, Any]:
    return {"use_sliding_window": config.sliding_window is not None,
            "sliding_window": config.sliding_window,
            "layer_types": hf_layer_types(config.layer_types)}


LLAMA = Architecture("llama", "LlamaForCausalLM", _llama,
                     lambda c: {"attention_bias": c.attention_bias})
QWEN2 = Architecture("qwen2", "Qwen2ForCausalLM", _qwen2, qwen_window_keys)
MISTRAL = Architecture("mistral", "MistralForCausalLM", _mistral,
                       lambda c: {"attention_bias": c.attention_bias,
                                  "sliding_window": c.sliding_window})
