"""Expert parallelism inside a tensor-parallel replica
(``--enable-expert-parallel``): each rank holds ``E / N`` whole experts
instead of every expert's ``1 / N`` features; the shared experts and the
router are whole on every rank.

A MoE layer's tokens are the same on every rank (the attention before it
ended in an all-reduce). Each rank takes its share of them (a contiguous
slice), routes them, and sends each (token, expert) pick to the rank that
holds the expert: an all-to-all of the pick counts, then of the rows, their
expert ids and routing weights. Each rank runs its experts on what it
received and sends the weighted answers back (the reverse all-to-all); the
sender adds them into its tokens, adds the shared experts, and an all-gather
gives every rank every token's output again. The layer's MLP output is then
whole: nothing is all-reduced after it.

A capacity (``--expert-capacity-factor`` F > 0) bounds the rows one rank
takes in one layer to ``ceil(F * picks / N)``; rows past it are dropped (they
add nothing) and counted in ``dropped``, and every rank's in ``rank_dropped``
(``/metrics``: ``carpool:moe_rank_dropped_total``). 0: no bound, nothing dropped.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

_A2A_NATIVE = (torch.float32, torch.float64, torch.int64, torch.int32)


def expert_parallel_problem(num_experts: int, size: int) -> str | None:
    if num_experts % size:
        return f"expert parallel size {size} does not divide {num_experts} experts"
    return None


def _token_slice(tokens: int, rank: int, size: int) -> tuple[int, int]:
    """This rank's contiguous share of ``tokens`` (the first ranks get one more)."""
    base, extra = divmod(tokens, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class ExpertDispatch:
    """A MoE block's experts spread over a group's ranks (module docstring)."""

    def __init__(self, tp, first_expert: int, num_local: int,  # noqa: ANN001 - the group
                 capacity_factor: float = 0.0) -> None:
        self.tp, self.first, self.num_local = tp, first_expert, num_local
        self.capacity_factor = capacity_factor
        self.received = 0  # (token, expert) rows this rank's experts computed
        self.dropped = 0  # rows past the capacity, computed by nobody
        # Every rank's drops, seen from here: each rank routes every token
        # (the router is whole), so each knows what every rank receives.
        self.rank_dropped = [0] * tp.size

    def __call__(self, block, x: torch.Tensor, weights: torch.Tensor,  # noqa: ANN001
                 ids: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if self.capacity_factor > 0:
            self._count_drops(ids)
        start, stop = _token_slice(x.shape[0], tp.rank, tp.size)
        own = x[start:stop]
        k = ids.shape[1]
        picks = ids[start:stop].flatten()
        order = torch.sort(picks // self.num_local, stable=True)[1]
        token_of = order // k
        send_counts = torch.bincount(picks // self.num_local, minlength=tp.size)
        recv_counts = self._exchange(send_counts, None, None)
        send = (own.index_select(0, token_of), picks[order],
                weights[start:stop].flatten()[order].float())
        rows, experts, row_weights = (self._exchange(t, send_counts, recv_counts) for t in send)
        answers = self._compute(block, rows, experts - self.first, row_weights,
                                x.shape[0] * k)
        back = self._exchange(answers, recv_counts, send_counts)
        mine = torch.zeros_like(own).index_add_(0, token_of, back.to(own.dtype))
        return self._gather(block.with_shared(own, mine), x.shape[0])

    def _count_drops(self, ids: torch.Tensor) -> None:
        """Each rank's rows past the capacity this layer (``_compute``'s rule)."""
        size = self.tp.size
        capacity = math.ceil(self.capacity_factor * ids.numel() / size)
        rows = torch.bincount(ids.flatten() // self.num_local, minlength=size).tolist()
        self.rank_dropped = [d + max(0, r - capacity) for d, r in zip(self.rank_dropped, rows)]

    def _compute(self, block, rows: torch.Tensor, local: torch.Tensor,  # noqa: ANN001
                 row_weights: torch.Tensor, picks: int) -> torch.Tensor:
        """This rank's experts on the rows it received, each row weighted;
        rows past the capacity answer zeros."""
        keep = rows.shape[0]
        if self.capacity_factor > 0:
            keep = min(keep, math.ceil(self.capacity_factor * picks / self.tp.size))
        self.received += keep
        self.dropped += rows.shape[0] - keep
        out = torch.zeros_like(rows)
        if keep:
            ids, weights = local[:keep, None], row_weights[:keep, None].to(
                weights_dtype(block, rows))
            counts = torch.bincount(local[:keep], minlength=self.num_local)
            out[:keep] = block.routed(rows[:keep], weights, ids, counts, counts.cpu())
        return out

    def _exchange(self, tensor: torch.Tensor, send: torch.Tensor | None,
                  recv: torch.Tensor | None) -> torch.Tensor:
        """An all-to-all: ``send[j]`` rows to rank j, ``recv[j]`` from it
        (None and None: one element each way, the counts)."""
        wide = tensor if tensor.dtype in _A2A_NATIVE else tensor.float()
        rows = int(recv.sum()) if recv is not None else self.tp.size
        out = torch.empty((rows, *wide.shape[1:]), dtype=wide.dtype, device=wide.device)
        splits = (None, None) if send is None else (recv.tolist(), send.tolist())
        dist.all_to_all_single(out, wide.contiguous(), splits[0], splits[1], group=self.tp.group)
        return out if tensor.dtype in _A2A_NATIVE else out.to(tensor.dtype)

    def _gather(self, mine: torch.Tensor, tokens: int) -> torch.Tensor:
        """Every rank's token outputs, in token order, on every rank."""
        size = self.tp.size
        longest = _token_slice(tokens, 0, size)[1]
        padded = torch.zeros((longest, mine.shape[1]), dtype=mine.dtype, device=mine.device)
        padded[:mine.shape[0]] = mine
        wide = padded if padded.dtype in _A2A_NATIVE else padded.float()
        parts = [torch.empty_like(wide) for _ in range(size)]
        dist.all_gather(parts, wide.contiguous(), group=self.tp.group)
        pieces = []
        for rank, part in enumerate(parts):
            start, stop = _token_slice(tokens, rank, size)
            pieces.append(part[:stop - start])
        return torch.cat(pieces).to(mine.dtype)


def weights_dtype(block, rows: torch.Tensor) -> torch.dtype:  # noqa: ANN001
    """The routing weights' dtype the block's own forward would use."""
    return rows.dtype if block.spec.weights_in_model_dtype else torch.float32


def shard_experts(moe, tp, capacity_factor: float) -> None:  # noqa: ANN001 - a MoEBlock
    """Keep rank ``tp.rank``'s whole experts of ``moe`` and give it their dispatch."""
    experts = moe.spec.num_experts
    problem = expert_parallel_problem(experts, tp.size)
    if problem is not None:
        raise ValueError(problem)
    local = experts // tp.size
    first = tp.rank * local
    moe.w_gate_up = nn.Parameter(moe.w_gate_up.data[first:first + local].clone(),
                                 requires_grad=False)
    moe.w_down = nn.Parameter(moe.w_down.data[first:first + local].clone(), requires_grad=False)
    moe.dispatch = ExpertDispatch(tp, first, local, capacity_factor)
