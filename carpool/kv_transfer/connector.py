"""A replica's live KV connector on a shared store: both sides of it.

Scheduler side (``ExternalKV``, ``carpool.scheduler.kv_connector``): on a
local prefix miss, ``loadable`` asks the store how many of the following
prompt blocks it holds; ``load`` starts fetching them into the blocks the
scheduler just gave the request, which waits (``LOADING``) while steps go
on; ``save`` writes a request's newly computed prompt blocks through.

Worker side: the store's I/O runs on one background thread, off the step.
The engine thread alone touches the cache tensors and the scheduler: a
save copies its blocks out at once (``KVBlockIO.read``, before a later
step could reuse them) and queues the put; a load's payloads, once
fetched, are checked (``decode_block``: key, model fingerprint, layout,
CRC) and copied in by ``poll``, which the engine calls before each step and
which reports the load done to the scheduler, with the tokens that
actually arrived (leading blocks up to the first missing or refused one;
the rest are computed). A store that fails (down, timing out) costs only
those recomputations: ``loadable`` answers 0 and saves are dropped.
Saves beyond ``max_inflight_bytes`` not yet written are dropped too.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from carpool.kv_transfer.blocks import KVBlockIO
from carpool.kv_transfer.layer_export import LayerExporter
from carpool.kv_transfer.payload import (
    KVPayloadError,
    block_key_bytes,
    decode_block,
    encode_block,
)
from carpool.kv_transfer.stores import KVStore
from carpool.scheduler import Request, RequestStatus

logger = logging.getLogger(__name__)


# Upper bounds (seconds) of the transfer-time histograms' buckets; the last is +Inf.
# How often a P/D decode part asks the store again for prompt blocks its
# prefill part has not finished sending.
HANDOFF_POLL_S = 0.002

TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def _observe(counts: list[int], seconds: float) -> None:
    for i, bound in enumerate(TRANSFER_BUCKETS):
        if seconds <= bound:
            counts[i] += 1
            return
    counts[-1] += 1


@dataclass
class ConnectorStats:
    """Counters of one replica's connector, for metrics."""

    blocks_loaded: int = 0
    blocks_refused: int = 0  # fetched but not this model's / damaged
    blocks_missing: int = 0  # gone between the lookup and the fetch
    blocks_saved: int = 0
    saves_dropped: int = 0  # blocks not saved: bytes in flight over the limit, or store down
    store_errors: int = 0
    load_seconds: float = 0.0  # fetch wall time, summed
    save_seconds: float = 0.0
    # P/D prefill side (layer_export): per-layer parts put, and the put time
    # of streamed steps, split into what overlapped the forward and the tail after it.
    layer_parts_sent: int = 0
    export_steps: int = 0
    export_seconds: float = 0.0
    export_hidden_seconds: float = 0.0
    export_exposed_seconds: float = 0.0
    # Fetches / puts by wall time: counts per TRANSFER_BUCKETS bound, then +Inf.
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_BUCKETS) + 1))
    save_buckets: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_BUCKETS) + 1))


class StoreConnector:
    """See the module docstring. ``bind`` it to the scheduler it serves."""

    def __init__(self, store: KVStore, io: KVBlockIO, fingerprint: bytes,
                 max_inflight_bytes: int = 256 << 20, retry_after_s: float = 5.0,
                 clock=time.monotonic, handoff_wait_s: float = 5.0, model=None) -> None:
        """``retry_after_s``: after the store failed, lookups answer 0
        without asking it for this long (a store that hangs costs one
        timeout, not one per admission: lookups run on the engine thread).
        ``handoff_wait_s``: how long a P/D decode part waits for its prefill
        part's blocks before computing the missing ones itself (the prefill
        replica died mid-transfer). ``model``: the ``DecoderModel`` whose
        ``after_layer`` hook streams a P/D prefill's blocks layer by layer
        (None: they go out whole after each step)."""
        self.handoff_wait_s = handoff_wait_s
        self.model = model
        self.store, self.io, self.fingerprint = store, io, fingerprint
        self.retry_after_s, self.clock = retry_after_s, clock
        self._down_until = -math.inf
        self.layout = io.layout
        self.max_inflight_bytes = max_inflight_bytes
        self.stats = ConnectorStats()
        self.scheduler = None
        self._io_thread = ThreadPoolExecutor(1, thread_name_prefix="carpool-kv-store")
        self._fetched: queue.Queue = queue.Queue()  # (request, block ids, payloads | None)
        self._lock = threading.Lock()
        self._inflight_bytes = 0
        self.exporter = LayerExporter(self)

    def bind(self, scheduler) -> None:
        """The scheduler whose block tables and loads this connector serves."""
        self.scheduler = scheduler

    def _keys(self, hashes: Sequence[int]) -> list[bytes]:
        return [block_key_bytes(self.fingerprint, h) for h in hashes]

    # -- scheduler side ------------------------------------------------------------

    def loadable(self, request: Request, hashes: Sequence[int]) -> int:
        if self.clock() < self._down_until:
            return 0  # failed lately: compute, and ask again later
        if request.kv_handoff:
            return len(hashes)  # a P/D prefill is sending them (the fetch waits)
        try:
            return self.store.count_prefix(self._keys(hashes))
        except Exception as error:  # noqa: BLE001 - any store failure is a miss
            self.store_failed(error)
            return 0

    def load(self, request: Request, hashes: Sequence[int], first: int) -> float:
        """Fetch in the background; done when ``poll`` copies it in."""
        table = self.scheduler.kv.block_tables[request.request_id]
        block_ids = list(table[first:first + len(hashes)])
        wait_s = self.handoff_wait_s if request.kv_handoff else 0.0
        self._io_thread.submit(self._fetch, request, list(hashes), block_ids, wait_s)
        return math.inf

    def save(self, request: Request, hashes: Sequence[int], first: int) -> None:
        # The blocks it loaded from the store are there already.
        size = self.layout.block_size
        loaded = range((request.num_cached_tokens - request.num_loaded_tokens) // size,
                       request.num_cached_tokens // size)
        picked = [(i, h) for i, h in enumerate(hashes, first) if i not in loaded]
        if request.kv_export:
            self._export(request, picked)
            return
        if not picked:
            return
        if self.clock() < self._down_until:  # failed lately: do not queue writes to it
            self.stats.saves_dropped += len(picked)
            return
        size = len(picked) * self.layout.data_bytes
        with self._lock:  # a P/D export is never dropped: its decode part waits for it
            if (self._inflight_bytes + size > self.max_inflight_bytes
                    and not request.kv_export):
                self.stats.saves_dropped += len(picked)
                return
            self._inflight_bytes += size
        table = self.scheduler.kv.block_tables[request.request_id]
        datas = self.io.read([table[i] for i, _ in picked])
        self._io_thread.submit(self._put, [h for _, h in picked], datas, size)

    def _export(self, request: Request, picked: list[tuple[int, int]]) -> None:
        """A P/D prefill's blocks: those its steps streamed are sent already;
        the rest (found cached here, or loaded) go now, every layer at once."""
        streamed = self.exporter.streamed.get(request.request_id, set())
        rest = [(i, h) for i, h in picked if i not in streamed]
        streamed.difference_update(i for i, _ in picked)
        if not streamed:
            self.exporter.streamed.pop(request.request_id, None)
        if rest:
            table = self.scheduler.kv.block_tables[request.request_id]
            self.exporter.export_now([table[i] for i, _ in rest], [h for _, h in rest])

    # -- the engine thread ---------------------------------------------------------

    def begin_forward(self, spans) -> bool:  # noqa: ANN001 - ScheduledSpan list
        """Before a step's forward: hook the model to stream the prompt
        blocks its P/D prefills fill up, layer by layer; True if hooked."""
        if self.model is None or not self.exporter.begin(spans):
            return False
        self.model.after_layer = self.exporter.layer_done
        return True

    def end_forward(self) -> None:
        """After a hooked forward."""
        self.model.after_layer = None
        self.exporter.end()

    def submit(self, work, *args) -> None:  # noqa: ANN001
        """Run ``work(*args)`` on the store's I/O thread, in order."""
        self._io_thread.submit(work, *args)

    def poll(self) -> int:
        """Copy fetched blocks in and report their loads done; returns how
        many loads finished. Call it on the engine thread, between steps."""
        done = 0
        while True:
            try:
                request, block_ids, datas = self._fetched.get_nowait()
            except queue.Empty:
                return done
            done += 1
            if (request.status is not RequestStatus.LOADING
                    or self.scheduler.requests.get(request.request_id) is not request):
                continue  # aborted while fetching (or another scheduler's): no blocks
            self.io.write(block_ids[:len(datas)], datas)
            self.scheduler.loading.complete(request, len(datas) * self.layout.block_size)
            self.stats.blocks_loaded += len(datas)

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a fetch to finish (the engine
        has nothing else to run)."""
        try:
            item = self._fetched.get(timeout=timeout)
        except queue.Empty:
            return
        self._fetched.put(item)  # poll takes it, in order

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

    def _fetch(self, request: Request, hashes: list[int], block_ids: list[int],
               wait_s: float) -> None:
        """Fetch and check; always reports (the request waits on it).
        ``wait_s``: blocks not in the store yet are asked for again until
        then (a P/D prefill's blocks may still be on their way)."""
        started = time.perf_counter()
        datas: list[memoryview] = []
        fetch = self._fetched_blocks
        try:
            if request.kv_handoff:  # a P/D prefill's layer parts
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
            seconds = time.perf_counter() - started
            self.stats.load_seconds += seconds
            _observe(self.stats.load_buckets, seconds)
            self._fetched.put((request, block_ids, datas))

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
            _observe(self.stats.save_buckets, seconds)

    def store_failed(self, error: Exception) -> None:
        self._down_until = self.clock() + self.retry_after_s
        self.stats.store_errors += 1
        if self.stats.store_errors == 1 or self.stats.store_errors % 100 == 0:
            logger.warning("kv store unavailable (%d times so far; recomputing instead): %s",
                           self.stats.store_errors, error)


def store_connector(cache, executor, model_config, store: KVStore | None = None,
                    ) -> StoreConnector:
    """The connector ``cache`` (a ``CacheConfig`` with ``kv_store`` set)
    asks for, on ``executor``'s KV tensors; ``store``: that store instead."""
    from carpool.config import parse_size
    from carpool.kv_transfer import open_store
    from carpool.kv_transfer.blocks import weights_fingerprint

    if store is None:
        store = open_store(cache.kv_store, cache.kv_store_ttl, parse_size(cache.kv_store_capacity))
    io = KVBlockIO(executor.kv_caches)
    fingerprint = weights_fingerprint(executor.model, f"{model_config!r} {executor.dtype}")
    return StoreConnector(store, io, fingerprint, parse_size(cache.kv_store_max_inflight),
                          model=getattr(executor, "model", None))
