"""A live fleet pool's replica count, moved by its ``PoolScaler``.

``FleetEngine`` (``carpool.fleet.local``) mixes this in under
``--autoscale``: every ``tick_s`` the pool's views become ``PoolSignals``,
the scaler answers a count, and replicas are started (``_add_replica``)
or drained (``_drain_replica``: no new requests, its own finish, then it
stops) to reach it.

With ``--min-replicas 0`` a pool whose traffic stopped for a whole
scale-in window drains its last replica. A request that comes then is
not refused: ``wait_for_a_replica`` has the scaler want one at once
(``PoolScaler.wake``), starts it, and holds the request until it joins
(at most ``ZERO_WAIT_S``), the cold start its only cost.
"""
from __future__ import annotations

import asyncio
import logging
import time

from carpool.cluster.autoscaler import PoolScaler, PoolSignals
from carpool.cluster.view import Health
from carpool.engine.client import EngineClient
from carpool.engine.streams import EngineDeadError

log = logging.getLogger("carpool.server")

# A cold start here is about 10 s (load, calibrate); a request at zero
# waits at most this long for it (plus ``--replica-start-delay``) before a 503.
ZERO_WAIT_S = 60.0


class AutoscaledPool:
    """The autoscaling half of ``FleetEngine`` (module docstring). The host
    class provides ``clients``, ``router``, ``views()``, ``_join``,
    ``_retire``, ``config``, ``_launch``, ``pool`` and ``_stopping``."""

    scaler: PoolScaler | None

    def _init_scaling(self, scaler: PoolScaler | None, joined: int) -> None:
        """Live replica counts: the autoscaler's ticks, arrivals since the
        last one, replicas being started or drained for it."""
        self.scaler = scaler
        self._joined = joined
        self._arrivals = 0
        self._scaling: set[asyncio.Task] = set()
        self._starting = 0
        self._replica_joined = asyncio.Event()  # set (and replaced) by each join
        # A replica the autoscaler starts waits this long before it takes
        # requests (``--replica-start-delay``: a GPU's cold model load).
        self.start_delay_s = 0.0
        # The scaler sizes by the replicas' live max_num_seqs, the slots its
        # utilisation is measured against (``--replica-concurrency`` unset).
        self.concurrency_from_replicas = False
        self._ticks = asyncio.ensure_future(self._autoscale()) if scaler is not None else None

    @property
    def scaled_to_zero(self) -> bool:
        """No replica by the autoscaler's choice (not one dead and restarting)."""
        return (self.scaler is not None and self.scaler.replicas == 0 and not self.clients
                and not self._restarting)

    def _joined_now(self) -> None:
        self._replica_joined.set()
        self._replica_joined = asyncio.Event()

    async def wait_for_a_replica(self) -> None:
        """At zero replicas: want one now, start it, and return once a
        replica joined (``EngineDeadError`` after ``ZERO_WAIT_S``)."""
        joined = self._replica_joined
        if self.scaler.wake(time.monotonic()) or not self._starting:
            log.info("autoscaler: a request at zero replicas; starting one")
            self._spawn(self._add_replica())
        bound = ZERO_WAIT_S + self.start_delay_s
        try:
            await asyncio.wait_for(joined.wait(), bound)
        except TimeoutError:
            raise EngineDeadError(f"the fleet was scaled to zero and no replica came up "
                                  f"within {bound:.0f} s") from None

    async def _autoscale(self) -> None:
        assert self.scaler is not None
        while True:
            await asyncio.sleep(self.scaler.config.tick_s)
            views = [v for v in self.views() if v.routable]
            slots = sum(v.max_num_seqs for v in views)
            times = [v.service_time for v in views if v.service_time is not None]
            signals = PoolSignals(
                now=time.monotonic(), replicas=len(views) + self._starting, ready=len(views),
                backlog=sum(v.waiting for v in views),
                in_flight=sum(v.in_flight for v in views), arrivals=self._arrivals,
                utilization=sum(v.running for v in views) / slots if slots else 0.0,
                service_time=sum(times) / len(times) if times else None)
            self._arrivals = 0
            if self.concurrency_from_replicas and views:
                self.scaler.config.replica_concurrency = slots / len(views)
            target = self.scaler.tick(signals)
            have = len(views) + self._starting
            for _ in range(target - have):
                self._spawn(self._add_replica())
            surplus = max(0, have - target)
            for view in sorted(views, key=lambda v: (v.in_flight, -v.order))[:surplus]:
                self._spawn(self._drain_replica(view.replica_id))

    def _spawn(self, work) -> None:  # noqa: ANN001
        task = asyncio.ensure_future(work)
        self._scaling.add(task)
        task.add_done_callback(self._scaling.discard)

    async def _add_replica(self) -> None:
        self._starting += 1
        try:
            client = await EngineClient.start(self.config, **self._launch)
            try:
                await asyncio.sleep(self.start_delay_s)
            except BaseException:  # cancelled by a shutdown: no worker left behind
                await client.wait_closed()
                raise
        except Exception as exc:  # noqa: BLE001 - the next tick asks again
            log.error("autoscaler: starting a replica failed (%s)", exc)
            return
        finally:
            self._starting -= 1
        if self._stopping:
            await client.wait_closed()
            return
        replica_id = f"{self.pool}{self._joined}"
        self._joined += 1
        self._join(replica_id, client)
        log.info("autoscaler: replica %s joined (%d ready)", replica_id, len(self.clients))

    async def _drain_replica(self, replica_id: str) -> None:
        """Take no new requests there, let its own finish, then stop it."""
        self.router.set_health(replica_id, Health.DRAINING)
        client = self.clients.get(replica_id)
        while client is not None and client.num_in_flight and not self._stopping:
            await asyncio.sleep(0.1)
        self.router.remove_replica(replica_id)
        if self.clients.pop(replica_id, None) is not None:
            client.on_failure = None  # stopping on purpose: no restart
            await client.wait_closed()
            self._retire(client)
            log.info("autoscaler: replica %s left (%d ready)", replica_id, len(self.clients))
