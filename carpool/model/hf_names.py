"""The Hugging Face tensor names of a decoder checkpoint, in one place:
the loader checks a checkpoint against ``expected_shapes`` and the model
copies its weights in by ``layer_names``, so the two cannot disagree (they
once did about o_proj's bias). Plain Python: no torch."""
from __future__ import annotations

from collections.abc import Collection

from carpool.model.config import ModelConfig
from carpool.model.moe_spec import PER_EXPERT, detect_layout, expected_moe_shapes

EMBED_TOKENS = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def o_proj_has_bias(config: ModelConfig) -> bool:
    """Llama's ``attention_bias`` covers o_proj too; Qwen2's q/k/v bias does not."""
    return config.attention_bias and config.architecture != "qwen2"


def layer_names(index: int) -> dict[str, str]:
    """Layer ``index``'s tensor names by role (``q``, ``q_bias``, ``gate``, ...)."""
    prefix = layer_prefix(index)
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    names = {p: f"{attn}{p}_proj.weight" for p in "qkvo"}
    names.update({f"{p}_bias": f"{attn}{p}_proj.bias" for p in "qkvo"})
    names.update({p: f"{mlp}{p}_proj.weight" for p in ("gate", "up", "down")})
    names["input_norm"] = prefix + "input_layernorm.weight"
    # Llama's norm before the MLP; with sandwich norms (Gemma) the one on
    # the attention's output, and the MLP's own norms are the two after.
    names["post_norm"] = prefix + "post_attention_layernorm.weight"
    names["pre_ff_norm"] = prefix + "pre_feedforward_layernorm.weight"
    names["post_ff_norm"] = prefix + "post_feedforward_layernorm.weight"
    names["q_norm"], names["k_norm"] = attn + "q_norm.weight", attn + "k_norm.weight"
    return names


def layer_prefix(index: int) -> str:
    return f"model.layers.{index}."


def mla_names(index: int) -> dict[str, str]:
    """Layer ``index``'s MLA tensor names by role."""
    attn = layer_prefix(index) + "self_attn."
    names = {role: f"{attn}{role}.weight" for role in (
        "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}
    names["q_a_layernorm"] = attn + "q_a_layernorm.weight"
    names["kv_a_layernorm"] = attn + "kv_a_layernorm.weight"
    return names


def mla_shapes(config: ModelConfig, index: int) -> dict[str, tuple[int, ...]]:
    """The MLA tensors a checkpoint's layer ``index`` must hold, with shapes."""
    m, hidden, heads = config.mla, config.hidden_size, config.num_heads
    n = mla_names(index)
    shapes = {n["kv_a_proj_with_mqa"]: (m.latent_dim, hidden),
              n["kv_a_layernorm"]: (m.kv_lora_rank,),
              n["kv_b_proj"]: (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
              n["o_proj"]: (hidden, heads * m.v_head_dim)}
    if m.q_lora_rank is None:
        shapes[n["q_proj"]] = (heads * m.qk_head_dim, hidden)
    else:
        shapes.update({n["q_a_proj"]: (m.q_lora_rank, hidden),
                       n["q_a_layernorm"]: (m.q_lora_rank,),
                       n["q_b_proj"]: (heads * m.qk_head_dim, m.q_lora_rank)})
    return shapes


def expected_shapes(config: ModelConfig,
                    names: Collection[str] = ()) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes a checkpoint for ``config`` must contain.
    ``names``: the checkpoint's, which say how its experts are laid out
    (carpool/model/moe_spec.py; default: per expert, as hubs have them)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {EMBED_TOKENS: (c.vocab_size, c.hidden_size),
                                          FINAL_NORM: (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes[LM_HEAD] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        n = layer_names(i)
        shapes.update({n["input_norm"]: (c.hidden_size,), n["post_norm"]: (c.hidden_size,)})
        if c.mla is not None:
            shapes.update(mla_shapes(c, i))
        else:
            shapes.update({n["q"]: (q, c.hidden_size), n["k"]: (kv, c.hidden_size),
                           n["v"]: (kv, c.hidden_size), n["o"]: (c.hidden_size, q)})
        if c.is_moe_layer(i):
            prefix = layer_prefix(i)
            layout = detect_layout(names, c.moe, prefix) if names else PER_EXPERT
            shapes.update(expected_moe_shapes(c.moe, c.hidden_size, prefix, layout))
        else:
            shapes.update({n["gate"]: (c.intermediate_size, c.hidden_size),
                           n["up"]: (c.intermediate_size, c.hidden_size),
                           n["down"]: (c.hidden_size, c.intermediate_size)})
        if c.qk_norm:
            shapes.update({n["q_norm"]: (c.head_dim,), n["k_norm"]: (c.head_dim,)})
        if c.sandwich_norms:
            shapes.update({n["pre_ff_norm"]: (c.hidden_size,), n["post_ff_norm"]: (c.hidden_size,)})
        if c.attention_bias and c.mla is None:
            shapes.update({n["q_bias"]: (q,), n["k_bias"]: (kv,), n["v_bias"]: (kv,)})
        if o_proj_has_bias(c):
            shapes[n["o_bias"]] = (c.hidden_size,)
    return shapes
