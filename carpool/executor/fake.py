"""An executor without a model: what the engine costs on its own.

``FakeExecutor`` stands behind the ``Executor`` interface like
``TorchExecutor`` but computes nothing: every item that samples gets a
token picked from ``token_ids`` by a cheap hash of its row's seed and step
(the same row, the same token; never EOS unless the pool holds it), and
each step optionally waits ``step_seconds`` to stand in for the device
(then it ``overlaps_host``, as a device executor does).
``carpool bench engine`` drives the live engine with it, so a step's wall
time is the engine's own per-step work (scheduling, batch items, sampling
rows, stop checks, detokenizing, outputs) and nothing else. Holds no KV
tensors: ``num_blocks`` only sizes the scheduler's pool.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from carpool.executor.base import BatchItem, Executor, Padding
from carpool.model.sampler import SampleResult

# An odd 64-bit multiplier (golden ratio): spreads consecutive steps over the pool.
_SPREAD = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


class FakeExecutor(Executor):
    """Samples without computing; see the module docstring.

    ``token_ids``: the tokens it may sample (default: ``range(vocab_size)``);
    ``step_seconds``: how long each ``execute`` sleeps (0: not at all).
    ``steps`` and ``items`` count the steps run and the items seen.
    """

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int,
                 token_ids: Sequence[int] | None = None, step_seconds: float = 0.0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, "
                             f"{block_size}")
        pool = list(range(vocab_size) if token_ids is None else token_ids)
        if not pool:
            raise ValueError("the fake executor needs at least one token id to sample")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.step_seconds = step_seconds
        # Its wait stands in for a device's (see launch).
        self.overlaps_host = step_seconds > 0
        self._pool = pool
        # One shared result per token: the engine only reads results, and a
        # fake should spend no time of its own making them.
        self._results = [SampleResult(token) for token in pool]
        self.steps = 0
        self.items = 0

    def token_for(self, seed: int, step: int) -> int:
        """The token a row of this seed samples at this step."""
        return self._pool[self._index(seed, step)]

    def _index(self, seed: int, step: int) -> int:
        mixed = ((seed ^ (step * _SPREAD)) * _SPREAD) & _MASK64
        return (mixed >> 17) % len(self._pool)

    def execute(self, items: Sequence[BatchItem], padding: Padding | None = None,
                ) -> list[SampleResult]:
        """One ``SampleResult`` per item that samples, in item order; waits
        ``step_seconds`` first when set."""
        return self.launch(items, padding)()

    def launch(self, items: Sequence[BatchItem], padding: Padding | None = None,
               ) -> Callable[[], list[SampleResult]]:
        """As a device does: the results are made now, and the wait ends
        ``step_seconds`` after the launch, whatever the host did meanwhile."""
        done = time.perf_counter() + self.step_seconds
        self.steps += 1
        self.items += len(items)
        index, results = self._index, self._results
        picked = [results[index(item.sampling.seed, item.sampling.step)]
                  for item in items if item.sampling is not None]

        def wait() -> list[SampleResult]:
            left = done - time.perf_counter()
            if left > 0:
                time.sleep(left)
            return picked
        return wait
