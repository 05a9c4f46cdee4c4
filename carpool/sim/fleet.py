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

from collections.abc import Sequence

from carpool.cluster import POLICIES, Health, ReplicaView, Router, RouteRequest
from carpool.config import EngineConfig
from carpool.scheduler.block_pool import ROOT_HASH, BlockKeyChain
from carpool.sim.replica import SimReplica, prompt_token_ids
from carpool.workload.traces import TraceRequest

ROUTING = tuple(POLICIES)
# Policies that read the fleet prefix index (and so need block hashes).
_CACHE_POLICIES = {"cache-aware", "approx-cache-aware", "predicted-ttft"}


class _Events:
    """One replica's listener and block events, into the router."""

    def __init__(self, router: Router, replica_id: str) -> None:
        self.router, self.replica_id = router, replica_id

    def first_token(self, index: int, now: float) -> None:
        self.router.first_token(str(index), now)

    def finished(self, index: int, now: float, ok: bool) -> None:
        self.router.finished(str(index), now, learn=ok)

    def stored(self, hashes: list[int]) -> None:
        self.router.blocks_stored(self.replica_id, hashes)

    def evicted(self, hashes: list[int]) -> None:
        self.router.blocks_evicted(self.replica_id, hashes)


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
        self._by_id: dict[str, SimReplica] = {}

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
               hash_block: int = 1) -> None:
        """Build the cluster router over ``replicas`` (before any arrival)."""
        self.router = Router(self.routing)
        scheduler = config.scheduler
        needs_hashes = self.routing in _CACHE_POLICIES and config.cache.enable_prefix_caching
        if needs_hashes:
            self._chain = BlockKeyChain(config.cache.block_size)
            self._hash_block = hash_block
        for replica in replicas:
            replica_id = str(replica.index)
            self._by_id[replica_id] = replica
            self.router.add_replica(ReplicaView(
                replica_id, max_num_seqs=scheduler.max_num_seqs,
                max_num_batched_tokens=scheduler.max_num_batched_tokens,
                block_size=config.cache.block_size,
                cost_model=replica.scheduler.admission.cost_model))
            events = _Events(self.router, replica_id)
            replica.listener = events
            if needs_hashes:
                replica.scheduler.kv.report_blocks_to(events)

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
                                                  self._hashes(index, item)), now)
        return self._by_id[decision.replica_id]

    def _hashes(self, index: int, item: TraceRequest) -> tuple[int, ...]:
        if self._chain is None:
            return ()
        tokens = prompt_token_ids(index, item.input_len, item.hash_ids, self._hash_block)
        full = len(tokens) // self._chain.block_size
        return tuple(self._chain.keys(ROOT_HASH, tokens, 0, full)[1])
