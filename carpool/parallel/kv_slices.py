"""A tensor-parallel replica's KV blocks, moved as one replica's.

Each rank's cache holds its slice of the KV heads (``shard.kv_head_span``:
its share, or a head its group of ranks shares; MLA's latent whole on
every rank). A block that leaves the replica (a save to the KV store, a P/D
prefill's layer parts) or enters it (a load, a P/D decode's handoff) is
the *whole* block, in the layout a one-process replica of the same model
has: every rank's slice moves to or from rank 0 over the group's KV channel
(gloo, on the host), and rank 0's connector sees one ``KVBlockIO``. So the
store's keys, payloads and checks do not depend on how a replica is sliced:
a TP 2 prefill replica hands off to a TP 1 decode replica, and replicas of
any slicing share one store's prefixes.

Rank 0 drives (``ShardedBlockIO``); each follower answers the orders rank 0
sends it between steps (``answer``) or, for blocks streamed while a forward
runs, from its layer hook (``stream_layer``), so every rank enters each
gather and scatter in the same order.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from carpool.kv_transfer.blocks import KVBlockIO, block_bytes, joined_blocks


def gather_to_first(tp, data: torch.Tensor) -> list[torch.Tensor] | None:  # noqa: ANN001
    """Every rank's ``data`` (equal shapes) on rank 0, in rank order; None elsewhere."""
    parts = [torch.empty_like(data) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(data, parts, dst=0, group=tp.kv)
    return parts


def scatter_from_first(tp, parts: list[torch.Tensor] | None,  # noqa: ANN001
                       out: torch.Tensor) -> torch.Tensor:
    """Rank r's part of rank 0's ``parts`` (one per rank, each shaped ``out``), in ``out``."""
    dist.scatter(out, parts, src=0, group=tp.kv)
    return out


class ShardedBlockIO:
    """Rank 0's ``KVBlockIO`` for the whole replica (module docstring):
    ``layout`` is the unsliced model's. ``spans``: each rank's (first, count)
    of the KV heads; ``order(op, block_ids)`` sends the followers an order
    (``read`` or ``write``) they answer between steps."""

    def __init__(self, local: KVBlockIO, tp, spans: Sequence[tuple[int, int]],  # noqa: ANN001
                 heads: int, order: Callable[[str, list[int]], None]) -> None:
        self.local, self.tp, self.spans, self.order = local, tp, list(spans), order
        self.layout = replace(local.layout, num_kv_heads=heads)
        self.latent = local.latent

    def _whole(self, parts: list[torch.Tensor]) -> torch.Tensor:
        count, layers, tensors, _, head_bytes = parts[0].shape
        whole = torch.empty((count, layers, tensors, self.layout.num_kv_heads, head_bytes),
                            dtype=torch.uint8)
        for (first, heads), part in zip(self.spans, parts):  # a shared head: equal bytes
            whole[:, :, :, first:first + heads] = part
        return whole

    def read(self, block_ids: Sequence[int]) -> list[bytes]:
        """Each whole block's data, between steps (the followers answer the order)."""
        if not block_ids:
            return []
        self.order("read", list(block_ids))
        return block_bytes(self._whole(gather_to_first(self.tp, self.local.gather(block_ids))))

    def read_layer(self, block_ids: Sequence[int], layer: int) -> list[bytes]:
        """One layer of each whole block, from inside a forward: the
        followers' layer hooks (``stream_layer``) send theirs, told the
        blocks by the step's message."""
        if not block_ids:
            return []
        parts = gather_to_first(self.tp, self.local.gather(block_ids, [layer]))
        return block_bytes(self._whole(parts))

    def write(self, block_ids: Sequence[int], datas: Sequence[bytes | memoryview]) -> None:
        """Put each whole block's data into every rank's slice of it."""
        if not block_ids:  # a load that found nothing
            if datas:
                raise ValueError("one data per block")
            return
        whole = joined_blocks(datas, len(block_ids), self.layout)
        self.order("write", list(block_ids))
        parts = [whole[:, :, :, first:first + heads].contiguous() for first, heads in self.spans]
        self.local.scatter(block_ids, scatter_from_first(self.tp, parts, torch.empty_like(parts[0])))


def answer(local: KVBlockIO, tp, op: str, block_ids: list[int]) -> None:  # noqa: ANN001
    """A follower's side of rank 0's ``read`` or ``write`` order."""
    if op == "read":
        gather_to_first(tp, local.gather(block_ids))
    elif op == "write":
        local.scatter(block_ids, scatter_from_first(tp, None, local.empty(len(block_ids))))
    else:
        raise ValueError(f"unknown KV order {op!r}")


def stream_layer(local: KVBlockIO, tp, block_ids: list[int]) -> Callable[[int], None]:  # noqa: ANN001
    """A follower's layer hook while rank 0 streams ``block_ids`` out: its
    slice of each layer, as the layer's KV is written."""
    def layer_done(layer: int) -> None:
        gather_to_first(tp, local.gather(block_ids, [layer]))
    return layer_done
