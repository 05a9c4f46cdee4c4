"""The engine deployment: each Ray Serve replica holds one in-process ``AsyncEngine``.

Requests come as msgspec bytes (``carpool.engine.wire.Add``, ``RouteHint``
and the router's ``Routed`` decision) and stream back as ``StreamEvent``
bytes: acceptance, then every output waiting at each send in one event.
Leaving the stream early (the ingress cancels it: the client went away)
cancels this generator, which aborts the request and frees its KV blocks
before the engine's next step.

P/D serving (``role`` ``prefill`` or ``decode``: the application's
``CarpoolPrefill`` and ``CarpoolDecode`` deployments): the engine's KV
connector works on the application's ``RayObjectStore`` (``kv_store``),
and each ``Add`` carries its part's ``Handoff`` to the engine.

The replica reports, for carpool's request router, the ``ReplicaReport``
its ``ReplicaView`` needs (``record_routing_stats``), and, for carpool's
autoscaling policy, its waiting and running counts, slots and arrivals
(``record_autoscaling_stats``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterable

import msgspec

from carpool.engine.async_engine import AsyncEngine
from carpool.engine.pins import PinReconciler
from carpool.engine.stats import EngineStats
from carpool.engine.streams import EngineDeadError, RequestStream
from carpool.engine.wire import Add, Delta
from carpool.engine.worker import build_serving_engine, delta_of, refusal_of
from carpool.ray_serve.kv_store import store_for, uses_ray_store
from carpool.ray_serve.tp_followers import start_rank_actors
from carpool.ray_serve.wire import (
    REPORT_KEY,
    Accepted,
    AppSettings,
    Failed,
    Outputs,
    Refused,
    ReplicaReport,
    Routed,
    RouteHint,
    StatsReply,
)
from carpool.scheduler import RejectedError
from carpool.scheduler.pinned_prefixes import PinSpec

log = logging.getLogger("carpool.server")

# Recent steps a routing report carries: the router fits the replica's step costs on them.
REPORTED_STEPS = 64

_add_decoder = msgspec.msgpack.Decoder(Add)
_hint_decoder = msgspec.msgpack.Decoder(RouteHint)
_routed_decoder = msgspec.msgpack.Decoder(Routed)
_pins_decoder = msgspec.msgpack.Decoder(list[PinSpec])


async def _batches(stream: RequestStream) -> AsyncIterator[list[Delta]]:
    """The stream's outputs as deltas, each batch every output already
    queued when the previous batch left: one stream item per token costs a
    Ray hop per token, and a hop slower than a step queues them. A batch
    never waits for a token (the first of each is awaited alone); an error
    after some outputs sends those first."""
    async for output in stream:
        batch = [delta_of(output)]
        while not output.finished and stream.ready:
            try:
                output = await anext(stream)  # queued: returns without waiting
            except EngineDeadError:
                yield batch
                raise
            batch.append(delta_of(output))
        yield batch


class HeldBlocks:
    """``BlockEvents`` kept as the set of block hashes the prefix cache
    holds. The engine thread reports, the replica's event loop snapshots:
    hence the lock (a ``KvEventBuffer`` is single-threaded)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()

    def stored(self, hashes: Iterable[int]) -> None:
        with self._lock:
            self._held.update(hashes)

    def evicted(self, hashes: Iterable[int]) -> None:
        with self._lock:
            self._held.difference_update(hashes)

    def snapshot(self) -> list[int]:
        with self._lock:
            return list(self._held)


def replica_name() -> str:
    """This Ray Serve replica's unique id (what the request router sees)."""
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


def app_name() -> str:
    """The Serve application this replica belongs to."""
    from ray import serve

    return serve.get_replica_context().app_name


class EngineReplica:
    """One engine; the deployment's class (``carpool.ray_serve.app``)."""

    def __init__(self, settings: bytes, role: str = "") -> None:
        """``role``: ``prefill`` or ``decode`` (a P/D pool), or empty (colocated)."""
        if role not in ("", "prefill", "decode"):
            raise ValueError(f"an engine replica's role is prefill, decode or empty, got {role!r}")
        app = AppSettings.decode(settings)
        self.config = app.engine
        self.role = role
        self.name = replica_name()
        self.held = HeldBlocks()
        kv_store = (store_for(self.config.cache, app_name())
                    if role and uses_ray_store(self.config.cache) else None)
        self._encoder = msgspec.msgpack.Encoder()
        if self.config.model.threads is None:
            # Ray's CPUs for this replica (at least one thread): more torch
            # threads than cores make every OpenMP region wait (async_engine).
            ranks = self.config.model.tensor_parallel_size  # each rank its share
            self.config.model.threads = max(1, int(app.replica_cpus / ranks))
        sliced = self.config.model.tensor_parallel_size > 1

        def build():
            engine = build_serving_engine(self.config, app.slo_sources, None, log.info,
                                          kv_store=kv_store,
                                          start_followers=start_rank_actors if sliced else None)
            engine.scheduler.kv.report_blocks_to(self.held)  # before the first request
            return engine

        # Built on the engine thread: one thread runs every torch op.
        self.engine = AsyncEngine(build)
        self.pins = PinReconciler(self.engine)  # the ingress's pins, with each stats poll
        log.info("engine replica %s%s ready (pid %d)", self.name,
                 f" ({role})" if role else "", os.getpid())

    async def generate(self, add: bytes, hint: bytes, routed: bytes = b"",
                       ) -> AsyncIterator[bytes]:
        """Run one request: ``Accepted`` (with the router's ``routed``
        decision) or ``Refused`` first, then ``Outputs`` until one finishes
        (``Failed`` if the engine dies under it)."""
        request = _add_decoder.decode(add)
        route = _hint_decoder.decode(hint)
        encode = self._encoder.encode
        try:
            stream = await self.engine.add_request(
                request.prompt_token_ids, request.params, request.request_id,
                request.priority, request.session_id, request.deadline, request.max_wait,
                request.cache_salt, received_at=time.monotonic() - max(0.0, route.waited_s),
                handoff=request.handoff)
        except (ValueError, RejectedError) as exc:
            yield encode(Refused(refusal_of(request.request_id, exc)))
            return
        except EngineDeadError as exc:
            yield encode(Failed(str(exc)))
            return
        yield encode(Accepted(self.name, _routed_decoder.decode(routed) if routed else None))
        try:
            async for deltas in _batches(stream):
                yield encode(Outputs(deltas))
        except EngineDeadError as exc:
            yield encode(Failed(str(exc)))
        finally:
            await stream.aclose()  # cancelled (the ingress left): abort, free the blocks

    async def stats(self, pins: bytes = b"") -> bytes:
        """This replica's ``StatsReply`` (the ingress polls it for /metrics);
        ``pins``: the ingress's pinned prefixes, to hold (``RayEngine``)."""
        if pins:
            self.pins.sync(_pins_decoder.decode(pins))
        return self._encoder.encode(StatsReply(self.name, self.current_stats(),
                                               self.engine.info, os.getpid()))

    def current_stats(self) -> EngineStats:
        """The engine thread's latest snapshot, its KV store counters read
        now: the store's I/O thread goes on after the engine went idle (a
        P/D prefill's last layer parts), and an idle engine publishes no
        new snapshot. Plain counters, which the I/O thread only adds to."""
        stats = self.engine.stats
        connector = self.engine.engine.kv_connector
        if connector is None:
            return stats
        return dataclasses.replace(stats, kv_store=connector.metrics())

    def record_routing_stats(self) -> dict[str, bytes]:
        """Ray Serve's routing-stats hook: a ``ReplicaReport`` for carpool's router."""
        stats, cache, scheduler = self.engine.stats, self.config.cache, self.config.scheduler
        steps, _ = self.engine.step_log.snapshot(REPORTED_STEPS)
        report = ReplicaReport(
            self.name, stats.num_waiting, stats.num_running, stats.kv_usage,
            stats.kv_num_blocks - stats.kv_used_blocks, scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens, cache.block_size, self.held.snapshot(),
            [(s.shape.tokens, s.shape.seqs, s.seconds) for s in steps], stats.waiting_tokens)
        return {REPORT_KEY: self._encoder.encode(report)}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom-metrics hook, read by carpool's autoscaling policy."""
        stats = self.engine.stats
        return {"waiting": float(stats.num_waiting), "running": float(stats.num_running),
                "slots": float(self.config.scheduler.max_num_seqs),
                "requests_added": float(stats.counters.requests_added)}

    def check_health(self) -> None:
        """Ray Serve's health check: a dead engine loop restarts the replica."""
        if not self.engine.is_alive:
            raise RuntimeError(f"the engine loop of replica {self.name} is dead")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()  # in flight: each stream ends with an error
