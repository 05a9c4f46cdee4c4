"""The GGUF families carpool converts, one ``GGUFFamily`` each: the Hugging
Face ``config.json`` keys its metadata says and the HF names of its
tensors. carpool/model/gguf_arch.py maps llama.cpp's architecture names
onto these and reads the keys every family shares.

What llama.cpp's converter (convert_hf_to_gguf.py) changed, and so what is
undone here or in gguf_convert.py:

* "llama" (and Mixtral, "llama" with ``expert_count``): q/k rows permuted
  for llama.cpp's interleaved rotary (``permuted_qk``). Mixtral's experts
  are stacked per layer (``ffn_gate_exps``), or one tensor per expert
  (``ffn_gate.{e}``) in files from before April 2024.
* "gemma3": every RMSNorm weight stored as ``w + 1`` (Gemma's norm scales
  by ``1 + w``; ``norm_shift``); the attention scale, the sliding layers and
  their rope base are not in the file but fixed by llama.cpp's loader.
* "deepseek2": nothing permuted (llama.cpp's rotary for it is interleaved,
  as DeepSeek's weights are). Newer files split ``kv_b_proj`` into
  ``attn_k_b`` (its key rows, transposed per head) and ``attn_v_b``, and
  describe the MQA form llama.cpp runs (one KV head of the latent's width),
  with the per-head sizes under ``key_length_mla``/``value_length_mla``.
"""
from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import gguf

NO_DEFAULT = object()
# llama.cpp's expert_gating_func values.
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2
# Gemma 3's llama.cpp loader: every sixth layer global, the sliding ones on
# their own rope base; the 27B (62 layers) scales attention by
# hidden / heads instead of head_dim, as Google's reference does.
_GEMMA3_PATTERN, _GEMMA3_LOCAL_THETA, _GEMMA3_27B_LAYERS = 6, 10_000.0, 62
# llama.cpp writes DeepSeek's yarn mscale_all_dim as 0.1 * mscale_all_dim.
_YARN_LOG_MUL_PER_MSCALE = 0.1


def meta(reader: gguf.GGUFReader, key: str, default: Any = NO_DEFAULT) -> Any:
    """Metadata value ``key``; ``default`` when absent (ValueError without one)."""
    field = reader.get_field(key)
    if field is None:
        if default is NO_DEFAULT:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def find_tensor(reader: gguf.GGUFReader, name: str) -> Any:
    for tensor in reader.tensors:
        if tensor.name == name:
            return tensor
    return None


@dataclass(frozen=True)
class GGUFFamily:
    """One GGUF model family. ``hf_config(reader, arch, shared)``: the HF
    config dict, from the keys every family shares (``shared``) and the
    family's own metadata. ``layer_tensors``: a block's GGUF tensor -> the
    HF name in its layer; ``expert_tensors``: stacked experts [E, ...] -> the
    per-expert HF name (``{e}``: the expert); ``per_expert_tensors``: the
    older one-tensor-per-expert GGUF names (``{e}`` in both)."""

    model_type: str
    hf_config: Callable[[gguf.GGUFReader, str, dict], dict]
    layer_tensors: Mapping[str, str]
    expert_tensors: Mapping[str, str] = field(default_factory=lambda: _table())
    per_expert_tensors: Mapping[str, str] = field(default_factory=lambda: _table())
    permuted_qk: bool = False  # llama.cpp reordered q/k rows for its rotary
    norm_shift: float = 0.0    # llama.cpp stored each RMSNorm weight plus this


def _table(*parts: Mapping[str, str]) -> Mapping[str, str]:
    merged: dict[str, str] = {}
    for part in parts:
        merged.update(part)
    return types.MappingProxyType(merged)


_ATTENTION = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_BIASES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight",
             "attn_k_norm.weight": "self_attn.k_norm.weight"}
_NORMS = {"attn_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_DENSE_MLP = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
              "ffn_down.weight": "mlp.down_proj.weight"}
# The hub's per-expert names of Qwen3-MoE and DeepSeek-V3 (Mixtral's differ).
_MLP_EXPERTS = _table({"ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
                       "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
                       "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight"})
_MIXTRAL_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}  # HF Mixtral's names
# One table for llama/qwen2/qwen3/qwen3moe: a name a file lacks is never asked for.
_LLAMA_QWEN_LAYER = _table(_NORMS, _ATTENTION, _BIASES, _QK_NORMS, _DENSE_MLP,
                           {"ffn_gate_inp.weight": "mlp.gate.weight"})
_MIXTRAL_LAYER = _table(_NORMS, _ATTENTION, _BIASES,
                        {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight"})
_GEMMA3_LAYER = _table(_ATTENTION, _QK_NORMS, _DENSE_MLP, {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",  # Gemma's norm before the MLP
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
})
# attn_k_b / attn_v_b keep llama.cpp's intermediate names until gguf_convert
# joins each layer's pair back into kv_b_proj (``join_split_kv_b``).
K_B_PROJ, V_B_PROJ = "self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight"
_DEEPSEEK2_LAYER = _table(_NORMS, _DENSE_MLP, {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": K_B_PROJ,
    "attn_v_b.weight": V_B_PROJ,
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
})


def _attention_bias(reader: gguf.GGUFReader) -> bool:
    return find_tensor(reader, "blk.0.attn_q.bias") is not None


def _llama_config(reader: gguf.GGUFReader, arch: str, shared: dict) -> dict:
    return {**shared, "model_type": "llama", "attention_bias": _attention_bias(reader)}


def _qwen2_config(reader: gguf.GGUFReader, arch: str, shared: dict) -> dict:
    return {**shared, "model_type": "qwen2"}


def _qwen3_config(reader: gguf.GGUFReader, arch: str, shared: dict) -> dict:
    return {**shared, "model_type": "qwen3", "attention_bias": _attention_bias(reader)}


def _qwen3moe_config(reader: gguf.GGUFReader, arch: str, shared: dict) -> dict:
    expert_ffn = int(meta(reader, f"{arch}.expert_feed_forward_length"))
    return {**shared, "model_type": "qwen3_moe", "attention_bias": _attention_bias(reader),
            "intermediate_size": shared["intermediate_size"] or expert_ffn,
            "num_experts": int(meta(reader, f"{arch}.expert_count")),
            "num_experts_per_tok": int(meta(reader, f"{arch}.expert_used_count")),
            "moe_intermediate_size": expert_ffn,
            "norm_topk_prob": True}  # llama.cpp renormalises qwen3moe's top-k


def _mixtral_config(reader: gguf.GGUFReader, arch: str, shared: dict) -> dict:
    # llama.cpp writes Mixtral's expert size as feed_forward_length.
    inter = shared["intermediate_size"] or int(meta(reader, f"{arch}.expert_feed_forward_length"))
    return {**shared, "model_type": "mixtral", "attention_bias": _attention_bias(reader),
            "intermediate_size": inter, "sliding_window": None,
            "num_local_experts": int(meta(reader, f"{arch}.expert_count")),
            "num_experts_per_tok": int(meta(reader, f"{arch}.expert_used_count"))}


def gemma3_sliding_layers(reader: gguf.GGUFReader, arch: str, num_layers: int) -> list[bool]:
    """Which layers attend through the window: llama.cpp's period-6 pattern
    (the last of every six global) unless ``sliding_window_pattern`` gives
    another period or a flag per layer (true: sliding)."""
    pattern = meta(reader, f"{arch}.attention.sliding_window_pattern", _GEMMA3_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"sliding_window_pattern lists {len(pattern)} layers, "
                             f"the model has {num_layers}")
        return [bool(p) for p in pattern]
    period = int(pattern)
    return [period == 0 or i % period < period - 1 for i in range(num_layers)]


def _gemma3_config(reader: gguf.GGUFReader, arch: str, shared: dict) -> dict:
    layers, heads = shared["num_hidden_layers"], shared["num_attention_heads"]
    window = int(meta(reader, f"{arch}.attention.sliding_window", 0) or 0)
    sliding = gemma3_sliding_layers(reader, arch, layers) if window else [False] * layers
    scalar = (shared["hidden_size"] // heads if layers == _GEMMA3_27B_LAYERS
              else shared["head_dim"])
    softcap = meta(reader, f"{arch}.final_logit_softcapping", None)
    return {**shared, "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": scalar, "sliding_window": window or None,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "rope_local_base_freq": float(meta(reader, f"{arch}.rope.freq_base_swa",
                                               _GEMMA3_LOCAL_THETA)),
            "final_logit_softcapping": None if not softcap else float(softcap)}


def _deepseek2_attention(reader: gguf.GGUFReader, arch: str) -> dict:
    """MLA's sizes. Newer files give the per-head sizes as *_mla (their
    key_length/value_length being the latent MQA's); older ones directly."""
    rope = int(meta(reader, f"{arch}.rope.dimension_count"))
    key_mla = meta(reader, f"{arch}.attention.key_length_mla", None)
    if key_mla is not None:
        key, value = int(key_mla), int(meta(reader, f"{arch}.attention.value_length_mla"))
    else:
        key = int(meta(reader, f"{arch}.attention.key_length"))
        value = int(meta(reader, f"{arch}.attention.value_length"))
    q_lora = meta(reader, f"{arch}.attention.q_lora_rank", None)
    return {"kv_lora_rank": int(meta(reader, f"{arch}.attention.kv_lora_rank")),
            "q_lora_rank": None if not q_lora else int(q_lora), "qk_rope_head_dim": rope,
            "qk_nope_head_dim": key - rope, "v_head_dim": value, "rope_interleave": True}


def _deepseek2_moe(reader: gguf.GGUFReader, arch: str) -> dict:
    gating = int(meta(reader, f"{arch}.expert_gating_func", _GATING_SOFTMAX))
    if gating != _GATING_SIGMOID:
        # llama.cpp reads a missing key as softmax: DeepSeek-V2's routing.
        raise ValueError(f"unsupported GGUF deepseek2 routing (expert_gating_func {gating}); "
                         "only DeepSeek-V3's sigmoid routing (2) is implemented")
    groups = int(meta(reader, f"{arch}.expert_group_count", 1) or 1)
    return {"n_routed_experts": int(meta(reader, f"{arch}.expert_count")),
            "num_experts_per_tok": int(meta(reader, f"{arch}.expert_used_count")),
            "moe_intermediate_size": int(meta(reader, f"{arch}.expert_feed_forward_length")),
            "n_shared_experts": int(meta(reader, f"{arch}.expert_shared_count", 0)),
            "routed_scaling_factor": float(meta(reader, f"{arch}.expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(meta(reader, f"{arch}.expert_weights_norm", False)),
            "n_group": groups,
            "topk_group": int(meta(reader, f"{arch}.expert_group_used_count", groups) or groups),
            "first_k_dense_replace": int(meta(reader, f"{arch}.leading_dense_block_count", 0))}


def _deepseek2_config(reader: gguf.GGUFReader, arch: str, shared: dict) -> dict:
    config = {**shared, "model_type": "deepseek_v3", **_deepseek2_attention(reader, arch),
              **_deepseek2_moe(reader, arch)}
    config["num_key_value_heads"] = shared["num_attention_heads"]  # the file's is the MQA's
    config["head_dim"] = config["qk_rope_head_dim"]
    config["intermediate_size"] = shared["intermediate_size"] or config["moe_intermediate_size"]
    scaling = shared["rope_scaling"]
    log_mul = meta(reader, f"{arch}.rope.scaling.yarn_log_multiplier", None)
    if scaling and scaling["rope_type"] == "yarn" and log_mul:
        # llama.cpp scales attention by mscale_all_dim's yarn factor squared
        # and cancels yarn's cos/sin factor: HF's with mscale == mscale_all_dim.
        mscale = float(f"{float(log_mul) / _YARN_LOG_MUL_PER_MSCALE:.6g}")
        config["rope_scaling"] = {**scaling, "mscale": mscale, "mscale_all_dim": mscale}
    for key in ("beta_fast", "beta_slow"):
        value = meta(reader, f"{arch}.rope.scaling.yarn_{key}", None)
        if scaling and scaling["rope_type"] == "yarn" and value is not None:
            config["rope_scaling"] = {**config["rope_scaling"], key: float(value)}
    return config


def _expert_parts(name_of: Callable[[str], str]) -> Mapping[str, str]:
    """The older one-tensor-per-expert GGUF names (``ffn_gate.{e}.weight``)."""
    return _table({f"ffn_{role}.{{e}}.weight": name_of(role) for role in ("gate", "up", "down")})


LLAMA = GGUFFamily("llama", _llama_config, _LLAMA_QWEN_LAYER, permuted_qk=True)
MIXTRAL = GGUFFamily(
    "mixtral", _mixtral_config, _MIXTRAL_LAYER,
    expert_tensors=_table({f"ffn_{role}_exps.weight": f"block_sparse_moe.experts.{{e}}.{w}.weight"
                           for role, w in _MIXTRAL_EXPERT.items()}),
    per_expert_tensors=_expert_parts(
        lambda role: f"block_sparse_moe.experts.{{e}}.{_MIXTRAL_EXPERT[role]}.weight"),
    permuted_qk=True)
QWEN2 = GGUFFamily("qwen2", _qwen2_config, _LLAMA_QWEN_LAYER)
QWEN3 = GGUFFamily("qwen3", _qwen3_config, _LLAMA_QWEN_LAYER)
QWEN3_MOE = GGUFFamily("qwen3_moe", _qwen3moe_config, _LLAMA_QWEN_LAYER,
                       expert_tensors=_MLP_EXPERTS)
GEMMA3 = GGUFFamily("gemma3_text", _gemma3_config, _GEMMA3_LAYER, norm_shift=1.0)
DEEPSEEK2 = GGUFFamily("deepseek_v3", _deepseek2_config, _DEEPSEEK2_LAYER,
                       expert_tensors=_MLP_EXPERTS)
