"""The host's CPU and the GPUs' NVML readings, as metric families.

``HostCpu``: the share of the host's CPU time (every CPU, every process)
spent busy between two readings of ``/proc/stat``: each scrape reads the
time since the one before (at least ``min_interval`` apart; the first covers
the time since the server started). Linux only; elsewhere the family is left
out. No dependency.

``NvmlDevices``: utilisation, memory and PCIe / NVLink traffic of the GPUs
this process sees, through NVML (``nvidia-ml-py``: ``pip install
carpool[gpu]``), only when the engine runs on CUDA. ``pynvml`` is imported
then, never on a CPU install. The NVML module is passed in (tests hand in a
fake one). Readings a GPU does not support (NVLink on a PCIe card, PCIe
counters in a VM) are left out for that GPU, never shown as 0.

Every family is unprefixed and labelled ``model_name`` like the rest
(``carpool.server.metrics`` names them ``carpool:`` / ``vllm:``).
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger("carpool.metrics")

PROC_STAT = Path("/proc/stat")
# NVML's NVLink throughput fields (nvml.h), KiB since the driver loaded; the
# scope UINT_MAX sums every link of the GPU.
NVLINK_DATA_TX, NVLINK_DATA_RX = 138, 139
ALL_LINKS = 0xFFFFFFFF


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


def host_families(cpu: HostCpu, model_name: str) -> Iterator[Metric]:
    value = cpu.utilization()
    if value is None:
        return
    family = GaugeMetricFamily(
        "host_cpu_utilization", "Share of the host's CPU time (all CPUs, all processes) "
        "spent busy since the previous scrape (0-1; /proc/stat).", labels=["model_name"])
    family.add_metric([model_name], value)
    yield family


def load_pynvml() -> ModuleType | None:
    """``pynvml`` (nvidia-ml-py), or None when it is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def visible_gpus(nvml, environ: Mapping[str, str]) -> list[tuple[str, object]]:
    """(CUDA index as this process numbers it, NVML handle) of each GPU that
    ``CUDA_VISIBLE_DEVICES`` leaves visible (every GPU when unset). As CUDA
    does, the list ends at the first entry that names no GPU. Indices are
    NVML's (PCI bus order): set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or name the
    GPUs by UUID for the labels to match CUDA's numbering."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [(str(i), nvml.nvmlDeviceGetHandleByIndex(i))
                for i in range(nvml.nvmlDeviceGetCount())]
    count = nvml.nvmlDeviceGetCount()
    out = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit() and int(entry) < count:
            handle = nvml.nvmlDeviceGetHandleByIndex(int(entry))
        elif entry.startswith(("GPU-", "MIG-")):
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(entry)
            except nvml.NVMLError:
                break
        else:
            break
        out.append((str(len(out)), handle))
    return out


# name, help, kind, reading (nvml, handle) -> value
_READINGS: tuple[tuple[str, str, str, Callable], ...] = (
    ("gpu_utilization", "Share of the last sample period (NVML: 1/6 to 1 s) in which a "
     "kernel ran on the GPU (0-1).", "gauge",
     lambda nvml, h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
    ("gpu_memory_used_bytes", "GPU memory in use, by every process (bytes).", "gauge",
     lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).used),
    ("gpu_memory_total_bytes", "GPU memory installed (bytes).", "gauge",
     lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).total),
    ("gpu_pcie_rx_bytes_per_second", "PCIe traffic into the GPU over NVML's 20 ms "
     "sample (bytes/s).", "gauge",
     lambda nvml, h: 1024.0 * nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES)),
    ("gpu_pcie_tx_bytes_per_second", "PCIe traffic out of the GPU over NVML's 20 ms "
     "sample (bytes/s).", "gauge",
     lambda nvml, h: 1024.0 * nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES)),
    ("gpu_nvlink_rx_bytes", "NVLink data received, every link (bytes; take rate()).",
     "counter", lambda nvml, h: _nvlink_bytes(nvml, h, NVLINK_DATA_RX)),
    ("gpu_nvlink_tx_bytes", "NVLink data sent, every link (bytes; take rate()).",
     "counter", lambda nvml, h: _nvlink_bytes(nvml, h, NVLINK_DATA_TX)),
)


def _nvlink_bytes(nvml, handle, field: int) -> float | None:
    value = nvml.nvmlDeviceGetFieldValues(handle, [(field, ALL_LINKS)])[0]
    if value.nvmlReturn != nvml.NVML_SUCCESS:
        return None  # no NVLink, or a driver without the field
    return 1024.0 * value.value.ullVal


class NvmlDevices:
    """NVML's readings of ``gpus`` ((label, handle) pairs) at each scrape."""

    def __init__(self, nvml, gpus: list[tuple[str, object]]) -> None:
        self.nvml = nvml
        self.gpus = gpus

    @classmethod
    def open(cls, nvml, environ: Mapping[str, str] = os.environ) -> "NvmlDevices | None":
        """Initialise NVML and find the visible GPUs; None (logged) if it cannot."""
        try:
            nvml.nvmlInit()
            gpus = visible_gpus(nvml, environ)
        except nvml.NVMLError as exc:
            log.warning("no GPU metrics: NVML did not start (%s)", exc)
            return None
        return cls(nvml, gpus)

    def families(self, model_name: str) -> Iterator[Metric]:
        for name, doc, kind, read in _READINGS:
            make = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = make(name, doc, labels=["model_name", "gpu"])
            for label, handle in self.gpus:
                try:
                    value = read(self.nvml, handle)
                except self.nvml.NVMLError:
                    continue  # not supported here (or the GPU is gone): no sample
                if value is not None:
                    family.add_metric([model_name, label], value)
            if family.samples:
                yield family


def device_metrics(device: str, load: Callable[[], ModuleType | None] = load_pynvml,
                   environ: Mapping[str, str] = os.environ) -> NvmlDevices | None:
    """The GPU readings for an engine on ``device`` ("cpu", "cuda:0"...):
    None unless it is CUDA and NVML loads (``pip install carpool[gpu]``)."""
    if not device.startswith("cuda"):
        return None
    nvml = load()
    if nvml is None:
        log.info("no GPU metrics: nvidia-ml-py is not installed (pip install carpool[gpu])")
        return None
    return NvmlDevices.open(nvml, environ)
