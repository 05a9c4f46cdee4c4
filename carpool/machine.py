"""What machine this is, as far as step costs care, and whether a cost
model measured elsewhere describes it.

A measured cost model is only true of the machine it was measured on: the
same "2-core AMD EPYC" ran the default model's decode steps about 2x
faster with AVX-512 (bf16 instructions) than with AVX2 only. ``carpool
measure`` records ``machine_identity()`` in the model; ``carpool simulate``,
``plan`` and ``fidelity`` compare it with the machine they run on
(``identity_mismatch``) and say so loudly when it differs. Plain Python:
reads /proc/cpuinfo and package metadata, imports no torch.
"""
from __future__ import annotations

import os
import platform
from importlib import metadata

# The instruction sets that change how fast our CPU kernels and torch's run.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """The CPU's model name and feature flags (from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return platform.processor() or "unknown", set()
    model, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, flags


def available_cpus() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_identity(device: str = "cpu") -> dict:
    """This machine: CPU model, the ISA flags of ``ISA_FLAGS`` it has, the
    CPUs this process may use, the architecture, torch's version and the
    device a model runs on."""
    model, flags = cpu_model_and_flags()
    return {"cpu_model": model, "isa": [f for f in ISA_FLAGS if f in flags],
            "cpus": available_cpus(), "arch": platform.machine(), "torch": _version("torch"),
            "device": device}


def identity_mismatch(recorded: dict | None, current: dict | None = None) -> list[str]:
    """How ``recorded`` (a cost model's ``machine``) differs from
    ``current`` (default: this machine), one phrase per difference; empty
    when they match. A model that recorded no identity is one difference."""
    if not recorded:
        return ["it records no machine identity (measured before carpool kept one)"]
    current = current if current is not None else machine_identity(recorded.get("device", "cpu"))
    out = []
    for key, name in (("cpu_model", "CPU"), ("cpus", "CPUs"), ("arch", "architecture"),
                      ("device", "device"), ("torch", "torch")):
        if recorded.get(key) != current.get(key):
            out.append(f"{name} {recorded.get(key)} there, {current.get(key)} here")
    gained = sorted(set(current.get("isa", [])) - set(recorded.get("isa", [])))
    lost = sorted(set(recorded.get("isa", [])) - set(current.get("isa", [])))
    if gained or lost:
        out.append("instruction sets differ (" + ", ".join(
            [f"+{f} here" for f in gained] + [f"{f} only there" for f in lost]) + ")")
    return out


# -- was the machine quiet? --------------------------------------------------------

# A run shares the machine with others when they used more than this many
# cores on average, or the hypervisor stole more than this share of its CPUs:
# real serving on a few cores then moves by far more than a fidelity goal.
BUSY_OTHER_CORES = 0.2
BUSY_STEAL_SHARE = 0.05


def _cpu_seconds() -> tuple[float, float, int] | None:
    """(busy seconds of all CPUs, stolen seconds, CPUs) since boot, from
    /proc/stat; None where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            first = f.readline().split()
            cpus = sum(1 for line in f if line.startswith("cpu"))
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    ticks = [int(v) for v in first[1:]] + [0] * 8
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    hz = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / hz, steal / hz, max(1, cpus)


def _own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class MachineLoad:
    """What else ran on the machine between ``__init__`` and ``report``:
    the cores other processes kept busy on average, and the share of CPU
    time the hypervisor stole (what ``carpool fidelity`` checks its real
    runs by)."""

    def __init__(self, clock=None) -> None:
        import time

        self._clock = clock or time.monotonic
        self._start = (self._clock(), _cpu_seconds(), _own_cpu_seconds())

    def report(self) -> dict | None:
        """{"other_cores", "steal_share", "busy", "why"} over the interval;
        None where it cannot tell: no /proc/stat (not Linux), or one that
        counts more CPUs than this process may use (a container on a
        bigger host: the others' work there is not ours to judge by)."""
        wall0, cpu0, own0 = self._start
        wall, cpu, own = self._clock() - wall0, _cpu_seconds(), _own_cpu_seconds() - own0
        if cpu0 is None or cpu is None or wall <= 0 or cpu[2] > available_cpus():
            return None  # no /proc/stat, or it counts CPUs this process is kept off
        return load_verdict(max(0.0, (cpu[0] - cpu0[0]) - own) / wall,
                            (cpu[1] - cpu0[1]) / (wall * cpu[2]))


def load_verdict(other_cores: float, steal_share: float) -> dict:
    """Whether a run with these averages shared the machine, and why."""
    why = []
    if other_cores > BUSY_OTHER_CORES:
        why.append(f"other processes kept {other_cores:.2f} cores busy on average "
                   f"(more than {BUSY_OTHER_CORES})")
    if steal_share > BUSY_STEAL_SHARE:
        why.append(f"the hypervisor stole {steal_share:.1%} of the CPU time "
                   f"(more than {BUSY_STEAL_SHARE:.0%})")
    return {"other_cores": round(other_cores, 3), "steal_share": round(steal_share, 4),
            "busy": bool(why), "why": "; ".join(why)}
