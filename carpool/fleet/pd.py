"""PDFleet: a prefill pool and a decode pool behind one front (P/D serving).

``carpool serve --prefill P --decode D`` runs one API process in front of
two ``FleetEngine`` pools of engine workers (replicas ``p0``.. and
``d0``..), each with carpool's router, sharing one block-hash secret and
one KV store (by default a TCP store this process serves on 127.0.0.1).

A request's life (``wire.Handoff``):

1. the prefill pool's router picks a replica, which computes the prompt
   and samples the first token (``max_tokens`` 1); its prompt blocks are
   written to the store as they fill up, off the engine thread;
2. the first token goes to the client as soon as it is back here;
3. the request goes on in the decode pool: the chosen replica admits it
   ahead of its own prefills, loads the prompt's full blocks from the
   store (waiting for blocks still on their way, up to the connector's
   ``handoff_wait_s``; what never comes it computes), computes the last
   partial block and the first token, and generates the rest.

Sampling draws from (seed, token index), so the front fixes a seed for a
request that has none: both parts then draw what one replica would, and
greedy outputs are those of colocated serving. Detokenizing state crosses
over too: the prefill part holds back text that may begin a stop string,
and the decode part re-reads the first token before going on.

Placement: both pools' replicas are views of one router (the prefill
pool's role ``prefill``, the decode pool's ``decode``), so its prefix index
and cost models cover the fleet, and ``carpool.cluster.pd.PDPlanner`` (the
simulator's) picks each request's decode replica and, unless the request
stays colocated there, its prefill replica, counting both at once:
``always`` (``--pd-mode``, the default) disaggregates every request while a
prefill replica is ready; ``conditional`` only where the predicted first
token with the transfer (``--pd-bandwidth``/``--pd-latency``) beats a
prefill on the decode replica itself. Without a planner (Ray Serve, whose
request routers place each part), every request is disaggregated and each
pool places its part.

Pinned prefixes (``carpool.engine.pins``) are pinned in both pools. The
prefill pool computes the prompts, so there a pin saves the prefix's
compute; the decode pool pins too because its replicas prefill as well
(a request the planner keeps colocated, a rescued one) and because a
decode leg admits with its local prefix hits first and loads only the rest
from the store: a pinned prefix is neither recomputed nor transferred.
Hits are counted on the leg that prefilled (a decode leg after a handoff
is not counted again).

Failures: a prefill replica that dies before the first token costs the
client nothing (the request runs colocated on a decode replica instead);
after it, a decode replica that dies has its streams resumed on another
(``FleetEngine``), or on the one restarting in its place when none other
is up, and a decode part finding no decode replica up while one restarts
waits for it (``_decode_leg``). The dead replica's pool restarts it, and no
blocks stay held: the prefill part's blocks return to its pool when it
finishes (their bytes were copied out for the store), the decode part's
when it ends. Nor do the handoff's layer parts stay in the store: the
decode part deletes them once fetched, or when it ends; a prefill part
that ends without a decode part, at once; and the front has a replica
delete them when no decode part took them (``_go_on``).
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import random
import secrets
import time
from collections.abc import Sequence

from carpool.cluster.pd import PD_MODES, KVShape, Link, PDPlan, PDPlanner
from carpool.cluster.router import Router
from carpool.cluster.view import Role, RouteRequest, RoutingError
from carpool.config import EngineConfig
from carpool.engine.front import RequestIntake
from carpool.engine.outputs import RequestOutput
from carpool.engine.stats import EngineStats, merge_stats
from carpool.engine.step_log import StepLog
from carpool.engine.streams import EngineDeadError, RequestStream
from carpool.engine.wire import Handoff
from carpool.fleet.local import FleetEngine
from carpool.fleet.parked import RESTART_WAIT_S
from carpool.fleet.store_host import local_kv_store
from carpool.sampling_params import SamplingParams
from carpool.scheduler import RejectedError
from carpool.scheduler.pinned_prefixes import PinSpec

log = logging.getLogger("carpool.server")

RESTART_POLL_S = 0.2  # a decode leg waiting for a restarting replica asks this often


class PDFleet(RequestIntake):
    """Prefill and decode pools with one engine's interface (module docstring)."""

    def __init__(self, prefill: FleetEngine, decode: FleetEngine, store_server=None,
                 planner: PDPlanner | None = None) -> None:
        """``planner``: over the router both pools share (module docstring);
        None: every request disaggregated, each pool placing its part."""
        self.prefill, self.decode = prefill, decode
        self.planner = planner
        self.config = decode.config
        self.info = decode.info
        self.tokenizer = decode.tokenizer
        self.step_log = decode.step_log  # both pools log into it
        self.on_failure = None  # a replica's death is its pool's business
        self.kv_store_server = store_server
        self.handoffs = 0  # requests that went from a prefill to a decode replica
        self.colocated = 0  # requests the planner kept on a decode replica
        self.rescued = 0  # requests re-run on a decode replica: their prefill one died
        self.decode_waited = 0  # decode parts that waited for a decode replica's restart
        self._parts: dict[str, asyncio.Task] = {}  # request id -> what moves it along
        self._seeds = random.Random()
        self._stopping = False

    @classmethod
    async def start(cls, config: EngineConfig, prefill: int, decode: int,
                    routing: str = "predicted-ttft", mode: str = "always",
                    link: Link | None = None, min_remote_tokens: int = 0,
                    stall_weight: float = 0.0, **launch) -> "PDFleet":
        """Start both pools (concurrently) on one secret, one router and one
        KV store (``kv_store`` unset or ``local``: served by this process);
        ``mode``, ``link``, ``min_remote_tokens``, ``stall_weight``: the
        planner's (``PDPlanner``)."""
        if prefill < 1 or decode < 1:
            raise ValueError(f"P/D serving needs prefill and decode replicas, got {prefill}:"
                             f"{decode}")
        if mode not in PD_MODES:
            raise ValueError(f"pd_mode must be one of {', '.join(PD_MODES)}, got {mode!r}")
        config = copy.deepcopy(config)
        if config.cache.block_hash_key is None:
            config.cache.block_hash_key = secrets.token_hex(32)
        if config.cache.kv_store is None:
            config.cache.kv_store = "local"
        if not config.cache.enable_prefix_caching:
            raise ValueError("P/D serving moves KV by block keys: it needs prefix caching")
        store_server = local_kv_store(config)
        if config.model.threads is None:  # the cores split between every replica
            processes = (prefill + decode) * config.model.tensor_parallel_size  # one per rank
            config.model.threads = max(1, (os.cpu_count() or 1) // processes)
        launch["step_log"] = StepLog()
        router = Router(routing)
        pools = await asyncio.gather(
            FleetEngine.start(config, prefill, routing, pool="p", router=router,
                              role=Role.PREFILL, **launch),
            FleetEngine.start(config, decode, routing, pool="d", router=router,
                              role=Role.DECODE, **launch),
            return_exceptions=True)
        failure = next((p for p in pools if isinstance(p, BaseException)), None)
        if failure is not None:
            await asyncio.gather(*(p.wait_closed() for p in pools
                                   if isinstance(p, FleetEngine)))
            if store_server is not None:
                store_server.stop()
            raise failure
        planner = PDPlanner(router, KVShape(*pools[1].info.kv_shape), link,
                            min_remote_tokens, always=mode == "always",
                            stall_weight=stall_weight)
        return cls(*pools, store_server, planner)

    # -- requests ----------------------------------------------------------------------

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0,
                          session_id: str | None = None, deadline: float | None = None,
                          max_wait: float | None = None, cache_salt: str | None = None,
                          received_at: float | None = None) -> RequestStream:
        """The prefill part is queued (its refusal raised here, as any
        engine's); the rest follows on a task of its own."""
        request_id, ids, params = self._intake(prompt, params, request_id, self._parts)
        if params.seed is None:  # one seed for both parts (module docstring)
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        common = {"priority": priority, "session_id": session_id, "cache_salt": cache_salt}
        times = {"deadline": deadline, "max_wait": max_wait, "received_at": received_at}
        if params.max_tokens <= 1:  # nothing to hand over
            return await self.prefill.add_request(ids, params, request_id, **times, **common)
        plan = self._plan(request_id, ids, session_id, priority, cache_salt)
        # The decode leg's replica (the planner counted it there already).
        home = {"replica_id": plan.decode.replica_id} if plan is not None else {}
        if plan is not None and not plan.disaggregated:
            self.colocated += 1
            return await self.decode.add_request(ids, params, request_id, **times, **home,
                                                 **common)
        worker = {"replica_id": plan.prefill.replica_id} if plan is not None else {}
        parts = _Parts(self._seeds.getrandbits(64) or 1, worker.get("replica_id"))
        try:
            first = await self.prefill.add_request(
                ids, dataclasses.replace(params, max_tokens=1), PDPlanner.prefill_leg(request_id),
                handoff=Handoff("prefill", parts_key=parts.key), **times, **worker, **common)
        except EngineDeadError as exc:  # no prefill replica took it: run it colocated
            self._rescue(request_id, exc)
            return await self.decode.add_request(ids, params, request_id, **times, **home,
                                                 **common)
        except BaseException:
            self._release(request_id)
            raise
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self._go_on(request_id, ids, params, first, queue,
                                                 {**common, **home}, parts))
        self._parts[request_id] = task
        task.add_done_callback(lambda _: self._parts.pop(request_id, None))
        return RequestStream(self, request_id, queue)

    def _plan(self, request_id: str, ids: list[int], session_id: str | None, priority: int,
              cache_salt: str | None) -> PDPlan | None:
        """The planner's placement, both legs counted (None: no planner)."""
        if self.planner is None:
            return None
        hashes = self.decode.block_hashes(ids, cache_salt)
        try:
            return self.planner.plan(RouteRequest(request_id, len(ids), hashes, session_id,
                                                  priority), time.monotonic())
        except RoutingError as exc:  # no decode replica ready
            raise RejectedError(exc.reason, exc.retry_after, str(exc)) from None

    def _release(self, request_id: str) -> None:
        """The planned decode leg was never sent: uncount it."""
        if self.planner is not None:
            self.planner.router.finished(request_id, time.monotonic(), learn=False)

    async def _go_on(self, request_id: str, ids: list[int], params: SamplingParams,
                     prefill: RequestStream, queue: asyncio.Queue, common: dict,
                     parts: _Parts) -> None:
        """Pass the first token on, then the decode part's outputs (or the
        colocated re-run's, if the prefill replica died)."""
        sent = False  # the decode leg: once sent, its pool uncounts it
        # Whether a decode part took charge of the handoff's layer parts (it
        # drops them itself: once fetched, or when it ends). Else the front
        # has them dropped: the request ended before or between its legs,
        # its prefill replica died mid-export, its decode part was refused.
        taken = False
        try:
            try:
                first = await self._first_output(prefill, request_id)
            except EngineDeadError as exc:  # nothing reached the client yet
                self._rescue(request_id, exc)
                sent = True
                rest = await self.decode.add_request(ids, params, request_id, **common)
                await _forward(rest, queue)
                return
            queue.put_nowait(first)
            if first.finished:  # a stop, a rejection or an abort: that is all
                return
            self.handoffs += 1
            handoff = Handoff("decode", list(first.token_ids), first.logprobs, parts.key)
            sent = True
            rest = await self._decode_leg(ids, params, request_id, handoff, first.text, common)
            taken = True
            await _forward(rest, queue, first)
        except asyncio.CancelledError:
            raise  # aborted: the stream being read (and so its request) was closed
        except BaseException as exc:  # noqa: BLE001 - the client's error, not ours
            queue.put_nowait(exc)
        finally:
            if not sent:
                self._release(request_id)
            if not taken and not self.prefill.drop_handoff(ids, common["cache_salt"], parts.key,
                                                           parts.exporter):
                self.decode.drop_handoff(ids, common["cache_salt"], parts.key)

    async def _decode_leg(self, ids: list[int], params: SamplingParams, request_id: str,
                          handoff: Handoff, delivered_text: str, common: dict) -> RequestStream:
        """Send the decode part. Its client has the first token already: while
        no decode replica is up but one is restarting, it waits for it (at
        most ``RESTART_WAIT_S``) rather than fail."""
        deadline = time.monotonic() + RESTART_WAIT_S
        waited = False
        while True:
            try:
                return await self.decode.add_request(ids, params, request_id, handoff=handoff,
                                                     delivered_text=delivered_text, **common)
            except (RejectedError, EngineDeadError) as exc:  # none up, or it died just now
                if (getattr(exc, "reason", "no_replica") != "no_replica"
                        or self.decode.degraded is None or time.monotonic() > deadline
                        or self._stopping):
                    raise
            if not waited:
                waited = True
                self.decode_waited += 1
            await asyncio.sleep(RESTART_POLL_S)

    def _rescue(self, request_id: str, error: BaseException) -> None:
        log.warning("request %s: its prefill replica died (%s); running it on a decode "
                    "replica", request_id, error)
        self.rescued += 1

    @staticmethod
    async def _first_output(prefill: RequestStream, request_id: str) -> RequestOutput:
        """The prefill part's final output, made the first of the whole
        request (``request_id``'s) unless it ended it (a stop token or
        string, a rejection)."""
        output = None
        async for output in prefill:
            pass
        assert output is not None and output.finished
        output.request_id = request_id
        if output.finish_reason == "length" and output.num_output_tokens:
            output.finished, output.finish_reason, output.finish_time = False, None, None
        return output

    def abort(self, request_id: str) -> None:
        task = self._parts.get(request_id)
        if task is not None:
            task.cancel()  # closes whichever part's stream it is reading
        else:
            self.prefill.abort(request_id)  # a request with nothing to hand over

    def abort_without_lock(self, request_id: str) -> None:
        """Any thread (a stream's finalizer): on the event loop."""
        task = self._parts.get(request_id)
        if task is not None:
            task.get_loop().call_soon_threadsafe(task.cancel)
        else:
            self.prefill.abort_without_lock(request_id)

    def first_token_seen(self, first_token_time: float) -> None:
        self.prefill.first_token_seen(first_token_time)

    async def pin_prefix(self, spec: PinSpec) -> tuple[PinSpec, bool]:
        """Pin in both pools (module docstring): (the pin, whether it is new
        in the prefill pool); a pool that fails leaves it in neither."""
        results = await asyncio.gather(self.prefill.pin_prefix(spec),
                                       self.decode.pin_prefix(spec), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            for pool, result in zip(self.pools, results):
                if not isinstance(result, BaseException) and result[1]:
                    pool.unpin_prefix(spec.pin_id)
            raise failure
        return results[0]

    def unpin_prefix(self, pin_id: str) -> bool:
        in_prefill = self.prefill.unpin_prefix(pin_id)
        return self.decode.unpin_prefix(pin_id) or in_prefill

    def pinned_prefixes(self) -> list[PinSpec]:
        return self.prefill.pinned_prefixes()

    def report(self) -> dict:
        """For /carpool/policy: the placements so far and how they are made."""
        planner = self.planner
        placement = {"mode": "always", "placed_by": "each pool"} if planner is None else {
            "mode": "always" if planner.always else "conditional", "placed_by": "planner",
            "link": {"bandwidth_gbps": planner.link.bandwidth / 1e9,
                     "latency_s": planner.link.latency},
            "min_remote_tokens": planner.min_remote_tokens,
            "stall_weight": planner.stall_weight}
        return {**placement, "handoffs": self.handoffs, "colocated": self.colocated,
                "rescued": self.rescued, "decode_waited": self.decode_waited}

    # -- the engine interface's state ------------------------------------------------------

    def routing(self) -> dict:
        """Both pools' routing (they share one router) and the handoffs."""
        return {"pd": {**self.report(), **{name: pool.routing().get("routing", {})
                                           for name, pool in zip(("prefill", "decode"),
                                                                 self.pools)}}}

    @property
    def pools(self) -> tuple[FleetEngine, FleetEngine]:
        return self.prefill, self.decode

    @property
    def stats(self) -> EngineStats:
        """Every replica's snapshot merged (``merge_stats``)."""
        return merge_stats([self.prefill.stats, self.decode.stats])

    def replica_stats(self) -> dict[str, EngineStats]:
        return {**self.prefill.replica_stats(), **self.decode.replica_stats()}

    @property
    def is_alive(self) -> bool:
        return not self._stopping and self.prefill.is_alive and self.decode.is_alive

    @property
    def degraded(self) -> str | None:
        reasons = [f"{name}: {why}" for name, why in (("prefill", self.prefill.degraded),
                                                        ("decode", self.decode.degraded)) if why]
        return "; ".join(reasons) or None

    @property
    def last_progress(self) -> float:
        return max(self.prefill.last_progress, self.decode.last_progress)

    @property
    def num_in_flight(self) -> int:
        return self.prefill.num_in_flight + self.decode.num_in_flight + len(self._parts)

    def shutdown(self) -> None:
        self._stopping = True
        self.prefill.shutdown()
        self.decode.shutdown()

    async def wait_closed(self, timeout: float = 10.0) -> None:
        self.shutdown()
        for task in list(self._parts.values()):
            task.cancel()
        await asyncio.gather(self.prefill.wait_closed(timeout), self.decode.wait_closed(timeout),
                             *self._parts.values(), return_exceptions=True)
        if self.kv_store_server is not None:
            self.kv_store_server.stop()
            self.kv_store_server = None


@dataclasses.dataclass(frozen=True)
class _Parts:
    """A request's handoff parts: their key (``Handoff.parts_key``) and the
    prefill replica exporting them (None: its pool places the part)."""

    key: int
    exporter: str | None


async def _forward(stream: RequestStream, queue: asyncio.Queue,
                   first: RequestOutput | None = None) -> None:
    """Every output of ``stream`` onto ``queue``; after a handoff, with the
    whole request's arrival, first-token time and prefix hit (the
    prefill's)."""
    async for output in stream:
        if first is not None:
            output.arrival_time = first.arrival_time
            output.first_scheduled_time = first.first_scheduled_time
            output.first_token_time = first.first_token_time
            output.num_cached_tokens = first.num_cached_tokens
        queue.put_nowait(output)
