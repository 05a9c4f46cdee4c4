"""What both sides of a live KV connector share: its counters, and whether
its store failed lately (then lookups answer 0 and saves are dropped for
``retry_after_s``: a store that hangs costs one timeout, not one per
admission, since lookups run on the engine thread)."""
from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("carpool.kv_transfer.connector")

# Upper bounds (seconds) of the transfer-time histograms' buckets; the last is +Inf.
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def observe(counts: list[int], seconds: float) -> None:
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
    # Parts deleted from the store as soon as no decode part needs them
    # (taken, or their request ended without one): single use, no TTL wait.
    layer_parts_dropped: int = 0
    export_steps: int = 0
    export_seconds: float = 0.0
    export_hidden_seconds: float = 0.0
    export_exposed_seconds: float = 0.0
    # Fetches / puts by wall time: counts per TRANSFER_BUCKETS bound, then +Inf.
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_BUCKETS) + 1))
    save_buckets: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_BUCKETS) + 1))


class StoreHealth:
    """Whether the store failed lately; ``failed`` from either side's thread."""

    def __init__(self, stats: ConnectorStats, retry_after_s: float,
                 clock: Callable[[], float]) -> None:
        self.stats, self.retry_after_s, self.clock = stats, retry_after_s, clock
        self._down_until = -math.inf
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return self.clock() < self._down_until

    def failed(self, error: Exception) -> None:
        with self._lock:
            self._down_until = self.clock() + self.retry_after_s
            self.stats.store_errors += 1
            errors = self.stats.store_errors
        if errors == 1 or errors % 100 == 0:
            logger.warning("kv store unavailable (%d times so far; recomputing instead): %s",
                           errors, error)
