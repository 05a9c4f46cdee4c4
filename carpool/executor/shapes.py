"""What one step computes, as the simulator's cost models price it.

Beside the executor interface, since both sides of it use the shape: the
live engine logs the shape and wall time of every step it runs
(``carpool.engine.step_log``), and the simulator's cost models (``analytic``,
``fitted``) price it; its own module, so they import it without importing
each other. Pure Python.
"""
from __future__ import annotations

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
    """One timed step: its shape, its wall seconds, and how long the engine
    had been idle before it started (0 for a step right after another).
    A step after idling costs more (carpool.sim.fitted: the wake term), so
    the fit and every error table need the gap beside the time."""

    shape: StepShape
    seconds: float
    idle_s: float = 0.0


def as_samples(samples) -> list[StepSample]:
    """``StepSample``s of timed steps given as samples or as (shape,
    seconds[, idle_s]) tuples (tests and older callers)."""
    return [StepSample(*sample) for sample in samples]
