"""One step: its output, its token accounting, and the room planner of
priority preemption.

Pure Python; nothing here changes scheduler state: the scheduler applies
what ``plan_room`` returns.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from carpool.scheduler.kv_manager import KVCacheManager
from carpool.scheduler.request import Request


@dataclass(slots=True)
class ScheduledSpan:
    """Compute tokens ``[start, start + num_tokens)`` of ``request.token_ids``.

    ``sample`` is true when the span reaches the end of the known tokens,
    so the step yields the request's next token.
    """

    request: Request
    start: int
    num_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    """What one step computes; ``preempted`` lost their KV this step.

    ``pad_rows``: 0 runs the spans as one ragged batch; otherwise the step
    is a padded rectangle of ``max(pad_rows, len(spans))`` rows by the
    longest span's length, every missing token slot computed as padding.
    """

    spans: list[ScheduledSpan] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    pad_rows: int = 0

    @property
    def num_tokens(self) -> int:
        """Real tokens computed (padding excluded)."""
        return sum(span.num_tokens for span in self.spans)

    @property
    def num_slots(self) -> int:
        """Token slots computed, padding included (``num_tokens`` when ragged)."""
        if not self.pad_rows or not self.spans:
            return self.num_tokens
        return max(self.pad_rows, len(self.spans)) * max(s.num_tokens for s in self.spans)

    @property
    def is_empty(self) -> bool:
        return not self.spans


def span_for(request: Request, num_tokens: int) -> ScheduledSpan:
    """The request's next ``num_tokens`` tokens, from its computed ones."""
    start = request.num_computed_tokens
    return ScheduledSpan(request, start, num_tokens,
                         sample=start + num_tokens == request.num_tokens)


def trim_span(output: SchedulerOutput, step: StepBudget, request: Request,
              num_tokens: int) -> None:
    """Take ``num_tokens`` off the end of the request's span in ``output``
    and give them back to ``step`` (the span goes when nothing is left).
    Blocks grown for them stay allocated: the next steps use them."""
    step.take_back(request, num_tokens)
    left = step.granted.get(request, (0, 0))[0]
    spans = []
    for span in output.spans:
        if span.request is request:
            if not left:
                continue
            span = span_for(request, left)
        spans.append(span)
    output.spans = spans


def is_decoding(request: Request) -> bool:
    """A request computing only its last sampled token; anything else
    (prompt chunks, recompute after a preemption) is prefill."""
    return request.num_output_tokens > 0 and request.num_pending_tokens == 1


@dataclass
class StepBudget:
    """Tokens handed out in one step.

    ``tokens`` is what is left of ``max_num_batched_tokens``; ``long_left``
    what is left of the long-prompt prefill allowance (``math.inf`` when the
    cap is off this step). ``admit_below``: once a request was preempted or
    had its span shortened this step, only waiting requests whose base
    priority is below this bound may be admitted (``-inf`` under FCFS:
    nobody), so a victim is never re-admitted in the step that preempted
    it and never overtaken by work that could not have displaced it. ``granted`` maps each request
    with a span to (tokens, of which counted against ``long_left``).
    """

    tokens: int
    long_left: float = math.inf
    admit_below: float = math.inf
    granted: dict[Request, tuple[int, int]] = field(default_factory=dict)
    admitted: set[Request] = field(default_factory=set)  # admitted from the queue this step

    def limit(self, capped: bool) -> int:
        """Tokens a request may get now; ``capped``: they count as long prefill."""
        if capped:
            return max(0, int(min(self.tokens, self.long_left)))
        return max(0, self.tokens)

    def grant(self, request: Request, num_tokens: int, capped: bool) -> None:
        self.tokens -= num_tokens
        counted = num_tokens if capped else 0
        self.long_left -= counted
        self.granted[request] = (num_tokens, counted)

    def take_back(self, request: Request, num_tokens: int) -> None:
        """Return ``num_tokens`` of the request's granted span to the budget."""
        granted, counted = self.granted.pop(request, (0, 0))
        num_tokens = min(num_tokens, granted)
        returned_long = min(num_tokens, counted)
        self.tokens += num_tokens
        self.long_left += returned_long
        if granted > num_tokens:
            self.granted[request] = (granted - num_tokens, counted - returned_long)

    def refund(self, request: Request) -> None:
        """Give back the whole span of a request that will not run (preempted)."""
        self.take_back(request, self.granted.get(request, (0, 0))[0])


@dataclass
class RoomPlan:
    """Shorten the spans of ``trims`` (request, tokens taken back) this step;
    those requests stay running. Then preempt ``victims`` in this order and
    admit with ``num_tokens``."""

    trims: list[tuple[Request, int]]
    victims: list[Request]
    num_tokens: int


def plan_room(request: Request, capped: bool, candidates: Sequence[Request], step: StepBudget,
              kv: KVCacheManager, free_slots: int) -> RoomPlan | None:
    """How to make room for ``request`` this step at the expense of
    ``candidates`` (running requests of strictly worse base priority, in
    preemption order); ``None`` when even all of them would not be enough
    (then nothing should change).

    Tokens first: while ``request`` could get fewer tokens than it has
    pending, the next candidate with a span this step gives back what is
    missing (its span is shortened or dropped; it stays running with its
    KV), which frees tokens as a preemption would at no recompute cost.
    That fixes the chunk, so freeing more cannot grow the blocks it needs.
    Then slots and blocks: candidates are preempted in order until a slot
    is free and ``kv.try_admit(request, chunk)`` would succeed with their
    blocks released. ``capped``: the request's tokens count against the
    long-prefill allowance.
    """
    trims: list[tuple[Request, int]] = []
    tokens, long_left = step.tokens, step.long_left
    # What admission would compute: the cached prefix is reused, not computed.
    hits = kv.find_cached_prefix(request)
    need = request.num_tokens - len(hits) * kv.block_size
    for candidate in candidates:
        if _limit(tokens, long_left, capped) >= need:
            break
        granted, counted = step.granted.get(candidate, (0, 0))
        # Giving back x tokens raises tokens by x and long_left by min(x, counted).
        short = max(need - tokens, need - long_left if capped and counted else 0)
        take = min(granted, max(0, short))
        after = (tokens + take, long_left + min(take, counted))
        if _limit(*after, capped) > _limit(tokens, long_left, capped):
            trims.append((candidate, take))
            tokens, long_left = after
    chunk = _limit(tokens, long_left, capped)
    if chunk < 1:
        return None
    victims: list[Request] = []
    refs: Counter[int] = Counter()
    released: set[int] = set()  # blocks whose every reference belongs to a victim
    rest = iter(candidates)
    while (free_slots + len(victims) < 1
           or kv.admit_shortfall(request, chunk, released, hits) > 0):
        victim = next(rest, None)
        if victim is None:
            return None
        for block_id in kv.block_tables[victim.request_id]:
            refs[block_id] += 1
            if refs[block_id] == kv.pool.ref_counts[block_id]:
                released.add(block_id)
        victims.append(victim)
    return RoomPlan(trims, victims, chunk)


def _limit(tokens: float, long_left: float, capped: bool) -> int:
    return max(0, int(min(tokens, long_left) if capped else tokens))

