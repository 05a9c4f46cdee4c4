"""Which CPU kernels serve on this machine kind, chosen once at start-up.

The machine kinds this project runs on differ in what pays: an Intel Xeon
with AMX (oneDNN's bf16 tiles win at every batch size past a few rows), an
AMD EPYC with AVX512-BF16 and VNNI but no AMX (our packed bf16 kernel for a
few rows, VNNI's INT8 for batches under ``--quantization w8a8``), CPUs with
AVX-512 but no bf16 instructions, and AVX2-only ones (fp32, ATen's kernels,
our portable loops). `plan_kernels` maps the CPU's feature flags to those
choices; the executor follows the plan, logs it at start-up and puts it on
``/metrics`` (``cpu_kernels_info``) and ``/carpool/steps``.

Plain Python (no torch): the tests check every tier's plan on any machine,
and force a lower tier on the CI machine to run its fallbacks for real.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

# From the most capable down; a CPU's tier is the first whose flags it has all of.
TIERS = (("amx", ("amx_bf16", "amx_tile", "avx512_bf16")),
         ("avx512_bf16", ("avx512f", "avx512_bf16")),
         ("avx512_vnni", ("avx512f", "avx512_vnni")),
         ("avx512", ("avx512f",)),
         ("avx2", ("avx2", "fma")),
         ("portable", ()))


@dataclass(frozen=True)
class KernelPlan:
    """What serves each kind of work on this CPU (labels of ``cpu_kernels_info``)."""

    isa: str          # the tier (``TIERS``)
    dtype: str        # what ``--dtype auto`` becomes
    decode: str       # decode-only steps of a few rows
    batched: str      # prefill and batched steps
    attention: str    # decode attention
    w8a8: bool        # whether ``--quantization w8a8`` can serve here

    def labels(self) -> dict[str, str]:
        """The plan as ``/metrics`` labels (strings)."""
        return {key: str(value).lower() if isinstance(value, bool) else value
                for key, value in asdict(self).items()}

    def describe(self) -> str:
        """One line for the start-up log."""
        return (f"CPU kernels for {self.isa}: {self.dtype}; decode steps of a few rows on "
                f"{self.decode}; batched steps on {self.batched}; decode attention on "
                f"{self.attention}")


def cpu_tier(flags: Iterable[str], cap: str = "auto") -> str:
    """The first of ``TIERS`` whose flags ``flags`` (a CPU's, from
    /proc/cpuinfo) holds all of; no higher than ``cap`` (``--cpu-isa``:
    a tier's name, or ``auto``). A cap above the CPU's tier is an error:
    its instructions would fault."""
    have = set(flags)
    names = [name for name, _ in TIERS]
    tier = next(name for name, needs in TIERS if have.issuperset(needs))
    if cap == "auto":
        return tier
    if cap not in names:
        raise ValueError(f"--cpu-isa must be auto or one of {', '.join(names)}, got {cap!r}")
    if names.index(cap) < names.index(tier):
        raise ValueError(f"--cpu-isa {cap}: this CPU's best is {tier} (it lacks "
                         f"{', '.join(sorted(set(dict(TIERS)[cap]) - have))})")
    return cap


def plan_kernels(flags: Iterable[str], quantization: str | None = None,
                 dtype: str = "auto", kernels: bool = True, cap: str = "auto") -> KernelPlan:
    """The plan for a CPU with ``flags``, under ``--quantization``,
    ``--dtype`` (``auto``: bf16 where the tier has bf16 instructions, else
    fp32) and ``--cpu-isa`` (``cap``); ``kernels``: whether our compiled
    kernels are (or will be) there."""
    tier = cpu_tier(flags, cap)
    native_bf16 = tier in ("amx", "avx512_bf16")
    vnni = "avx512_vnni" in set(flags) and tier in ("amx", "avx512_bf16", "avx512_vnni")
    resolved = dtype if dtype != "auto" else ("bfloat16" if native_bf16 else "float32")
    bf16 = resolved == "bfloat16"
    batched = ("oneDNN blocked bf16" + (" (AMX tiles)" if tier == "amx" else "")
               if bf16 else f"ATen {resolved}")
    decode = "packed bf16 (vdpbf16ps)" if kernels and bf16 and native_bf16 else batched
    if quantization == "int4":
        decode = "int4 (ours, vdpbf16ps)" if kernels and bf16 and native_bf16 else "int4 (ATen)"
    elif quantization == "int8":
        decode = "int8 weight-only (ATen)"
    elif quantization == "w8a8" and kernels and vnni:
        decode = batched = "w8a8 (vpdpbusd)"
    attention = "ours (fused decode block)" if kernels else "portable torch"
    return KernelPlan(tier, resolved, decode, batched, attention, kernels and vnni)
