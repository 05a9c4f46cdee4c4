"""The worker side of a replica's live KV connector: the bytes.

It belongs to the executor (``Executor.kv_worker``): it holds the cache
tensors' block I/O (``KVBlockIO``), the store's one background I/O thread
and the model's layer hook, and knows requests only by the orders the
scheduler side hands it with a step (``KVConnectorMeta``). The engine
thread alone touches the cache tensors: a save copies its blocks out at
once (``start``, before a later step could reuse them) and queues the put;
a load's payloads, once fetched, are checked (``decode_block``: key, model
fingerprint, layout, CRC) and come back from ``fetched`` as (load id,
blocks that arrived): leading blocks up to the first missing or refused
one (the rest are computed); ``write`` copies in those whose requests are
still there. A store that fails (down, timing out) costs only those
recomputations. Saves beyond ``max_inflight_bytes`` not yet written are
dropped; a P/D export never is (its decode part waits for it).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from carpool.kv_transfer.blocks import KVBlockIO
from carpool.kv_transfer.health import ConnectorStats, StoreHealth, observe
from carpool.kv_transfer.layer_export import LayerExporter, part_hashes
from carpool.kv_transfer.payload import (
    KVPayloadError,
    block_key_bytes,
    decode_block,
    encode_block,
)
from carpool.kv_transfer.stores import KVStore
from carpool.scheduler.kv_connector import KVConnectorMeta, LoadOrder, SaveOrder

logger = logging.getLogger("carpool.kv_transfer.connector")

# How often a P/D decode part asks the store again for prompt blocks its
# prefill part has not finished sending.
HANDOFF_POLL_S = 0.002


class StoreWorker:
    """``KVConnectorWorker`` on a ``KVStore`` (module docstring).
    ``handoff_wait_s``: how long a P/D decode part waits for its prefill
    part's blocks before computing the missing ones itself (the prefill
    replica died mid-transfer). ``model``: the ``DecoderModel`` whose
    ``after_layer`` hook streams a P/D prefill's blocks layer by layer
    (None: they go out whole when saved)."""

    def __init__(self, store: KVStore, io: KVBlockIO, fingerprint: bytes, health: StoreHealth,
                 stats: ConnectorStats, max_inflight_bytes: int = 256 << 20,
                 handoff_wait_s: float = 5.0, model=None) -> None:  # noqa: ANN001
        self.store, self.io, self.fingerprint = store, io, fingerprint
        self.health, self.stats, self.model = health, stats, model
        self.layout = io.layout
        self.max_inflight_bytes, self.handoff_wait_s = max_inflight_bytes, handoff_wait_s
        self._io_thread = ThreadPoolExecutor(1, thread_name_prefix="carpool-kv-store")
        self._fetched: queue.Queue = queue.Queue()  # (load id, block ids, payloads)
        self._arrived: dict[int, tuple[tuple[int, ...], list]] = {}  # fetched, not written
        self._lock = threading.Lock()
        self._inflight_bytes = 0
        self._streamed: list[tuple[int, int]] = []  # the next forward's, from ``start``
        self.exporter = LayerExporter(self)

    def _keys(self, hashes: Sequence[int]) -> list[bytes]:
        return [block_key_bytes(self.fingerprint, h) for h in hashes]

    # -- the engine thread -----------------------------------------------------------

    def start(self, meta: KVConnectorMeta) -> None:
        for order in meta.saves:
            self._save(order)
        for order in meta.loads:
            wait_s = self.handoff_wait_s if order.handoff else 0.0
            self._io_thread.submit(self._fetch, order, wait_s)
        for hashes in meta.drops:  # after the puts queued before (one I/O thread, in order)
            self._io_thread.submit(self.exporter.drop, list(hashes))
        self._streamed = meta.streamed

    def drop_parts(self, hashes: Sequence[int], parts_key: int) -> None:
        """Delete the layer parts of ``hashes`` under a handoff's
        ``parts_key`` (one no decode part took; the front knows): on the I/O
        thread, after what is queued there."""
        self._io_thread.submit(self.exporter.drop, part_hashes(hashes, parts_key))

    def begin_forward(self) -> bool:
        streamed, self._streamed = self._streamed, []
        if self.model is None or not streamed:
            return False
        self.exporter.begin(streamed)
        self.model.after_layer = self.exporter.layer_done
        return True

    def streaming_block_ids(self) -> list[int]:
        """The blocks the forward ``begin_forward`` hooked sends out layer by
        layer (a tensor-parallel replica's followers gather theirs too)."""
        return self.exporter.block_ids()

    def end_forward(self) -> None:
        """After a forward ``begin_forward`` hooked."""
        self.model.after_layer = None
        self.exporter.end()

    def _save(self, order: SaveOrder) -> None:
        if order.export:
            self.exporter.export_now(list(order.block_ids), list(order.hashes))
            return
        size = len(order.block_ids) * self.layout.data_bytes
        with self._lock:
            if self._inflight_bytes + size > self.max_inflight_bytes:
                self.stats.saves_dropped += len(order.block_ids)
                return
            self._inflight_bytes += size
        datas = self.io.read(list(order.block_ids))
        self._io_thread.submit(self._put, list(order.hashes), datas, size)

    def submit(self, work, *args) -> None:  # noqa: ANN001
        """Run ``work(*args)`` on the store's I/O thread, in order."""
        self._io_thread.submit(work, *args)

    def fetched(self) -> list[tuple[int, int]]:
        done = []
        while True:
            try:
                load_id, block_ids, datas = self._fetched.get_nowait()
            except queue.Empty:
                return done
            self._arrived[load_id] = (block_ids, datas)
            done.append((load_id, len(datas)))

    def write(self, load_ids: Sequence[int]) -> None:
        for load_id in load_ids:
            block_ids, datas = self._arrived.pop(load_id)
            self.io.write(list(block_ids[:len(datas)]), datas)
            self.stats.blocks_loaded += len(datas)
        self._arrived.clear()  # their requests left: the blocks are no longer theirs

    def wait(self, timeout: float) -> None:
        try:
            item = self._fetched.get(timeout=timeout)
        except queue.Empty:
            return
        self._fetched.put(item)  # ``fetched`` takes it, in order

    def metrics(self) -> dict:
        """The connector's and its store client's counters, for /metrics
        (``EngineStats.kv_store``): plain numbers, and bucket count lists."""
        store = self.store.stats
        return {**asdict(self.stats), "store_queries": store.queries, "store_hits": store.hits,
                "bytes_written": store.bytes_in, "bytes_read": store.bytes_out}

    def flush(self) -> None:
        """Wait until every save and fetch queued so far reached the store."""
        self._io_thread.submit(lambda: None).result()

    def close(self) -> None:
        self._io_thread.shutdown(wait=True, cancel_futures=True)
        self.store.close()

    # -- the store's thread ----------------------------------------------------------

    def _fetch(self, order: LoadOrder, wait_s: float) -> None:
        """Fetch and check; always reports (the request waits on it).
        ``wait_s``: blocks not in the store yet are asked for again until
        then (a P/D prefill's blocks may still be on their way)."""
        started = time.perf_counter()
        datas: list = []
        fetch = self._fetched_blocks
        hashes = list(order.hashes)
        try:
            if order.handoff:  # a P/D prefill's layer parts
                self.exporter.wait_for(hashes, wait_s, HANDOFF_POLL_S)
                fetch = self.exporter.fetch
            while True:
                got, missing = fetch(hashes[len(datas):])
                datas += got
                if not missing or time.perf_counter() - started >= wait_s:
                    self.stats.blocks_missing += missing
                    break
                time.sleep(HANDOFF_POLL_S)
        except Exception:  # noqa: BLE001 - never leave the request waiting
            logger.exception("kv store: a fetch failed; its blocks are computed instead")
        finally:
            if order.handoff:  # single use: taken (or given up on), the parts go now
                self.exporter.drop(hashes)
            seconds = time.perf_counter() - started
            self.stats.load_seconds += seconds
            observe(self.stats.load_buckets, seconds)
            self._fetched.put((order.load_id, order.block_ids, datas))

    def _fetched_blocks(self, hashes: list[int]) -> tuple[list[memoryview], bool]:
        """The leading blocks of ``hashes`` the store gives and the checks
        pass, and whether they end at a block the store does not hold
        (rather than at the end, a refused block or a store failure)."""
        datas: list[memoryview] = []
        try:
            payloads = self.store.get_many(self._keys(hashes))
        except Exception as error:  # noqa: BLE001 - any store failure is a miss
            self.store_failed(error)
            return datas, False
        for block_hash, payload in zip(hashes, payloads):
            if payload is None:
                return datas, True
            try:
                datas.append(decode_block(payload, block_hash, self.fingerprint, self.layout))
            except KVPayloadError as error:
                self.stats.blocks_refused += 1
                logger.warning("kv store: block %#x refused: %s", block_hash, error)
                break
        return datas, False

    def _put(self, hashes: list[int], datas: list[bytes], size: int) -> None:
        started = time.perf_counter()
        try:
            self.store.put_many([(key, encode_block(h, self.fingerprint, self.layout, data))
                                 for key, h, data in zip(self._keys(hashes), hashes, datas)])
            self.stats.blocks_saved += len(hashes)
        except Exception as error:  # noqa: BLE001 - any store failure is a miss
            self.store_failed(error)
            self.stats.saves_dropped += len(hashes)
        finally:
            with self._lock:
                self._inflight_bytes -= size
            seconds = time.perf_counter() - started
            self.stats.save_seconds += seconds
            observe(self.stats.save_buckets, seconds)

    def store_failed(self, error: Exception) -> None:
        self.health.failed(error)
