"""Gemma 3 (text): sandwich norms (a norm after attention and after the MLP,
each before its residual add), RMSNorm weights as ``1 + w`` in fp32, GeGLU
(tanh gelu), embeddings scaled by sqrt(hidden), q/k RMSNorm per head,
attention scaled by ``query_pre_attn_scalar ** -0.5``, sliding-window
layers between global ones (every sixth layer global by default) with
their own rope base, and an optional final logit soft-cap.

``gemma3_text`` is the text-only model (Gemma3ForCausalLM: gemma-3-1b and
the text towers saved alone); the multimodal ``gemma3`` checkpoints nest
this config under ``text_config``: ``gemma3`` serves their text model
(gemma-3-4b/12b/27b), leaving the vision tower unread, as text-only
serving of those checkpoints."""
from __future__ import annotations

from typing import Any

from carpool.model.arch.base import (
    FULL,
    SLIDING,
    Architecture,
    check_activation,
    common_fields,
    hf_layer_types,
    hf_rope,
    layer_types_of,
    rope_of,
)

_PATTERN = 6  # sliding_window_pattern's default: every sixth layer global


def _gemma3(d: dict) -> dict[str, Any]:
    act = check_activation(d, "hidden_activation", ("gelu_pytorch_tanh",))
    if d.get("hidden_act") not in (None, act):
        raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} for gemma3_text")
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("unsupported config: attn_logit_softcapping (Gemma 2's attention soft-cap)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("unsupported config: use_bidirectional_attention")
    window = d.get("sliding_window", 4096)  # None: no window
    defaults = {"head_dim": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
    d = {**defaults, **{k: v for k, v in d.items() if v is not None}}
    fields = common_fields(d, "gemma3_text", 131072)
    pattern = int(d.get("sliding_window_pattern") or _PATTERN)
    fields["layer_types"] = layer_types_of(
        d, fields["num_layers"], lambda i: SLIDING if (i + 1) % pattern else FULL)
    if window is None:
        fields["layer_types"] = (FULL,) * fields["num_layers"]
    fields["sliding_window"] = int(window) if SLIDING in fields["layer_types"] else None
    global_d = {**d, "rope_theta": d.get("rope_theta", 1_000_000.0)}
    fields["rope_theta"], fields["rope_scaling"] = rope_of(global_d, "full_attention")
    local_d = {"rope_parameters": d.get("rope_parameters"),
               "rope_theta": d.get("rope_local_base_freq", 10_000.0)}
    fields["local_rope_theta"], fields["local_rope_scaling"] = rope_of(local_d, "sliding_attention")
    fields.update(
        qk_norm=True, norm_style="gemma", hidden_act="gelu_tanh", sandwich_norms=True,
        embed_scale=fields["hidden_size"] ** 0.5,
        attention_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcap=(None if d.get("final_logit_softcapping") is None
                             else float(d["final_logit_softcapping"])))
    return fields


def _hf_extras(c: Any) -> dict[str, Any]:
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": c.attention_bias,
        "query_pre_attn_scalar": c.attention_scale ** -2,
        "sliding_window": c.sliding_window,
        "layer_types": hf_layer_types(c.layer_types),
        "final_logit_softcapping": c.final_logit_softcap,
        "rope_parameters": {
            "full_attention": hf_rope(c.rope_theta, c.rope_scaling),
            "sliding_attention": hf_rope(c.local_rope_theta, c.local_rope_scaling)},
    }


GEMMA3_TEXT = Architecture("gemma3_text", "Gemma3ForCausalLM", _gemma3, _hf_extras)


def _gemma3_multimodal(d: dict) -> dict[str, Any]:
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("a gemma3 config needs its text_config")
    merged = {**text, "model_type": "gemma3_text"}
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if merged.get(key) is None and d.get(key) is not None:
            merged[key] = d[key]
    return _gemma3(merged)


# Hub checkpoints name the text model ``language_model.model.*`` (and its
# head ``language_model.lm_head``); transformers 5 in memory ``model.language_model.*``.
GEMMA3 = Architecture("gemma3", "Gemma3ForConditionalGeneration", _gemma3_multimodal,
                      _hf_extras, weight_prefixes=(
                          ("language_model.model.", "model."), ("language_model.lm_head.",
                                                                "lm_head."),
                          ("model.language_model.", "model.")),
                      dropped_prefixes=("vision_tower.", "multi_modal_projector.",
                                        "model.vision_tower.", "model.multi_modal_projector."))
