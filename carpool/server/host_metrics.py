"""The host's CPU and the GPUs' NVML readings, as metric families.

``host_families``: the share of the host's CPU time (every CPU, every
process) spent busy between two scrapes (``carpool.host_cpu.HostCpu``: the
first covers the time since the server started). Linux only; elsewhere the
family is left out. No dependency.

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
import os
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from carpool.host_cpu import HostCpu

log = logging.getLogger("carpool.metrics")

# NVML's NVLink throughput fields (nvml.h), KiB since the driver loaded; the
# scope UINT_MAX sums every link of the GPU.
NVLINK_DATA_TX, NVLINK_DATA_RX = 138, 139
ALL_LINKS = 0xFFFFFFFF


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
