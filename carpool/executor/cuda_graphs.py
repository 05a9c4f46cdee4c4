"""Decode steps replayed from captured CUDA graphs, one per batch-size bucket.

Eagerly, a decode step launches every kernel of every layer from Python
(about 15 per layer): at small batches the GPU waits on the launches, not
on memory. A CUDA graph records the decode forward once per bucket and
replays it with one launch. A step of ``n`` decodes runs in the smallest
bucket ``b >= n``; the executor pads it with ``b - n`` dummy sequences (one
token at position 0, written to a scratch block, context 1, output
discarded: the same pad sequences as request-level padding), which is the
padding waste ``DecodeGraphs.stats`` reports. Steps with a prefill chunk,
padded rectangles, or more decodes than the largest bucket run eagerly.

Replays read only tensors at fixed addresses: the step's metadata is
copied into static buffers, and the attention backend must read context
lengths and block tables from tensors (``TritonAttention.graph_safe``);
block tables are as wide as the longest context the engine admits.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from carpool.model.attention import AttentionMetadata

Forward = Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]


def bucket_for(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest size >= ``batch`` (sizes ascending), None if none is."""
    at = bisect.bisect_left(sizes, batch)
    return sizes[at] if at < len(sizes) else None


class CudaGraph:
    """``fn`` captured once into a CUDA graph; ``replay`` reruns it in place."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool) -> None:  # noqa: ANN001
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles the Triton kernels, settles the allocator
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class EagerGraph:
    """The same interface, replayed by running ``fn`` again into the same
    output tensor: how CPU tests drive the bucket, padding and static-buffer
    logic without a GPU."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool=None) -> None:  # noqa: ANN001
        self.fn = fn
        self.output = fn()

    def replay(self) -> torch.Tensor:
        self.output.copy_(self.fn())
        return self.output


@dataclass
class GraphStats:
    """Decode steps replayed, their real rows, and the pad rows added."""

    replays: int = 0
    rows: int = 0
    pad_rows: int = 0
    eager_fallbacks: int = 0

    @property
    def padding_waste(self) -> float:
        """Pad rows as a fraction of all rows the replays computed."""
        total = self.rows + self.pad_rows
        return self.pad_rows / total if total else 0.0


class DecodeGraphs:
    """Static input buffers and one captured graph per bucket size.

    ``forward(ids, meta)`` is the model's decode forward (hidden states
    ``[B, hidden]``); ``scratch_block`` is a KV block outside the
    scheduler's pool that pad rows write to; ``table_width`` the block table
    width of the longest admitted context.
    """

    def __init__(self, forward: Forward, sizes: Sequence[int], table_width: int,
                 scratch_block: int, device: torch.device,
                 graph_type: type = CudaGraph) -> None:
        self.sizes = sorted(sizes)
        self.table_width = table_width
        self.stats = GraphStats()
        biggest = self.sizes[-1]
        self.ids = torch.zeros(biggest, dtype=torch.long, device=device)
        self.positions = torch.zeros(biggest, dtype=torch.long, device=device)
        self.slot_blocks = torch.full((biggest,), scratch_block, dtype=torch.long, device=device)
        self.slot_offsets = torch.zeros(biggest, dtype=torch.long, device=device)
        self.context_lens = torch.ones(biggest, dtype=torch.long, device=device)
        self.tables = torch.full((biggest, table_width), scratch_block, dtype=torch.long,
                                 device=device)
        pool = torch.cuda.graph_pool_handle() if graph_type is CudaGraph else None
        self.graphs = {}
        # Largest first: smaller graphs reuse its memory from the shared pool.
        for size in reversed(self.sizes):
            self.graphs[size] = graph_type(lambda b=size: forward(self.ids[:b], self._meta(b)),
                                           pool)

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_blocks=self.slot_blocks[:batch], slot_offsets=self.slot_offsets[:batch],
            positions=self.positions[:batch], num_decodes=batch,
            decode_blocks=self.tables[:batch], decode_context_lens=self.context_lens[:batch])

    def bucket(self, decodes: int, table_width: int) -> int | None:
        """The bucket a step of ``decodes`` sequences replays in, or None
        (counted as a fallback) when it is larger than every bucket or its
        block tables are wider than the captured ones."""
        size = bucket_for(decodes, self.sizes)
        if size is None or table_width > self.table_width:
            self.stats.eager_fallbacks += 1
            return None
        return size

    def replay(self, ids: torch.Tensor, meta: AttentionMetadata, real_rows: int) -> torch.Tensor:
        """Run a decode step already padded to a bucket (``ids`` and ``meta``
        of ``bucket`` rows, built by the backend): copy it into the static
        buffers, replay, return the hidden states of its rows."""
        batch, width = meta.decode_blocks.shape
        self.ids[:batch].copy_(ids)
        self.positions[:batch].copy_(meta.positions)
        self.slot_blocks[:batch].copy_(meta.slot_blocks)
        self.slot_offsets[:batch].copy_(meta.slot_offsets)
        self.context_lens[:batch].copy_(meta.decode_context_lens)
        # Columns past the step's width keep stale entries: the kernel reads
        # a row's table only up to its context length.
        self.tables[:batch, :width].copy_(meta.decode_blocks)
        self.stats.replays += 1
        self.stats.rows += real_rows
        self.stats.pad_rows += batch - real_rows
        return self.graphs[batch].replay()
