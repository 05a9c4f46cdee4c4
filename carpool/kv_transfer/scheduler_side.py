"""The scheduler side of a replica's live KV connector on a shared store.

It answers the KV manager (``ExternalKV``): on a local prefix miss,
``loadable`` asks the store how many of the following prompt blocks it
holds; ``load`` and ``save`` decide, and become orders (``LoadOrder``,
``SaveOrder``) that the engine hands the worker side with the step
(``take_meta``). A load the worker side finished comes back as (load id,
blocks) and ``resolve`` names its request. It sees requests and the block
ids the KV manager gives it; it never holds the scheduler, the cache
tensors or the model.

P/D: an exporting request's (a prefill's) blocks that a step's forward
fills stream out layer by layer (``filling``, when the worker side can
hook the model); its ``save`` then sends only the blocks that did not
stream (found cached here, or loaded), all layers at once.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from carpool.kv_transfer.health import ConnectorStats, StoreHealth
from carpool.kv_transfer.layer_export import part_hashes
from carpool.kv_transfer.payload import block_key_bytes
from carpool.kv_transfer.stores import KVStore
from carpool.scheduler import Request, RequestStatus
from carpool.scheduler.kv_connector import KVConnectorMeta, LoadOrder, SaveOrder


class StoreScheduler:
    """``KVConnectorScheduler`` on a ``KVStore`` (module docstring).
    ``streams_layers``: whether the worker side streams exporting requests'
    blocks per layer (it hooks the model); if not, they go out whole."""

    def __init__(self, store: KVStore, fingerprint: bytes, block_size: int,
                 health: StoreHealth, stats: ConnectorStats, streams_layers: bool) -> None:
        self.store, self.fingerprint, self.block_size = store, fingerprint, block_size
        self.health, self.stats, self.streams_layers = health, stats, streams_layers
        self._meta = KVConnectorMeta()
        self._loads: dict[int, Request] = {}  # load id -> its request, until resolved
        self._next_load = 0
        # Request id -> indices of its blocks streamed this far (their save is done).
        self.streamed: dict[str, set[int]] = {}
        # A decode part's request id -> the indices of the handoff blocks it
        # fetched (the fetch drops their parts; ``forget`` drops the others).
        self.fetched_parts: dict[str, set[int]] = {}

    def loadable(self, request: Request, hashes: Sequence[int]) -> int:
        if self.health.down:
            return 0  # failed lately: compute, and ask again later
        if request.kv_handoff:
            return len(hashes)  # a P/D prefill is sending them (the fetch waits)
        try:
            return self.store.count_prefix([block_key_bytes(self.fingerprint, h)
                                            for h in hashes])
        except Exception as error:  # noqa: BLE001 - any store failure is a miss
            self.health.failed(error)
            return 0

    def load(self, request: Request, hashes: Sequence[int], first: int,
             block_ids: Sequence[int]) -> float:
        """A fetch the worker side begins with this step; done when it says so."""
        self._next_load += 1
        self._loads[self._next_load] = request
        if request.kv_handoff:  # the prefill part's layer parts, this request's own
            self.fetched_parts.setdefault(request.request_id, set()).update(
                range(first, first + len(hashes)))
            hashes = part_hashes(hashes, request.handoff_key)
        self._meta.loads.append(LoadOrder(self._next_load, tuple(hashes), tuple(block_ids),
                                          request.kv_handoff))
        return math.inf

    def save(self, request: Request, hashes: Sequence[int], first: int,
             block_ids: Sequence[int]) -> None:
        # The blocks it loaded from the store are there already.
        size = self.block_size
        loaded = range((request.num_cached_tokens - request.num_loaded_tokens) // size,
                       request.num_cached_tokens // size)
        picked = [(i, h, b) for i, (h, b) in enumerate(zip(hashes, block_ids), first)
                  if i not in loaded]
        if request.kv_export:
            self._export(request, picked)
            return
        if not picked:
            return
        if self.health.down:  # failed lately: do not queue writes to it
            self.stats.saves_dropped += len(picked)
            return
        self._meta.saves.append(SaveOrder(tuple(h for _, h, _ in picked),
                                          tuple(b for _, _, b in picked)))

    def _export(self, request: Request, picked: list[tuple[int, int, int]]) -> None:
        """A P/D prefill's blocks: those its steps streamed are sent already;
        the rest (found cached here, or loaded) go now, every layer at once."""
        streamed = self.streamed.get(request.request_id, set())
        rest = [(h, b) for i, h, b in picked if i not in streamed]
        streamed.difference_update(i for i, _, _ in picked)
        if not streamed:
            self.streamed.pop(request.request_id, None)
        if rest:
            self._meta.saves.append(SaveOrder(
                part_hashes([h for h, _ in rest], request.handoff_key),
                tuple(b for _, b in rest), export=True))

    def filling(self, request: Request, first: int, block_ids: Sequence[int],
                hashes: Sequence[int]) -> None:
        if not self.streams_layers:
            return  # they go out whole when saved
        self.streamed.setdefault(request.request_id, set()).update(
            range(first, first + len(block_ids)))
        self._meta.streamed += zip(block_ids, part_hashes(hashes, request.handoff_key))

    def forget(self, request: Request) -> None:
        self.streamed.pop(request.request_id, None)  # ended (aborted) before its save
        if not request.status.finished:
            return  # preempted: it comes back
        prompt_hashes = request.block_hashes[:request.num_prompt_tokens // self.block_size]
        if request.kv_export and request.status is not RequestStatus.FINISHED_LENGTH:
            # No decode part will take what it exported: drop it now, not at the TTL.
            self._meta.drops.append(part_hashes(prompt_hashes, request.handoff_key))
        elif request.kv_handoff:
            # A decode part's handoff: the parts it fetched went after the
            # fetch; those of blocks its own cache held, or of a fetch it
            # never began, go now (its own: keyed by its handoff).
            fetched = self.fetched_parts.pop(request.request_id, set())
            rest = [h for i, h in enumerate(prompt_hashes) if i not in fetched]
            if rest:
                self._meta.drops.append(part_hashes(rest, request.handoff_key))

    def take_meta(self) -> KVConnectorMeta:
        meta, self._meta = self._meta, KVConnectorMeta()
        return meta

    def resolve(self, fetched: Sequence[tuple[int, int]]) -> list[tuple[int, Request, int]]:
        return [(load_id, self._loads.pop(load_id), blocks * self.block_size)
                for load_id, blocks in fetched]
