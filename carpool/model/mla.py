"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

Per token and layer the cache holds ``c`` (the RMS-normalised KV latent,
``kv_lora_rank`` wide) and ``k_rope`` (the rotary key every head shares),
one row of ``latent_dim`` values instead of K and V per head. Attention
absorbs the up-projections: with ``kv_b_proj`` split per head into
``W_uk`` [nope, L] and ``W_uv`` [v, L],

    score = q_nope . (W_uk c) + q_rope . k_rope = (W_uk^T q_nope) . c + q_rope . k_rope
    out   = W_uv (sum_j p_j c_j)

so every head attends over the cached rows as one-KV-head attention whose
key is the whole row and whose value is its first ``kv_lora_rank`` values
(``TorchAttention.latent_forward``), and no token's K or V is expanded.

DeepSeek's checkpoints pair rotary dimensions as (0, 1), (2, 3), ...
(``rope_interleave``); the rows of ``q_b_proj`` / ``q_proj`` and
``kv_a_proj_with_mqa`` that make the rotary part are reordered at load
(evens, then odds) so our half-split rotary gives the same dot products.
"""
from __future__ import annotations

import torch
from torch import nn

from carpool.model.attention import AttentionMetadata, TorchAttention
from carpool.model.config import ModelConfig
from carpool.model.hf_names import mla_names
from carpool.model.layers import RMSNorm, Rotary


def _deinterleave(rows: int) -> torch.Tensor:
    """Row order taking interleaved rotary pairs to half-split ones."""
    return torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        m = self.spec = config.mla
        self.heads, hidden = config.num_heads, config.hidden_size
        eps = config.rms_norm_eps
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.heads * m.qk_head_dim, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps)
        # kv_b_proj split per head: W_uk [H, nope, L] absorbed into the
        # query, W_uv [H, v, L] applied to the attended latent.
        self.w_uk = nn.Parameter(torch.zeros(self.heads, m.qk_nope_head_dim, m.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.zeros(self.heads, m.v_head_dim, m.kv_lora_rank))
        self.o_proj = nn.Linear(self.heads * m.v_head_dim, hidden, bias=False)
        self.scale = config.scale

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, cache: torch.Tensor,
                attention: TorchAttention) -> torch.Tensor:
        """x: [T, hidden] (the step's tokens) -> [T, hidden]."""
        m, tokens = self.spec, x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(tokens, self.heads, m.qk_head_dim)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim],
                                                          dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rope = Rotary.apply(k_rope.reshape(tokens, 1, m.qk_rope_head_dim), *rope)
        q_latent = torch.einsum("thn,hnl->thl", q_nope, self.w_uk)
        query = torch.cat([q_latent, Rotary.apply(q_rope, *rope)], dim=-1)
        row = torch.cat([latent[:, None, :], k_rope], dim=-1)  # [T, 1, latent_dim]
        out = attention.latent_forward(query, row, cache, meta, self.scale, m.kv_lora_rank)
        out = torch.einsum("thl,hvl->thv", out, self.w_uv)
        return self.o_proj(out.reshape(tokens, self.heads * m.v_head_dim))

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor], index: int) -> None:
        m, n = self.spec, mla_names(index)
        q_out = self.q_proj if self.q_proj is not None else self.q_b_proj
        q_weight = weights[n["q_proj" if self.q_proj is not None else "q_b_proj"]]
        kv_a = weights[n["kv_a_proj_with_mqa"]]
        if m.interleaved:
            order = _deinterleave(m.qk_rope_head_dim)
            q_weight = q_weight.view(self.heads, m.qk_head_dim, -1).clone()
            q_weight[:, m.qk_nope_head_dim:] = q_weight[:, m.qk_nope_head_dim:][:, order]
            q_weight = q_weight.view(self.heads * m.qk_head_dim, -1)
            kv_a = kv_a.clone()
            kv_a[m.kv_lora_rank:] = kv_a[m.kv_lora_rank:][order]
        q_out.weight.copy_(q_weight)
        if self.q_a_proj is not None:
            self.q_a_proj.weight.copy_(weights[n["q_a_proj"]])
            self.q_a_layernorm.weight.copy_(weights[n["q_a_layernorm"]])
        self.kv_a_proj_with_mqa.weight.copy_(kv_a)
        self.kv_a_layernorm.weight.copy_(weights[n["kv_a_layernorm"]])
        kv_b = weights[n["kv_b_proj"]].view(self.heads, m.qk_nope_head_dim + m.v_head_dim, -1)
        self.w_uk.copy_(kv_b[:, :m.qk_nope_head_dim])
        self.w_uv.copy_(kv_b[:, m.qk_nope_head_dim:])
        self.o_proj.weight.copy_(weights[n["o_proj"]])
