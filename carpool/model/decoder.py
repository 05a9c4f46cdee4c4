"""Our decoder (every family of carpool/model/arch/) over a ragged token batch
and a paged KV cache.

One layer shape with the parts families differ by, chosen by
``ModelConfig``: grouped-query attention with optional qkv bias (Qwen2),
q/k norms per head (Qwen3, Gemma 3), sliding-window layers with their own
rope (Gemma 3, Mistral), a gated MLP with SiLU or tanh-GELU or a mixture
of experts (carpool/model/moe.py: Mixtral, Qwen3-MoE), Llama's
pre-norms or Gemma's sandwich norms, scaled embeddings, a tied or untied
LM head and a final logit soft-cap. q/k/v and gate/up projections are fused
into one matmul each at load time.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from carpool.model.attention import AttentionMetadata, TorchAttention
from carpool.model.config import ModelConfig
from carpool.model.hf_names import (
    EMBED_TOKENS,
    FINAL_NORM,
    LM_HEAD,
    layer_names,
    layer_prefix,
    o_proj_has_bias,
)
from carpool.model.layers import RMSNorm, Rotary, StepKind
from carpool.model.mla import LatentAttention
from carpool.model.moe import MoEBlock

__all__ = ["DecoderLayer", "DecoderModel", "RMSNorm", "Rotary", "StepKind"]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        # Attention: grouped-query (q/k/v fused), or latent (MLA: DeepSeek).
        self.mla = LatentAttention(c) if c.mla is not None else None
        if self.mla is None:
            self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size,
                                      bias=c.attention_bias)
            self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=o_proj_has_bias(c))
        # The MLP: dense (gate/up fused) or a mixture of experts.
        self.moe = MoEBlock(c.moe, c.hidden_size) if c.is_moe_layer(index) else None
        if self.moe is None:
            self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
            self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        norm = lambda size: RMSNorm(size, c.rms_norm_eps, c.norm_style)  # noqa: E731
        self.input_layernorm = norm(c.hidden_size)
        self.post_attention_layernorm = norm(c.hidden_size)
        # Sandwich norms (Gemma): post_attention_layernorm normalises the
        # attention's output; the MLP has a norm before and one after.
        self.sandwich = c.sandwich_norms
        self.pre_feedforward_layernorm = norm(c.hidden_size) if c.sandwich_norms else None
        self.post_feedforward_layernorm = norm(c.hidden_size) if c.sandwich_norms else None
        self.q_norm = norm(c.head_dim) if c.qk_norm else None
        self.k_norm = norm(c.head_dim) if c.qk_norm else None
        self.gelu = c.hidden_act == "gelu_tanh"
        self.window = c.window_of(index)
        self.local_rope = self.window is not None and c.local_rope_theta is not None
        self.scale = c.scale
        # Tensor parallel (carpool/parallel/shard.py): the group whose ranks
        # hold the rest of this layer; o_proj's and the MLP's outputs are
        # partial sums over it (the MLP's not when its experts are spread
        # whole over the ranks: ``mlp_sum`` False). None: the whole layer is here.
        self.tp = None
        self.mlp_sum = True

    def linear_names(self) -> tuple[str, ...]:
        """The dense linear layers decode paths may replace (quantized,
        packed, blocked copies): the experts' weights are not among them."""
        attention = () if self.mla is not None else ("qkv_proj", "o_proj")
        mlp = () if self.moe is not None else ("gate_up_proj", "down_proj")
        return (*attention, *mlp)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor],
                attention: TorchAttention, ops=None) -> torch.Tensor:  # noqa: ANN001
        """``ops``: fused kernels (RMSNorm, SwiGLU; rotary where they have it):
        our compiled CPU kernels or the Triton ones on a GPU; or None.

        Three stages around the two sums a tensor-parallel layer waits for
        (``DecoderModel.forward_micro_batches`` interleaves two batches' stages)."""
        attn = self._reduced(self.attention_partial(hidden, rope, meta, kv, attention, ops))
        hidden, mlp = self.mlp_partial(hidden, attn, meta.positions.shape[0], ops)
        return self.finish(hidden, self._reduced(mlp) if self.mlp_sum else mlp, ops)

    def attention_partial(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                          meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor],
                          attention: TorchAttention, ops=None) -> torch.Tensor:  # noqa: ANN001
        """Stage 1: the attention's output, projected; under tensor
        parallelism this rank's partial sum."""
        # ``hidden`` may hold pad rows past the step's tokens (see
        # ``DecoderModel.forward``); every op but attention is row by row, so
        # they never touch a real row, and attention sees only real ones.
        rows, tokens = hidden.shape[0], meta.positions.shape[0]
        if self.mla is not None:
            attn = self.mla(self.input_layernorm(hidden, ops)[:tokens], rope, meta, kv[0],
                            attention)
            return F.pad(attn, (0, 0, 0, rows - tokens)) if rows > tokens else attn
        qkv = self.qkv_proj(self.input_layernorm(hidden, ops))[:tokens]
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv, ops)
        # A backend with a fused decode op does rotary, the cache write and
        # attention in one call (decode-only steps, whole-context layers);
        # None: op by op below.
        attn = None
        if self.window is None:
            attn = attention.decode_block(qkv, rope, kv, meta, self.num_heads,
                                          self.num_kv_heads, self.scale)
        if attn is None:
            attn = self._attention(qkv, rope, kv, meta, attention, ops)
        if rows > tokens:
            attn = F.pad(attn, (0, 0, 0, rows - tokens))
        return self.o_proj(attn)

    def mlp_partial(self, hidden: torch.Tensor, attn: torch.Tensor, tokens: int,
                    ops) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        """Stage 2: the attention's output (summed) added; the residual
        stream and the MLP's output (a partial sum under tensor parallelism)."""
        if self.sandwich:
            hidden = hidden + self.post_attention_layernorm(attn, ops)
            return hidden, self._mlp(self.pre_feedforward_layernorm(hidden, ops), tokens, ops)
        hidden = hidden + attn
        return hidden, self._mlp(self.post_attention_layernorm(hidden, ops), tokens, ops)

    def finish(self, hidden: torch.Tensor, mlp: torch.Tensor, ops) -> torch.Tensor:  # noqa: ANN001
        """Stage 3: the MLP's output (summed) added."""
        return hidden + (self.post_feedforward_layernorm(mlp, ops) if self.sandwich else mlp)

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel output summed over the ranks (as is without them)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _mlp(self, x: torch.Tensor, tokens: int, ops) -> torch.Tensor:  # noqa: ANN001
        if self.moe is not None:  # pad rows would be routed (and counted) like tokens
            out = self.moe(x[:tokens])
            return F.pad(out, (0, 0, 0, x.shape[0] - tokens)) if x.shape[0] > tokens else out
        gate_up = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if ops is not None:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def _norm_qk(self, qkv: torch.Tensor, ops) -> torch.Tensor:  # noqa: ANN001
        """q and k normalised head by head (before rotary, as Qwen3 and
        Gemma 3 do); v as it was."""
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(tokens * self.num_heads, self.head_dim), ops)
        k = self.k_norm(k.reshape(tokens * self.num_kv_heads, self.head_dim), ops)
        return torch.cat([q.view(tokens, -1), k.view(tokens, -1), v], dim=-1)

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
        attn = attention.forward(q, k, v, kv[0], kv[1], meta, self.scale, self.window)
        return attn.reshape(tokens, self.q_size)


class DecoderModel(nn.Module):
    """Forward over a flattened ragged batch; logits only where sampled."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_style)
        self.rotary = Rotary.of(config, max_positions)
        # The sliding layers' own rope (Gemma 3), or None: one rope for all.
        self.local_rotary = (Rotary.of(config, max_positions, local=True)
                             if any(layer.local_rope for layer in self.layers) else None)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.ops = None  # fused kernels (CPU or Triton), set by the executor when available
        # The LM head as a module when it is not plain F.linear (INT8 decode: carpool.model.quant).
        self.head: nn.Module | None = None
        self.step_kind = StepKind()
        # Called with each layer's index once its KV of the step is in the
        # cache (a P/D prefill streams it out: carpool/kv_transfer/layer_export.py).
        self.after_layer: Callable[[int], None] | None = None
        # Tensor parallel (carpool/parallel/shard.py): the group, and the
        # first vocab row of this rank's embedding and LM head slice.
        self.tp = None
        self.vocab_start = 0

    def rotaries(self) -> list[Rotary]:
        return [self.rotary] + ([self.local_rotary] if self.local_rotary is not None else [])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            hidden = self.embed_tokens(input_ids)
        else:  # vocab-parallel: the rows of ids in this rank's range, zeros else, summed
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.embed_tokens.num_embeddings)
            hidden = self.embed_tokens(local.masked_fill(outside, 0))
            hidden = self.tp.all_reduce(hidden.masked_fill(outside.unsqueeze(-1), 0))
        if self.config.embed_scale is not None:  # in the weights' dtype, as Gemma's reference
            hidden = hidden * torch.tensor(self.config.embed_scale, dtype=hidden.dtype)
        return hidden

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attention: TorchAttention) -> torch.Tensor:
        """input_ids: [R >= T], the step's T tokens (``meta``'s) and R - T
        pad rows after them, which the linear layers compute (so a CPU
        matrix kernel serves every step of R rows: see
        ``carpool.executor.shapes.padded_rows``) and nothing else reads.
        Returns final hidden states [T, hidden] (pre-norm)."""
        self.step_kind.decode_only = not meta.prefills
        hidden = self.embed(input_ids)
        rope = self.rotary.tables(meta.positions, hidden.dtype)
        local_rope = (None if self.local_rotary is None
                      else self.local_rotary.tables(meta.positions, hidden.dtype))
        after_layer = self.after_layer
        for index, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            hidden = layer(hidden, local_rope if layer.local_rope else rope, meta, kv,
                           attention, self.ops)
            if after_layer is not None:  # layer ``index``'s KV of this step is written
                after_layer(index)
        return hidden[:meta.positions.shape[0]]

    def forward_micro_batches(self, batches: list[tuple[torch.Tensor, AttentionMetadata]],
                              kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                              attention: TorchAttention) -> list[torch.Tensor]:
        """``forward`` of two (or more) batches, layer by layer interleaved so
        each batch's sums travel while the others compute: a batch's
        attention starts its all-reduce, the next batch's attention runs,
        the first waits and runs its MLP, and so on (SGLang's two-batch
        overlap). Every rank issues the collectives in this same order.
        Each batch's rows are computed exactly as ``forward`` would."""
        self.step_kind.decode_only = all(not meta.prefills for _, meta in batches)
        states = [_BatchState(self, ids, meta) for ids, meta in batches]
        for index, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            for state in states:  # the last layer's MLP sum, then this attention
                state.finish_mlp(layer_before=self.layers[index - 1] if index else None)
                state.pending = self._start(layer.attention_partial(
                    state.hidden, state.local_rope if layer.local_rope else state.rope,
                    state.meta, kv, attention, self.ops))
            counts = []  # the experts' tokens of every batch (the step's, as forward counts)
            for state in states:
                state.hidden, mlp = layer.mlp_partial(state.hidden, self._finish(state.pending),
                                                      state.tokens, self.ops)
                state.pending = self._start(mlp, layer.mlp_sum)
                if layer.moe is not None:
                    counts.append(layer.moe.last_expert_counts)
            if counts:
                layer.moe.last_expert_counts = sum(counts[1:], counts[0])
            if self.after_layer is not None:
                self.after_layer(index)
        for state in states:
            state.finish_mlp(layer_before=self.layers[-1])
        return [state.hidden[:state.tokens] for state in states]

    def _start(self, partial: torch.Tensor, summed: bool = True):  # noqa: ANN202 - a PendingSum or the tensor
        if self.tp is None:
            return partial
        return self.tp.start_all_reduce(partial) if summed else self.tp.ready(partial)

    def _finish(self, pending) -> torch.Tensor:  # noqa: ANN001
        return pending if self.tp is None else self.tp.finish(pending)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [S, vocab] for the given rows only, in the model's dtype: the
        sampler widens what it needs (an all-greedy batch needs nothing)."""
        normed = self.norm(hidden, self.ops)
        if self.head is not None:
            logits = self.head(normed)
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(normed, weight)
        if self.tp is not None:  # each rank's vocab slice, side by side, padding dropped
            logits = self.tp.all_gather_columns(logits)[:, :self.config.vocab_size]
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

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
            if layer.mla is not None:
                layer.mla.load_hf_weights(weights, index)
            else:
                layer.qkv_proj.weight.copy_(torch.cat([take(n[p]) for p in "qkv"]))
                if layer.qkv_proj.bias is not None:
                    layer.qkv_proj.bias.copy_(torch.cat([take(n[f"{p}_bias"]) for p in "qkv"]))
                layer.o_proj.weight.copy_(take(n["o"]))
                if layer.o_proj.bias is not None:
                    layer.o_proj.bias.copy_(take(n["o_bias"]))
            if layer.moe is not None:
                layer.moe.load_hf_weights(weights, layer_prefix(index))
            else:
                layer.gate_up_proj.weight.copy_(torch.cat([take(n["gate"]), take(n["up"])]))
                layer.down_proj.weight.copy_(take(n["down"]))
            for role, norm in (("input_norm", layer.input_layernorm),
                               ("post_norm", layer.post_attention_layernorm),
                               ("pre_ff_norm", layer.pre_feedforward_layernorm),
                               ("post_ff_norm", layer.post_feedforward_layernorm),
                               ("q_norm", layer.q_norm), ("k_norm", layer.k_norm)):
                if norm is not None:
                    norm.weight.copy_(take(n[role]))


class _BatchState:
    """One micro-batch through ``DecoderModel.forward_micro_batches``: its
    residual stream, rope tables, metadata and the sum it waits for."""

    def __init__(self, model: DecoderModel, ids: torch.Tensor, meta: AttentionMetadata) -> None:
        self.model, self.meta = model, meta
        self.tokens = meta.positions.shape[0]
        self.hidden = model.embed(ids)
        self.rope = model.rotary.tables(meta.positions, self.hidden.dtype)
        self.local_rope = (None if model.local_rotary is None
                           else model.local_rotary.tables(meta.positions, self.hidden.dtype))
        self.pending = None

    def finish_mlp(self, layer_before: DecoderLayer | None) -> None:
        """The previous layer's MLP sum added (nothing before the first layer)."""
        if layer_before is not None:
            mlp = self.model._finish(self.pending)
            self.hidden = layer_before.finish(self.hidden, mlp, self.model.ops)
