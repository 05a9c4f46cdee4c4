"""A loaded ``DecoderModel`` cut to one tensor-parallel rank's slice, in place.

Megatron's split, which vLLM's layers make too:
- q/k/v and gate/up are column-parallel: each rank computes its heads and
  its share of the MLP's intermediate features;
- o_proj and down_proj are row-parallel: each rank's product is a partial
  sum the layer all-reduces (a bias is added once: rank 0 keeps it);
- KV heads split with the query heads that read them; with fewer KV heads
  than ranks each rank keeps the one its query heads read (replicated);
- MoE experts split like the MLP (each expert's intermediate features);
  the router and the shared experts' split follow;
- MLA (DeepSeek) splits its heads; the latent and its cache are whole on
  every rank;
- the embedding and the LM head are vocab-parallel: each rank holds
  ``ceil(V / size)`` rows (the last padded with zeros); a lookup keeps the
  ids in its range and all-reduces, the logits are gathered.

The model is cut after ``load_hf_weights``, so one cut serves every family's
checkpoint names. Each rank loads the whole checkpoint first (the peak is the
whole model's memory on each rank); cutting while loading is the next step.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from carpool.model.config import ModelConfig


def tensor_parallel_problem(config: ModelConfig, size: int,
                            expert_parallel: bool = False) -> str | None:
    """Why ``config`` cannot be split over ``size`` ranks (its experts whole
    on each rank with ``expert_parallel``), or None."""
    problems = []
    if config.num_heads % size:
        problems.append(f"{config.num_heads} attention heads")
    kv = config.num_kv_heads
    if config.mla is None and kv % size and size % kv:
        problems.append(f"{kv} KV heads (neither a multiple nor a divisor of the ranks)")
    dense = any(not config.is_moe_layer(i) for i in range(config.num_layers))
    if dense and config.intermediate_size % size:
        problems.append(f"an MLP of {config.intermediate_size} features")
    if config.moe is not None and expert_parallel:
        if config.moe.num_experts % size:
            problems.append(f"{config.moe.num_experts} experts")
    elif config.moe is not None:
        for name in ("expert_intermediate_size", "shared_intermediate_size"):
            if getattr(config.moe, name) % size:
                problems.append(f"{name} {getattr(config.moe, name)}")
    if not problems:
        return None
    return f"tensor parallel size {size} does not divide: " + ", ".join(problems)


def local_config(config: ModelConfig, size: int, expert_parallel: bool = False) -> ModelConfig:
    """One rank's shapes: its heads, KV heads and intermediate features
    (the experts' whole with ``expert_parallel``: a rank has fewer of them)."""
    problem = tensor_parallel_problem(config, size, expert_parallel)
    if problem is not None:
        raise ValueError(problem)
    moe = config.moe
    if moe is not None and not expert_parallel:
        moe = dataclasses.replace(
            moe, expert_intermediate_size=moe.expert_intermediate_size // size,
            shared_intermediate_size=moe.shared_intermediate_size // size)
    return dataclasses.replace(
        config, num_heads=config.num_heads // size,
        num_kv_heads=max(1, config.num_kv_heads // size) if config.mla is None
        else config.num_kv_heads,
        intermediate_size=config.intermediate_size // size, moe=moe)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                    device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out


def _pieces(tensor: torch.Tensor, dim: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([tensor.narrow(dim, start, width) for start, width in spans], dim)


def column_parallel(linear: nn.Linear, spans: list[tuple[int, int]]) -> nn.Linear:
    """The output rows ``spans`` ((start, width) each) of ``linear``."""
    bias = None if linear.bias is None else _pieces(linear.bias.data, 0, spans)
    return _linear(_pieces(linear.weight.data, 0, spans), bias)


def row_parallel(linear: nn.Linear, start: int, width: int, rank: int) -> nn.Linear:
    """The input columns [start, start + width) of ``linear``; its bias on rank 0 only."""
    bias = linear.bias
    if bias is not None:
        bias = bias.data if rank == 0 else torch.zeros_like(bias.data)
    return _linear(linear.weight.data.narrow(1, start, width), bias)


def kv_head_span(config: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """(first, count) of the model's KV heads rank ``rank`` of ``size`` holds
    in its cache: its own share, or (fewer KV heads than ranks) the one its
    group of ranks shares. MLA's latent is one head every rank holds whole."""
    if config.mla is not None:
        return 0, 1
    kv = config.num_kv_heads
    local = max(1, kv // size)
    return (rank * local if kv >= size else rank // (size // kv)), local


def _attention(layer, config: ModelConfig, rank: int, size: int) -> None:  # noqa: ANN001
    heads, kv, dim = config.num_heads, config.num_kv_heads, config.head_dim
    local_heads = heads // size
    first_kv, local_kv = kv_head_span(config, rank, size)
    q_size, kv_size = heads * dim, kv * dim
    layer.qkv_proj = column_parallel(layer.qkv_proj, [
        (rank * local_heads * dim, local_heads * dim),
        (q_size + first_kv * dim, local_kv * dim),
        (q_size + kv_size + first_kv * dim, local_kv * dim)])
    layer.o_proj = row_parallel(layer.o_proj, rank * local_heads * dim, local_heads * dim, rank)
    layer.num_heads, layer.num_kv_heads = local_heads, local_kv
    layer.q_size, layer.kv_size = local_heads * dim, local_kv * dim


def _latent_attention(mla, rank: int, size: int) -> None:  # noqa: ANN001
    spec, local = mla.spec, mla.heads // size
    first = rank * local
    if mla.q_proj is not None:
        mla.q_proj = column_parallel(mla.q_proj, [(first * spec.qk_head_dim,
                                                   local * spec.qk_head_dim)])
    else:
        mla.q_b_proj = column_parallel(mla.q_b_proj, [(first * spec.qk_head_dim,
                                                       local * spec.qk_head_dim)])
    mla.w_uk = nn.Parameter(mla.w_uk.data[first:first + local].clone(), requires_grad=False)
    mla.w_uv = nn.Parameter(mla.w_uv.data[first:first + local].clone(), requires_grad=False)
    mla.o_proj = row_parallel(mla.o_proj, first * spec.v_head_dim, local * spec.v_head_dim, rank)
    mla.heads = local


def _gated(features: int, rank: int, size: int) -> list[tuple[int, int]]:
    """A fused gate/up's rows of this rank: its gate share, then its up share."""
    width = features // size
    return [(rank * width, width), (features + rank * width, width)]


def _mlp(layer, config: ModelConfig, rank: int, size: int) -> None:  # noqa: ANN001
    features = config.intermediate_size
    layer.gate_up_proj = column_parallel(layer.gate_up_proj, _gated(features, rank, size))
    width = features // size
    layer.down_proj = row_parallel(layer.down_proj, rank * width, width, rank)


def _experts(moe, rank: int, size: int) -> None:  # noqa: ANN001
    spec = moe.spec
    inter, width = spec.expert_intermediate_size, spec.expert_intermediate_size // size
    moe.w_gate_up = nn.Parameter(_pieces(moe.w_gate_up.data, 1, _gated(inter, rank, size)),
                                 requires_grad=False)
    moe.w_down = nn.Parameter(moe.w_down.data.narrow(2, rank * width, width).contiguous(),
                              requires_grad=False)
    shared = spec.shared_intermediate_size
    if moe.shared_gate_up is not None:
        moe.shared_gate_up = column_parallel(moe.shared_gate_up, _gated(shared, rank, size))
        moe.shared_down = row_parallel(moe.shared_down, rank * (shared // size),
                                       shared // size, rank)
    moe.spec = dataclasses.replace(spec, expert_intermediate_size=width,
                                   shared_intermediate_size=shared // size)


def _vocab_rows(weight: torch.Tensor, rank: int, size: int) -> tuple[torch.Tensor, int]:
    """This rank's ``ceil(V / size)`` rows of a [V, H] table (zeros past V)
    and the first row's index."""
    vocab = weight.shape[0]
    rows = -(-vocab // size)
    start = rank * rows
    part = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    stop = min(start + rows, vocab)
    if stop > start:
        part[:stop - start] = weight[start:stop]
    return part, start


def shard_model(model, tp, expert_parallel: bool = False,  # noqa: ANN001 - a DecoderModel, its group
                capacity_factor: float = 0.0) -> None:
    """Cut ``model`` (loaded, whole) to rank ``tp.rank``'s slice of
    ``tp.size``, and give its layers the group's collectives; with
    ``expert_parallel`` its MoE layers keep whole experts
    (``carpool/parallel/experts.py``)."""
    from carpool.parallel.experts import shard_experts

    config, rank, size = model.config, tp.rank, tp.size
    problem = tensor_parallel_problem(config, size, expert_parallel)
    if problem is not None:
        raise ValueError(problem)
    with torch.no_grad():
        for layer in model.layers:
            if layer.mla is not None:
                _latent_attention(layer.mla, rank, size)
            else:
                _attention(layer, config, rank, size)
            if layer.moe is not None and expert_parallel:
                shard_experts(layer.moe, tp, capacity_factor)
                layer.mlp_sum = False  # each token's output comes back whole
            elif layer.moe is not None:
                _experts(layer.moe, rank, size)
            else:
                _mlp(layer, config, rank, size)
            layer.tp = tp
        table, start = _vocab_rows(model.embed_tokens.weight.data, rank, size)
        model.embed_tokens = nn.Embedding.from_pretrained(table, freeze=True)
        if model.lm_head is not None:
            head, _ = _vocab_rows(model.lm_head.weight.data, rank, size)
            model.lm_head = _linear(head, None)
    model.vocab_start, model.tp = start, tp
