"""The scheduler: one token-budget loop per step.

There is no prefill phase and no decode phase. Each request has a number of
computed tokens catching up with its number of tokens; every step hands out
at most ``max_num_batched_tokens`` tokens, running requests first (a decode
needs one, an unfinished prompt gets a chunk), then waiting requests while
budget, sequence slots and KV blocks last. Pure Python and deterministic:
time only comes from the injected clock.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from carpool.config import CacheConfig, SchedulerConfig
from carpool.scheduler.kv_manager import KVCacheManager
from carpool.scheduler.queues import make_queue
from carpool.scheduler.request import Request, RequestStatus


@dataclass
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
    spans: list[ScheduledSpan] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(span.num_tokens for span in self.spans)

    @property
    def is_empty(self) -> bool:
        return not self.spans


class Scheduler:
    """Decides which token spans run each step and owns the KV bookkeeping."""

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, num_blocks: int,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                 cache.watermark)
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. Its full length must fit the pool on its own."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not self.kv.can_ever_fit(request.num_prompt_tokens + request.max_tokens):
            raise ValueError(
                f"request {request.request_id!r} needs "
                f"{request.num_prompt_tokens + request.max_tokens} tokens of KV cache, more "
                f"than the pool holds; raise the KV cache memory or lower max_tokens")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) and free its blocks."""
        assert status.finished
        if self.requests.pop(request.request_id, None) is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ---------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's spans; see the module docstring for the order."""
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        # After a preemption blocks are short: admitting would only thrash.
        if not output.preempted:
            self._schedule_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = min(request.num_pending_tokens, budget)
            assert num_tokens > 0, "a running request always has a token to compute"
            while not self.kv.try_grow(request, num_tokens):
                victim = self._pick_victim()
                self._preempt(victim, output)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            output.spans.append(self._span(request, num_tokens))
            budget -= num_tokens
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if not self.kv.try_admit(request, budget):
                break  # head of line waits for blocks: keeps FCFS/priority order fair
            self.waiting.pop()
            num_tokens = min(request.num_pending_tokens, budget)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
                request.num_cached_tokens = request.num_computed_tokens
            self.running.append(request)
            output.spans.append(self._span(request, num_tokens))
            budget -= num_tokens

    def _span(self, request: Request, num_tokens: int) -> ScheduledSpan:
        start = request.num_computed_tokens
        return ScheduledSpan(request, start, num_tokens,
                             sample=start + num_tokens == request.num_tokens)

    def _pick_victim(self) -> Request:
        # Lowest priority (largest value) first, then the latest arrival.
        return max(self.running, key=lambda r: (r.priority, r.arrival_time))

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        """Preempt by recompute: drop the KV, keep the tokens, requeue at the front.

        Its full blocks stay in the prefix cache, so re-admission usually
        revives most of them instead of recomputing.
        """
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        # A span already scheduled this step for the victim must not run.
        output.spans = [s for s in output.spans if s.request is not request]
        output.preempted.append(request)
        self.waiting.prepend(request)

    # -- after the step ran -----------------------------------------------------

    def commit(self, output: SchedulerOutput, sampled: Iterable[tuple[Request, int]]) -> None:
        """Record that ``output`` ran: advance computed counts, append sampled
        tokens and register newly full blocks in the prefix cache."""
        for span in output.spans:
            request = span.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens = span.start + span.num_tokens
            self.kv.cache_computed_blocks(request)
        for request, token_id in sampled:
            if request.status == RequestStatus.RUNNING:
                request.append_output(token_id)

    def check_invariants(self) -> None:
        """Bookkeeping consistency, for tests."""
        self.kv.check_invariants()
        assert len(self.running) <= self.config.max_num_seqs
        assert set(self.kv.block_tables) == {r.request_id for r in self.running}
        queued = {r.request_id for r in self.waiting}
        running = {r.request_id for r in self.running}
        assert not queued & running
        assert queued | running == set(self.requests)
