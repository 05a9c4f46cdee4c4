"""Our Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM2) over a
ragged token batch and a paged KV cache.

RMSNorm, rotary embeddings (with Llama 3 / linear rope scaling), grouped
query attention, SwiGLU, tied or untied LM head, optional qkv bias (Qwen2).
q/k/v and gate/up projections are fused into one matmul each at load time.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from carpool.model.attention import AttentionMetadata, TorchAttention
from carpool.model.config import ModelConfig
from carpool.model.hf_names import EMBED_TOKENS, FINAL_NORM, LM_HEAD, layer_names, o_proj_has_bias


@dataclass
class StepKind:
    """What the step now running is, set by ``LlamaModel.forward`` before
    its first layer and read by the decode-only linear layers (packed bf16,
    INT8/INT4: carpool/model/packed_linear.py, quant.py).

    Why only decode-only steps: their kernels round differently from the
    bf16 matrix kernel, and a prefill's rows depend on how much of the
    prompt the prefix cache already held. Were short prefills to take
    the other kernel, one seeded request would sample differently the
    second time it came. (A prefill gains nothing from them anyway: they
    win only up to a few rows.)"""

    decode_only: bool = False


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:  # noqa: ANN001
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight, as the reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse rotary frequencies, with the model's rope scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float()
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band
    # between is interpolated smoothly (Llama 3.1's recipe).
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, interpolated, out)


class Rotary(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(config))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the step's positions, [T, 1, D/2]; built once per step."""
        return (self.cos[positions][:, None, :].to(dtype),
                self.sin[positions][:, None, :].to(dtype))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] rotated by the half-split convention."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=c.attention_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=o_proj_has_bias(c))
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.scale = c.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor],
                attention: TorchAttention, ops=None) -> torch.Tensor:  # noqa: ANN001
        """``ops``: fused kernels (RMSNorm, SwiGLU; rotary where they have it):
        our compiled CPU kernels or the Triton ones on a GPU; or None."""
        # ``hidden`` may hold pad rows past the step's tokens (see
        # ``LlamaModel.forward``); every op but attention is row by row, so
        # they never touch a real row, and attention sees only real ones.
        rows, tokens = hidden.shape[0], meta.positions.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(hidden, ops))[:tokens]
        # A backend with a fused decode op does rotary, the cache write and
        # attention in one call (decode-only steps); None: op by op below.
        attn = attention.decode_block(qkv, rope, kv, meta, self.num_heads, self.num_kv_heads,
                                      self.scale)
        if attn is None:
            attn = self._attention(qkv, rope, kv, meta, attention, ops)
        if rows > tokens:
            attn = F.pad(attn, (0, 0, 0, rows - tokens))
        hidden = hidden + self.o_proj(attn)
        gate_up = self.gate_up_proj(self.post_attention_layernorm(hidden, ops))
        if ops is not None:
            return hidden + self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up)


    def _attention(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                   attention: TorchAttention, ops) -> torch.Tensor:  # noqa: ANN001
        """Rotary, cache write and attention of ``qkv`` [T, ...] -> [T, H * D]."""
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        rotate = getattr(ops, "rotary", Rotary.apply)
        q = rotate(q.view(tokens, self.num_heads, self.head_dim), *rope)
        k = rotate(k.view(tokens, self.num_kv_heads, self.head_dim), *rope)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        attn = attention.forward(q, k, v, kv[0], kv[1], meta, self.scale)
        return attn.reshape(tokens, self.q_size)


class LlamaModel(nn.Module):
    """Forward over a flattened ragged batch; logits only where sampled."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config, max_positions)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.ops = None  # fused kernels (CPU or Triton), set by the executor when available
        # The LM head as a module when it is not plain F.linear (INT8 decode: carpool.model.quant).
        self.head: nn.Module | None = None
        self.step_kind = StepKind()
        # Called with each layer's index once its KV of the step is in the
        # cache (a P/D prefill streams it out: carpool/kv_transfer/layer_export.py).
        self.after_layer: Callable[[int], None] | None = None

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attention: TorchAttention) -> torch.Tensor:
        """input_ids: [R >= T], the step's T tokens (``meta``'s) and R - T
        pad rows after them, which the linear layers compute (so a CPU
        matrix kernel serves every step of R rows: see
        ``carpool.executor.shapes.padded_rows``) and nothing else reads.
        Returns final hidden states [T, hidden] (pre-norm)."""
        self.step_kind.decode_only = not meta.prefills
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.tables(meta.positions, hidden.dtype)
        after_layer = self.after_layer
        for index, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            hidden = layer(hidden, rope, meta, kv, attention, self.ops)
            if after_layer is not None:  # layer ``index``'s KV of this step is written
                after_layer(index)
        return hidden[:meta.positions.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [S, vocab] for the given rows only, in the model's dtype: the
        sampler widens what it needs (an all-greedy batch needs nothing)."""
        normed = self.norm(hidden, self.ops)
        if self.head is not None:
            return self.head(normed)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(normed, weight)

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up."""
        def take(name: str) -> torch.Tensor:
            try:
                return weights[name]
            except KeyError:
                raise ValueError(f"weight {name!r} missing from the checkpoint") from None

        self.embed_tokens.weight.copy_(take(EMBED_TOKENS))
        self.norm.weight.copy_(take(FINAL_NORM))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(take(LM_HEAD))
        for index, layer in enumerate(self.layers):
            n = layer_names(index)
            layer.qkv_proj.weight.copy_(torch.cat([take(n[p]) for p in "qkv"]))
            if layer.qkv_proj.bias is not None:
                layer.qkv_proj.bias.copy_(torch.cat([take(n[f"{p}_bias"]) for p in "qkv"]))
            layer.o_proj.weight.copy_(take(n["o"]))
            if layer.o_proj.bias is not None:
                layer.o_proj.bias.copy_(take(n["o_bias"]))
            layer.gate_up_proj.weight.copy_(torch.cat([take(n["gate"]), take(n["up"])]))
            layer.down_proj.weight.copy_(take(n["down"]))
            layer.input_layernorm.weight.copy_(take(n["input_norm"]))
            layer.post_attention_layernorm.weight.copy_(take(n["post_norm"]))
