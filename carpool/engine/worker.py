"""An engine worker process: one ``LLMEngine`` driven over a ZeroMQ socket.

The API process (``EngineClient``) starts it as ``python -m
carpool.engine.worker --connect ENDPOINT`` and sends a ``Launch``; the
worker builds the engine (the model, the start-up measurement), answers
``Ready`` with what the API side needs (``EngineInfo``) and then loops:
take every message waiting (adds, aborts), run one step, send one
``Progress`` with the round's acceptances, refusals and outputs. Idle, it
blocks on the socket and sends a heartbeat (a stats snapshot) every
second, which is how the front tells a stalled engine from an idle one.

One thread runs every torch op (see ``async_engine``'s note on OpenMP
teams). The worker ignores SIGINT and SIGTERM: the front drains on them
and then sends ``Shutdown``; it dies with the front (``PR_SET_PDEATHSIG``)
so a killed front leaves no orphan holding the model's memory.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec
import zmq

from carpool.child_process import die_with_parent
from carpool.engine.front import ContextLengthError
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.outputs import RequestOutput
from carpool.engine.wire import (
    MAX_FRAME_BYTES,
    Abort,
    Add,
    DeliveryLagUpdate,
    Delta,
    DropHandoff,
    Failed,
    Launch,
    LaunchFailed,
    Progress,
    Ready,
    Refusal,
    ResyncKvEvents,
    Shutdown,
    Unpin,
    to_worker_decoder,
)
from carpool.scheduler import RejectedError
from carpool.settings_fields import add_setting_args, setting

log = logging.getLogger("carpool.worker")

# How often a busy worker sends a stats snapshot, and an idle one a heartbeat.
STATS_INTERVAL_S = 0.25
HEARTBEAT_S = 1.0
# Test hook: make the engine loop raise on this step (exercises the failure path).
FAULT_ENV = "CARPOOL_FAULT_AT_STEP"


def build_serving_engine(config, slo_sources: dict[str, str] | None = None, schedule=None,
                         log_line=None, kv_store=None, start_followers=None) -> LLMEngine:
    """The engine ``carpool serve`` runs: loaded (serving while the CPU
    kernels compile on a first start), its latency targets resolved
    (``prepare_serving``), following ``schedule`` (a ``ProfileSchedule``);
    ``kv_store``, ``start_followers``: as ``LLMEngine.from_config``'s."""
    from carpool.engine.calibrate import prepare_serving

    engine = prepare_serving(LLMEngine.from_config(config, kernels_in_background=True,
                                                   kv_store=kv_store,
                                                   start_followers=start_followers),
                             slo_sources, log_line)
    engine.grammars().prepare()  # not on a first constrained request's step
    if os.environ.get(FAULT_ENV):
        inject_fault(engine, int(os.environ[FAULT_ENV]))
    if schedule is not None:
        engine.follow_schedule(schedule)
    return engine


def inject_fault(engine: LLMEngine, at_step: int) -> None:
    """Make ``engine.step`` raise from step ``at_step`` on (tests)."""
    step = engine.step

    def faulty_step():
        if engine.counters.steps + 1 >= at_step:
            raise RuntimeError(f"injected fault at step {at_step} ({FAULT_ENV})")
        return step()

    engine.step = faulty_step


def delta_of(output: RequestOutput) -> Delta:
    """The wire form of one output: its delta fields and timestamps."""
    return Delta(output.request_id, output.delta_text, output.delta_token_ids,
                 output.finished, output.finish_reason, output.stop_reason,
                 output.delta_logprobs, output.num_cached_tokens, output.arrival_time,
                 output.first_scheduled_time, output.first_token_time, output.finish_time,
                 output.reject_reason)


def refusal_of(request_id: str, exc: Exception) -> Refusal:
    if isinstance(exc, RejectedError):
        return Refusal(request_id, "rejected", str(exc), exc.reason, exc.retry_after)
    kind = "context" if isinstance(exc, ContextLengthError) else "invalid"
    return Refusal(request_id, kind, str(exc))


class WorkerLoop:
    """Drives one engine from one socket until ``Shutdown`` (or the front dies)."""

    def __init__(self, engine: LLMEngine, socket: zmq.Socket, parent_pid: int,
                 kv_events: bool = False) -> None:
        """``kv_events``: send each step's prefix-cache changes (block
        hashes stored and evicted) for the front's router."""
        self.engine = engine
        self.kv_events = engine.scheduler.kv.event_buffer() if kv_events else None
        self.socket = socket
        self.parent_pid = parent_pid
        self.encoder = msgspec.msgpack.Encoder()
        self.steps_sent = engine.step_log.total
        self.stats_sent = 0.0
        # Adds whose grammar compiles off the engine's thread: (future, add, since).
        self._compiling: list[tuple[Future, Add, float]] = []

    def run(self) -> None:
        engine = self.engine
        while True:
            progress = Progress()
            busy = engine.has_unfinished
            wait_ms = 0 if busy else 1 if self._compiling else int(HEARTBEAT_S * 1000)
            if not self._receive(progress, wait_ms):
                return
            if self._compiling:
                self._add_compiled(progress)
            if engine.has_unfinished:
                progress.outputs.extend(map(delta_of, engine.step()))
            now = time.monotonic()
            idle_now = busy and not engine.has_unfinished
            if idle_now or now - self.stats_sent >= (STATS_INTERVAL_S if busy else HEARTBEAT_S):
                progress.stats = engine.stats()
                self.stats_sent = now
                if os.getppid() != self.parent_pid:
                    return  # the front is gone (no PDEATHSIG where prctl is missing)
            if self.kv_events is not None:
                batch = self.kv_events.drain()
                progress.kv_events = None if batch.empty else batch
            if engine.step_log.total != self.steps_sent:
                progress.steps = engine.step_log.since(self.steps_sent)
                self.steps_sent = engine.step_log.total
            if (progress.accepted or progress.refused or progress.outputs
                    or progress.stats is not None or progress.kv_events is not None):
                self.socket.send(self.encoder.encode(progress))

    def _receive(self, progress: Progress, timeout_ms: int) -> bool:
        """Handle every message waiting (waiting up to ``timeout_ms`` for the
        first); False on ``Shutdown``."""
        if not self.socket.poll(timeout_ms):
            return True
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            message = to_worker_decoder.decode(frame)
            if isinstance(message, Add):
                self._add(message, progress)
            elif isinstance(message, Abort):
                self._drop_compiling(set(message.request_ids), progress)
                for request_id in message.request_ids:
                    output = self.engine.abort_request(request_id)
                    if output is not None:
                        progress.outputs.append(delta_of(output))
            elif isinstance(message, Unpin):
                for pin_id in message.pin_ids:
                    self.engine.unpin_prefix(pin_id)
            elif isinstance(message, DropHandoff):
                if self.engine.kv_connector is not None:
                    self.engine.kv_connector.worker.drop_parts(message.block_hashes,
                                                               message.parts_key)
            elif isinstance(message, ResyncKvEvents):
                if self.kv_events is not None:  # this round's drain is the reset
                    self.kv_events.resync()
            elif isinstance(message, DeliveryLagUpdate):
                self.engine.scheduler.admission.delivery_lag = message.seconds
            elif isinstance(message, Shutdown):
                return False

    def _add(self, add: Add, progress: Progress) -> None:
        spec = add.params.structured if add.pin is None else None
        pending = self.engine.grammars().compile_later(spec) if spec is not None else None
        if pending is not None:  # a new grammar: compiled while the engine steps on
            self._compiling.append((pending, add, time.monotonic()))
            return
        try:
            if add.pin is not None:
                self.engine.pin_prefix(add.pin, add.request_id, add.arrival_time)
            else:
                self.engine.add_request(
                    add.prompt_token_ids, add.params, request_id=add.request_id,
                    priority=add.priority, session_id=add.session_id, deadline=add.deadline,
                    max_wait=add.max_wait, cache_salt=add.cache_salt,
                    arrival_time=add.arrival_time, handoff=add.handoff)
        except (ValueError, RejectedError) as exc:
            progress.refused.append(refusal_of(add.request_id, exc))
        else:
            progress.accepted.append(add.request_id)


    def _add_compiled(self, progress: Progress) -> None:
        """Adds whose grammar is compiled now (or failed, or timed out)."""
        compiler, waiting = self.engine.grammars(), []
        for future, add, since in self._compiling:
            spec = add.params.structured
            if not future.done():
                if time.monotonic() - since < compiler.timeout_s:
                    waiting.append((future, add, since))
                else:
                    progress.refused.append(refusal_of(add.request_id, compiler.timed_out(spec)))
            elif future.exception() is not None:
                error = compiler.refusal(spec, future.exception())
                progress.refused.append(refusal_of(add.request_id, error))
            else:
                self._add(add, progress)
        self._compiling = waiting

    def _drop_compiling(self, request_ids: set[str], progress: Progress) -> None:
        """Aborted while their grammar compiled: refused (their front let go)."""
        dropped = [add for _, add, _ in self._compiling if add.request_id in request_ids]
        self._compiling = [entry for entry in self._compiling
                           if entry[1].request_id not in request_ids]
        for add in dropped:
            progress.refused.append(refusal_of(add.request_id, ValueError("aborted")))


def _build(launch: Launch) -> LLMEngine:
    schedule = None
    if launch.profile is not None:
        from carpool.profiles.schedule import ProfileSchedule

        schedule = ProfileSchedule.from_profile(launch.profile, launch.pinned)

    def log_line(message: str) -> None:
        log.info(message.removeprefix("carpool: "))

    return build_serving_engine(launch.config, launch.slo_sources, schedule, log_line)


def serve(endpoint: str, parent_pid: int) -> int:
    """Connect, build the engine ``Launch`` names, loop; the exit status."""
    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.connect(endpoint)
    encoder = msgspec.msgpack.Encoder()
    # The front sends Launch at once; one that died first never will.
    while not socket.poll(1000):
        if os.getppid() != parent_pid:
            socket.close()
            return 1
    launch = to_worker_decoder.decode(socket.recv())
    if not isinstance(launch, Launch):
        raise SystemExit(f"carpool worker: expected a Launch message, got {type(launch).__name__}")
    if launch.log_format:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(launch.log_format, launch.log_datefmt))
        logging.basicConfig(level=logging.INFO, handlers=[handler])
    try:
        engine = _build(launch)
    except Exception as exc:  # noqa: BLE001 - said to the front, which exits with it
        from carpool.model.loader import ModelLoadError

        usage = isinstance(exc, (ValueError, OSError, ModelLoadError))
        if not usage:
            log.exception("the engine could not be built")
        socket.send(encoder.encode(LaunchFailed(str(exc) if usage else repr(exc), usage)))
        socket.close()
        return 1
    socket.send(encoder.encode(Ready(engine.info(), engine.stats(), os.getpid())))
    # What start-up built (the model's modules, the tokenizer: ~200k objects)
    # lives as long as this process: out of the collector's scans. Its older
    # generations' scans over them took ~1 ms of a 15 ms one-sequence decode
    # step (2-core AMD EPYC, 6 alternating runs). Only in this process, which
    # holds one engine for its life.
    gc.freeze()
    try:
        WorkerLoop(engine, socket, parent_pid, launch.kv_events).run()
    except Exception as exc:  # noqa: BLE001 - the front fails every stream with it
        log.exception("engine loop failed")
        socket.send(encoder.encode(Failed(repr(exc))))
        socket.close()
        return 1
    finally:
        engine.close()
    socket.close()
    return 0


@dataclass
class WorkerArgs:
    """What the front starts a worker process with."""

    connect: str = setting(None, "--connect", None, "the front's ZeroMQ endpoint",
                           required=True)
    parent_pid: int | None = setting(
        None, "--parent-pid", None, "the front's pid (default: this process's parent now)",
        parse=int)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m carpool.engine.worker", allow_abbrev=False,
                                     description="a carpool engine worker (started by the "
                                                 "API process, not by hand)")
    add_setting_args(parser, WorkerArgs)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent_pid = args.parent_pid if args.parent_pid is not None else os.getppid()
    die_with_parent()
    # A front that died before the line above sent no death signal: its
    # worker already has another parent.
    if os.getppid() != parent_pid:
        return 1
    return serve(args.connect, parent_pid)


if __name__ == "__main__":
    sys.exit(main())
