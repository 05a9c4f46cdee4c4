"""The executor interface: run one scheduled step, return sampled tokens.

The live engine runs a scheduled step through an ``Executor`` (``TorchExecutor``:
the real model). The simulator shares the scheduler but still drives it with
its own replica loop and a cost model (``carpool/sim/replica.py``), not
through this interface (yet: one engine core for both is the plan).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from carpool.config import PADDINGS


@dataclass
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

    @abstractmethod
    def execute(self, items: Sequence[BatchItem], padding: Padding | None = None) -> list[Any]:
        """Run one batch, ragged or (``padding`` given) padded to a rectangle;
        return one sample result per item whose ``sampling`` is set, in item
        order."""
