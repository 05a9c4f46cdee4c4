"""P/D: a prefill replica's prompt blocks sent layer by layer while the
next layers compute, and read back whole by the decode replica.

A request that exports its prompt (``Request.kv_export``) sends each
block as one part per layer, each its own store entry (a checked payload
of a one-layer ``BlockLayout`` under ``layer_hash(block hash, layer)``:
the reader refuses a part of another block, layer, model or layout). The
scheduler side's orders say which blocks a step fills up (``begin``); the
model calls ``layer_done(i)`` as soon as layer ``i``'s KV is in the cache
(``DecoderModel.after_layer``), which copies that layer of those blocks out
on the engine thread (a gather of a few KB per block) and queues the
put on the connector's I/O thread: the bytes travel while layers
``i + 1 ..`` compute. ``end`` marks the end of the forward; each step's
transfer time is then split into the part that overlapped the forward
(hidden) and the part after it (exposed), for metrics.

Blocks an exporting request did not compute in a step (found in the
prefix cache, loaded) go out all layers at once (``export_now``). The
decode side (``StoreWorker``'s handoff fetch) waits until the last
layer of its blocks is in the store (parts go in layer order), then gets
every part and joins them into whole blocks.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from carpool.kv_transfer.payload import block_key_bytes, decode_block, encode_block

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def layer_hash(block_hash: int, layer: int) -> int:
    """The store key hash of one layer's part of a block."""
    return (block_hash ^ ((layer + 1) * 0x9E3779B97F4A7C15)) & _MASK64


def part_hashes(block_hashes: Sequence[int], parts_key: int) -> tuple[int, ...]:
    """What a handoff's parts of ``block_hashes`` are keyed by: each hash
    mixed with the handoff's ``parts_key`` (``wire.Handoff``); 0: the
    hashes themselves."""
    if not parts_key:
        return tuple(block_hashes)
    return tuple(((h ^ parts_key) * 0xFF51AFD7ED558CCD + parts_key) & _MASK64
                 for h in block_hashes)


@dataclass
class _StepExport:
    """The parts one step streams: when its forward ended, the puts still
    running, and each finished put's (start, end)."""

    forward_end: float | None = None
    pending: int = 0
    busy: list[tuple[float, float]] = field(default_factory=list)


class LayerExporter:
    """Both sides' layer parts for one connector's worker side (``StoreWorker``;
    module docstring)."""

    def __init__(self, connector) -> None:  # noqa: ANN001 - StoreWorker (a cycle)
        self.connector = connector
        self.layer_layout = replace(connector.layout, num_layers=1)
        self.num_layers = connector.layout.num_layers
        self._blocks: list[tuple[int, int]] = []  # (block id, hash) the running step fills
        self._step: _StepExport | None = None
        self._lock = threading.Lock()

    def key(self, block_hash: int, layer: int) -> bytes:
        return block_key_bytes(self.connector.fingerprint, layer_hash(block_hash, layer))

    # -- prefill side: the engine thread ---------------------------------------------------

    def begin(self, blocks: Sequence[tuple[int, int]]) -> None:
        """Before a step's forward: the (block id, hash) pairs of exporting
        requests' prompt blocks it fills up (the scheduler side's orders)."""
        self._blocks = list(blocks)
        self._step = _StepExport() if blocks else None

    def block_ids(self) -> list[int]:
        """The blocks the running step streams (``begin``'s)."""
        return [block_id for block_id, _ in self._blocks] if self._step is not None else []

    def layer_done(self, layer: int) -> None:
        """Layer ``layer``'s KV of the step is written: send it."""
        step = self._step
        if step is None:
            return
        datas = self.connector.io.read_layer([b for b, _ in self._blocks], layer)
        hashes = [h for _, h in self._blocks]
        with self._lock:
            step.pending += 1
        self.connector.submit(self._put, step, [layer], hashes, datas)

    def end(self) -> None:
        """After the forward: the rest of the step's transfer is exposed."""
        step, self._step, self._blocks = self._step, None, []
        if step is not None:
            with self._lock:
                step.forward_end = time.perf_counter()
                self._settle(step)

    def export_now(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Blocks whose KV is there already (cached, loaded): every layer at once."""
        if not block_ids:
            return
        layers = range(self.num_layers)
        wholes = self.connector.io.read(block_ids)  # one read: each block's layers in order
        size = self.layer_layout.data_bytes
        datas = [whole[layer * size:(layer + 1) * size] for layer in layers for whole in wholes]
        self.connector.submit(self._put, None, list(layers), list(hashes), datas)

    # -- prefill side: the I/O thread ------------------------------------------------------

    def _put(self, step: _StepExport | None, layers: list[int], hashes: list[int],
             datas: list[bytes]) -> None:
        """Put ``datas`` (layer-major: every block of ``layers[0]``, then ...)."""
        started = time.perf_counter()
        connector = self.connector
        try:
            items = [(self.key(h, layer), encode_block(layer_hash(h, layer), connector.fingerprint,
                                                       self.layer_layout, data))
                     for layer_index, layer in enumerate(layers)
                     for h, data in zip(hashes, datas[layer_index * len(hashes):])]
            connector.store.put_many(items)
            connector.stats.layer_parts_sent += len(items)
        except Exception as error:  # noqa: BLE001 - the decode side computes instead
            connector.store_failed(error)
        finally:
            if step is not None:
                with self._lock:
                    step.busy.append((started, time.perf_counter()))
                    step.pending -= 1
                    self._settle(step)

    def _settle(self, step: _StepExport) -> None:
        """Once the forward ended and every put finished (under the lock):
        count the step's transfer time, hidden and exposed."""
        if step.forward_end is None or step.pending or not step.busy:
            return
        end = step.forward_end
        stats = self.connector.stats
        stats.export_seconds += sum(b - a for a, b in step.busy)
        stats.export_hidden_seconds += sum(max(0.0, min(b, end) - a) for a, b in step.busy)
        stats.export_exposed_seconds += max(0.0, max(b for _, b in step.busy) - end)
        stats.export_steps += 1
        step.busy = []

    def drop(self, hashes: Sequence[int]) -> None:
        """Delete every layer part of ``hashes`` from the store (I/O thread):
        a handoff's parts once its decode part took them, or an exporting
        request's that no decode part will take."""
        if not hashes:
            return
        try:
            self.connector.store.delete_many([self.key(h, layer) for h in hashes
                                              for layer in range(self.num_layers)])
            self.connector.stats.layer_parts_dropped += len(hashes) * self.num_layers
        except Exception as error:  # noqa: BLE001 - the TTL drops them instead
            self.connector.store_failed(error)

    # -- decode side: the I/O thread -------------------------------------------------------

    def wait_for(self, hashes: Sequence[int], wait_s: float, poll_s: float) -> None:
        """Until the last layer of every block is in the store, or ``wait_s``."""
        last = [self.key(h, self.num_layers - 1) for h in hashes]
        deadline = time.perf_counter() + wait_s
        store = self.connector.store
        try:
            while store.count_prefix(last) < len(last) and time.perf_counter() < deadline:
                time.sleep(poll_s)
        except Exception as error:  # noqa: BLE001 - the fetch finds what there is
            self.connector.store_failed(error)

    def fetch(self, hashes: Sequence[int]) -> tuple[list[bytes], bool]:
        """The leading whole blocks whose every part is in the store and
        passes the checks, and whether they end at a missing part."""
        layers = self.num_layers
        keys = [self.key(h, layer) for h in hashes for layer in range(layers)]
        connector = self.connector
        datas: list[bytes] = []
        try:
            payloads = connector.store.get_many(keys)
        except Exception as error:  # noqa: BLE001 - any store failure is a miss
            connector.store_failed(error)
            return datas, False
        for index, block_hash in enumerate(hashes):
            parts = payloads[index * layers:(index + 1) * layers]
            if any(p is None for p in parts):
                return datas, True
            try:
                datas.append(b"".join(
                    decode_block(part, layer_hash(block_hash, layer), connector.fingerprint,
                                 self.layer_layout) for layer, part in enumerate(parts)))
            except ValueError as error:  # KVPayloadError: another block, model or layout
                connector.stats.blocks_refused += 1
                logger.warning("kv handoff: block %#x refused: %s", block_hash, error)
                break
        return datas, False
