"""A sliced replica on Ray Serve: one replica, N actors, one placement group.

An engine deployment with ``--tensor-parallel-size`` N asks Serve for a
placement group of N bundles on one node (``placement_group_bundles``,
``STRICT_PACK``: the ranks' collectives stay within a node, as NVLink
does). The replica's own actor takes bundle 0 and is rank 0; it starts
ranks 1..N-1 as ``RankActor``s in bundles 1..N-1 (``start_rank_actors``,
the engine's ``FollowerStarter``), which join its group on the node's
loopback and run its steps (``carpool.executor.tp_follower.serve_rank``).
The actors are the replica's own: they die with it, and its engine's end
stops them.
"""
from __future__ import annotations

import msgspec
import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from carpool.config import EngineConfig
from carpool.executor.tensor_parallel import FollowerLaunch


def rank_bundles(size: int, replica_cpus: float) -> list[dict[str, float]]:
    """One bundle per rank: a replica's CPUs split between its ranks."""
    return [{"CPU": replica_cpus / size} for _ in range(size)]


class RankActor:
    """Rank r of a replica whose rank 0 is the Serve replica that made it."""

    def run(self, launch: bytes, rank: int, size: int, port: int) -> int:
        from carpool.executor.tp_follower import serve_rank

        config = msgspec.msgpack.decode(launch, type=FollowerLaunch).config
        serve_rank(config, rank, size, port)
        return rank


class _RankRun:
    """A ``Follower``: the actor and its ``run`` in flight."""

    def __init__(self, actor, run) -> None:  # noqa: ANN001 - a Ray actor handle, an ObjectRef
        self.actor, self.run = actor, run

    def wait(self, timeout: float) -> object:
        return ray.get(self.run, timeout=timeout)

    def kill(self) -> None:
        ray.kill(self.actor)


def start_rank_actors(config: EngineConfig, port: int) -> list[_RankRun]:
    """Ranks 1..N-1 of this replica as actors in its placement group's
    bundles 1..N-1 (a ``FollowerStarter``)."""
    group = get_current_placement_group()
    if group is None:
        raise RuntimeError("a sliced replica on Ray runs in its placement group "
                           "(the deployment's placement_group_bundles)")
    size = config.model.tensor_parallel_size
    cpus = group.bundle_specs[1].get("CPU", 0.0)
    launch = msgspec.msgpack.encode(FollowerLaunch(config))
    runs = []
    for rank in range(1, size):
        actor = ray.remote(RankActor).options(
            num_cpus=cpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank)).remote()
        runs.append(_RankRun(actor, actor.run.remote(launch, rank, size, port)))
    return runs
