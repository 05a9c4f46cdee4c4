"""What the analytic cost model (carpool/sim/analytic.py) knows of a model:
its sizes (``ModelShape``), the parameter counts and KV bytes they imply,
and presets from published Hugging Face configs (``MODELS``). Pure Python:
no torch.

A shape is a Llama-family decoder (GQA attention, SwiGLU MLP) with two
optional parts, each off at its fields' defaults (so older saved shapes load
unchanged):

* Mixture of experts (Mixtral, Qwen3-MoE, DeepSeek-V3): ``experts`` routed
  SwiGLU experts of ``expert_intermediate``, ``top_k`` per token, a router
  (``experts x hidden``, plus DeepSeek's selection bias with
  ``router_bias``) and shared experts of ``shared_intermediate`` in all (0:
  none) in every layer except the first ``dense_layers``, which keep a
  dense MLP of ``intermediate``. ``params`` counts every expert (what
  memory holds); ``active_params`` only the ``top_k`` a token runs (what it
  computes).
* Multi-head latent attention (DeepSeek): ``kv_lora_rank > 0``. Queries
  through a LoRA pair of ``q_lora_rank`` (0: one projection), keys and
  values from one latent of ``kv_lora_rank`` plus a shared rotary key of
  ``qk_rope_head_dim``; per head ``qk_nope_head_dim + qk_rope_head_dim``
  for q/k and ``v_head_dim`` for v. The cache holds one row of
  ``kv_lora_rank + qk_rope_head_dim`` per token and layer.
"""
from __future__ import annotations

import types
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from carpool.model.config import ModelConfig


@dataclass(frozen=True)
class ModelShape:
    """The sizes of one decoder (see the module docstring).

    head_dim defaults to hidden // heads (MLA: the q/k head,
    qk_nope_head_dim + qk_rope_head_dim); qkv_bias adds the q/k/v biases of
    Qwen2 and qk_norm the per-head q/k norms of Qwen3 to the count.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    head_dim: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts (experts == 0: a dense model).
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    dense_layers: int = 0
    router_bias: bool = False
    # Multi-head latent attention (kv_lora_rank == 0: GQA).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        sizes = (self.layers, self.hidden, self.heads, self.kv_heads, self.intermediate, self.vocab)
        if min(sizes) <= 0 or self.head_dim < 0:
            raise ValueError(f"{self.name}: model sizes must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads ({self.heads}) must be a multiple of "
                             f"kv_heads ({self.kv_heads})")
        self._check_moe()
        self._check_mla()
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.head_dim not in (0, qk):
                raise ValueError(f"{self.name}: an MLA head_dim is qk_nope_head_dim + "
                                 f"qk_rope_head_dim ({qk}), got {self.head_dim}")
            object.__setattr__(self, "head_dim", qk)
        elif not self.head_dim:
            if self.hidden % self.heads:
                raise ValueError(f"{self.name}: hidden ({self.hidden}) is not a multiple of "
                                 f"heads ({self.heads}); give head_dim")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    def _check_moe(self) -> None:
        if not self.experts:
            if self.top_k or self.expert_intermediate or self.shared_intermediate \
                    or self.dense_layers or self.router_bias:
                raise ValueError(f"{self.name}: MoE fields need experts > 0")
            return
        if not (0 < self.top_k <= self.experts and self.expert_intermediate > 0):
            raise ValueError(f"{self.name}: an MoE shape needs 1 <= top_k <= experts "
                             "and expert_intermediate > 0")
        if self.shared_intermediate < 0 or not 0 <= self.dense_layers < self.layers:
            raise ValueError(f"{self.name}: shared_intermediate must be >= 0 and "
                             "dense_layers in [0, layers)")

    def _check_mla(self) -> None:
        heads = (self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if not self.kv_lora_rank:
            if self.q_lora_rank or any(heads):
                raise ValueError(f"{self.name}: MLA fields need kv_lora_rank > 0")
            return
        if self.kv_lora_rank < 0 or self.q_lora_rank < 0 or min(heads) <= 0:
            raise ValueError(f"{self.name}: MLA sizes must be positive (q_lora_rank >= 0)")

    @classmethod
    def from_config(cls, config: ModelConfig, name: str = "model") -> ModelShape:
        """The shape of a loaded ``carpool.model.config.ModelConfig``."""
        moe, mla = config.moe, config.mla
        fields: dict[str, Any] = {}
        if moe is not None:
            fields.update(experts=moe.num_experts, top_k=moe.top_k,
                          expert_intermediate=moe.expert_intermediate_size,
                          shared_intermediate=moe.shared_intermediate_size,
                          dense_layers=config.num_layers - sum(config.moe_layers),
                          router_bias=moe.correction_bias)
        if mla is not None:
            fields.update(q_lora_rank=mla.q_lora_rank or 0, kv_lora_rank=mla.kv_lora_rank,
                          qk_nope_head_dim=mla.qk_nope_head_dim,
                          qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim)
        head_dim = mla.qk_head_dim if mla is not None else config.head_dim
        return cls(name=name, layers=config.num_layers, hidden=config.hidden_size,
                   heads=config.num_heads, kv_heads=config.num_kv_heads,
                   intermediate=config.intermediate_size, vocab=config.vocab_size,
                   tied_embeddings=config.tie_word_embeddings, head_dim=head_dim,
                   qkv_bias=config.attention_bias, qk_norm=config.qk_norm, **fields)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def q_dim(self) -> int:
        """Width of the query projection: heads * head_dim."""
        return self.heads * self.head_dim

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is the mixture of experts."""
        return self.layers - self.dense_layers if self.is_moe else 0

    @property
    def attention_params(self) -> int:
        """Parameters of one layer's attention (projections, biases, norms)."""
        h = self.hidden
        if self.is_mla:
            qk, latent = self.head_dim, self.kv_lora_rank
            if self.q_lora_rank:  # q_a_proj, its norm, q_b_proj
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.heads * qk
            else:
                q = h * self.heads * qk
            kv = h * (latent + self.qk_rope_head_dim) + latent  # kv_a_proj_with_mqa, its norm
            kv += latent * self.heads * (self.qk_nope_head_dim + self.v_head_dim)  # kv_b_proj
            return q + kv + self.heads * self.v_head_dim * h  # o_proj
        kv_dim = self.kv_heads * self.head_dim
        attention = 2 * h * self.q_dim + 2 * h * kv_dim
        if self.qkv_bias:
            attention += self.q_dim + 2 * kv_dim
        return attention + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert in one layer (a SwiGLU MLP)."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def routed_params(self) -> int:
        """Routed-expert parameters of the whole model (every expert)."""
        return self.moe_layers * self.experts * self.expert_params

    @property
    def active_routed_params(self) -> int:
        """Routed-expert parameters one token computes through (top_k a layer)."""
        return self.moe_layers * self.top_k * self.expert_params

    @property
    def body_params(self) -> int:
        """Parameters of the layers and the final norm, every expert counted
        (no embedding table, no LM head)."""
        h = self.hidden
        dense_mlp = 3 * h * self.intermediate
        moe_fixed = self.experts * h + (self.experts if self.router_bias else 0) \
            + 3 * h * self.shared_intermediate  # router (and bias), shared experts
        per_layer = self.attention_params + 2 * h  # and two norms
        return (self.layers * per_layer + (self.layers - self.moe_layers) * dense_mlp
                + self.moe_layers * moe_fixed + self.routed_params + h)

    @property
    def active_body_params(self) -> int:
        """Body parameters every computed token passes through: only top_k
        routed experts per MoE layer (``body_params`` for a dense model)."""
        return self.body_params - self.routed_params + self.active_routed_params

    @property
    def params(self) -> int:
        """All parameters, every expert, a tied embedding/LM head once."""
        return self.body_params + self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def active_params(self) -> int:
        """``params`` with only top_k routed experts per MoE layer (the
        "activated parameters" model cards quote)."""
        return self.params - self.routed_params + self.active_routed_params

    @property
    def streamed_params(self) -> int:
        """Parameters read when a step touches every expert: the body and
        the LM head (the input embedding is only gathered row by row)."""
        return self.body_params + self.vocab * self.hidden

    def touched_experts(self, tokens: float) -> float:
        """Expected distinct experts of one MoE layer that ``tokens`` tokens
        route to, each picking top_k of experts uniformly at random:
        ``E * (1 - (1 - k/E) ** tokens)``; never decreases with tokens."""
        if not self.is_moe or tokens <= 0:
            return 0.0
        return self.experts * (1 - (1 - self.top_k / self.experts) ** tokens)

    @property
    def pair_flops(self) -> int:
        """FLOPs of one (query, key) pair over every layer. GQA: 4 * heads *
        head_dim a layer (scores, weighted sum). MLA with absorbed
        attention: each head scores the whole cached row (kv_lora_rank +
        qk_rope_head_dim) and sums latents (kv_lora_rank), 2 FLOPs each."""
        if self.is_mla:
            return self.layers * self.heads * 2 * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 4 * self.layers * self.q_dim

    # The KV cache's geometry, as ``ModelConfig`` has it: per layer
    # ``cache_tensors`` tensors of ``cache_heads`` x ``cache_dim`` per token.
    @property
    def cache_tensors(self) -> int:
        return 1 if self.is_mla else 2

    @property
    def cache_heads(self) -> int:
        return 1 if self.is_mla else self.kv_heads

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """Bytes cached per token over all layers: K and V of each KV head
        (MLA: one latent row)."""
        return self.layers * self.cache_tensors * self.cache_heads * self.cache_dim * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that ``ModelShape(**d)`` rebuilds."""
        return asdict(self)


# Shapes from each model's published Hugging Face config.json.
MODELS = types.MappingProxyType({
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, False),
    "llama-3-70b": ModelShape("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, False),
    "qwen2-7b": ModelShape("qwen2-7b", 28, 3584, 28, 4, 18944, 152064, False, qkv_bias=True),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 1536, 49152, True),
    # Qwen/Qwen3-32B (what llm-d's prefix-cache benchmark serves).
    "qwen3-32b": ModelShape("qwen3-32b", 64, 5120, 64, 8, 25600, 151936, False,
                            head_dim=128, qk_norm=True),
    # mistralai/Mixtral-8x7B-v0.1: every layer MoE, experts of intermediate_size.
    "mixtral-8x7b": ModelShape("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, False,
                               experts=8, top_k=2, expert_intermediate=14336),
    # Qwen/Qwen3-30B-A3B: every layer MoE (intermediate_size 6144 is unused).
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, False,
                                head_dim=128, qk_norm=True, experts=128, top_k=8,
                                expert_intermediate=768),
    # deepseek-ai/DeepSeek-V3: MLA; 3 dense layers, then 256 routed experts
    # (top 8) and one shared; the multi-token-prediction layer is not counted.
    "deepseek-v3": ModelShape("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, False,
                              experts=256, top_k=8, expert_intermediate=2048,
                              shared_intermediate=2048, dense_layers=3, router_bias=True,
                              q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                              qk_rope_head_dim=64, v_head_dim=128),
})
