"""The scheduler: one token-budget loop per step.

There is no prefill phase and no decode phase. Each request has a number of
computed tokens catching up with its number of tokens; every step hands out
at most ``max_num_batched_tokens`` tokens, running requests first (a decode
needs one, an unfinished prompt gets a chunk; under ``policy: priority`` in
(priority, arrival) order), then waiting requests in queue order while
budget, sequence slots and KV blocks last. Pure Python and deterministic:
time only comes from the injected clock.

Queues (``queues.LaneQueue``): FIFO lanes per priority class and prompt
length class, merged by arrival (FCFS) or by aged priority. Under
``policy: priority`` a waiting request that does not fit preempts running
requests of strictly worse base priority (``step.plan_room``). Dual queue
(both policies): while short requests wait or prefill, long prompts get at
most ``long_prefill_cap`` prefill tokens per step, and waiting long
requests are passed over once that is spent.

Admission control bounds the waiting queue (``RejectedError`` at arrival)
and expires requests that waited past their deadline or queue timeout;
those leave through ``pop_rejected``. Every accepted request leaves exactly
once: through ``finish_request`` / ``abort_request`` (the caller knows) or
through ``pop_rejected``. Requests sharing a session id run in arrival
order and their cached prefix is protected between turns (``sessions``).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from carpool.config import CacheConfig, ControllerConfig, SchedulerConfig
from carpool.scheduler.control.admission import AdmissionControl
from carpool.scheduler.control.controller import AdaptiveController, LiveKnobs
from carpool.scheduler.control.regimes import BatchGate, GateHook, GateStats, LongLane
from carpool.scheduler.control.sessions import SessionStats, SessionTracker
from carpool.scheduler.invariants import check_invariants
from carpool.scheduler.kv_connector import ExternalKV, PendingLoads
from carpool.scheduler.kv_manager import KVCacheManager
from carpool.scheduler.pinned_prefixes import PinnedPrefixes
from carpool.scheduler.queues import ExpiryQueue, make_queue
from carpool.scheduler.request import Request, RequestStatus
from carpool.scheduler.step import (
    RoomPlan,
    ScheduledSpan,
    SchedulerOutput,
    StepBudget,
    is_decoding,
    plan_room,
    span_for,
    trim_span,
)


class Scheduler:
    """Decides which token spans run each step and owns the KV bookkeeping."""

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, num_blocks: int,
                 clock: Callable[[], float], controller: ControllerConfig | None = None,
                 external_kv: ExternalKV | None = None,
                 block_hash_key: bytes | None = None) -> None:
        """``block_hash_key``: the secret of the keyed block hashes a fleet
        shares (``CacheConfig.block_hash_secret``); None: Python's hash,
        exact within one process (the simulator's)."""
        self.config = config
        self.clock = clock
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                 cache.watermark, external_kv, block_hash_key=block_hash_key,
                                 session_checkpoint_batches=cache.kv_session_checkpoint_batches)
        # Admitted requests loading KV from ``external_kv`` (kv_connector).
        self.loading = PendingLoads()
        self._by_priority = config.policy == "priority"
        self.waiting = make_queue(config.policy, clock, config.aging_interval,
                                  config.long_prompt_threshold)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.steps_built = 0  # schedule() calls so far: a deferred request counts them
        self.num_preemptions = 0  # every preemption, for blocks or for priority
        self.num_priority_preemptions = 0  # of those, made room for a better-priority request
        # The knobs every step reads; an adaptive controller moves them.
        self.knobs = LiveKnobs.from_config(config)
        # "auto" targets not measured by now and adaptive: null mean their fallbacks.
        controller = controller.concrete() if controller is not None else None
        adaptive = controller is not None and controller.adaptive
        shed_target = (controller.ttft_target
                       if adaptive and controller.shed_on_ttft_target else None)
        self.admission = AdmissionControl(config, self.knobs, shed_target)
        self.controller = AdaptiveController(
            controller, config, self.knobs, num_blocks, cache.block_size,
            self.admission.cost_model, request_level=config.batching != "continuous",
        ) if adaptive else None
        # The same objects, under the names the engine and tests use.
        self.departures = self.admission.departures
        self.cost_model = self.admission.cost_model
        self.overload = self.admission.overload
        self.rejections = self.admission.rejections
        self.gate: BatchGate | None = None
        self.gate_stats = GateStats()  # kept across regime changes (set_batching)
        self.step_hooks: tuple = ()
        self.set_batching(config.batching)
        self.expiries = ExpiryQueue()
        self.sessions = SessionTracker(self.kv.pool, config.session_ttl)
        self.pins = PinnedPrefixes(self.kv)  # operator-pinned prefixes (pinned_prefixes)
        self._rejected: list[Request] = []  # expired, not yet handed out by pop_rejected

    def set_batching(self, regime: str) -> None:
        """Batch under ``regime`` from the next step on (a live setting: the
        emergency switch and schedule windows change it while requests run).

        static / dynamic batching: a gate picks which waiting requests form
        the next batch, and when; the requests running when it takes over
        are its first batch, so no new one starts beside them. Continuous:
        no gate; whatever runs keeps running and others join.
        """
        config = self.config
        if regime == "continuous":
            self.gate = None
        else:
            lane = (None if config.long_batch_size is None else
                    LongLane(config.long_prompt_threshold, config.long_batch_size,
                             config.long_max_wait))
            self.gate = BatchGate(regime, self.knobs.preferred_batch_size,
                                  self.knobs.max_batch_size, self.knobs.max_wait,
                                  config.bucket_tolerance, lane)
            self.gate.members = {r.request_id for r in (*self.running, *self.loading)}
            self.gate.stats = self.gate_stats
        # Everything that acts at the start of every step besides picking
        # spans, in order. ``schedule`` runs exactly these, and fast-forward
        # (which applies decode steps without ``schedule``) refuses to run
        # while there is any: a new per-step feature joins this tuple, or it
        # does not act at all, so fast-forward cannot skip it unawares.
        self.step_hooks = tuple(hook for hook in (
            self.overload, self.controller,
            GateHook(self.gate) if self.gate is not None else None) if hook is not None)

    # -- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request.

        Raises ``ValueError`` when it can never run (duplicate id, longer
        than the pool, prompt over ``max_queue_tokens``) and
        ``RejectedError`` when admission control turns it away for now.
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not self.kv.can_ever_fit(request.num_prompt_tokens + request.max_tokens):
            raise ValueError(
                f"request {request.request_id!r} needs "
                f"{request.num_prompt_tokens + request.max_tokens} tokens of KV cache, more "
                f"than the pool holds; raise the KV cache memory or lower max_tokens")
        limit = self.config.max_queue_tokens
        if limit is not None and request.num_prompt_tokens > limit:
            raise ValueError(f"the prompt has {request.num_prompt_tokens} tokens, more than "
                             f"the queue admits (max_queue_tokens={limit})")
        now = self.clock()
        self.admission.arrivals += 1
        if request.session_id is not None and not request.resumed:
            self.admission.check_session_room(now, self.sessions.num_unfinished(request.session_id))
        if self.controller is not None:
            # Offered load, admitted or not: counting only the admitted ones
            # would hide a surge behind its own shedding.
            self.controller.observe_arrival(now, request.num_prompt_tokens + request.max_tokens,
                                            request.num_prompt_tokens)
        self.admission.next_step = self.steps_built + 1
        if not request.resumed:  # admitted once already, on the replica that died
            self.admission.check(request, now, self.waiting, self.running, self._drop_waiting)
        request.status = RequestStatus.WAITING
        if self.controller is not None:
            request.slot_limit = self.knobs.max_num_seqs
        self.requests[request.request_id] = request
        if request.resumed:
            self.waiting.prepend(request)  # first, as a preempted request
        else:
            self.waiting.add(request)
        self.sessions.add(request)
        self.expiries.add(request, self.config.queue_timeout)
        self.expiries.compact(self._is_unscheduled)
        self.departures.set_busy(now, True)

    def record_step(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        """Feed the online cost model with an executed step's size and duration."""
        self.record_steps(num_tokens, num_seqs, (seconds,), (self.clock(),))

    def record_steps(self, num_tokens: int, num_seqs: int, seconds: Sequence[float],
                     ends: Sequence[float]) -> None:
        """``record_step`` for several steps of one size that ended at ``ends``."""
        # The two windows never read each other, so each takes the steps in one go.
        self.admission.cost_model.record_many(num_tokens, num_seqs, seconds)
        self.admission.busy.record_many(ends, seconds)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) and free its blocks."""
        assert status.finished
        if self.requests.get(request.request_id) is not request:
            return
        self._remove(request, status)

    def _remove(self, request: Request, status: RequestStatus) -> None:
        now = self.clock()
        del self.requests[request.request_id]
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.LOADING:
            self.loading.remove(request)
        else:
            self.waiting.remove(request)
        # Protect before releasing, so the blocks go straight to the protected free list.
        self.sessions.finish(request, self.kv.block_tables.get(request.request_id, ()), now)
        self.pins.finished(request, status)  # a pin's prefill holds its blocks first
        request.status = status  # before the free: the KV connector reads how it ended
        self.kv.free(request)
        if self.gate is not None:
            self.gate.member_left(request)
        if self.controller is not None and status in (
                RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            tpot = None
            if request.num_output_tokens > 1:
                tpot = ((request.last_token_time - request.first_token_time)
                        / (request.num_output_tokens - 1))
                self.controller.observe_tpot(now, tpot, request.first_token_time)
            ttft = (None if request.first_token_time is None
                    else request.first_token_time - request.arrival_time)
            self.controller.observe_finish(now, now - request.arrival_time,
                                           request.num_output_tokens, ttft, tpot)
        self.departures.record(now)
        self.departures.set_busy(now, bool(self.requests))

    def pop_rejected(self) -> list[Request]:
        """Requests expired in the queue since the last call (status
        ``FINISHED_REJECTED``, ``reject_reason`` set); each is returned once."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def session_stats(self) -> SessionStats:
        """Session counters and gauges (expired protections are dropped first)."""
        self.sessions.expire(self.clock())
        return self.sessions.stats()

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    @property
    def long_prefill_cap(self) -> int | None:
        """Long-prompt prefill tokens per step while short requests want the
        budget: ``long_prefill_share`` of the live step budget; None = no cap."""
        budget = self.knobs.max_num_batched_tokens
        share_tokens = math.floor(self.config.long_prefill_share * budget)
        return None if share_tokens >= budget else max(1, share_tokens)

    @property
    def has_pending_rejections(self) -> bool:
        """Expired requests not yet handed out by ``pop_rejected``."""
        return bool(self._rejected)

    @property
    def has_unfinished(self) -> bool:
        """True while a request is queued, running or expired but not yet popped."""
        return bool(self.requests or self._rejected)

    # -- one step ---------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's spans; see the module docstring for the order."""
        now = self.clock()
        self.steps_built += 1
        self._expire_waiting(now)
        self.sessions.expire(now)
        for hook in self.step_hooks:
            hook.before_step(now, self)
        output = SchedulerOutput()
        step = StepBudget(self.knobs.max_num_batched_tokens, self._long_allowance())
        self._finish_loads(now)
        self._schedule_running(output, step)
        self._schedule_waiting(output, step)
        if self.gate is not None and self.config.padding_mode != "none":
            output.pad_rows = self.gate.batch_rows  # the batch's shape at dispatch
        return output

    def _is_unscheduled(self, request: Request) -> bool:
        """Still accepted here and never scheduled: the only state that expires."""
        return (self.requests.get(request.request_id) is request
                and request.first_scheduled_time is None)

    def _expire_waiting(self, now: float) -> None:
        for request, reason in self.expiries.pop_expired(now):
            if self._is_unscheduled(request):  # else scheduled, finished or aborted since
                self._drop_waiting(request, reason)

    def _drop_waiting(self, request: Request, reason: str) -> None:
        """Reject an accepted, waiting request; it leaves through ``pop_rejected``."""
        self._remove(request, RequestStatus.FINISHED_REJECTED)
        request.reject_reason = reason
        self._rejected.append(request)
        self.admission.count(reason)

    def _long_allowance(self) -> float:
        """Long-prompt prefill tokens allowed this step.

        The rule: ``long_prefill_cap`` while some short request is waiting
        or prefilling (decodes are neither), otherwise unlimited, so long
        prompts never starve when no short request wants the budget.
        """
        if self.long_prefill_cap is None:
            return math.inf
        if self.waiting.num_short:
            return self.long_prefill_cap
        is_long = self.waiting.is_long
        for request in self.running:  # every step, every request: kept lean
            tokens = request.token_ids
            if (len(tokens) - request.num_computed_tokens == 1  # is_decoding, inlined
                    and len(tokens) > len(request.prompt_token_ids)):
                continue
            if not is_long(request):
                return self.long_prefill_cap
        return math.inf

    def _is_capped(self, request: Request) -> bool:
        """Whether the request's next tokens count against the long allowance."""
        return not is_decoding(request) and self.waiting.is_long(request)

    def running_order(self) -> list[Request]:
        """The order a step visits running requests in: as they run, or
        under ``policy: priority`` by (priority, arrival)."""
        order = list(self.running)
        if self._by_priority:
            order.sort(key=lambda r: (r.priority, r.arrival_time))
        return order

    def _schedule_running(self, output: SchedulerOutput, step: StepBudget) -> None:
        running = RequestStatus.RUNNING
        is_long, try_grow, spans = self.waiting.is_long, self.kv.try_grow, output.spans
        tables, block_size, granted = self.kv.block_tables, self.kv.block_size, step.granted
        for request in self.running_order():  # every request, every step: kept lean
            if step.tokens <= 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this loop
            tokens, computed = request.token_ids, request.num_computed_tokens
            pending = len(tokens) - computed
            assert pending > 0, "a running request always has a token to compute"
            if (pending == 1 and len(tokens) > len(request.prompt_token_ids)
                    and computed < len(tables[request.request_id]) * block_size):
                # A decode whose block has room (is_decoding and try_grow,
                # inlined: the common case at a thousand sequences): one
                # token, never capped, step.tokens > 0 leaves room for it.
                spans.append(ScheduledSpan(request, computed, 1, True))
                step.tokens -= 1  # step.grant, inlined
                granted[request] = (1, 0)
                continue
            if pending == 1 and len(tokens) > len(request.prompt_token_ids):
                capped, num_tokens = False, 1  # a decode that needs a block
            else:
                capped = is_long(request)  # _is_capped, for a prefill
                num_tokens = min(pending, step.limit(capped))
                if num_tokens <= 0:
                    continue  # the long allowance is spent; decodes and short ones still run
            while not try_grow(request, num_tokens):
                victim = self._pick_victim()
                self._preempt(victim, output, step)
                if victim is request:
                    break
            if request.status is not running:
                continue
            # span_for: the request's computed tokens are as read above (a
            # preemption of another request leaves them, its own ends here).
            spans.append(ScheduledSpan(request, computed, num_tokens,
                                       sample=computed + num_tokens == len(tokens)))
            step.grant(request, num_tokens, capped)

    def _schedule_waiting(self, output: SchedulerOutput, step: StepBudget) -> None:
        """Admit waiting requests in queue order while tokens, slots and blocks last.

        Requests waiting on an earlier turn of their session, and long ones
        once the long allowance is spent, are passed over, so they never
        hold up requests behind them; any other request that does not fit
        stops admission (head of line keeps the FCFS / priority order fair).
        Under ``policy: priority`` that request first makes room at the
        expense of running requests of strictly worse base priority: their
        spans are shortened for tokens, they are preempted for slots and
        blocks (``plan_room``); it is then admitted in this same step.
        """
        long_blocked = False  # a long head could not make room for the long allowance
        while self.waiting:
            include_long = step.long_left > 0 or (self._by_priority and not long_blocked)
            request = self.waiting.first_eligible(self._may_start, include_long)
            if request is None or request.priority >= step.admit_below:
                return
            capped = self._is_capped(request)
            limit = step.limit(capped)
            # A limit cut since its admission does not apply to it (slot_limit).
            slots = max(self.knobs.max_num_seqs, request.slot_limit or 0)
            if (limit > 0 and len(self.running) + len(self.loading) < slots
                    and self.kv.try_admit(request, limit)):
                self._admit(request, limit, capped, output, step)
                continue
            plan = self._plan_room(request, capped, step) if self._by_priority else None
            if plan is None:
                if capped and step.long_left <= 0:
                    long_blocked = True  # pass over the long lanes from now on
                    continue
                return
            for trimmed, num_tokens in plan.trims:
                self._trim_span(trimmed, num_tokens, output, step)
            for victim in plan.victims:
                self._preempt(victim, output, step, by_priority=True)
            if not self.kv.try_admit(request, plan.num_tokens):
                return  # plan_room mirrors try_admit exactly; kept as a safe stop
            self._admit(request, plan.num_tokens, capped, output, step)

    def _plan_room(self, request: Request, capped: bool, step: StepBudget) -> RoomPlan | None:
        # Requests admitted this step won the queue order: never displace them for a later head.
        candidates = [r for r in self.running
                      if r.priority > request.priority and r not in step.admitted]
        # Preemption order as for blocks: worst priority, then latest arrival.
        candidates.sort(key=lambda r: (r.priority, r.arrival_time), reverse=True)
        return plan_room(request, capped, candidates, step, self.kv,
                         self.knobs.max_num_seqs - len(self.running) - len(self.loading))

    def _admit(self, request: Request, limit: int, capped: bool, output: SchedulerOutput,
               step: StepBudget) -> None:
        """Start ``request`` after ``kv.try_admit(request, limit)`` succeeded:
        running from this step, or loading first if the KV manager began an
        external load (it runs from the first step after the load)."""
        self.waiting.remove(request)
        load = self.kv.take_load(request)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
            request.num_loaded_tokens = load[0] if load else 0
            request.num_cached_tokens = request.num_computed_tokens + request.num_loaded_tokens
            self.sessions.first_admitted(request)
            self.pins.first_admitted(request)
        if load is not None:
            request.status = RequestStatus.LOADING
            self.loading.begin(request, self.clock() + load[1], load[0])
            return
        num_tokens = min(request.num_pending_tokens, limit)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        output.spans.append(span_for(request, num_tokens))
        step.grant(request, num_tokens, capped)
        step.admitted.add(request)

    def _finish_loads(self, now: float) -> None:
        """Requests whose external load is done join the running ones, the
        loaded tokens computed (and cached here from now on)."""
        for request, num_tokens in self.loading.pop_done(now):
            # A live load may bring fewer tokens than it began with: the rest are computed.
            shortfall = request.num_loaded_tokens - num_tokens if request.num_loaded_tokens \
                else 0
            if shortfall > 0:
                request.num_loaded_tokens -= shortfall
                request.num_cached_tokens -= shortfall
                self.kv.external_hits -= shortfall
            request.num_computed_tokens += num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.kv.cache_computed_blocks(request)

    def _not_session_blocked(self, request: Request) -> bool:
        return not self.sessions.is_blocked(request)

    def _may_start(self, request: Request) -> bool:
        """Not deferred past this step by admission, not waiting on an earlier
        turn of its session and, under static or dynamic batching, a member
        of the batch in flight (nobody joins it)."""
        return (self.steps_built >= request.earliest_step and self._not_session_blocked(request)
                and (self.gate is None or self.gate.may_start(request)))

    def _pick_victim(self) -> Request:
        # Lowest priority (largest value) first, then the latest arrival.
        return max(self.running, key=lambda r: (r.priority, r.arrival_time))

    def _preempt(self, request: Request, output: SchedulerOutput, step: StepBudget,
                 by_priority: bool = False) -> None:
        """Preempt by recompute: drop the KV, keep the tokens, requeue at the
        front of its lane.

        Its full blocks stay in the prefix cache, so re-admission usually
        revives most of them instead of recomputing. ``by_priority``: made
        room for a waiting request of better priority.
        """
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        if by_priority:
            self.num_priority_preemptions += 1
        # Its KV is gone: a span already scheduled for it this step must not run.
        output.spans = [s for s in output.spans if s.request is not request]
        step.refund(request)
        output.preempted.append(request)
        self.waiting.prepend(request)
        # After a preemption blocks are short: admitting work that could not
        # have preempted the victim would only thrash (FCFS: admit nothing).
        if self._by_priority:
            step.admit_below = min(step.admit_below, request.priority)
        else:
            step.admit_below = -math.inf

    def _trim_span(self, request: Request, num_tokens: int, output: SchedulerOutput,
                   step: StepBudget) -> None:
        """Take ``num_tokens`` off the request's span this step; it stays running."""
        trim_span(output, step, request, num_tokens)
        # Work that could not have displaced it must not get its tokens.
        step.admit_below = min(step.admit_below, request.priority)

    # -- after the step ran -----------------------------------------------------

    def commit(self, output: SchedulerOutput, sampled: Iterable[tuple[Request, int]]) -> None:
        """Record that ``output`` ran: advance computed counts, append sampled
        tokens and register newly full blocks in the prefix cache."""
        self.commit_spans(output)
        now = self.clock()
        running = RequestStatus.RUNNING
        for request, token_id in sampled:
            if request.status is running:
                self.append_token(request, token_id, now)

    def commit_spans(self, output: SchedulerOutput) -> None:
        """``commit``'s first half: the spans' tokens are computed."""
        running, cache_blocks = RequestStatus.RUNNING, self.kv.cache_computed_blocks
        block_size = self.kv.block_size
        for span in output.spans:  # every span of every step: kept lean
            request = span.request
            if request.status is not running:
                continue  # aborted while the step ran
            start = span.start
            end = request.num_computed_tokens = start + span.num_tokens
            # Blocks are registered up to start // block_size already (each
            # commit registers all full ones): only a span that fills one
            # has any to add.
            if end // block_size > start // block_size:
                cache_blocks(request)

    def append_token(self, request: Request, token_id: int, now: float) -> None:
        """``commit``'s second half for one running request: it sampled
        ``token_id`` at ``now`` (the engine core inlines the common case)."""
        request.token_ids.append(token_id)
        if request.first_token_time is None:
            self.first_token(request, now)
        request.last_token_time = now

    def first_token(self, request: Request, now: float) -> None:
        """The request's first output token came at ``now``."""
        request.first_token_time = now
        self.admission.observe_first_token(request, now)
        if self.controller is not None:
            self.controller.observe_ttft(now, now - request.arrival_time)

    def check_invariants(self) -> None:
        """Bookkeeping consistency, for tests."""
        check_invariants(self)
