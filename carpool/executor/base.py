"""The executor interface: run one scheduled step, return sampled tokens.

The engine and the simulator share the scheduler; only the executor
differs (a real model here, a cost model in the simulator).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


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


class Executor(ABC):
    """Owns the model and the KV tensors of one replica."""

    #: KV blocks the executor allocated; the scheduler's pool has exactly these.
    num_blocks: int
    block_size: int

    @abstractmethod
    def execute(self, items: Sequence[BatchItem]) -> list[Any]:
        """Run one ragged batch; return one sample result per item whose
        ``sampling`` is set, in item order."""
