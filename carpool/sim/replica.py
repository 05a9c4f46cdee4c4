"""One simulated replica: carpool's own ``Scheduler`` with a cost-model
executor (``carpool.sim.executor.CostModelExecutor``) in place of the model.

The replica drives the engine core ``LLMEngine.step`` drives
(``carpool.engine.core.EngineCore``), and hands each step to its
executor through the same ``Executor`` interface, in virtual time: requests that
arrived while a step ran are added at the next step boundary, a step is
begun at a boundary and completed when its cost-model time is up, and a
request finishes when it has generated its output length (every request
runs with ignore_eos, as in the benchmark: no stop check). Runs of
identical decode steps are applied in one go (``EngineCore.fast_forward``)
with the same result as stepping through them.
"""
from __future__ import annotations

import enum
import math
from typing import Protocol

from carpool.config import EngineConfig
from carpool.engine.core import EngineCore
from carpool.executor.base import batch_items, step_padding
from carpool.scheduler import RejectedError, Request, Scheduler
from carpool.scheduler.fast_forward import horizon
from carpool.scheduler.kv_connector import ExternalKV
from carpool.scheduler.step import SchedulerOutput
from carpool.sim.costs import CostModel
from carpool.sim.executor import SAMPLED_TOKEN, CostModelExecutor
from carpool.workload.stats import FAILED, OK, REJECTED, RequestRecord
from carpool.workload.traces import TraceRequest

# An engine with requests it cannot schedule yet (a request-level batch
# waiting to fill) loops without sleeping; the simulator looks again this
# much later.
POLL_S = 0.001
_FIRST_RUN, _MAX_RUN = 16, 4096  # steps planned per fast-forward run (doubling)


class VirtualClock:
    """The simulation's time in seconds; the schedulers read it by calling it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def set(self, now: float) -> None:
        self.now = now


def prompt_token_ids(index: int, length: int, hash_ids: tuple[int, ...] = (),
                     hash_block: int = 1) -> list[int]:
    """Token ids that give the prefix cache what the real prompts would:
    blocks of ``hash_block`` tokens equal wherever (Mooncake) hash ids are
    equal, the rest unique to the request. Token ids never reach a model."""
    tokens: list[int] = []
    for hash_id in hash_ids:
        if len(tokens) >= length:
            break
        tokens += [hash_id + 1] + [0] * (hash_block - 1)  # ids >= 1: shared blocks
    if len(tokens) < length:
        tokens += [-(index + 1)] + [0] * (length - len(tokens) - 1)  # ids < 0: this request only
    return tokens[:length]


class State(enum.Enum):
    IDLE = "idle"  # nothing to do; an arrival makes a boundary at once
    STEP = "step"  # one step runs until next_time
    RUN = "run"  # a planned run of decode steps ends at next_time (cut short by an arrival)
    BOUNDARY = "boundary"  # the next step boundary is at next_time (a cut run, an arrival)
    POLL = "poll"  # work it cannot schedule yet; looks again at next_time


class ReplicaListener(Protocol):
    """Told what happens to the requests a replica was sent (a fleet router
    counts its in-flight work from these), by the plan index of each."""

    def first_token(self, index: int, now: float, cached_tokens: int | None = None) -> None:
        """``cached_tokens``: the prompt tokens its replica found cached."""

    def finished(self, index: int, now: float, ok: bool, queued_s: float = 0.0) -> None: ...


class SimReplica:
    """A scheduler, its inbox and its in-flight step, in virtual time.

    ``next_time`` is when the replica next needs the simulation's attention
    (None while idle); ``outstanding`` counts requests routed here and not
    yet finished or rejected. ``listener`` (a ``ReplicaListener``), when
    set, hears of every first token and every request that leaves.
    """

    def __init__(self, index: int, config: EngineConfig, num_blocks: int, cost: CostModel,
                 clock: VirtualClock, *, max_model_len: int | None = None,
                 fast_forward: bool = True, token_times: bool = False,
                 hash_block: int = 1, external_kv: ExternalKV | None = None,
                 role: str = "mixed") -> None:
        self.index = index
        self.role = role  # "mixed", "prefill" or "decode" (carpool.cluster.Role's values)
        self.executor = CostModelExecutor(cost, num_blocks, config.cache.block_size)
        self.clock = clock
        self.scheduler = Scheduler(config.scheduler, config.cache, self.executor.num_blocks,
                                   clock, config.controller, external_kv)
        self.padding_mode = config.scheduler.padding_mode
        # No context limit here: a request longer than max_model_len fails on arrival.
        self.core = EngineCore(self.scheduler)
        self.max_model_len = max_model_len
        self.fast_forward = fast_forward
        self.token_times = token_times
        self.hash_block = hash_block
        self.state = State.IDLE
        self.next_time: float | None = None
        self.outstanding = 0
        self.steps = 0  # scheduler steps simulated, fast-forwarded ones included
        self.fast_forwarded_steps = 0
        self.busy_seconds = 0.0  # virtual seconds spent in steps
        # Prompt tokens of the requests that ran here, and of those the ones
        # found cached (or loaded) on first admission: a hit rate that counts
        # each prompt once (a preempted request's re-admission hits itself).
        self.prompt_tokens = self.cached_tokens = self.loaded_tokens = 0
        # (request, its record, whether it is a P/D handoff, output tokens
        # it resumes after: its replica died after streaming them)
        self._inbox: list[tuple[TraceRequest, RequestRecord, bool, int]] = []
        # Request id -> (its record, what was routed here) while it is here.
        self._records: dict[str, RequestRecord] = {}
        self._items: dict[str, TraceRequest] = {}
        self.failed_at: float | None = None
        self.created_at = clock.now
        self._output: SchedulerOutput | None = None
        self._seconds = 0.0
        self._last_end = 0.0  # when the last step ended: a step later than it woke the engine
        self._sampled: list[tuple[Request, int]] = []  # what the step in flight sampled
        self._run: tuple[list[float], list[float]] = ([], [])  # (seconds, ends) of a RUN
        self._run_shape = (0, 0)  # its sequences and its first step's context
        self._run_steps = _FIRST_RUN
        self.listener: ReplicaListener | None = None

    @property
    def num_waiting(self) -> int:
        """Requests here that no step has started yet (inbox and queue)."""
        return len(self._inbox) + len(self.scheduler.waiting)

    # -- events ----------------------------------------------------------------

    def receive(self, request: TraceRequest, record: RequestRecord, now: float,
                handoff: bool = False, resumed: int = 0) -> bool:
        """A request routed here at ``now`` (``handoff``: the decode leg of a
        remote prefill, whose KV comes over the connector; ``resumed``: the
        output tokens its client got from a replica that died, which it goes
        on after, its prompt and those computed here); it joins at the next
        step boundary. Returns whether ``next_time`` changed."""
        if self.failed_at is not None:
            raise RuntimeError(f"replica {self.index} failed at {self.failed_at}: routed to")
        record.sent = now
        self._inbox.append((request, record, handoff, resumed))
        self.outstanding += 1
        if self.state in (State.IDLE, State.POLL):
            # A boundary now, after every arrival of this same instant (the
            # event loop delivers arrivals first): a burst's requests share
            # the first step, as the live engine's inbox holds them all.
            self._set(State.BOUNDARY, now)
            return True
        if self.state == State.RUN:
            return self._cut_run(now)
        return False

    def advance(self, now: float) -> None:
        """``next_time`` has come: finish what was in flight, start what is next."""
        if self.failed_at is not None:
            return  # a dead replica's last wake-up, left in the event queue
        self.clock.set(now)  # a step's tokens are committed at its end
        if self.state == State.STEP:
            self._commit(now)
        elif self.state == State.RUN:
            self._apply_run(len(self._run[0]))
            self._run_steps = min(_MAX_RUN, 2 * self._run_steps)
        self._boundary(now)

    def fail(self, now: float) -> list[tuple[TraceRequest, RequestRecord, int]]:
        """The replica dies at ``now`` with everything it held (the step in
        flight never ends). Returns every request it held, with its record
        and the output tokens its client got (0: none), for the caller to
        send on (or fail). It never acts again."""
        held = [(request, record, resumed) for request, record, _, resumed in self._inbox]
        for request_id, record in self._records.items():
            request = self.scheduler.requests.get(request_id)
            streamed = request.num_output_tokens if request is not None else 0
            if streamed:
                record.output_tokens = streamed
                if not record.chunk_times:  # its first token, whatever comes after
                    record.chunk_times = [request.first_token_time]
            held.append((self._items[request_id], record, streamed))
        for request_id in list(self.scheduler.requests):
            self.scheduler.abort_request(request_id)
        self.scheduler.pop_rejected()  # expired ones not yet handed out: retried above
        self._inbox, self._records, self._items = [], {}, {}
        self._output, self._sampled, self._run = None, [], ([], [])
        self.outstanding = 0
        self.failed_at = now
        self._set(State.IDLE, None)
        return held

    # -- a step boundary -----------------------------------------------------------

    def _boundary(self, now: float) -> None:
        self.clock.set(now)
        inbox, self._inbox = self._inbox, []
        for request, record, handoff, resumed in inbox:
            self._add(request, record, now, handoff, resumed)
        if self.fast_forward and self._plan_run(now):
            return
        output, expired = self.core.begin()
        self._reject(expired)
        if not output.is_empty:
            self._execute(output, idle_s=now - self._last_end)
            self._last_end = now + self._seconds
            self._set(State.STEP, self._last_end)
        elif self.scheduler.has_unfinished:
            self._set(State.POLL, self._poll_time(now))
        else:
            self._set(State.IDLE, None)

    def _poll_time(self, now: float) -> float:
        """When to look again with nothing to schedule: when the next KV
        load is done if only loads are pending, else ``POLL_S`` later."""
        scheduler = self.scheduler
        loaded = scheduler.loading.next_done
        if loaded is None or scheduler.waiting or scheduler.has_pending_rejections:
            return now + POLL_S
        return max(loaded, now)

    def _set(self, state: State, next_time: float | None) -> None:
        self.state, self.next_time = state, next_time

    def _add(self, item: TraceRequest, record: RequestRecord, now: float,
             handoff: bool = False, resumed: int = 0) -> None:
        total = item.input_len + item.output_len
        if self.max_model_len is not None and total > self.max_model_len:
            self._fail(record, now, f"the request needs {total} tokens of context, more than "
                                    f"max_model_len {self.max_model_len}")
            return
        request_id = f"r{record.index}"
        request = Request(request_id, prompt_token_ids(record.index, item.input_len,
                                                       item.hash_ids, self.hash_block),
                          item.output_len, arrival_time=record.scheduled, kv_handoff=handoff)
        request.token_ids.extend([SAMPLED_TOKEN] * resumed)  # as the live engine's resume
        request.resumed = resumed > 0
        try:
            self.scheduler.add_request(request)
        except RejectedError as exc:
            self._done(record, REJECTED, now, exc.reason)
        except ValueError as exc:
            self._fail(record, now, str(exc))
        else:
            self._records[request_id] = record
            self._items[request_id] = item

    def _fail(self, record: RequestRecord, now: float, message: str) -> None:
        record.error = message
        self._done(record, FAILED, now, "http_400")  # what the server answers

    def _done(self, record: RequestRecord, status: str, now: float, reason: str | None,
              queued_s: float = 0.0) -> None:
        record.status, record.reason, record.finished = status, reason, now
        self.outstanding -= 1
        if self.listener is not None:
            self.listener.finished(record.index, now, status == OK, queued_s)

    def _reject(self, expired: list[Request]) -> None:
        for request in expired:
            record = self._records.pop(request.request_id)
            del self._items[request.request_id]
            self._done(record, REJECTED, self.clock.now, request.reject_reason or "shed")

    # -- one step ------------------------------------------------------------------

    def _execute(self, output: SchedulerOutput, idle_s: float) -> None:
        """Hand the step to the executor, as the live engine does; it ends
        ``_seconds`` (its price, and the wake cost after ``idle_s`` idle)
        later."""
        executor = self.executor
        items = batch_items(output.spans, self.scheduler.kv.block_tables, _samples)
        tokens = iter(executor.execute(items, step_padding(output.pad_rows, self.padding_mode)))
        self._output = output
        self._seconds = executor.last_step_seconds + executor.wake_seconds(idle_s)
        self.busy_seconds += self._seconds
        self._sampled = [(span.request, next(tokens)) for span in output.spans if span.sample]

    def _commit(self, now: float) -> None:
        output, self._output = self._output, None
        sampled, self._sampled = self._sampled, []
        progressed, finished = self.core.complete(output, sampled, self._seconds)
        self.steps += 1
        if self.token_times:
            for request in progressed:
                self._records[request.request_id].chunk_times.append(now)
        if self.listener is not None:  # a run of decodes makes no first token
            for request in progressed:
                if request.num_output_tokens == 1:
                    self.listener.first_token(self._records[request.request_id].index, now,
                                              request.num_cached_tokens)
        for request in finished:
            self._finish(request, now)

    def _finish(self, request: Request, now: float) -> None:
        record = self._records.pop(request.request_id)
        del self._items[request.request_id]
        if not self.token_times and not record.chunk_times:  # a resumed one's: its first
            record.chunk_times = [request.first_token_time]
        record.output_tokens = request.num_output_tokens
        if not request.kv_handoff:  # a decode leg's "hit" is its transfer: the P/D planner
            record.cached_tokens = request.num_cached_tokens  # copies its prefill leg's
        self.prompt_tokens += request.num_prompt_tokens
        self.cached_tokens += request.num_cached_tokens
        self.loaded_tokens += request.num_loaded_tokens
        queued = (request.first_scheduled_time or request.arrival_time) - request.arrival_time
        self._done(record, OK, now, None, max(0.0, queued))

    # -- runs of decode steps ----------------------------------------------------------

    def _plan_run(self, now: float) -> bool:
        """Plan a run of identical decode steps from ``now`` if one is due
        (at least two steps); its steps' times are priced one by one, as
        stepping would."""
        scheduler = self.scheduler
        limit = self.core.decode_run_limit(self._run_steps)
        if limit < 2:
            return False
        latest = horizon(scheduler)
        latest = math.inf if latest is None else latest
        running = len(scheduler.running)
        context = sum(r.num_computed_tokens + 1 for r in scheduler.running)
        price = self.executor.decode_step_seconds
        seconds: list[float] = []
        ends: list[float] = []
        start = now
        for _ in range(limit):
            if start > latest:
                break
            step = price(running, context)
            start += step
            seconds.append(step)
            ends.append(start)
            context += running
        if len(seconds) < 2:
            return False
        self._run = (seconds, ends)
        self._run_shape = (running, context - len(seconds) * running)  # its first step's
        self._set(State.RUN, ends[-1])
        return True

    def _cut_run(self, now: float) -> bool:
        """An arrival at ``now`` ends the run at the first boundary at or after it."""
        seconds, ends = self._run
        cut = next(i for i, end in enumerate(ends) if end >= now) + 1
        if cut == len(ends):
            return False
        self._apply_run(cut)
        self._run_steps = _FIRST_RUN
        self._set(State.BOUNDARY, ends[cut - 1])
        return True

    def _apply_run(self, steps: int) -> None:
        seconds, ends = self._run
        seconds, ends = seconds[:steps], ends[:steps]
        if self.executor.meter is not None:  # the steps that ran, as execute meters its own
            self.executor.meter.decodes(*self._run_shape, steps)
        if self.token_times:
            for request in self.scheduler.running:
                self._records[request.request_id].chunk_times.extend(ends)
        finished = self.core.fast_forward(seconds, ends, self.clock.set, SAMPLED_TOKEN)
        self.steps += steps
        self.fast_forwarded_steps += steps
        self.busy_seconds += sum(seconds)
        self._run = ([], [])
        self._last_end = ends[-1]
        for request in finished:
            self._finish(request, ends[-1])


def _samples(request: Request) -> bool:
    """The simulator's sampling row: only whether a span samples matters."""
    return True
