"""What one step computes, as the simulator's cost models price it.

Beside the executor interface, since both sides of it use the shape: the
live engine logs the shape and wall time of every step it runs
(``carpool.engine.step_log``), and the simulator's cost models (``analytic``,
``fitted``) price it; its own module, so they import it without importing
each other. Pure Python.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class StepShape:
    """What one step computes.

    prefill_tokens: prompt tokens computed (the sum of the prefill chunks);
    decode_seqs: sequences generating one token each;
    context_tokens: the sum, over every sequence in the step, of the
        context it attends to after the step (its KV length);
    seqs: sequences in the step (prefill chunks + decodes);
    attention_pairs: query x key pairs attention scores, the sum over
        sequences of (tokens computed) x (context after the step): a decode
        adds its context, a prefill chunk grows with chunk x context.
    """

    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    seqs: int
    attention_pairs: int = 0

    @property
    def tokens(self) -> int:
        """Tokens computed: prompt chunk tokens plus one per decode."""
        return self.prefill_tokens + self.decode_seqs

    @classmethod
    def of(cls, spans) -> StepShape:
        """The shape of a step from its spans (anything with ``start`` and
        ``num_tokens``: the scheduler's spans, the executor's batch items). A
        one-token span counts as a decode: a one-token prompt chunk costs
        the same."""
        decodes = total = context = pairs = 0
        for span in spans:  # one pass: the live engine shapes every step it runs
            tokens = span.num_tokens
            after = span.start + tokens
            decodes += tokens == 1
            total += tokens
            context += after
            pairs += tokens * after
        return cls(prefill_tokens=total - decodes, decode_seqs=decodes, context_tokens=context,
                   seqs=len(spans), attention_pairs=pairs)


class StepSample(NamedTuple):
    """One timed step: its shape, its wall seconds, how long the engine had
    been idle before it started (0 for a step right after another), and
    whether its token count was new to the process (``ShapeMemory``). Both
    make a step cost more (carpool.sim.fitted: the wake and new-shape
    terms), so the fit and every error table need them beside the time."""

    shape: StepShape
    seconds: float
    idle_s: float = 0.0
    new_shape: bool = False


def as_samples(samples) -> list[StepSample]:
    """``StepSample``s of timed steps given as samples or as (shape,
    seconds[, idle_s[, new_shape]]) tuples (tests and older callers)."""
    return [StepSample(*sample) for sample in samples]


SHAPE_MEMORY_TOKEN_COUNTS = 128
#: What ``ModelSettings.row_bucket`` defaults to.
DEFAULT_ROW_BUCKET = 16


#: Steps of at most this many tokens run on exact rows: mostly decode
#: batches, whose counts (1..max_num_seqs) recur anyway, and where pad rows
#: cost the most (16 rows for a 1-sequence decode: +11%, measured on the
#: default model, 2-core CPU).
EXACT_ROWS = 32


def padded_rows(tokens: int, row_bucket: int = DEFAULT_ROW_BUCKET) -> int:
    """The rows the linear layers of a step of ``tokens`` compute: above
    ``EXACT_ROWS``, ``tokens`` rounded up to a multiple of ``row_bucket``
    (``ModelSettings.row_bucket``); at most that, ``tokens``."""
    if tokens <= EXACT_ROWS:
        return tokens
    return -(-tokens // row_bucket) * row_bucket


class ShapeMemory:
    """The row counts of the steps a process ran lately, least recently run
    first out.

    Why: the CPU matrix kernels (oneDNN) build a kernel per matrix shape on
    first use and keep 1,024 of them; a step whose row count (the rows of
    every linear layer) is new pays for ~8 of them, measured 5-18 ms on a
    2-core CPU for the default model (+12-30% of the step), then nothing
    the next time. The executor pads a step's token count up to a multiple
    of ``row_bucket`` (``padded_rows``), so only a new bucket pays. 128 row
    counts x ~8 shapes fill that cache: the approximation the live engine,
    the grid and the simulator all use.
    """

    def __init__(self, capacity: int = SHAPE_MEMORY_TOKEN_COUNTS,
                 row_bucket: int = DEFAULT_ROW_BUCKET) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.row_bucket = row_bucket
        self._seen: OrderedDict[int, None] = OrderedDict()

    def see(self, tokens: int) -> bool:
        """Record a step of ``tokens``; whether its row count was new."""
        rows = padded_rows(tokens, self.row_bucket)
        seen = self._seen
        if rows in seen:
            seen.move_to_end(rows)
            return False
        seen[rows] = None
        if len(seen) > self.capacity:
            seen.popitem(last=False)
        return True
