"""The emergency switch's last step: identical deterministic requests
answered from a cache (``carpool.scheduler.control.overload``, stage 3).

Only while the engine is that deep in degrade mode does a request read the
cache; every deterministic, non-streamed response is stored in it (so the
repeats of an overload find their first answer). Deterministic: every
choice greedy (temperature 0) or seeded, so the engine would answer the
same again. The key is the tenant (cache sharing never crosses keys), the
endpoint and the request as the engine would see it: the prompt token ids,
the sampling parameters and ``n``. Bounded in entries and bytes (least
recently used out first) and by a TTL; a hit gets a fresh id and creation
time. Thread-safe (routes run on one event loop, but cheap to keep safe).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from carpool.sampling_params import SamplingParams


def is_deterministic(params: list[SamplingParams]) -> bool:
    """Every choice greedy or seeded: the engine would give the same answer."""
    return all(p.temperature == 0 or p.seed is not None for p in params)


def cache_key(tenant: str, route: str, prompts: list[list[int]],
              params: list[SamplingParams], n: int) -> str:
    """A digest of what the engine would be asked (tenant and route first)."""
    document = json.dumps([tenant, route, n, prompts,
                           [dataclasses.asdict(p) for p in params]],
                          sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(document.encode()).hexdigest()


class ResponseCache:
    """Response bodies by ``cache_key``: at most ``max_entries`` and
    ``max_bytes`` (their JSON size), each for ``ttl`` seconds."""

    def __init__(self, max_entries: int, max_bytes: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, int, dict[str, Any]]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0  # lookups that found nothing (only while serving from it)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, response_id: str) -> dict[str, Any] | None:
        """The stored body under a new ``id`` and ``created``, or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and self._clock() - entry[0] > self.ttl:
                self._drop(key)
                entry = None
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            body = copy.deepcopy(entry[2])
        body["id"], body["created"] = response_id, int(time.time())
        return body

    def put(self, key: str, body: dict[str, Any]) -> None:
        size = len(json.dumps(body, separators=(",", ":")))
        if self.max_entries < 1 or size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                self._drop(key)
            self._entries[key] = (self._clock(), size, copy.deepcopy(body))
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def _drop(self, key: str) -> None:
        _, size, _ = self._entries.pop(key)
        self._bytes -= size
