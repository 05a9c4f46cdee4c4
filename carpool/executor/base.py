"""The executor interface: run one scheduled step, return sampled tokens.

Both drivers of the engine core (``carpool.engine.core``) run a scheduled
step through an ``Executor``: the live engine through ``TorchExecutor`` (the
real model), the simulated replica through ``CostModelExecutor``
(``carpool/sim/executor.py``: prices the step with a cost model, samples a
fixed token). ``batch_items`` and ``step_padding`` turn the scheduler's
output into this interface's arguments for either. Pure Python.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from carpool.config import PADDINGS


@dataclass(slots=True)
class BatchItem:
    """One request's span in a step: compute ``token_ids[start:start+num_tokens]``.

    ``token_ids`` and ``block_table`` are the request's live lists (not
    copies). ``sampling`` is the sampler's row (``carpool.model.sampler.
    SamplingRow``) when the span ends at the last known token, else None.
    """

    request_id: str
    token_ids: Sequence[int]
    start: int
    num_tokens: int
    block_table: Sequence[int]
    sampling: Any = None


@dataclass(frozen=True)
class Padding:
    """Run a step as a padded rectangle, as a request-level batcher does.

    The rectangle is ``rows`` (at least one per item) by ``cols`` (the
    longest item's ``num_tokens``): each item's span is padded up to
    ``cols`` and each row without an item is ``cols`` pad tokens. ``align``
    (left | right | center) puts a row's pad tokens before, after, or split
    around its real tokens. Pad tokens are computed and their results
    discarded; real results match the ragged batch.
    """

    rows: int
    align: str = "right"

    def __post_init__(self) -> None:
        if self.align not in PADDINGS or self.align == "none":
            raise ValueError(f"padding alignment must be left|right|center, got {self.align!r}")

    def shape(self, lengths: Sequence[int]) -> tuple[int, int]:
        """(rows, cols) of the rectangle for items of these span lengths."""
        return max(self.rows, len(lengths)), max(lengths, default=0)

    def split(self, length: int, cols: int) -> tuple[int, int]:
        """(pad tokens before, pad tokens after) a row's ``length`` real tokens."""
        pad = cols - length
        if self.align == "left":
            return pad, 0
        if self.align == "right":
            return 0, pad
        return pad // 2, pad - pad // 2


class Executor(ABC):
    """Owns the model and the KV tensors of one replica."""

    #: KV blocks the executor allocated; the scheduler's pool has exactly these.
    num_blocks: int
    block_size: int
    #: Whether ``launch`` returns while a device still computes the batch,
    #: so host work before its wait costs the step nothing: the engine's
    #: overlap (``overlap: auto``) is on for such executors. Not on a CPU,
    #: whose forward runs on the host and needs every core.
    overlaps_host: bool = False
    #: The worker side of a live KV connector (``carpool.scheduler.kv_connector.
    #: KVConnectorWorker``: block I/O, fetches, the layer hook), set by the
    #: engine that has one; it moves the bytes of the orders each step hands it.
    kv_worker: Any = None
    #: A sliced replica's ``payload.model_fingerprint`` of the whole model
    #: (its own weights are one rank's); None: the connector takes the model's.
    unsharded_fingerprint: bytes | None = None

    @abstractmethod
    def execute(self, items: Sequence[BatchItem], padding: Padding | None = None) -> list[Any]:
        """Run one batch, ragged or (``padding`` given) padded to a rectangle;
        return one sample result per item whose ``sampling`` is set, in item
        order. Items and their rows are read during the call only: the live
        engine updates them in place for its next step."""

    def launch(self, items: Sequence[BatchItem], padding: Padding | None = None,
               ) -> Callable[[], list[Any]]:
        """Start the batch; return the function that waits for it and gives
        ``execute``'s results. A device executor returns while the device
        computes (the engine makes the previous step's outputs before it
        waits); this default runs the whole batch first. Items are read
        until the wait returns."""
        results = self.execute(items, padding)
        return lambda: results


    def block_io(self) -> Any:
        """The ``KVBlockIO`` (``carpool.kv_transfer.blocks``) a KV connector
        moves this replica's blocks through: whole blocks, in the layout of
        the unsliced model."""
        raise NotImplementedError(f"{type(self).__name__} holds no KV tensors to move")

    def close(self) -> None:
        """Release what runs beside the model (a tensor-parallel replica's
        follower processes); the engine calls it once, at its end."""


def batch_items(spans: Sequence[Any], block_tables: Mapping[str, Sequence[int]],
                sampling_row: Callable[[Any], Any]) -> list[BatchItem]:
    """The executor's items for a step's scheduled spans (the scheduler's
    ``ScheduledSpan``: ``request``, ``start``, ``num_tokens``, ``sample``),
    in order; ``sampling_row(request)`` gives the row of a span that samples."""
    # One item per span, every step: a comprehension, positional arguments.
    return [BatchItem(span.request.request_id, span.request.token_ids, span.start,
                      span.num_tokens, block_tables[span.request.request_id],
                      sampling_row(span.request) if span.sample else None)
            for span in spans]


def resolve_overlap(mode: str, executor: Executor) -> bool:
    """Whether an engine overlaps host work with ``executor``'s steps:
    ``on``, ``off``, or ``auto`` (where the executor ``overlaps_host``)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"overlap must be auto|on|off, got {mode!r}")
    return mode == "on" or (mode == "auto" and executor.overlaps_host)


def step_padding(pad_rows: int, align: str) -> Padding | None:
    """The ``Padding`` of a step the scheduler shaped as ``pad_rows`` rows
    (0: a ragged step, None)."""
    return Padding(pad_rows, align) if pad_rows else None
