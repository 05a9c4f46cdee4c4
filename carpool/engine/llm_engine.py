"""The synchronous live engine: add requests, step, abort.

One ``step()`` drives the engine core (``carpool.engine.core``):
``EngineCore.begin`` (schedule, pure Python) -> the executor runs the batch
(``TorchExecutor``) -> ``EngineCore.complete``, whose stop check is this
engine's: record the sampled token (logprobs, detokenized text) and stop
at EOS, a stop token or a stop string; else the core finishes by length.
Not thread safe: ``AsyncEngine`` drives it from a single background thread.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from operator import attrgetter

from carpool.config import CacheConfig, EngineConfig
from carpool.engine.core import EngineCore
from carpool.engine.detokenizer import IncrementalDetokenizer, token_pieces
from carpool.engine.front import check_prompt
from carpool.engine.output_stage import OutputStage, RequestState
from carpool.engine.outputs import RequestOutput
from carpool.engine.pins import PIN_PARAMS, PIN_PRIORITY
from carpool.engine.stats import (
    LONG_PROMPT_TOKENS,
    EngineCounters,
    EngineStats,
    StepOffer,
    engine_stats,
)
from carpool.engine.step_log import StepLog, StepPhases
from carpool.engine.wire import EngineInfo, Handoff
from carpool.executor.base import BatchItem, Executor, Padding, resolve_overlap, step_padding
from carpool.executor.shapes import StepShape
from carpool.host_cpu import HostCpu
from carpool.model.grammar import GrammarCompiler
from carpool.model.kernel_switch import SwitchingCpuAttention
from carpool.model.sampler import SamplingRow
from carpool.sampling_params import SamplingParams
from carpool.scheduler import Request, RequestStatus, Scheduler
from carpool.scheduler.control.live_settings import apply_live_settings
from carpool.scheduler.pinned_prefixes import PinLimits, PinSpec
from carpool.scheduler.step import ScheduledSpan

logger = logging.getLogger(__name__)

_token_id = attrgetter("token_id")  # of a SampleResult


class LLMEngine:
    """Owns tokenizer, scheduler and executor of one replica."""

    def __init__(self, config: EngineConfig, tokenizer, model_config, executor: Executor,
                 max_model_len: int, clock: Callable[[], float] = time.monotonic,
                 kv_connector=None) -> None:
        """``kv_connector``: a live KV connector (``carpool.kv_transfer.
        connector.StoreConnector``): its scheduler side is the KV manager's
        external store, its worker side the executor's ``kv_worker``; None:
        none."""
        self.config = config
        self.tokenizer = tokenizer
        self._grammars = GrammarCompiler(tokenizer, model_config.vocab_size)  # llguidance on use
        self.model_config = model_config
        self.executor = executor
        self.max_model_len = max_model_len
        self.clock = clock
        # Keyed block hashes: equal across processes given one secret (a fleet's).
        self.scheduler = Scheduler(config.scheduler, config.cache, executor.num_blocks, clock,
                                   config.controller,
                                   block_hash_key=config.cache.block_hash_secret(),
                                   external_kv=kv_connector.scheduler if kv_connector else None)
        if self.scheduler.overload is not None:  # the emergency switch's CPU breaker
            self.scheduler.overload.cpu_source = HostCpu().utilization
        self.kv_connector = kv_connector
        executor.kv_worker = kv_connector.worker if kv_connector is not None else None
        # The step's rules, shared with the simulator (carpool.engine.core).
        self.core = EngineCore(self.scheduler, max_model_len)
        self.counters = EngineCounters()
        # Recent steps' shapes and wall times (GET /carpool/steps).
        self.step_log = StepLog(row_bucket=config.model.row_bucket)
        self.last_phases: StepPhases | None = None  # the latest step that ran a batch
        self._seeds = random.Random(config.model.seed)
        # Token-level stops for the commit; text and outputs after it.
        self.output_stage = OutputStage(
            set(model_config.eos_token_ids) | set(tokenizer.eos_token_ids), self.counters, clock)
        # The detokenizer's per-token texts (token_pieces), built at the first request.
        self._pieces: tuple[str | None, ...] | None = None
        self._pieces_built = False
        # Overlap: the previous step's outputs are made while the device
        # computes this one (see _execute).
        self.overlap = resolve_overlap(config.model.overlap, executor)
        # The committed step whose outputs are not made yet (overlap only).
        self._pending: list[Request] | None = None
        self._next_id = 0
        self._schedule = None  # a profile's time-of-day windows, see follow_schedule
        self.slo = None  # the ServingSLO being served (carpool serve), for stats

    def renewed(self, config: EngineConfig | None = None) -> "LLMEngine":
        """A fresh engine (scheduler, estimators, counters) on this one's
        model and executor, with ``config`` (default: this one's). The
        executor's KV tensors are reused as they are: a new scheduler owns
        every block again, so nothing of this engine's requests survives."""
        engine = LLMEngine(config or self.config, self.tokenizer, self.model_config,
                           self.executor, self.max_model_len, self.clock, self.kv_connector)
        engine._pieces, engine._pieces_built = self._pieces, self._pieces_built
        engine._grammars = self._grammars
        return engine

    @classmethod
    def from_config(cls, config: EngineConfig, kernels_in_background: bool = False,
                    kv_store=None, start_followers=None) -> "LLMEngine":
        """Load the model named in ``config`` (the default model if none).

        A GGUF file is converted to the dtype the model will run in; the
        settings' ``tokenizer`` and ``chat_template`` replace the model's own.
        ``kernels_in_background``: on a CPU whose C++ kernels are not built
        yet, start at once on the portable path while they compile, and
        switch to them when built (``carpool.model.cpu_kernels``): what a
        server wants; benchmarks and tests keep the default (one path from
        the first step). ``kv_store``: a ``KVStore`` object for the KV
        connector instead of the one ``config.cache.kv_store`` names (a
        backend the engine layer cannot import, e.g. Ray's object store).
        ``start_followers``: how a sliced replica's other ranks start
        (``carpool.executor.tensor_parallel.FollowerStarter``; None: as
        processes of this machine; Ray Serve: actors of the replica's
        placement group).
        """
        from carpool.executor.loading import build_executor, load_served_model

        config.validate()
        settings = config.model
        loaded, max_len = load_served_model(settings)
        executor = build_executor(config, loaded, max_len, kernels_in_background,
                                  start_followers)
        loaded.weights.clear()
        connector = None
        if config.cache.kv_store is not None or kv_store is not None:
            from carpool.kv_transfer.connector import store_connector

            connector = store_connector(config.cache, executor, loaded.config, kv_store)
        return cls(config, loaded.tokenizer, loaded.config, executor, max_len,
                   kv_connector=connector)

    # -- requests ----------------------------------------------------------------

    def new_request_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None, session_id: str | None = None,
                    deadline: float | None = None, max_wait: float | None = None,
                    cache_salt: str | None = None, handoff: Handoff | None = None) -> str:
        """Queue a request; raise ``ValueError`` with a clear message on bad input.

        Raises ``carpool.scheduler.RejectedError`` (reason, retry_after) when
        admission control turns it away. ``deadline`` is an engine-clock time
        by which the request must have started; past it, it is rejected.
        Requests sharing a ``session_id`` run in order and keep their prefix
        cached for the session TTL. ``max_wait`` caps, for this request, the
        seconds request-level (static / dynamic) batching may hold it.
        Requests reuse each other's cached prefix only with an equal
        ``cache_salt`` (the server salts by tenant). ``handoff``: its part
        of a request split between a prefill and a decode replica
        (``wire.Handoff``; needs a KV connector).
        """
        params = params or SamplingParams()  # checked when made, and immutable
        token_ids = (self.tokenizer.encode(prompt) if isinstance(prompt, str)
                     else [int(t) for t in prompt])
        self.check_prompt(token_ids, params)
        request_id = request_id or self.new_request_id()
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        if not self._pieces_built:
            self._pieces, self._pieces_built = token_pieces(self.tokenizer), True
        detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params, self._pieces)
        state = RequestState(params, seed, detokenizer,
                             logprobs=[] if params.logprobs is not None else None)
        if params.structured is not None:
            state.constraint = self.grammars().constraint(params.structured)
        request = Request(request_id, token_ids, params.max_tokens,
                          self.clock() if arrival_time is None else arrival_time, priority,
                          payload=state, session_id=session_id, deadline=deadline,
                          max_wait=max_wait, cache_salt=cache_salt,
                          stop_token_ids=self.output_stage.stop_ids(params))
        if handoff is not None:
            self._take_handoff(request, handoff)
        self.scheduler.add_request(request)
        if state.logprobs is not None:
            self.output_stage.num_logprob_requests += 1
        self.counters.requests_added += 1
        self.counters.long_requests_added += len(token_ids) > LONG_PROMPT_TOKENS
        return request_id

    def pin_prefix(self, spec: PinSpec, request_id: str | None = None,
                   arrival_time: float | None = None) -> str:
        """Queue the prefill of a pinned prefix: ``spec``'s tokens as the
        prompt in its namespace, one greedy token, best priority; when it
        ends the scheduler holds the prefix's blocks until ``unpin_prefix``
        (``carpool.scheduler.pinned_prefixes``). Pinning a held prefix
        again costs that one-token prefill and holds nothing new. Raises as
        ``add_request``; returns the prefill's request id."""
        request_id = self.add_request(list(spec.token_ids), PIN_PARAMS, request_id,
                                      priority=PIN_PRIORITY, arrival_time=arrival_time,
                                      cache_salt=spec.cache_salt)
        self.scheduler.pins.expect(request_id, spec)
        return request_id

    def unpin_prefix(self, pin_id: str) -> bool:
        """Let a pinned prefix's blocks go (cached still, evictable again)."""
        return self.scheduler.pins.unpin(pin_id)

    def _take_handoff(self, request: Request, handoff: Handoff) -> None:
        """Set up a P/D part: a prefill's prompt blocks are exported; a
        decode part starts after the prefill's output tokens, as a request
        preempted there would (nothing computed yet, its prompt blocks to
        load), with their text and logprobs already delivered. A resumed
        request (its replica died mid-stream) is a decode part whose prompt
        and delivered tokens are computed here, as a preempted one's are."""
        if self.kv_connector is None and handoff.role != "resume":
            raise ValueError("a P/D handoff needs a KV store (--kv-store)")
        state: RequestState = request.payload
        state.handoff = handoff.role
        request.handoff_key = handoff.parts_key
        if handoff.role == "prefill":
            request.kv_export = True
            return
        outputs = list(handoff.output_token_ids)
        if len(outputs) >= request.max_tokens:
            raise ValueError(f"a {handoff.role} handoff must have tokens left to generate")
        request.token_ids.extend(outputs)
        request.kv_handoff = handoff.role == "decode"  # its blocks come from the prefill part
        request.resumed = handoff.role == "resume"
        state.sent_tokens = state.num_detokenized = len(outputs)
        for token_id in outputs:  # the prefill replica delivered this text
            state.text_parts.append(state.detokenizer.add_token(token_id)[0])
            if state.constraint is not None and not state.constraint.accept(token_id):
                raise ValueError("the handed-off output does not match the request's "
                                 "structured output")
        if state.logprobs is not None:
            state.logprobs.extend(handoff.logprobs or ())
            state.sent_logprobs = len(state.logprobs)

    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler for this model (thread-safe: fronts
        compile a new spec off the engine thread first, ``compile_later``)."""
        return self._grammars

    def check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        """``check_prompt`` against this engine's context and vocabulary."""
        check_prompt(token_ids, params, self.max_model_len, self.model_config.vocab_size)

    def info(self) -> EngineInfo:
        """What the API side needs to know of this engine (``EngineInfo``)."""
        from carpool.engine.step_log import step_facts

        # vLLM's cache_config_info labels: every CacheConfig field as a string
        # (block_size, enable_prefix_caching are vLLM's names too), the
        # blocks the pool got and the KV dtype.
        cache = {k: str(v) for k, v in dataclasses.asdict(self.config.cache).items()
                 if k not in CacheConfig.SECRET_FIELDS}  # never a secret on /metrics
        cache["num_gpu_blocks"] = str(self.executor.num_blocks)  # vLLM's name, any device
        cache["cache_dtype"] = str(self.executor.dtype).removeprefix("torch.")
        # What one token's KV takes over every layer (MLA: its latent rows).
        cache["kv_bytes_per_token"] = str(self.model_config.kv_bytes_per_token(
            self.executor.dtype.itemsize))
        settings = self.config.cache
        pin_limits = PinLimits.of(settings.block_size, self.executor.num_blocks,
                                  settings.pinned_prefix_share, settings.max_pinned_prefixes,
                                  self.max_model_len, settings.enable_prefix_caching,
                                  self.scheduler.kv.watermark_blocks)
        return EngineInfo(self.max_model_len, self.model_config.vocab_size,
                          self.tokenizer.describe(), cache, step_facts(self),
                          self.executor.num_blocks,
                          self.slo.describe() if self.slo is not None else None,
                          (self.model_config.num_layers, self.model_config.cache_heads,
                           self.model_config.cache_dim, self.executor.dtype.itemsize,
                           self.model_config.cache_tensors),
                          pin_limits)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort now (between steps): its blocks return to the pool at once."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        if self.kv_connector is not None:  # its orders (a drop, a checkpoint) go now:
            self.executor.kv_worker.start(self.kv_connector.scheduler.take_meta())  # idle next
        return self.output_stage.final(request, "abort")

    def close(self) -> None:
        """Stop what the engine runs besides its steps: the KV connector's I/O
        thread, a tensor-parallel replica's followers (idempotent). Its front
        calls this when it shuts down."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.executor.close()

    @property
    def has_unfinished(self) -> bool:
        """Requests in the scheduler, or a step's outputs not handed out yet."""
        return self.scheduler.has_unfinished or bool(self._pending)

    @property
    def kernels_pending(self) -> bool:
        """Whether the engine runs the portable path while its CPU kernels
        compile (``from_config(kernels_in_background=True)``), until the step
        that switches to them: step times now are not the engine's own."""
        attention = getattr(self.executor, "attention", None)
        return isinstance(attention, SwitchingCpuAttention) and not attention.ops.active

    # -- one step ----------------------------------------------------------------

    def follow_schedule(self, schedule, wall_clock: Callable[[], datetime] = datetime.now,
                        ) -> None:
        """Apply a profile's time-of-day windows (``ProfileSchedule``) as they
        open and close: checked before each step, applied at each boundary."""
        self._schedule = schedule
        self._wall_clock = wall_clock
        self._schedule_due: datetime | None = None  # None: apply at the next step

    def _follow_schedule(self) -> None:
        now = self._wall_clock()
        if self._schedule_due is not None and now < self._schedule_due:
            return
        changed = apply_live_settings(self.scheduler, self._schedule.knobs_at(now))
        if changed:
            window = self._schedule.active(now)
            logger.info("schedule window %s: %s", window.name if window else "(base)",
                        ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
        boundary = self._schedule.next_change(now)
        due = datetime.combine(now.date(), boundary, now.tzinfo) if boundary else None
        self._schedule_due = due + timedelta(days=1) if due and due <= now else due
        if self._schedule_due is None:
            self._schedule = None

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return outputs of requests that progressed
        (with overlap: those of the step before, see ``_execute``). A step
        that ran a batch leaves its phases' seconds in ``last_phases``."""
        clock = time.perf_counter
        begun = clock()
        if self._schedule is not None:
            self._follow_schedule()
        connector, worker = self.kv_connector, self.executor.kv_worker
        if connector is not None:
            self._finish_loads(connector.scheduler, worker)  # fetched meanwhile: join this step
        schedule, expired = self.core.begin()
        if connector is not None:  # this step's orders: loads begun, blocks streamed
            worker.start(connector.scheduler.take_meta())
        outputs = [self.output_stage.final(r, "rejected") for r in expired]
        if schedule.is_empty:
            if connector is not None and self.scheduler.loading and not self._pending:
                worker.wait(0.005)  # only loads in flight: no busy loop
            if self._pending:  # nothing runs next: hand out the last step's outputs
                outputs += self._make_outputs(self._pending)
                self._pending = None
            return outputs
        offered = StepOffer.of(self.scheduler)  # the live budget and slots it ran under
        started = clock()
        items = self._batch_items(schedule.spans)
        padding = step_padding(schedule.pad_rows, self.config.scheduler.padding_mode)
        built = clock()
        streaming = connector is not None and worker.begin_forward()
        try:
            results = self._execute(items, padding, outputs)
        finally:
            if streaming:  # P/D prefills' blocks went out layer by layer meanwhile
                worker.end_forward()
        executed = clock()
        elapsed = executed - started
        requests = [span.request for span in schedule.spans if span.sample]
        stage = self.output_stage
        if stage.num_logprob_requests:
            stage.record_logprobs(requests, results)
        if len(results) != len(requests):
            raise RuntimeError(f"the executor returned {len(results)} samples for "
                               f"{len(requests)} sampling items")
        progressed, _ = self.core.complete(
            schedule, list(zip(requests, map(_token_id, results))), elapsed,
            on_stop=stage.on_stop_token)
        if connector is not None:  # the prompt blocks just computed: copied out now
            worker.start(connector.scheduler.take_meta())
        committed = clock()
        if self.overlap:
            self._pending = progressed  # their outputs are made while the next step runs
        else:
            outputs += self._make_outputs(progressed)
        output_end = clock()
        self._count_step(schedule, items, padding, len(progressed), elapsed, offered, begun)
        self.last_phases = StepPhases(started - begun, built - started, executed - built,
                                      committed - executed, output_end - committed,
                                      clock() - output_end)
        return outputs

    def _count_step(self, schedule, items: list[BatchItem], padding: Padding | None,  # noqa: ANN001
                    generated: int, elapsed: float, offered: StepOffer, begun: float) -> None:
        """A step that ran a batch, in the counters and the step log."""
        counters = self.counters
        counters.steps += 1
        counters.generation_tokens += generated  # the stop check saw each of them
        counters.busy_seconds += elapsed
        counters.count_offer(offered)
        if padding is None:  # a padded step costs its rectangle, not its ragged shape
            shape = StepShape.of(items)
            counters.computed_tokens += shape.prefill_tokens + shape.decode_seqs
            counters.slot_tokens += shape.prefill_tokens + shape.decode_seqs  # ragged: no padding
            self.step_log.record(shape, time.perf_counter() - begun, begun)
        else:
            counters.computed_tokens += schedule.num_tokens
            counters.slot_tokens += schedule.num_slots  # padding included

    def _finish_loads(self, connector, worker) -> None:  # noqa: ANN001 - the two sides
        """Fetched loads join the running requests; a left request's are dropped."""
        kept = []
        for load_id, request, num_tokens in connector.resolve(worker.fetched()):
            if (request.status is RequestStatus.LOADING
                    and self.scheduler.requests.get(request.request_id) is request):
                kept.append(load_id)
                self.scheduler.loading.complete(request, num_tokens)
        worker.write(kept)

    def _execute(self, items: list[BatchItem], padding, outputs: list[RequestOutput]) -> list:
        """Run the batch; with overlap, launch it and make the previous
        step's outputs (into ``outputs``) before waiting for it: a device
        computes meanwhile. The requests a stop string ended there are
        finished once the batch is done (it computed one token too many for
        them; the commit drops it)."""
        if not self.overlap:
            return self.executor.execute(items, padding)
        wait = self.executor.launch(items, padding)
        pending, self._pending = self._pending, None
        made, stopped = self.output_stage.outputs(pending) if pending else ([], [])
        try:
            results = wait()
        finally:
            # After the batch: the executor reads its requests' block tables while it runs.
            for request in stopped:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        outputs += made
        return results

    def _make_outputs(self, progressed: list[Request]) -> list[RequestOutput]:
        """The output stage for committed requests, finishing those a stop string ended."""
        outputs, stopped = self.output_stage.outputs(progressed)
        for request in stopped:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        return outputs

    def stats(self) -> EngineStats:
        """A snapshot for metrics; call it from the thread that steps the engine."""
        store = self.kv_connector.metrics() if self.kv_connector is not None else None
        stats = engine_stats(self.scheduler, self.counters, self.clock(),
                             self.config.scheduler, self.slo, store)
        load = getattr(self.executor, "expert_load", None)
        return stats if load is None else dataclasses.replace(stats, **load.stats_fields())

    def _batch_items(self, spans: Sequence[ScheduledSpan]) -> list[BatchItem]:
        """The executor's items for a step's spans, as ``batch_items`` makes
        them, but each request keeps one ``BatchItem`` and one
        ``SamplingRow`` for its life, updated in place: per step a decode
        changes only its span, block table and row step. Safe because an
        executor reads items only during ``execute`` (the interface's rule)."""
        tables = self.scheduler.kv.block_tables
        items = []
        for span in spans:  # every request, every step: kept lean
            request = span.request
            state: RequestState = request.payload
            item = state.item
            if item is None:
                item = state.item = BatchItem(request.request_id, request.token_ids, span.start,
                                              span.num_tokens, tables[request.request_id])
            else:
                item.start, item.num_tokens = span.start, span.num_tokens
                item.block_table = tables[request.request_id]  # new after a preemption
            row = state.row
            if not span.sample:
                item.sampling = None
            elif row is None or row.penalized:
                item.sampling = self._sampling_row(request, state)
            else:  # _sampling_row's common case, inlined
                row.step = len(request.token_ids) - len(request.prompt_token_ids)
                item.sampling = row
            items.append(item)
        return items

    @staticmethod
    def _sampling_row(request: Request, state: RequestState) -> SamplingRow:
        """The request's row, at the step of its next output token."""
        prompt = request.prompt_token_ids
        step = len(request.token_ids) - len(prompt)
        row = state.row
        if row is None:
            row = state.row = SamplingRow(state.params, state.seed, step, prompt,
                                          constraint=state.constraint)
        row.step = step
        if row.penalized:  # only penalties read the output tokens: copy them only then
            row.output_token_ids = request.token_ids[len(prompt):]
        return row
