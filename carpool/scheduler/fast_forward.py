"""Runs of identical decode steps, applied in one go (for the simulator).

Between arrivals and finishes a replica mostly runs steps in which every
running request decodes one token and nothing else changes but token
counts and block tables. ``decode_run_limit`` says how many such steps
follow from the scheduler's own state; ``apply_decode_steps`` applies them
with exactly the effects ``schedule`` + ``commit`` + ``record_step`` would
have had step by step (same blocks allocated and registered in the same
order, same times, same cost-model samples), at a cost per request and per
block boundary instead of per request and per step. The caller bounds the
run by what the scheduler cannot see (arrivals; ``horizon``). Pure Python.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from carpool.scheduler.request import Request


def decode_run_limit(scheduler, most: int | None = None) -> int:
    """How many of the next steps (at most ``most``) are pure decode steps
    that change nothing but tokens and blocks: 0 unless nothing waits,
    every running request is decoding, their tokens fit the step budget and
    nothing acts per step (``scheduler.step_hooks``: the controller, the
    overload detector, a batch gate, or whatever is added there). The run
    ends at the latest with the step in which a request samples its last
    token (the caller then finishes it, as the engine does after that
    step's commit), and before any step that would run out of free blocks
    (it would preempt). Session protections lapse by time: see ``horizon``."""
    running = scheduler.running
    if (not running or scheduler.waiting or scheduler.has_pending_rejections
            or scheduler.step_hooks
            or len(running) > scheduler.knobs.max_num_batched_tokens):
        return 0
    steps = None
    for request in running:  # one pass: all decoding (is_decoding), fewest tokens left
        num_tokens, num_prompt = len(request.token_ids), len(request.prompt_token_ids)
        if request.num_computed_tokens != num_tokens - 1 or num_tokens <= num_prompt:
            return 0
        left = request.max_tokens - (num_tokens - num_prompt)
        if steps is None or left < steps:
            steps = left
    if most is not None:
        steps = min(steps, most)
    kv = scheduler.kv
    free = kv.pool.num_free_blocks
    computed = [r.num_computed_tokens for r in running]
    tables = [len(kv.block_tables[r.request_id]) for r in running]

    def blocks_needed(run: int) -> int:
        size = kv.block_size
        return sum(max(0, -(-(c + run) // size) - t) for c, t in zip(computed, tables))

    if steps <= 0:
        return 0
    if blocks_needed(steps) <= free:
        return steps
    if blocks_needed(1) > free:
        return 0
    low, high = 1, steps  # needed(low) <= free < needed(high)
    while high - low > 1:
        middle = (low + high) // 2
        if blocks_needed(middle) <= free:
            low = middle
        else:
            high = middle
    return low


def horizon(scheduler) -> float | None:
    """The latest clock time a run's step may start at (a session's
    protection lapses after it, or an external KV load is done: that
    request joins the next step), or None."""
    times = [t for t in (scheduler.sessions.next_expiry, scheduler.loading.next_done)
             if t is not None]
    return min(times, default=None)


def apply_decode_steps(scheduler, seconds: Sequence[float], step_ends: Sequence[float],
                       set_time: Callable[[float], None], token_id: int = 0) -> list[Request]:
    """Apply ``len(seconds)`` decode steps (at most ``decode_run_limit``),
    step ``i`` taking ``seconds[i]`` and committing at ``step_ends[i]``;
    every request samples ``token_id`` each step. ``set_time`` moves the
    scheduler's clock (a step's effects are timed at its end). Returns the
    requests in the order the steps visited them: the order in which the
    caller finishes those that reached their ``max_tokens``."""
    steps = len(seconds)
    kv, size = scheduler.kv, scheduler.kv.block_size
    order = scheduler.running_order()
    # Step by step, a step allocates in visiting order while scheduling,
    # then registers newly full blocks in the same order on commit; the
    # block ids and the prefix-cache entries depend on that order.
    events: list[tuple[int, int, int, int]] = []  # (step, phase, position, computed)
    starts = [request.num_computed_tokens for request in order]
    tables = [kv.block_tables[request.request_id] for request in order]
    for position, (request, computed, table) in enumerate(zip(order, starts, tables)):
        covered = len(table) * size
        for step in range(covered - computed, steps, size):
            events.append((step, 0, position, computed + step))
        for step in range((size - 1 - computed) % size, steps, size):
            events.append((step, 1, position, computed + step + 1))
        request.token_ids.extend([token_id] * steps)
    events.sort()
    # A growth event needs exactly one block, and the run limit left enough free.
    allocate, register = kv.pool.allocate, kv.cache_computed_blocks
    for _, phase, position, computed in events:
        request = order[position]
        request.num_computed_tokens = computed
        if phase:
            register(request)
        else:
            tables[position] += allocate(1)
    for request, computed in zip(order, starts):
        request.num_computed_tokens = computed + steps
        request.last_token_time = step_ends[-1]
    scheduler.record_steps(len(order), len(order), seconds, step_ends)
    scheduler.steps_built += steps
    set_time(step_ends[-1])
    return order
