"""The host's CPU utilisation, read from ``/proc/stat`` (Linux; no dependency).

Shared by the metrics exporter (``carpool.server.host_metrics``) and the
engine, whose emergency switch trips on a busy host
(``carpool.scheduler.control.overload``: the HTTP front, the detokenizer and
anything else on the box share the CPUs with the engine).
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

PROC_STAT = Path("/proc/stat")

def read_proc_stat(path: Path = PROC_STAT) -> tuple[int, int] | None:
    """(busy, total) CPU time of every CPU since boot, in clock ticks;
    None where there is no ``/proc/stat``."""
    try:
        with path.open(encoding="ascii") as f:
            line = f.readline()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal (guest time is in user)
    ticks = [int(v) for v in line.split()[1:9]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return sum(ticks) - idle, sum(ticks)


class HostCpu:
    """Host CPU utilisation (0-1) between consecutive readings."""

    def __init__(self, read: Callable[[], tuple[int, int] | None] = read_proc_stat,
                 clock: Callable[[], float] = time.monotonic, min_interval: float = 0.5) -> None:
        self._read = read
        self._clock = clock
        self.min_interval = min_interval
        self._lock = threading.Lock()  # scrapes may come on several threads
        self._base = read()  # the first scrape covers the time since here
        self._base_at = clock()
        self._value = math.nan

    def utilization(self) -> float | None:
        """Busy share since the previous reading; the previous value when
        readings come closer than ``min_interval``; None without /proc/stat."""
        with self._lock:
            if self._base is None:
                return None
            now = self._clock()
            if now - self._base_at < self.min_interval and not math.isnan(self._value):
                return self._value
            current = self._read()
            if current is None:
                return None
            busy, total = current[0] - self._base[0], current[1] - self._base[1]
            if total > 0:  # else no tick elapsed: keep the base and the last value
                self._value = min(1.0, max(0.0, busy / total))
                self._base, self._base_at = current, now
            return self._value
