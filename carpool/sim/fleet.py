"""The fleet router in the simulator: ``carpool.cluster.Router`` fed by
simulated replicas.

The router object is the one a live fleet runs; here its views are fed
from the replicas in virtual time: each replica's listener reports first
tokens and departures (the router counts in-flight work from these), its
block pool reports the chained hashes it caches and evicts (the fleet
prefix index), and its scheduler's learned step-cost model is the view's.
Only policies that read the prefix index pay for block hashes: the
others leave the replicas' lazy keys alone.
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from carpool.cluster import POLICIES, Health, ReplicaView, Role, Router, RouteRequest
from carpool.cluster.autoscaler import PoolScaler, PoolSignals
from carpool.cluster.kv_tier import SharedKVTier, TierClient
from carpool.cluster.pd import KVShape, PDPlanner
from carpool.cluster.policies import ABLATIONS
from carpool.config import EngineConfig
from carpool.scheduler.block_pool import ROOT_HASH, BlockKeyChain
from carpool.sim.pd import FleetPD, PDSettings
from carpool.sim.replica import SimReplica, prompt_token_ids
from carpool.workload.stats import RequestRecord
from carpool.workload.traces import TraceRequest

# Every policy, and the default's ablations (``carpool.cluster.policies.ABLATIONS``).
ROUTING = (*POLICIES, *ABLATIONS)
# A node's share of a pooled DRAM tier, and the NIC it is read over: what
# Mooncake's store runs on (an 8-GPU node gives about 2 TiB of DRAM, each
# GPU's replica one eighth; a 200 Gb/s RDMA NIC per GPU).
TIER_MEMORY_PER_REPLICA = 256 << 30
TIER_BANDWIDTH = 25e9  # bytes/s
TIER_LATENCY_S = 0.001
# Policies that read the fleet prefix index (and so need block hashes).
_CACHE_POLICIES = {"cache-aware", "approx-cache-aware", "kv-cost", "predicted-ttft",
                   "learned-ttft"}


class _Events:
    """One replica's listener and block events, into the router; with
    ``lost`` > 0 that share of its block events never arrives (a fault to
    measure the router's guard against: ``Router._reconcile``)."""

    def __init__(self, router: Router, replica_id: str, lost: float = 0.0) -> None:
        self.router, self.replica_id = router, replica_id
        self.lost = lost
        self._random = random.Random(f"lost-events/{replica_id}")

    def first_token(self, index: int, now: float, cached_tokens: int | None = None) -> None:
        self.router.first_token(str(index), now, cached_tokens)

    def _arrives(self) -> bool:
        return not self.lost or self._random.random() >= self.lost

    def finished(self, index: int, now: float, ok: bool, queued_s: float = 0.0) -> None:
        self.router.finished(str(index), now, learn=ok, queued_s=queued_s)

    def stored(self, hashes: list[int]) -> None:
        if self._arrives():
            self.router.blocks_stored(self.replica_id, hashes)

    def evicted(self, hashes: list[int]) -> None:
        if self._arrives():
            self.router.blocks_evicted(self.replica_id, hashes)


@dataclass(frozen=True)
class KVTierSettings:
    """The shared external KV tier of a simulated fleet (``SharedKVTier``):
    every replica writes the blocks it computes through to it and, on a
    local prefix miss, loads the blocks it holds instead of computing them
    (``carpool.scheduler.kv_connector``). ``memory_bytes`` None: the
    default share per replica times the fleet's replicas."""

    memory_bytes: float | None = None
    bandwidth: float = TIER_BANDWIDTH
    latency: float = TIER_LATENCY_S
    ttl_s: float = 1800.0  # a chat's next turn

    def validate(self) -> KVTierSettings:
        if (self.memory_bytes is not None and self.memory_bytes <= 0) or self.bandwidth <= 0 \
                or self.latency < 0 or self.ttl_s <= 0:
            raise ValueError(f"a KV tier needs memory, bandwidth and TTL > 0 and latency >= 0, "
                             f"got {self}")
        return self

    def build(self, kv_bytes_per_token: float | None, block_size: int,
              replicas: int) -> SharedKVTier:
        if not kv_bytes_per_token:
            raise ValueError("the cost model does not say how many KV bytes a token takes: "
                             "a KV tier cannot be sized")
        block_bytes = kv_bytes_per_token * block_size
        memory = self.memory_bytes or TIER_MEMORY_PER_REPLICA * replicas
        return SharedKVTier(max(1, int(memory // block_bytes)), block_bytes, ttl_s=self.ttl_s,
                            bandwidth=self.bandwidth, latency=self.latency)


def tier_report(tier: SharedKVTier) -> dict:
    """What a run's tier held and served (for the result's JSON)."""
    return {"capacity_blocks": tier.capacity_blocks, "block_bytes": tier.block_bytes,
            "held_blocks": tier.num_blocks, "ttl_s": tier.ttl_s, "bandwidth": tier.bandwidth,
            **dataclasses.asdict(tier.stats)}


class _PrefillEvents(_Events):
    """A prefill replica's listener: its requests are prefill legs, and one
    that leaves hands its decode leg over (``FleetPD.prefill_done``)."""

    def __init__(self, router: Router, replica_id: str, pd, lost: float = 0.0) -> None:
        super().__init__(router, replica_id, lost)
        self.pd = pd

    def first_token(self, index: int, now: float, cached_tokens: int | None = None) -> None:
        self.router.first_token(PDPlanner.prefill_leg(str(index)), now, cached_tokens)

    def finished(self, index: int, now: float, ok: bool, queued_s: float = 0.0) -> None:
        self.router.finished(PDPlanner.prefill_leg(str(index)), now, learn=ok, queued_s=queued_s)
        self.pd.prefill_done(index, now, self.router)


class FleetRouter:
    """Routes each arrival among the replicas active at that time (the first
    ``active(now)`` by index; the others drain) with a cluster policy."""

    def __init__(self, routing: str, replicas: int,
                 schedule: tuple[tuple[float, int], ...] = ()) -> None:
        self.routing = routing
        self.replicas = replicas
        self.schedule = schedule
        self._turn = 0
        self.router: Router | None = None
        self._active = replicas
        self._chain: BlockKeyChain | None = None
        self._hash_block = 1
        self._lost_events = 0.0
        self._by_id: dict[str, SimReplica] = {}
        self.pd: FleetPD | None = None  # the P/D planner, when attached with pools

    def active(self, now: float) -> int:
        count = self.replicas
        for start, replicas in self.schedule:
            if start > now:
                break
            count = replicas
        return count

    def next_turn(self, active: int) -> int:
        """Round-robin's pick among ``active`` replicas, without replica state."""
        turn = self._turn % active
        self._turn += 1
        return turn

    def attach(self, replicas: Sequence[SimReplica], config: EngineConfig,
               hash_block: int = 1, shared_kv: TierClient | None = None,
               pd: PDSettings | None = None, kv_shape: KVShape | None = None,
               ttft_target: float | None = None, lost_events: float = 0.0) -> None:
        """Build the cluster router over ``replicas`` (before any arrival);
        ``shared_kv``: the fleet's KV tier, for the policies to price;
        ``pd``: plan each request's prefill and decode (``self.pd``);
        ``ttft_target``: fleet admission (``Router``); ``lost_events``: the
        share of block events lost on the way (``_Events``)."""
        self.router = Router(self.routing, shared_kv=shared_kv, ttft_target=ttft_target)
        self.router.resync_index = self._resync_index
        self._lost_events = lost_events
        self._config = config
        self.pd = None
        if pd is not None:
            if kv_shape is None:
                raise ValueError("prefill/decode needs the model's KV shape: an analytic cost "
                                 "model (--hardware, --model-shape)")
            self.pd = FleetPD(pd, self.router, kv_shape, self.replica)
        if ((self.routing.split("/")[0] in _CACHE_POLICIES or any(r.role != "mixed" for r in replicas))
                and config.cache.enable_prefix_caching):
            self._chain = BlockKeyChain(config.cache.block_size)
            self._hash_block = hash_block
        for replica in replicas:
            self.add(replica)

    def add(self, replica: SimReplica) -> None:
        """A replica joins the router (ready unless told otherwise)."""
        config = self._config
        replica_id = str(replica.index)
        self._by_id[replica_id] = replica
        self.router.add_replica(ReplicaView(
            replica_id, role=Role(replica.role), max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            block_size=config.cache.block_size,
            cost_model=replica.scheduler.admission.cost_model))
        lost = self._lost_events
        events = (_PrefillEvents(self.router, replica_id, self.pd, lost)
                  if replica.role == "prefill" else _Events(self.router, replica_id, lost))
        if replica.role == "decode":
            self.pd.inboxes[replica_id] = replica.scheduler.kv.external
        replica.listener = events
        if self._chain is not None:
            replica.scheduler.kv.report_blocks_to(events)

    def _resync_index(self, replica_id: str) -> None:
        """The router doubts its index of ``replica_id``: a snapshot of the
        replica's cache replaces it (the live worker's event reset)."""
        if self._chain is None:
            return
        self.router.block_events(replica_id, self._by_id[replica_id].scheduler.kv.pool
                                 .reported_hashes(), [], reset=True)

    def is_ready(self, replica: SimReplica) -> bool:
        """Whether the router sends ``replica`` new requests (always, without
        a router: one replica's share of a round-robin plan)."""
        if self.router is None:
            return True
        view = self.router.views.get(str(replica.index))
        return view is not None and view.routable

    def replica(self, replica_id: str) -> SimReplica:
        return self._by_id[replica_id]

    def place(self, replicas: Sequence[SimReplica], index: int, item: TraceRequest,
              record: RequestRecord, now: float):
        """(replica, what it receives, the record it keeps) for plan request
        ``index`` arriving at ``now``: ``pick``'s replica, or under P/D the
        planner's (a prefill leg has a record of its own)."""
        if self.pd is not None:
            return self.pd.route(index, item, record, self.hashes(index, item), now)
        return self.pick(replicas, index, item, now), item, record

    def pick(self, replicas: Sequence[SimReplica], index: int, item: TraceRequest,
             now: float) -> SimReplica:
        """The replica for plan request ``index`` arriving at ``now``."""
        active = self.active(now)
        if active != self._active:
            for position, replica in enumerate(replicas):
                self.router.set_health(str(replica.index), Health.READY if position < active
                                       else Health.DRAINING)
            self._active = active
        decision = self.router.route(RouteRequest(str(index), item.input_len,
                                                  self.hashes(index, item)), now)
        return self._by_id[decision.replica_id]

    def hashes(self, index: int, item: TraceRequest) -> tuple[int, ...]:
        """The chained block hashes of plan request ``index``'s prompt (what
        the replicas will key it by), when a policy or the planner reads them."""
        if self._chain is None:
            return ()
        tokens = prompt_token_ids(index, item.input_len, item.hash_ids, self._hash_block)
        full = len(tokens) // self._chain.block_size
        return tuple(self._chain.keys(ROOT_HASH, tokens, 0, full)[1])


class FleetScaling:
    """An autoscaler (``carpool.cluster.autoscaler.PoolScaler``) over the
    simulated fleet: at every tick it reads the pool's signals, and the
    replicas it adds are created then and take requests ``startup_s``
    later; those it removes drain (no new requests, their own finish) and
    then stop counting. Keeps the timeline and the replica-seconds paid.
    With ``min_replicas`` 0 a request that finds no replica is held
    (``hold``), as the live front holds it, and sent on when one is ready."""

    def __init__(self, scaler: PoolScaler, fleet: FleetRouter,
                 make_replica: Callable[[int], SimReplica]) -> None:
        self.scaler, self.fleet, self.make_replica = scaler, fleet, make_replica
        self.config = scaler.config
        self.next_tick = self.config.tick_s
        self._ready_at: dict[str, float] = {}  # starting replicas
        self._draining: set[str] = set()
        self._alive_since: dict[str, float] = {}
        self.replica_seconds = 0.0
        self.timeline: list[dict] = []
        self._arrivals = 0
        self._calm_service: float | None = None
        self._held: list = []  # (request, record) waiting for a replica at zero

    @property
    def holding(self) -> bool:
        """Requests wait for a replica (the event loop runs on for them)."""
        return bool(self._held)

    @property
    def holds_at_zero(self) -> bool:
        return self.config.min_replicas == 0

    def hold(self, request, record, now: float) -> None:  # noqa: ANN001
        """No replica to take ``request``: keep it, and tick now (a request
        at zero wants a replica at once: ``PoolScaler.tick``)."""
        self._held.append((request, record))
        self.next_tick = min(self.next_tick, now)

    def arrived(self) -> None:
        self._arrivals += 1

    def start(self, replicas: list[SimReplica], now: float) -> None:
        for replica in replicas:
            self._alive_since[str(replica.index)] = now

    def promote(self, now: float) -> None:
        """Replicas whose start-up is over take requests from ``now``."""
        for replica_id, ready_at in list(self._ready_at.items()):
            if ready_at <= now:
                del self._ready_at[replica_id]
                self.fleet.router.set_health(replica_id, Health.READY)

    def tick(self, now: float, replicas: list[SimReplica]) -> list[SimReplica]:
        """One autoscaler tick at ``now``; returns the replicas it created."""
        self.next_tick = now + self.config.tick_s
        self.promote(now)
        self._retire(now)
        router = self.fleet.router
        views = [router.views[rid] for rid in self._alive_since if rid in router.views]
        ready = [v for v in views if v.routable]
        in_flight = sum(v.in_flight for v in views)
        slots = max(1.0, len(ready) * self.config.replica_concurrency)
        signals = PoolSignals(now, len(views) - len(self._draining), len(ready),
                              sum(self.fleet.replica(v.replica_id).num_waiting for v in ready),
                              in_flight, self._arrivals, min(1.0, in_flight / slots),
                              self._service_time(ready))
        self._arrivals = 0
        wanted = self.scaler.tick(signals)
        created = self._resize(now, wanted, replicas)
        self.timeline.append({"t": now, "replicas": wanted, "ready": len(ready),
                              "backlog": signals.backlog, "in_flight": in_flight,
                              "utilization": signals.utilization})
        return created

    def _service_time(self, ready: list[ReplicaView]) -> float | None:
        """The mean service time of the replicas at or under the target
        utilisation, else the last such mean: an overloaded replica's
        requests are slowed by its big batches, and a pool sized with their
        times is sized for the overload (a 12x step went to the cap of 12
        replicas where 7 served everything)."""
        limit = self.config.replica_concurrency * self.config.target_utilization
        times = [v.service_time for v in ready
                 if v.service_time is not None and v.in_flight <= limit]
        if times:
            self._calm_service = sum(times) / len(times)
        return self._calm_service

    def replica_failed(self, replica_id: str, now: float) -> None:
        """A replica died: it stops counting (and costing) from ``now``."""
        self._ready_at.pop(replica_id, None)
        self._draining.discard(replica_id)
        self._stop(replica_id, now)

    def fire(self, now: float, replicas: list[SimReplica]) -> tuple[list[SimReplica], list]:
        """The event loop's timer interface: a tick, or a held request's
        replica ready; the held requests to route again once one is."""
        created = self.tick(now, replicas) if now >= self.next_tick else []
        self.promote(now)
        if not self._held or not any(v.routable for v in self.fleet.router.views.values()):
            return created, []
        held, self._held = self._held, []
        return created, [(request, record, 0) for request, record in held]

    @property
    def next_time(self) -> float:
        if self._held and self._ready_at:  # release them the moment one is ready
            return min(self.next_tick, min(self._ready_at.values()))
        return self.next_tick

    def finish(self, now: float) -> dict:
        for replica_id in list(self._alive_since):
            self._stop(replica_id, now)
        return {"policy": self.scaler.policy.name, "replica_seconds": self.replica_seconds,
                "replica_hours": self.replica_seconds / 3600,
                "events": [dataclasses.asdict(e) for e in self.scaler.events],
                "timeline": self.timeline}

    def _resize(self, now: float, wanted: int, replicas: list[SimReplica]) -> list[SimReplica]:
        router = self.fleet.router
        live = [rid for rid in self._alive_since if rid not in self._draining]
        created = []
        while len(live) < wanted:
            replica = self.make_replica(len(replicas) + len(created))
            created.append(replica)
            replica_id = str(replica.index)
            self.fleet.add(replica)
            router.set_health(replica_id, Health.STARTING)
            self._ready_at[replica_id] = now + self.config.startup_s
            self._alive_since[replica_id] = now
            live.append(replica_id)
        for replica_id in reversed(live[wanted:]):  # the newest leave first
            self._draining.add(replica_id)
            self._ready_at.pop(replica_id, None)
            router.set_health(replica_id, Health.DRAINING)
        return created

    def _retire(self, now: float) -> None:
        for replica_id in list(self._draining):
            if self.fleet.router.views[replica_id].in_flight == 0:
                self._draining.discard(replica_id)
                self._stop(replica_id, now)
                self.fleet.router.set_health(replica_id, Health.DEAD)

    def _stop(self, replica_id: str, now: float) -> None:
        since = self._alive_since.pop(replica_id, None)
        if since is not None:
            self.replica_seconds += now - since
