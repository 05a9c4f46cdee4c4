"""Which attention backend a replica runs (``--attention-backend``)."""
from __future__ import annotations

import logging

import torch

from carpool.model.attention import CpuPagedAttention, SdpaAttention, TorchAttention
from carpool.model.kernel_switch import SwitchingCpuAttention, SwitchingCpuOps
from carpool.model.triton_attention import TritonAttention, triton_unavailable

log = logging.getLogger(__name__)


def select_backend(name: str, device: torch.device, cpu_ops=None,  # noqa: ANN001
                   head_dim: int = 64, portable_only: str | None = None) -> TorchAttention:
    """``auto``: on CUDA our Triton kernels when Triton is installed, else
    SDPA; on CPU our C++ decode kernel when ``cpu_ops`` (the compiled
    extension) is available, else the portable torch path. ``cpu_ops`` may
    be a ``SwitchingCpuOps`` (the kernels still compiling): ``auto`` then
    runs the portable path until they are built, ``cpu`` waits for them.
    ``portable_only``: why the model needs the portable path's attention
    (sliding windows, MLA), which every backend but Triton runs; or None."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        why = portable_only or triton_unavailable(device, head_dim)
        if why is None:
            return TritonAttention()
        if name == "triton":
            raise ValueError(f"attention_backend=triton is unavailable: {why}")
        log.warning("Triton attention unavailable (%s); using SDPA", why)
    if name == "sdpa" or (name == "auto" and device.type == "cuda"):
        return SdpaAttention()
    if isinstance(cpu_ops, SwitchingCpuOps) and device.type == "cpu":
        if name == "auto" or (name == "cpu" and cpu_ops.wait() is not None):
            return SwitchingCpuAttention(cpu_ops)
        cpu_ops = None  # the build failed: as if there were no kernels
    if name in ("auto", "cpu") and device.type == "cpu" and cpu_ops is not None:
        return CpuPagedAttention(cpu_ops)
    if name == "cpu":
        raise ValueError("attention_backend=cpu needs the C++ kernels (a C++ compiler and ninja)")
    return TorchAttention()
