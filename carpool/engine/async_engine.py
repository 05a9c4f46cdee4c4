"""AsyncEngine: the engine loop in a background thread, streams to asyncio.

The event loop never runs model code. Requests and aborts cross into the
engine thread through a lock-protected inbox; outputs cross back with
``loop.call_soon_threadsafe`` into one ``asyncio.Queue`` per request.

Given a factory, the engine thread builds the engine too, so one thread
runs every torch op of the process. Why: each thread that runs a parallel
torch op gets its own OpenMP team, and once a process holds more OpenMP
threads than CPUs, libgomp stops spinning between parallel regions and
every region waits for its workers to wake. Measured on a 2-core CPU, a
12-sequence decode step of the default model took 33 ms where one thread
loaded and stepped the engine, 53 ms where the main thread loaded it and
another stepped it (as ``carpool serve`` did).
"""
from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from carpool.engine.front import RequestIntake
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.outputs import RequestOutput
from carpool.engine.pins import (
    PIN_PARAMS,
    PIN_PRIORITY,
    PinFront,
    PinRegistry,
    finish_pin,
    pin_request_id,
)
from carpool.engine.stats import EngineStats
from carpool.engine.streams import DeliveryLag, EngineDeadError, RequestStream
from carpool.engine.wire import EngineInfo, Handoff
from carpool.sampling_params import SamplingParams
from carpool.scheduler import RejectedError
from carpool.scheduler.pinned_prefixes import PinSpec

# How often the engine thread publishes a stats snapshot while busy.
STATS_INTERVAL_S = 0.25


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Add:
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    priority: int
    session_id: str | None
    deadline: float | None
    max_wait: float | None = None
    cache_salt: str | None = None
    arrival_time: float | None = None  # engine clock, when the caller handed it over
    handoff: Handoff | None = None  # its P/D part, if split (``wire.Handoff``)
    pin: PinSpec | None = None  # the prefill of this pinned prefix (``LLMEngine.pin_prefix``)


class AsyncEngine(PinFront, RequestIntake):
    """Thread-safe front of an ``LLMEngine``.

    ``add_request(...)`` returns a ``RequestStream`` of incremental
    ``RequestOutput``s ending with one whose ``finished`` is true. Leaving
    it early (``aclose``, or cancelling the task) aborts the request, whose
    blocks are freed before the next step. ``abort(request_id)`` does the
    same from anywhere. Pinned prefixes: ``PinFront``'s calls.

    ``stats`` is a snapshot refreshed by the engine thread (at most every
    ``STATS_INTERVAL_S`` while busy, and whenever it goes idle);
    ``last_progress`` is the monotonic time of the last step or idle wait.
    ``on_failure`` (if set) is called from the engine thread when the loop dies.
    """

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine],
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        """``engine``: an engine, or a factory the engine thread calls first
        (then the constructor waits for it, and raises what it raised)."""
        self.on_failure = on_failure
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._adds: list[_Add] = []
        # Appended from any thread (see RequestStream.__del__); drained by the engine.
        self._aborts: deque[str] = deque()
        self._unpins: deque[str] = deque()
        self.pins = PinRegistry()
        self._pin_runs = 0
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self.error: BaseException | None = None
        self.delivery = DeliveryLag()
        self.last_progress = time.monotonic()
        factory = None
        if isinstance(engine, LLMEngine):
            self.engine = engine
        else:
            factory = engine
        self._build_error: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(factory, ready),
                                        name="carpool-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        self.stats: EngineStats = self.engine.stats()
        self.info: EngineInfo = self.engine.info()
        self.tokenizer = self.engine.tokenizer
        self.step_log = self.engine.step_log

    def first_token_seen(self, first_token_time: float) -> None:
        self.delivery.observe(self.engine.clock() - first_token_time)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        """Requests added whose final output has not been delivered yet."""
        return len(self._streams)

    @property
    def degraded(self) -> str | None:
        return None  # one engine: serving or dead

    def replica_stats(self) -> dict[str, EngineStats]:
        return {}

    def routing(self) -> dict:
        return {}

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0,
                          session_id: str | None = None, deadline: float | None = None,
                          max_wait: float | None = None, cache_salt: str | None = None,
                          received_at: float | None = None, handoff: Handoff | None = None,
                          ) -> RequestStream:
        """Validate and queue; raises ``ValueError`` at once for bad input and
        ``RejectedError`` when admission control turns the request away.
        ``handoff``: a P/D part (``LLMEngine.add_request``'s).

        Cancelled while waiting for the engine to accept it (the engine
        thread may be in the middle of a long step), the request is aborted:
        once queued, a request ends only by finishing or by an abort.
        ``received_at`` (``time.monotonic()``) is when the caller got it (an
        HTTP server: before parsing and tokenizing); its arrival is then.
        """
        request_id, ids, params = self._intake(prompt, params, request_id, self._streams)
        if params.structured is not None:  # a new grammar compiles here, not on the engine thread
            await asyncio.to_thread(self.engine.grammars().compile, params.structured)
        return await self._submit(_Add(request_id, ids, params, priority, session_id,
                                       deadline, max_wait, cache_salt, None, handoff),
                                  received_at)

    def _new_request_id(self) -> str:
        return self.engine.new_request_id()  # the engine's own ids (offline calls share it)

    async def run_pin(self, spec: PinSpec) -> None:
        """Have the engine compute and hold ``spec``'s prefix (``PinFront``)."""
        self._pin_runs += 1
        add = _Add(pin_request_id(spec, self._pin_runs), list(spec.token_ids), PIN_PARAMS,
                   PIN_PRIORITY, None, None, cache_salt=spec.cache_salt, pin=spec)
        await finish_pin(await self._submit(add, None))

    def drop_pin(self, pin_id: str) -> None:
        with self._wake:
            self._unpins.append(pin_id)
            self._wake.notify()

    async def _submit(self, add: _Add, received_at: float | None) -> RequestStream:
        """Queue ``add`` for the engine thread; its stream once accepted."""
        if self.error is not None:
            raise EngineDeadError(f"engine loop failed: {self.error!r}")
        request_id = add.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._wake:
            if self._stopping or not self._thread.is_alive():
                raise EngineDeadError("the engine is shut down")
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = stream
            # Stamped when it came, not when the engine thread takes it between
            # two steps: the wait for the step in flight (and the server's
            # parsing and tokenizing) is part of its TTFT, so admission must
            # predict it and the learned margin must see it.
            arrival = self.engine.clock()
            if received_at is not None:
                arrival -= max(0.0, time.monotonic() - received_at)
            add.arrival_time = arrival
            self._adds.append(add)
            self._wake.notify()
        try:
            accepted = await stream.queue.get()  # None, or why it was refused
        except BaseException:
            self.abort(request_id)  # handled after the add: each round takes adds first
            raise
        if isinstance(accepted, BaseException):
            raise accepted  # bad input or rejected at admission
        return RequestStream(self, request_id, stream.queue)

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def abort_without_lock(self, request_id: str) -> None:
        """``abort`` for finalizers: no lock taken, no wake-up (the engine
        is stepping while the request is live, and drains aborts each step)."""
        self._aborts.append(request_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    async def wait_closed(self, timeout: float = 10.0) -> None:
        await asyncio.to_thread(self.shutdown, timeout)

    # -- engine thread --------------------------------------------------------

    def _run(self, factory: Callable[[], LLMEngine] | None, ready: threading.Event) -> None:
        if factory is not None:
            try:
                self.engine = factory()
            except BaseException as exc:  # noqa: BLE001 - the constructor raises it
                self._build_error = exc
                ready.set()
                return
        ready.set()
        self._loop()

    def _loop(self) -> None:
        try:
            published = 0.0
            while True:
                with self._wake:
                    if not (self._adds or self._aborts or self._unpins or self._stopping
                            or self.engine.has_unfinished):
                        self._publish_stats()
                        while not (self._adds or self._aborts or self._unpins or self._stopping
                                   or self.engine.has_unfinished):
                            self._wake.wait(timeout=1.0)
                            self.last_progress = time.monotonic()
                    if self._stopping:
                        break
                    adds, self._adds = self._adds, []
                    aborts = [self._aborts.popleft() for _ in range(len(self._aborts))]
                    unpins = [self._unpins.popleft() for _ in range(len(self._unpins))]
                self.engine.scheduler.admission.delivery_lag = self.delivery.seconds
                self._admit(adds)
                for pin_id in unpins:
                    self.engine.unpin_prefix(pin_id)
                if unpins:
                    self._publish_stats()
                for request_id in aborts:
                    output = self.engine.abort_request(request_id)
                    if output is not None:
                        self._deliver(output)
                for output in self.engine.step():
                    self._deliver(output)
                self.last_progress = time.monotonic()
                if self.last_progress - published >= STATS_INTERVAL_S:
                    self._publish_stats()
                    published = self.last_progress
            # Shut down: whatever was still in flight ends with an error, not a hang.
            self._fail_all(EngineDeadError("the engine was shut down"))
        except BaseException as exc:  # noqa: BLE001 - fail every stream, never hang
            traceback.print_exc()
            self.error = exc
            self._fail_all(EngineDeadError(f"engine loop failed: {exc!r}"))
            if self.on_failure is not None:
                self.on_failure(exc)
        finally:
            self.engine.close()

    def _publish_stats(self) -> None:
        self.stats = self.engine.stats()

    def _admit(self, adds: list[_Add]) -> None:
        for add in adds:
            try:
                if add.pin is not None:
                    self.engine.pin_prefix(add.pin, add.request_id, add.arrival_time)
                else:
                    self.engine.add_request(
                        add.prompt, add.params, request_id=add.request_id,
                        priority=add.priority, session_id=add.session_id, deadline=add.deadline,
                        max_wait=add.max_wait, cache_salt=add.cache_salt,
                        arrival_time=add.arrival_time, handoff=add.handoff)
            except (ValueError, RejectedError) as exc:
                self._send(add.request_id, exc, final=True)
            else:
                self._send(add.request_id, None, final=False)  # "accepted"

    def _deliver(self, output: RequestOutput) -> None:
        self._send(output.request_id, output, final=output.finished)

    def _send(self, request_id: str, item: object, final: bool) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if stream is not None:
            _post(stream, item)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            _post(stream, exc)


def _post(stream: _Stream, item: object) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        pass  # the caller's event loop is closed: nobody is listening any more
