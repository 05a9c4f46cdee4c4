"""FleetEngine: N engine worker processes behind carpool's router.

``carpool serve --replicas N`` runs one API process (this one: the same
FastAPI app, keys, limits, errors and metrics) in front of N engine
worker processes on this machine, each an ``EngineClient`` (the one kind
of engine connection; N = 1 is plain ``carpool serve``). The router of
``carpool.cluster`` (the simulator's, unchanged) picks each request's
replica from live views: what it sent each replica and has not finished
(exact, counted here), each replica's polled stats, and the fleet prefix
index fed by the replicas' block events, keyed by hashes every replica
shares (``CacheConfig.block_hash_key``, one secret per fleet).

A replica whose worker dies fails only its own requests (the client's
error), leaves the router at once and is started again; /health says
``degraded`` until it is back. The interface is ``EngineClient``'s, so the
server cannot tell one engine from a fleet. A pinned prefix
(``carpool.engine.pins``) is pinned on every replica, and again on a
replica that joins later (restarted or added by the autoscaler).
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence

from carpool.cluster.autoscaler import AutoscaleConfig, PoolScaler, make_scaler
from carpool.cluster.router import Router
from carpool.cluster.view import Health, ReplicaView, Role, RouteRequest, RoutingError
from carpool.config import EngineConfig
from carpool.engine.client import EngineClient, LiveRequest
from carpool.engine.front import RequestIntake
from carpool.engine.pins import PinFront, PinRegistry, repin, run_pin_everywhere
from carpool.engine.stats import EngineStats, merge_stats, retired_stats
from carpool.engine.step_log import StepLog
from carpool.engine.streams import EngineDeadError, RequestStream
from carpool.engine.wire import Handoff
from carpool.fleet.autoscaled import AutoscaledPool
from carpool.fleet.parked import ParkedRequests
from carpool.fleet.store_host import local_kv_store
from carpool.sampling_params import SamplingParams
from carpool.scheduler import RejectedError
from carpool.scheduler.control.cost_model import StepCostModel
from carpool.scheduler.kv_events import BlockKeyChain
from carpool.scheduler.pinned_prefixes import PinSpec

log = logging.getLogger("carpool.server")

VIEW_INTERVAL_S = 0.25  # how often replicas' polled stats refresh the router's views


def routing_report(router: Router, views: Sequence[ReplicaView],
                   pid_of: Callable[[str], int | None], scaler: PoolScaler | None,
                   restarts: int, rerouted: int, resumed: int = 0, held: int = 0) -> dict:
    """A fleet's routing for ``/carpool/policy``: its replicas as the router
    sees them, decision counts by cause and the latest decisions (each with
    its cause), and the autoscaler's latest events."""
    replicas = [{"replica": v.replica_id, "role": v.role.value, "health": v.health.value,
                 "in_flight": v.in_flight, "waiting": v.waiting, "running": v.running,
                 "kv_usage": v.kv_usage, "pid": pid_of(v.replica_id)} for v in views]
    scaling = {}
    if scaler is not None:
        scaling = {"scaling": {"replicas": scaler.replicas, "events": [
            {"time": e.time, "from": e.replicas_from, "to": e.replicas_to, "cause": e.cause}
            for e in scaler.events[-20:]]}}
    return {**scaling, "routing": {"policy": router.policy.name, "replicas": replicas,
                                   "restarts": restarts, "rerouted": rerouted,
                                   "resumed": resumed, "held_for_restart": held,
                                   "causes": dict(router.causes),
                                   # mean |predicted - observed| / observed of the latest TTFTs
                                   "ttft_prediction_error": router.ttft_error,
                                   # the analytic and the learned model, on the same tokens
                                   "ttft_models": router.ttft_errors_by_model(),
                                   "index_corrections": router.index_corrections,
                                   "decisions": list(router.decisions)[-20:]}}


class FleetEngine(AutoscaledPool, PinFront, RequestIntake):
    """Several engine workers with one engine's interface (module docstring)."""

    def __init__(self, launch: dict, config: EngineConfig, router: Router,
                 clients: Sequence[EngineClient], scaler: PoolScaler | None = None,
                 pool: str = "r", role: Role = Role.MIXED) -> None:
        """``pool``: the replicas' names' prefix (``r0``, ``r1``, ...);
        ``role``: theirs in the ``router``, which other pools may share (P/D)."""
        self._launch = launch  # EngineClient.start's arguments, for restarts
        self.config = config
        self.router = router
        self.step_log = clients[0].step_log  # shared by every replica
        self.info = clients[0].info
        self.tokenizer = clients[0].tokenizer
        self.on_failure = None  # a replica's death is not the server's: it restarts
        self.clients: dict[str, EngineClient] = {}
        self.restarts = 0
        self.rerouted = 0  # requests a dead replica held unstarted, sent to another
        self.resumed = 0  # requests a dead replica had streamed from, resumed on another
        self._chain = BlockKeyChain(config.cache.block_size,
                                    bytes.fromhex(config.cache.block_hash_key))
        self._stopping = False
        self._restarting: set[asyncio.Task] = set()
        self.parked = ParkedRequests()  # a dead replica's, while no other is up
        self._loop = asyncio.get_running_loop()
        self.pool, self.role = pool, role
        self.pins = PinRegistry()  # pinned on every replica, and on each that joins
        # The counters of replicas that left (``retired_stats``), kept in the
        # fleet's totals so they never go backwards when a worker restarts.
        self._retired: EngineStats | None = None
        self._init_scaling(scaler, len(clients))  # --autoscale (``AutoscaledPool``)
        # The router resyncs a replica's index entries through its worker; a
        # router shared with another pool (P/D) asks that pool for its own.
        other_pool = router.resync_index

        def resync_index(replica_id: str) -> None:
            client = self.clients.get(replica_id)
            if client is not None:
                client.resync_kv_events()
            elif other_pool is not None:
                other_pool(replica_id)

        router.resync_index = resync_index
        for index, client in enumerate(clients):
            self._join(f"{pool}{index}", client)
        self._last_stats = self.stats
        self._views = asyncio.ensure_future(self._refresh_views())
        self.kv_store_server = None  # the shared KV store this front hosts (kv_store: local)

    @classmethod
    async def start(cls, config: EngineConfig, replicas: int, routing: str = "predicted-ttft",
                    autoscale: AutoscaleConfig | None = None, autoscale_policy: str = "reactive",
                    pool: str = "r", router: Router | None = None, role: Role = Role.MIXED,
                    start_delay_s: float = 0.0, concurrency_from_replicas: bool = False,
                    forecaster: str = "holt", **launch) -> "FleetEngine":
        """Start ``replicas`` workers (concurrently) on one block-hash secret;
        ``autoscale``: then move the count within its bounds by the
        ``autoscale_policy``'s wants (``carpool.cluster.autoscaler``);
        ``router``: one shared with other pools (its policy then is
        ``routing``'s already), where this pool's replicas take ``role``;
        ``start_delay_s``, ``concurrency_from_replicas``: see ``AutoscaledPool``."""
        scaler = None
        if autoscale is not None:
            scaler = make_scaler(autoscale_policy, autoscale, replicas, forecaster=forecaster)
            replicas = scaler.replicas  # clamped into [min, max]
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        config = copy.deepcopy(config)
        if config.cache.block_hash_key is None:  # one secret per fleet, made here
            config.cache.block_hash_key = secrets.token_hex(32)
        store_server = local_kv_store(config)
        if config.model.threads is None:
            # The machine's cores split between the replicas (as many as the
            # autoscaler may start): more torch threads than cores make every
            # OpenMP region wait (see async_engine).
            # A sliced replica is one process per rank.
            most = autoscale.max_replicas if autoscale is not None else replicas
            processes = most * config.model.tensor_parallel_size
            config.model.threads = max(1, (os.cpu_count() or 1) // processes)
        router = router if router is not None else Router(routing)
        launch = {**launch, "kv_events": True, "step_log": launch.get("step_log") or StepLog()}
        started = await asyncio.gather(*(EngineClient.start(config, **launch)
                                         for _ in range(replicas)), return_exceptions=True)
        failure = next((c for c in started if isinstance(c, BaseException)), None)
        if failure is not None:
            await asyncio.gather(*(c.wait_closed() for c in started
                                   if isinstance(c, EngineClient)))
            if store_server is not None:
                store_server.stop()
            raise failure
        fleet = cls(launch, config, router, started, scaler, pool, role)
        fleet.kv_store_server = store_server
        fleet.start_delay_s, fleet.concurrency_from_replicas = (start_delay_s,
                                                                concurrency_from_replicas)
        return fleet

    # -- membership ----------------------------------------------------------------------

    def _join(self, replica_id: str, client: EngineClient) -> None:
        scheduler = self.config.scheduler
        # The replica's step costs, fitted from its steps as they come: what
        # the predicted-TTFT policy prices each replica's queue with.
        cost_model = StepCostModel()
        self.router.add_replica(ReplicaView(
            replica_id, self.role, max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            block_size=self.config.cache.block_size, free_blocks=client.info.kv_num_blocks,
            cost_model=cost_model))
        self.clients[replica_id] = client
        client.replica_id = replica_id
        client.on_steps = lambda steps: [cost_model.record(s.shape.tokens, s.shape.seqs,
                                                           s.seconds) for s in steps]
        client.on_kv_events = lambda batch, rid=replica_id: self.router.block_events(
            rid, batch.stored, batch.evicted, batch.reset)
        client.on_request = self._progress
        client.on_failure = lambda exc, rid=replica_id: self._replica_died(rid, exc)
        client.on_orphan = lambda live, rid=replica_id: self._reroute(rid, live)
        client.stream_owner = self  # aborts follow a request to whichever replica has it
        if self.pins.specs:  # a replica joining a running fleet holds its pins too
            self._spawn(repin(client, list(self.pins.specs.values()), replica_id))
        for live in self.parked.take_all():  # held for the first replica up
            if not self._send_on(live):
                live.queue.put_nowait(EngineDeadError(
                    f"request {live.add.request_id}: no replica could take it over"))
        self._joined_now()  # requests waiting at zero replicas go on

    def _progress(self, request_id: str, first: bool, ended: bool,
                  cached_tokens: int | None) -> None:
        now = time.monotonic()
        if first:
            self.router.first_token(request_id, now, cached_tokens)
        if ended:
            self.router.finished(request_id, now)

    def _replica_died(self, replica_id: str, exc: BaseException) -> None:
        """Its requests already failed (the client's error); route around it
        and start a new worker in its place."""
        self.router.set_health(replica_id, Health.DEAD)
        self.router.remove_replica(replica_id)
        dead = self.clients.pop(replica_id)
        self._retire(dead)
        log.error("replica %s died (%s); starting a new worker", replica_id, exc)
        if not self._stopping:
            task = asyncio.ensure_future(self._restart(replica_id, dead))
            self._restarting.add(task)
            task.add_done_callback(self._restarting.discard)

    def _route(self, request_id: str, ids: list[int], session_id: str | None, priority: int,
               cache_salt: str | None) -> str:
        """The replica for a request (counted there by the router)."""
        hashes = self.block_hashes(ids, cache_salt)
        try:
            decision = self.router.route(RouteRequest(request_id, len(ids), hashes, session_id,
                                                      priority), time.monotonic(), self.role)
        except RoutingError as exc:  # no replica ready, or every one over the TTFT target
            raise RejectedError(exc.reason, exc.retry_after, str(exc)) from None
        return decision.replica_id

    def block_hashes(self, ids: Sequence[int], cache_salt: str | None) -> list[int]:
        """The chained keys of the prompt's full blocks (the fleet's secret)."""
        full_blocks = len(ids) // self.config.cache.block_size
        return self._chain.keys(self._chain.root(cache_salt), ids, 0, full_blocks)[1]

    def _reroute(self, dead_id: str, live: LiveRequest) -> bool:
        """A request the dead replica held goes to another one, its caller
        none the wiser: sent again if nothing of it reached the caller, else
        resumed after the tokens that did (``LiveRequest.resumed_add``); held
        for the replica restarting in its place when none other is up
        (``ParkedRequests``). False: it fails instead."""
        if self._stopping:
            return False
        self.router.set_health(dead_id, Health.DEAD)  # before routing: not back to it
        self.router.finished(live.add.request_id, time.monotonic(), learn=False)
        # A P/D prefill part is not held: its front runs it on a decode
        # replica at once instead (``PDFleet``'s rescue).
        if self.role is not Role.PREFILL and not any(v.routable for v in self.views()):
            self.parked.park(live, time.monotonic())
            self._loop.call_later(self.parked.wait_s + 0.1, self._expire_parked)
            return True
        return self._send_on(live)

    def _send_on(self, live: LiveRequest) -> bool:
        """Route a dead replica's request anew and hand it to the chosen one."""
        add = live.add
        try:
            replica_id = self._route(add.request_id, add.prompt_token_ids, add.session_id,
                                     add.priority, add.cache_salt)
        except RejectedError:
            return False
        client = self.clients.get(replica_id)
        if client is None or not client.is_alive:
            self.router.finished(add.request_id, time.monotonic(), learn=False)
            return False
        if live.started:
            self.resumed += 1
        else:
            self.rerouted += 1
        client.adopt(live)
        return True

    def _expire_parked(self) -> None:
        self.parked.expire(time.monotonic())

    async def _restart(self, replica_id: str, dead: EngineClient) -> None:
        began = time.monotonic()
        await dead.wait_closed(timeout=5.0)
        while not self._stopping:
            try:
                client = await EngineClient.start(self.config, **self._launch)
            except Exception as exc:  # noqa: BLE001 - retried: a restart must not give up
                log.error("restarting replica %s failed (%s); retrying in 5 s", replica_id, exc)
                await asyncio.sleep(5.0)
                continue
            if self._stopping:
                await client.wait_closed()
                return
            self.restarts += 1
            self._join(replica_id, client)
            log.warning("replica %s is back after %.1f s (worker pid %d)", replica_id,
                        time.monotonic() - began, client.pid)
            return

    async def _refresh_views(self) -> None:
        while True:
            now = time.monotonic()
            for replica_id, client in list(self.clients.items()):
                stats = client.stats
                self.router.update_stats(
                    replica_id, now, waiting=stats.num_waiting, running=stats.num_running,
                    kv_usage=stats.kv_usage, waiting_tokens=stats.waiting_tokens,
                    free_blocks=stats.kv_num_blocks - stats.kv_used_blocks)
            await asyncio.sleep(VIEW_INTERVAL_S)

    # -- EngineClient's interface ----------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """The replicas' snapshots merged (``merge_stats``) with the counters
        of those that left; the last merge while there are neither."""
        snapshots = [c.stats for c in self.clients.values()]
        if self._retired is not None:  # an unpinned prefix's series leaves with it
            snapshots.append(dataclasses.replace(self._retired, pinned=tuple(
                p for p in self._retired.pinned if p.pin_id in self.pins.specs)))
        if snapshots:
            self._last_stats = merge_stats(snapshots)
        return dataclasses.replace(self._last_stats, requests_rerouted=self.rerouted,
                                   requests_resumed=self.resumed)

    def _retire(self, client: EngineClient) -> None:
        left = retired_stats(client.stats)
        self._retired = left if self._retired is None else merge_stats([self._retired, left])

    def replica_stats(self) -> dict[str, EngineStats]:
        """Each live replica's latest snapshot (``/metrics``' ``replica`` label)."""
        return {replica_id: client.stats for replica_id, client in self.clients.items()}

    @property
    def is_alive(self) -> bool:
        """Serving: some replica is up (``degraded`` says whether all are), or
        none by the autoscaler's choice (the next request starts one)."""
        return not self._stopping and (any(c.is_alive for c in self.clients.values())
                                       or self.scaled_to_zero)

    @property
    def degraded(self) -> str | None:
        """Why the fleet runs below its size (dead replicas restarting), or None."""
        if not self._restarting:
            return None
        return f"{len(self._restarting)} replica(s) restarting, {len(self.clients)} serving"

    def routing(self) -> dict:
        return routing_report(self.router, self.views(), self.replica_pid, self.scaler,
                              self.restarts, self.rerouted, self.resumed, self.parked.held)

    def replica_pid(self, replica_id: str) -> int | None:
        """The worker process of ``replica_id`` (None: not serving now)."""
        return getattr(self.clients.get(replica_id), "pid", None)

    def views(self) -> list[ReplicaView]:
        """This pool's replicas as the router sees them."""
        return [v for v in self.router.views.values() if v.replica_id in self.clients]

    @property
    def last_progress(self) -> float:
        if self.scaled_to_zero:  # idle by design: nothing is stalled
            return time.monotonic()
        return max((c.last_progress for c in self.clients.values()), default=0.0)

    @property
    def num_in_flight(self) -> int:
        return sum(c.num_in_flight for c in self.clients.values()) + len(self.parked)

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0,
                          session_id: str | None = None, deadline: float | None = None,
                          max_wait: float | None = None, cache_salt: str | None = None,
                          received_at: float | None = None, handoff: Handoff | None = None,
                          delivered_text: str = "", replica_id: str | None = None
                          ) -> RequestStream:
        """Route, then ``EngineClient.add_request`` on the chosen replica.
        ``replica_id``: the one a planner chose and counted in the router
        under ``request_id`` already (P/D); routed anew if it left since."""
        # Duplicate ids: the replica's client refuses them (it holds the live ones).
        request_id, ids, params = self._intake(prompt, params, request_id, ())
        self._arrivals += 1
        if (self.scaler is not None and not self._restarting
                and not self.router.candidates(self.role)):
            await self.wait_for_a_replica()  # scaled to zero (or its last one draining)
        if replica_id is None or self.router.replica_of(request_id) != replica_id:
            replica_id = self._route(request_id, ids, session_id, priority, cache_salt)
        client = self.clients.get(replica_id)
        try:
            if client is None:
                raise EngineDeadError(f"replica {replica_id} is restarting")
            return await client.add_request(ids, params, request_id, priority, session_id,
                                            deadline, max_wait, cache_salt, received_at,
                                            handoff, delivered_text)
        except BaseException:
            self.router.finished(request_id, time.monotonic(), learn=False)
            raise

    async def run_pin(self, spec: PinSpec) -> None:
        """Pin on every replica (``PinFront``)."""
        await run_pin_everywhere(self.clients.values(), spec)

    def drop_pin(self, pin_id: str) -> None:
        for client in self.clients.values():
            client.drop_pin(pin_id)

    def abort(self, request_id: str) -> None:
        self.abort_without_lock(request_id)

    def abort_without_lock(self, request_id: str) -> None:
        """Abort where the request is now (any thread: on the event loop)."""
        try:
            self._loop.call_soon_threadsafe(self._abort_here, request_id)
        except RuntimeError:  # the loop is closed: nothing runs any more
            pass

    def _abort_here(self, request_id: str) -> None:
        """On the event loop, where a request moves (a dead replica's goes
        to another, or is held): abort it wherever it is now."""
        if self.parked.abort(request_id):
            return
        replica_id = self.router.replica_of(request_id)
        client = self.clients.get(replica_id) if replica_id else None
        if client is not None:
            client.abort_without_lock(request_id)

    def drop_handoff(self, ids: Sequence[int], cache_salt: str | None, parts_key: int,
                     replica_id: str | None = None) -> bool:
        """P/D: the layer parts of a handoff of prompt ``ids`` that no decode
        part took, deleted by ``replica_id`` (the one that exported them:
        after its own writes) or else any replica (they all reach the one
        store); False: none is up."""
        client = self.clients.get(replica_id) if replica_id is not None else None
        if client is None or not client.is_alive:
            client = next((c for c in self.clients.values() if c.is_alive), None)
        hashes = self.block_hashes(ids, cache_salt)
        if client is not None and hashes:
            client.drop_handoff(hashes, parts_key)
        return client is not None

    def first_token_seen(self, first_token_time: float) -> None:
        """The delivery lag is this process's (its event loop), so every
        replica's admission gets each observation."""
        for client in self.clients.values():
            client.first_token_seen(first_token_time)

    def shutdown(self) -> None:
        self._stopping = True
        self.parked.fail_all(EngineDeadError("the server is shutting down"))
        for client in self.clients.values():
            client.shutdown()

    async def wait_closed(self, timeout: float = 10.0) -> None:
        self.shutdown()
        background = [self._views, *self._restarting, *self._scaling]
        if self._ticks is not None:
            background.append(self._ticks)
        for task in background:
            task.cancel()
        await asyncio.gather(*(c.wait_closed(timeout) for c in list(self.clients.values())),
                             *background, return_exceptions=True)
        if self.kv_store_server is not None:
            self.kv_store_server.stop()
            self.kv_store_server = None
