"""A replica's live KV connector on a shared store, built as its two sides.

The split is vLLM v1's. The *scheduler side* (``StoreScheduler``,
``scheduler_side.py``) answers the KV manager: on a local prefix miss it
asks the store how many of the following prompt blocks it holds, and
turns loads and saves into orders the engine hands the *worker side*
(``StoreWorker``, ``worker_side.py``, on the executor) with each step.
The worker side moves the bytes on one background I/O thread and reports
finished fetches, which the scheduler side maps back to requests. The
engine drives both (``LLMEngine.step``); neither holds the other or the
scheduler. A P/D prefill's blocks stream out per layer while the next
layers compute (``layer_export.py``).

``StoreConnector`` builds the pair on one store and holds what they share:
the counters (``stats``) and the store's health (after a failure, lookups
answer 0 and saves are dropped for ``retry_after_s``).
"""
from __future__ import annotations

import time

from carpool.kv_transfer.blocks import KVBlockIO
from carpool.kv_transfer.health import TRANSFER_BUCKETS, ConnectorStats, StoreHealth
from carpool.kv_transfer.scheduler_side import StoreScheduler
from carpool.kv_transfer.stores import KVStore
from carpool.kv_transfer.worker_side import HANDOFF_POLL_S, StoreWorker

__all__ = ["HANDOFF_POLL_S", "TRANSFER_BUCKETS", "ConnectorStats", "StoreConnector",
           "store_connector"]


class StoreConnector:
    """Both sides of one replica's connector on ``store`` (module docstring):
    ``scheduler`` (the KV manager's ``ExternalKV``) and ``worker`` (the
    executor's ``kv_worker``). ``model``: the ``DecoderModel`` whose layer
    hook streams a P/D prefill's blocks (None: they go out whole)."""

    def __init__(self, store: KVStore, io: KVBlockIO, fingerprint: bytes,
                 max_inflight_bytes: int = 256 << 20, retry_after_s: float = 5.0,
                 clock=time.monotonic, handoff_wait_s: float = 5.0,  # noqa: ANN001
                 model=None) -> None:  # noqa: ANN001
        self.store, self.fingerprint = store, fingerprint
        self.stats = ConnectorStats()
        health = StoreHealth(self.stats, retry_after_s, clock)
        self.worker = StoreWorker(store, io, fingerprint, health, self.stats,
                                  max_inflight_bytes, handoff_wait_s, model)
        self.scheduler = StoreScheduler(store, fingerprint, io.layout.block_size, health,
                                        self.stats, streams_layers=model is not None)

    def metrics(self) -> dict:
        return self.worker.metrics()

    def flush(self) -> None:
        """Wait until every save and fetch queued so far reached the store."""
        self.worker.flush()

    def close(self) -> None:
        self.worker.close()


def store_connector(cache, executor, model_config, store: KVStore | None = None,  # noqa: ANN001
                    ) -> StoreConnector:
    """The connector ``cache`` (a ``CacheConfig`` with ``kv_store`` set)
    asks for, on ``executor``'s KV tensors; ``store``: that store instead."""
    from carpool.config import parse_size
    from carpool.kv_transfer import open_store
    from carpool.kv_transfer.blocks import weights_fingerprint

    if store is None:
        store = open_store(cache.kv_store, cache.kv_store_ttl, parse_size(cache.kv_store_capacity))
    io = executor.block_io()
    # A sliced replica's weights are its rank's: its fingerprint is the whole model's.
    fingerprint = (executor.unsharded_fingerprint
                   or weights_fingerprint(executor.model, f"{model_config!r} {executor.dtype}"))
    return StoreConnector(store, io, fingerprint, parse_size(cache.kv_store_max_inflight),
                          model=getattr(executor, "model", None))
