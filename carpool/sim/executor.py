"""The simulator's executor: a cost model behind the ``Executor`` interface.

``CostModelExecutor.execute`` takes the batch the live engine would hand
``TorchExecutor`` (the same ``batch_items`` / ``step_padding``), prices it
with the cost model instead of running a model, and samples
``SAMPLED_TOKEN`` for every item that samples: token content never matters
to the simulator, whose requests all run with ignore_eos. The price of the
last step is ``last_step_seconds``; the simulated replica advances its
virtual clock by it (the live engine times the step on the wall clock
instead). ``decode_step_seconds`` prices the steps of a fast-forwarded
decode run exactly as ``execute`` would price them one by one. Both add
the new-shape cost to a step whose token count the executor's
``ShapeMemory`` lacks, as the live process pays it; ``wake_seconds`` is
what a step costs more after an idle gap (the replica knows the gap, the
batch does not).
"""
from __future__ import annotations

from collections.abc import Sequence

from carpool.executor.base import BatchItem, Executor, Padding
from carpool.executor.shapes import ShapeMemory, StepShape
from carpool.sim.costs import CostModel

SAMPLED_TOKEN = 0  # what every simulated step samples


class CostModelExecutor(Executor):
    """Prices steps with ``cost``; holds no KV tensors, only the pool's size."""

    def __init__(self, cost: CostModel, num_blocks: int, block_size: int) -> None:
        self.cost = cost
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.last_step_seconds = 0.0
        # The rows the measured process padded its steps to (1: exact).
        self.shapes = ShapeMemory(row_bucket=cost.row_bucket)
        # A cost model that meters steps (``meter(items, shape)``, as
        # carpool/sim/evaluate_batching.py wraps one) hears of each executed step.
        self.meter = getattr(cost, "meter", None)

    def execute(self, items: Sequence[BatchItem], padding: Padding | None = None) -> list[int]:
        """Price the step (``last_step_seconds``); one ``SAMPLED_TOKEN`` per
        item that samples, in item order."""
        shape = batch_shape(items, padding)
        self.last_step_seconds = self.cost.step_seconds(shape) + self._new_shape_seconds(
            shape.tokens)
        if self.meter is not None:
            self.meter(items, shape)
        return [SAMPLED_TOKEN for item in items if item.sampling is not None]

    def decode_step_seconds(self, seqs: int, context_tokens: int) -> float:
        """The price of a step of ``seqs`` one-token decodes attending to
        ``context_tokens`` in all (what ``execute`` charges for it)."""
        return self.cost.decode_step_seconds(seqs, context_tokens) + self._new_shape_seconds(
            seqs)

    def wake_seconds(self, idle_s: float) -> float:
        """What a step costs more after the replica idled ``idle_s``."""
        return self.cost.extra_seconds(0, idle_s, False)

    def _new_shape_seconds(self, tokens: int) -> float:
        return self.cost.extra_seconds(tokens, 0.0, True) if self.shapes.see(tokens) else 0.0


def batch_shape(items: Sequence[BatchItem], padding: Padding | None = None) -> StepShape:
    """What the executor computes for ``items``: their ragged spans, or with
    ``padding`` the padded rectangle (every row as long as the longest
    span, each from its item's start; rows without an item all padding)."""
    if padding is None:
        return StepShape.of(items)
    rows, cols = padding.shape([item.num_tokens for item in items])
    spans = [_Row(item.start, cols) for item in items]
    spans += [_Row(0, cols)] * (rows - len(items))
    return StepShape.of(spans)


class _Row:
    __slots__ = ("start", "num_tokens")

    def __init__(self, start: int, num_tokens: int) -> None:
        self.start, self.num_tokens = start, num_tokens
