"""Host CPU utilisation (``/proc/stat`` deltas) and the GPUs' NVML readings
(``carpool.server.host_metrics``), without a GPU: the NVML collector runs
against a fake NVML module handed in, which answers like the real one
(handles, NVMLError for what a GPU does not support, NVLink scopes)."""
from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from carpool.engine.stats import EngineCounters, EngineStats
from carpool.host_cpu import HostCpu, read_proc_stat
from carpool.server.host_metrics import (
    ALL_LINKS,
    NVLINK_DATA_RX,
    NVLINK_DATA_TX,
    NvmlDevices,
    device_metrics,
    visible_gpus,
)
from carpool.server.metrics import Metrics


class FakeNvml:
    """The slice of ``pynvml`` carpool calls, over made-up GPUs. GPU "b" is
    a PCIe card in a VM: no PCIe counters (NOT_SUPPORTED), no NVLink."""

    NVML_SUCCESS = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1

    class NVMLError(Exception):
        pass

    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.initialised = False
        self.gpus = {
            "a": {"uuid": "GPU-aaaa", "util": 42, "used": 30 << 30, "total": 80 << 30,
                  "pcie": {0: 1500, 1: 250}, "links": [100, 200, 300]},
            "b": {"uuid": "GPU-bbbb", "util": 7, "used": 1 << 30, "total": 16 << 30,
                  "pcie": None, "links": None},
        }
        self.order = ["a", "b"]

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")
        self.initialised = True

    def _check(self) -> None:
        if not self.initialised:
            raise self.NVMLError("Uninitialized")

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.order)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self._check()
        return self.order[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self._check()
        for handle, gpu in self.gpus.items():
            if gpu["uuid"] == uuid:
                return handle
        raise self.NVMLError("Not Found")

    def nvmlDeviceGetUtilizationRates(self, handle: str):
        return SimpleNamespace(gpu=self.gpus[handle]["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: str):
        gpu = self.gpus[handle]
        return SimpleNamespace(used=gpu["used"], total=gpu["total"],
                               free=gpu["total"] - gpu["used"])

    def nvmlDeviceGetPcieThroughput(self, handle: str, counter: int) -> int:
        pcie = self.gpus[handle]["pcie"]
        if pcie is None:
            raise self.NVMLError("Not Supported")
        return pcie[counter]  # KB/s

    def nvmlDeviceGetFieldValues(self, handle: str, field_ids: list):
        """As NVML: a (field, scope) pair reads one link, scope UINT_MAX
        sums them all; an unsupported field says so in its nvmlReturn."""
        links = self.gpus[handle]["links"]
        out = []
        for field_id, scope in field_ids:
            assert field_id in (NVLINK_DATA_TX, NVLINK_DATA_RX)
            if links is None:
                out.append(SimpleNamespace(nvmlReturn=self.NVML_ERROR_NOT_SUPPORTED,
                                           value=SimpleNamespace(ullVal=0)))
                continue
            kib = sum(links) if scope == ALL_LINKS else links[scope]
            kib *= 2 if field_id == NVLINK_DATA_TX else 1
            out.append(SimpleNamespace(nvmlReturn=self.NVML_SUCCESS,
                                       value=SimpleNamespace(ullVal=kib)))
        return out


def _samples(devices: NvmlDevices) -> dict[tuple[str, str], float]:
    return {(f.name, s.labels["gpu"]): s.value
            for f in devices.families("m") for s in f.samples}


def test_nvml_readings_of_every_visible_gpu_and_none_it_lacks():
    devices = NvmlDevices.open(FakeNvml(), environ={})
    got = _samples(devices)
    assert got == {
        ("gpu_utilization", "0"): 0.42, ("gpu_utilization", "1"): 0.07,
        ("gpu_memory_used_bytes", "0"): 30 << 30, ("gpu_memory_used_bytes", "1"): 1 << 30,
        ("gpu_memory_total_bytes", "0"): 80 << 30, ("gpu_memory_total_bytes", "1"): 16 << 30,
        # KB/s -> bytes/s; GPU 1 has no PCIe counters and no NVLink: no sample, never 0
        ("gpu_pcie_rx_bytes_per_second", "0"): 250 * 1024.0,
        ("gpu_pcie_tx_bytes_per_second", "0"): 1500 * 1024.0,
        # every link summed (scope UINT_MAX), KiB -> bytes
        ("gpu_nvlink_rx_bytes", "0"): 600 * 1024.0,
        ("gpu_nvlink_tx_bytes", "0"): 1200 * 1024.0,
    }
    kinds = {f.name: f.type for f in devices.families("m")}
    assert kinds["gpu_nvlink_rx_bytes"] == "counter" and kinds["gpu_utilization"] == "gauge"


def test_no_family_at_all_when_no_gpu_answers():
    nvml = FakeNvml()
    nvml.gpus["a"].update(pcie=None, links=None)
    devices = NvmlDevices.open(nvml, environ={"CUDA_VISIBLE_DEVICES": "0"})
    names = {f.name for f in devices.families("m")}
    assert "gpu_pcie_rx_bytes_per_second" not in names and "gpu_nvlink_tx_bytes" not in names
    assert "gpu_utilization" in names


@pytest.mark.parametrize("visible, expected", [
    ("1,0", [("0", "b"), ("1", "a")]),  # labels are CUDA's numbering in this process
    ("GPU-bbbb", [("0", "b")]),
    ("0,nope,1", [("0", "a")]),  # as CUDA: the list ends at the first bad entry
    ("0,7", [("0", "a")]),
    ("GPU-none,0", []),
    ("", []),
])
def test_cuda_visible_devices_picks_and_numbers_the_gpus(visible, expected):
    nvml = FakeNvml()
    nvml.nvmlInit()
    assert visible_gpus(nvml, {"CUDA_VISIBLE_DEVICES": visible}) == expected
    assert visible_gpus(nvml, {}) == [("0", "a"), ("1", "b")]


def test_nvml_is_loaded_only_for_a_cuda_engine():
    def must_not_load():
        raise AssertionError("pynvml imported for a CPU engine")

    assert device_metrics("cpu", must_not_load) is None
    assert device_metrics("cuda:0", lambda: None) is None  # nvidia-ml-py not installed
    assert device_metrics("cuda", lambda: FakeNvml(fail_init=True)) is None  # no driver
    assert device_metrics("cuda:0", FakeNvml, environ={}).gpus == [("0", "a"), ("1", "b")]


def _stats() -> EngineStats:
    return EngineStats(time=0.0, num_running=0, num_waiting=0, waiting_tokens=0,
                       kv_num_blocks=1, kv_used_blocks=0, prefix_queries=0, prefix_hits=0,
                       num_preemptions=0, counters=EngineCounters(), rejections={},
                       sessions={}, knobs={})


def _exported(device: str, load) -> str:
    metrics = Metrics("m", _stats)
    metrics.bind_engine(None, None, {"machine": {"device": device}}, load_nvml=load)
    return generate_latest(metrics.registry).decode()


def test_metrics_show_gpu_families_on_cuda_and_none_on_cpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cuda = _exported("cuda:0", FakeNvml)
    assert re.search(r'^carpool:gpu_utilization\{gpu="0",model_name="m"\} 0\.42$', cuda, re.M)
    assert 'carpool:gpu_nvlink_tx_bytes_total{gpu="0",model_name="m"}' in cuda
    cpu = _exported("cpu", FakeNvml)
    assert "gpu_" not in cpu
    assert "carpool:host_cpu_utilization{" in cpu


def test_real_pynvml_has_everything_the_fake_stands_in_for():
    """Only with nvidia-ml-py installed (the ``gpu`` extra): the fake's
    names are the real module's, and without a GPU NVML reports no devices
    instead of failing the scrape."""
    pynvml = pytest.importorskip("pynvml")
    names = [n for n in vars(FakeNvml) if n.startswith(("nvml", "NVML"))]
    assert [n for n in names if not hasattr(pynvml, n)] == []
    assert (pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES) == (0, 1)
    assert (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX) == (NVLINK_DATA_TX, NVLINK_DATA_RX)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        assert device_metrics("cuda:0", lambda: pynvml) is None
    else:
        assert device_metrics("cuda:0", lambda: pynvml) is not None


def test_host_cpu_is_the_busy_share_between_readings():
    readings = iter([(100, 1000), (160, 1100), (160, 1100), (400, 1400), None])
    now = [0.0]
    cpu = HostCpu(read=lambda: next(readings), clock=lambda: now[0], min_interval=0.5)
    now[0] = 1.0
    assert cpu.utilization() == pytest.approx(0.6)  # 60 busy of 100 ticks since the start
    now[0] = 1.2
    assert cpu.utilization() == pytest.approx(0.6)  # too soon: the last value, no read
    now[0] = 2.0
    assert cpu.utilization() == pytest.approx(0.6)  # no tick elapsed: kept, base unchanged
    now[0] = 3.0
    assert cpu.utilization() == pytest.approx(0.8)  # 240 of 300 since 1.0
    now[0] = 4.0
    assert cpu.utilization() is None  # /proc/stat gone


def test_host_cpu_without_proc_stat_exports_nothing():
    cpu = HostCpu(read=lambda: None)
    assert cpu.utilization() is None


def test_proc_stat_is_read_as_busy_and_total_ticks(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 2 30 400 50 6 7 8 90 0\ncpu0 1 1 1 1 1 1 1 1 0 0\n")
    # busy: user nice system irq softirq steal; idle: idle + iowait; guest is in user
    assert read_proc_stat(stat) == (10 + 2 + 30 + 6 + 7 + 8, 10 + 2 + 30 + 400 + 50 + 6 + 7 + 8)
    assert read_proc_stat(tmp_path / "absent") is None


def test_host_cpu_reads_this_machine():
    if read_proc_stat() is None:
        pytest.skip("no /proc/stat: not Linux")
    cpu = HostCpu(min_interval=0.0)
    deadline = 200
    value = cpu.utilization()
    while math.isnan(value) and deadline:  # until a clock tick has passed
        sum(i * i for i in range(20_000))
        value, deadline = cpu.utilization(), deadline - 1
    assert 0.0 <= value <= 1.0
