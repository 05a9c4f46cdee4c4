"""EngineClient: the engine in a worker process, with ``AsyncEngine``'s interface.

``carpool serve`` runs its engine here by default: the API process keeps
HTTP, parsing, tokenizing and the SSE stream, the worker process
(``carpool.engine.worker``) keeps the model, the scheduler and the
detokenizer, and neither waits for the other's GIL. They talk over one
ZeroMQ PAIR socket (``ipc://`` in a private temporary directory) in the
messages of ``carpool.engine.wire``; the worker sends one message per
engine step with every request's new tokens and text.

This client is the one kind of connection to an engine worker: a fleet
front holds one per worker.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import msgspec
import zmq
import zmq.asyncio

from carpool.cluster.failover import MAX_ATTEMPTS
from carpool.config import EngineConfig
from carpool.engine.front import ContextLengthError, RequestIntake
from carpool.engine.outputs import RequestOutput, TokenLogprob
from carpool.engine.pins import (
    PIN_PARAMS,
    PIN_PRIORITY,
    PinFront,
    PinRegistry,
    finish_pin,
    pin_request_id,
)
from carpool.engine.stats import EngineStats
from carpool.engine.step_log import StepLog
from carpool.engine.streams import DeliveryLag, EngineDeadError, RequestStream
from carpool.engine.wire import (
    MAX_FRAME_BYTES,
    Abort,
    Add,
    DeliveryLagUpdate,
    Delta,
    DropHandoff,
    EngineInfo,
    Failed,
    Handoff,
    Launch,
    LaunchFailed,
    Progress,
    Ready,
    Refusal,
    ResyncKvEvents,
    Shutdown,
    Unpin,
    to_front_decoder,
)
from carpool.sampling_params import SamplingParams
from carpool.scheduler import RejectedError
from carpool.scheduler.kv_events import KvEventBatch
from carpool.scheduler.pinned_prefixes import PinSpec

log = logging.getLogger("carpool.server")

# The front tells the worker its first-token delivery lag when it moved this much.
LAG_UPDATE_S = 0.002


class EngineLaunchError(RuntimeError):
    """The worker could not build its engine; ``usage``: the settings or the
    model are at fault (the message is one line for the user)."""

    def __init__(self, message: str, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage


@dataclass
class LiveRequest:
    """A request between its add and its final output."""

    queue: asyncio.Queue
    prompt: list[int]
    ids: list[int]  # prompt + output token ids so far
    add: Add  # as sent: a fleet re-sends it elsewhere if this worker dies first
    text_parts: list[str] = field(default_factory=list)  # the text so far, append-only
    logprobs: list[TokenLogprob] | None = None
    accepted: bool = False
    # Adopted from a dead worker after its caller saw it accepted: this
    # worker's acceptance is not passed on again.
    swallow_accept: bool = False
    attempts: int = 1  # workers it was sent to (MAX_ATTEMPTS at most)

    @property
    def started(self) -> bool:
        """Some output token reached the caller (or came with a P/D handoff)."""
        return len(self.ids) > len(self.prompt)

    def resumed_add(self) -> Add:
        """The ``Add`` that goes on where the caller is: as sent, while
        nothing reached it; else a ``resume`` after the tokens it got."""
        if not self.started:
            return self.add
        logprobs = list(self.logprobs) if self.logprobs is not None else None
        return msgspec.structs.replace(self.add, handoff=Handoff(
            "resume", self.ids[len(self.prompt):], logprobs))


class EngineClient(PinFront, RequestIntake):
    """Front of one engine worker process (see the module docstring).

    Built with ``await EngineClient.start(config, ...)``, which returns once
    the worker's engine is ready (and raises ``EngineLaunchError`` if it
    cannot be built). The rest is ``AsyncEngine``'s interface:
    ``add_request`` returns a ``RequestStream``; ``abort``; ``stats`` (the
    worker's latest snapshot, at most ``STATS_INTERVAL_S`` old while busy);
    ``last_progress`` (when the worker last spoke: each step, or its idle
    heartbeat); ``on_failure`` (called on the event loop when the worker
    dies or its loop fails); ``shutdown()`` and ``wait_closed()``; pinned
    prefixes (``PinFront``): its ``run_pin`` is an ``Add`` carrying the pin.
    """

    def __init__(self, process: asyncio.subprocess.Process, socket: zmq.asyncio.Socket,
                 context: zmq.asyncio.Context, workdir: str, ready: Ready,
                 step_log: StepLog | None = None) -> None:
        self._process = process
        self._socket = socket
        self._context = context
        self._workdir = workdir
        self.info: EngineInfo = ready.info
        self.pid = ready.pid
        from carpool.model.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_description(ready.info.tokenizer)
        self.step_log = step_log if step_log is not None else StepLog()
        self.stats: EngineStats = ready.stats
        self.delivery = DeliveryLag()
        self.on_failure: Callable[[BaseException], None] | None = None
        self.on_kv_events: Callable[[KvEventBatch], None] | None = None
        # Told (request id, first token now, ended now, prompt tokens found
        # cached with the first token) as requests progress: a fleet
        # router's live counts and index check (refused requests end at once).
        self.on_request: Callable[[str, bool, bool, int | None], None] | None = None
        self.on_steps: Callable[[list], None] | None = None  # each round's LoggedSteps
        # A fleet's name for this replica: tags the steps mirrored into a
        # step log the fleet's replicas share (idle gaps are per replica).
        self.replica_id: str | None = None
        # Offered, when this worker dies, each request it held that has
        # attempts left (started or not: ``LiveRequest.resumed_add``): True when
        # taken elsewhere (a fleet re-routes or resumes it), else it fails here.
        self.on_orphan: Callable[[LiveRequest], bool] | None = None
        self.stream_owner = self  # what its RequestStreams abort through (a fleet: itself)
        self.error: BaseException | None = None
        self.last_progress = time.monotonic()
        self._live: dict[str, LiveRequest] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._loop = asyncio.get_running_loop()
        self._aborts: deque[str] = deque()  # from any thread (RequestStream.__del__)
        self._lag_sent = 0.0
        self._stopping = False
        self.pins = PinRegistry()
        self._pin_runs = 0
        self._reader = asyncio.ensure_future(self._read())
        self._watcher = asyncio.ensure_future(self._watch())

    @classmethod
    async def start(cls, config: EngineConfig, slo_sources: dict[str, str] | None = None,
                    profile: dict | None = None, pinned: Sequence[str] = (),
                    log_format: str | None = None, log_datefmt: str | None = None,
                    kv_events: bool = False, step_log: StepLog | None = None,
                    ) -> "EngineClient":
        """Start a worker, have it build the engine ``config`` describes (with
        ``profile``'s time-of-day windows minus ``pinned`` knobs), wait until
        it is ready. The worker writes its own log lines to this stderr.
        ``kv_events``: the worker reports its prefix cache's changes, each
        step's ``KvEventBatch`` handed to ``on_kv_events`` (a router's feed).
        ``step_log``: where the worker's steps are mirrored (a fleet's
        shared log; default: this client's own)."""
        workdir = tempfile.mkdtemp(prefix="carpool-worker-")
        context = zmq.asyncio.Context()
        socket = context.socket(zmq.PAIR)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        socket.setsockopt(zmq.LINGER, 0)
        endpoint = f"ipc://{workdir}/engine.sock"
        socket.bind(endpoint)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "carpool.engine.worker", "--connect", endpoint,
            "--parent-pid", str(os.getpid()))
        try:
            await socket.send(msgspec.msgpack.encode(Launch(
                config, dict(slo_sources or {}), profile, list(pinned), log_format,
                log_datefmt, kv_events)))
            ready = await _first_answer(socket, process)
        except BaseException:
            if process.returncode is None:
                process.kill()
                await process.wait()
            socket.close()
            context.term()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return cls(process, socket, context, workdir, ready, step_log)

    # -- AsyncEngine's interface ---------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._process.returncode is None and not self._stopping

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    @property
    def degraded(self) -> str | None:
        return None  # one worker: serving or dead

    def replica_stats(self) -> dict[str, EngineStats]:
        return {}

    def routing(self) -> dict:
        return {}

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0,
                          session_id: str | None = None, deadline: float | None = None,
                          max_wait: float | None = None, cache_salt: str | None = None,
                          received_at: float | None = None, handoff: Handoff | None = None,
                          delivered_text: str = "") -> RequestStream:
        """As ``AsyncEngine.add_request``: raises ``ValueError`` for bad input
        and ``RejectedError`` when admission turns the request away.
        ``handoff``: a P/D part (``wire.Handoff``); a decode part's outputs
        count its prefill part's tokens, ``delivered_text`` and logprobs."""
        request_id, ids, params = self._intake(prompt, params, request_id, self._live)
        # Arrived when the caller got it (before parsing and tokenizing): see
        # AsyncEngine.add_request. One monotonic clock for both processes.
        now = time.monotonic()
        arrival = min(now, received_at) if received_at is not None else now
        add = Add(request_id, ids, params, priority, session_id, deadline, max_wait,
                  cache_salt, arrival, handoff)
        live = LiveRequest(asyncio.Queue(), ids, list(ids), add,
                     logprobs=[] if params.logprobs is not None else None)
        if handoff is not None and handoff.output_token_ids:
            live.ids += handoff.output_token_ids
            live.text_parts.append(delivered_text)
            if live.logprobs is not None:
                live.logprobs += handoff.logprobs or ()
        return await self._submit(add, live)

    async def run_pin(self, spec: PinSpec) -> None:
        """Have the worker compute and hold ``spec``'s prefix (``PinFront``)."""
        if self.error is not None or self._stopping:
            raise EngineDeadError("the engine is not running")
        self._pin_runs += 1
        ids = list(spec.token_ids)
        add = Add(pin_request_id(spec, self._pin_runs), ids, PIN_PARAMS, PIN_PRIORITY,
                  cache_salt=spec.cache_salt, arrival_time=time.monotonic(), pin=spec)
        await finish_pin(await self._submit(add, LiveRequest(asyncio.Queue(), ids, list(ids), add)))

    def drop_pin(self, pin_id: str) -> None:
        self._send_now(Unpin([pin_id]))

    def drop_handoff(self, block_hashes: list[int], parts_key: int) -> None:
        """P/D: delete a handoff's layer parts no decode part took."""
        if self.is_alive:
            self._send_now(DropHandoff(block_hashes, parts_key))

    def resync_kv_events(self) -> None:
        """Have the worker send its prefix cache's snapshot (a reset batch)."""
        if self.is_alive:
            self._send_now(ResyncKvEvents())

    async def _submit(self, add: Add, live: LiveRequest) -> RequestStream:
        """Send ``add``; its stream once the worker accepted it."""
        request_id = add.request_id
        self._live[request_id] = live
        await self._socket.send(self._encoder.encode(add))
        try:
            accepted = await live.queue.get()  # None, or why it was refused
        except BaseException:
            # Wherever it is now (its fleet may have moved it off a dead worker).
            self.stream_owner.abort_without_lock(request_id)
            raise
        if isinstance(accepted, BaseException):
            raise accepted
        return RequestStream(self.stream_owner, request_id, live.queue)

    def adopt(self, live: LiveRequest) -> None:
        """Take over a request whose worker died: the same queue goes on
        receiving its outputs, after those its caller got (``LiveRequest.
        resumed_add``); an acceptance it already saw is not passed on again."""
        live.add = live.resumed_add()
        live.attempts += 1
        live.swallow_accept = live.accepted
        self._live[live.add.request_id] = live
        self._send_now(live.add)

    def abort(self, request_id: str) -> None:
        self.abort_without_lock(request_id)

    def abort_without_lock(self, request_id: str) -> None:
        """Abort from any thread: queued, sent by the event loop."""
        self._aborts.append(request_id)
        try:
            self._loop.call_soon_threadsafe(self._send_aborts)
        except RuntimeError:
            pass  # the loop is closed: the worker is gone with it

    def first_token_seen(self, first_token_time: float) -> None:
        self.delivery.observe(time.monotonic() - first_token_time)
        if abs(self.delivery.seconds - self._lag_sent) >= LAG_UPDATE_S:
            self._lag_sent = self.delivery.seconds
            self._send_now(DeliveryLagUpdate(self._lag_sent))

    def shutdown(self) -> None:
        """Stop the worker (after its current step); whatever is still in
        flight ends with ``EngineDeadError``. ``wait_closed`` waits for it."""
        if self._stopping:
            return
        self._stopping = True
        self._send_now(Shutdown())
        self._fail_all(EngineDeadError("the engine was shut down"))

    async def wait_closed(self, timeout: float = 10.0) -> None:
        """Wait for the worker to exit (killing it after ``timeout``), then
        release the socket and the temporary directory."""
        self.shutdown()
        try:
            await asyncio.wait_for(self._process.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("the engine worker did not stop in %.0f s: killing it", timeout)
            self._process.kill()
            await self._process.wait()
        self._reader.cancel()
        await asyncio.gather(self._reader, self._watcher, return_exceptions=True)
        self._socket.close()
        self._context.term()
        shutil.rmtree(self._workdir, ignore_errors=True)

    # -- the worker's messages -----------------------------------------------------------

    def _send_now(self, message) -> None:
        if self._process.returncode is None:
            try:
                self._socket.send(self._encoder.encode(message))  # queued at once, in order
            except zmq.ZMQError:
                pass  # closed: the worker is gone

    def _send_aborts(self) -> None:
        if self._aborts:
            ids = [self._aborts.popleft() for _ in range(len(self._aborts))]
            self._send_now(Abort(ids))

    async def _read(self) -> None:
        try:
            while True:
                message = to_front_decoder.decode(await self._socket.recv())
                self.last_progress = time.monotonic()
                if isinstance(message, Progress):
                    self._progress(message)
                elif isinstance(message, Failed):
                    self._die(EngineDeadError(f"engine loop failed: {message.error}"))
                    return
        except (asyncio.CancelledError, zmq.ZMQError):
            return
        except Exception as exc:  # noqa: BLE001 - a message that does not decode
            self._die(exc)

    def _progress(self, progress: Progress) -> None:
        for request_id in progress.accepted:
            live = self._live.get(request_id)
            if live is not None:
                live.accepted = True
                if not live.swallow_accept:
                    live.queue.put_nowait(None)
        observe = self.on_request
        for refusal in progress.refused:
            live = self._live.pop(refusal.request_id, None)
            if live is not None:
                live.queue.put_nowait(refusal_error(refusal))
                if observe is not None:
                    observe(refusal.request_id, False, True, None)
        for delta in progress.outputs:
            live = self._live.get(delta.request_id)
            if live is not None:
                first = len(live.ids) == len(live.prompt) and bool(delta.delta_token_ids)
                if delta.finished:
                    del self._live[delta.request_id]
                live.queue.put_nowait(output_of(delta, live))
                if observe is not None and (first or delta.finished):
                    observe(delta.request_id, first, delta.finished,
                            delta.num_cached_tokens if first else None)
        if progress.stats is not None:
            self.stats = progress.stats
        for step in progress.steps:
            self.step_log.append(step if self.replica_id is None
                                 else replace(step, replica=self.replica_id))
        if progress.steps and self.on_steps is not None:
            self.on_steps(progress.steps)
        if progress.kv_events is not None and self.on_kv_events is not None:
            self.on_kv_events(progress.kv_events)

    async def _watch(self) -> None:
        code = await self._process.wait()
        if not self._stopping:
            self._die(EngineDeadError(f"the engine worker exited unexpectedly (status {code})"))

    def _die(self, exc: BaseException) -> None:
        if self.error is not None or self._stopping:
            return
        self.error = exc
        log.error("%s", exc)
        self._fail_all(exc if isinstance(exc, EngineDeadError)
                       else EngineDeadError(f"engine loop failed: {exc!r}"), offer=True)
        if self.on_failure is not None:
            self.on_failure(exc)

    def _fail_all(self, exc: BaseException, offer: bool = False) -> None:
        """End every live request with ``exc``; ``offer``: those not started
        go to ``on_orphan`` first (the worker died)."""
        live, self._live = self._live, {}
        for request_id, request in live.items():
            if (offer and self.on_orphan is not None and request.add.pin is None
                    and request.attempts < MAX_ATTEMPTS and self.on_orphan(request)):
                continue
            error = exc
            if offer and request.attempts >= MAX_ATTEMPTS:
                error = EngineDeadError(f"{exc} (tried on {MAX_ATTEMPTS} workers: no more "
                                        "attempts)")
            request.queue.put_nowait(error)
            if self.on_request is not None:
                self.on_request(request_id, False, True, None)


def output_of(delta: Delta, live) -> RequestOutput:  # noqa: ANN001
    """The ``RequestOutput`` of one delta, with the cumulative fields that
    ``live`` keeps (``prompt``, ``ids``, ``text_parts``, ``logprobs``)."""
    if delta.delta_text:
        live.text_parts.append(delta.delta_text)  # joined only when an output's text is read
    live.ids.extend(delta.delta_token_ids)
    if live.logprobs is not None and delta.delta_logprobs:
        live.logprobs.extend(delta.delta_logprobs)
    output = RequestOutput.of_request(
        delta.request_id, live.prompt, live.text_parts, live.ids, delta.delta_text,
        delta.delta_token_ids, delta.finished, delta.stop_reason, live.logprobs,
        delta.delta_logprobs, delta.num_cached_tokens, delta.arrival_time,
        delta.first_scheduled_time, delta.first_token_time)
    if delta.finished:
        output.finish_reason = delta.finish_reason
        output.finish_time = delta.finish_time
        output.reject_reason = delta.reject_reason
    return output


def refusal_error(refusal: Refusal) -> Exception:
    """The exception ``AsyncEngine.add_request`` raises for a refusal."""
    if refusal.kind == "rejected":
        return RejectedError(refusal.reason, refusal.retry_after, refusal.message)
    if refusal.kind == "context":
        return ContextLengthError(refusal.message)
    return ValueError(refusal.message)


async def _first_answer(socket: zmq.asyncio.Socket,
                        process: asyncio.subprocess.Process) -> Ready:
    """The worker's ``Ready``; ``EngineLaunchError`` if it failed or died first."""
    answer = asyncio.ensure_future(socket.recv())
    exited = asyncio.ensure_future(process.wait())
    done, _ = await asyncio.wait({answer, exited}, return_when=asyncio.FIRST_COMPLETED)
    if answer not in done:
        answer.cancel()
        raise EngineLaunchError(f"the engine worker exited while starting (status "
                                f"{process.returncode})")
    exited.cancel()
    message = to_front_decoder.decode(answer.result())
    if isinstance(message, LaunchFailed):
        raise EngineLaunchError(message.error, message.usage)
    if not isinstance(message, Ready):
        raise EngineLaunchError(f"the engine worker answered {type(message).__name__}")
    return message

