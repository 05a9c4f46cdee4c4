"""The CPU weights a model serves from, laid out once at start-up as this
machine kind's ``KernelPlan`` (carpool/kernel_plan.py) says: quantized
copies (``--quantization``), packed copies for decode steps of a few rows
(``--packed-decode``), MoE experts packed for our fused kernel, and
oneDNN-blocked dense weights (``--blocked-weights``).

The plan decides what this CPU's tier can run; the kernels' own build
(``*_native``: compiled with the instructions) must agree, as a cache built
on another CPU would not.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from carpool.config import ModelSettings
from carpool.kernel_plan import KernelPlan, plan_kernels
from carpool.machine import cpu_model_and_flags

log = logging.getLogger(__name__)  # carpool serve's log lines; silent offline at INFO


def cpu_plan(settings: ModelSettings, kernels: bool) -> KernelPlan:
    """This CPU's plan under ``settings`` (``kernels``: ours are there, or compiling)."""
    return plan_kernels(cpu_model_and_flags()[1], settings.quantization, settings.dtype,
                        kernels, settings.cpu_isa)


def native_bf16_dot(ops) -> bool:  # noqa: ANN001 - the kernels or a SwitchingCpuOps
    """Whether the packed kernel has its AVX512-BF16 path (built with it);
    while the kernels compile in the background, whether this CPU has it."""
    native = getattr(ops, "packed_linear_native", None)
    if native is not None:
        return bool(native())
    return "avx512_bf16" in cpu_model_and_flags()[1]


def prepare_cpu_weights(model: nn.Module, plan: KernelPlan, ops, settings: ModelSettings,  # noqa: ANN001
                        dtype: torch.dtype, free_bytes: int) -> None:
    """Lay ``model``'s weights out as ``plan`` says (module docstring).
    ``ops``: our compiled kernels (or a ``SwitchingCpuOps``), or None;
    ``free_bytes``: memory available now (the packed copy's budget)."""
    native_bf16 = (plan.isa in ("amx", "avx512_bf16") and ops is not None
                   and native_bf16_dot(ops))
    if settings.quantization == "w8a8":
        _quantize_w8a8(model, plan, ops)
    elif settings.quantization is not None:
        _quantize_for_decode(model, settings.quantization, ops if native_bf16 else None, dtype)
    if ops is not None and dtype == torch.bfloat16:
        _pack_experts(model, settings.packed_decode, ops, native_bf16 and plan.isa != "amx")
        _pack_for_decode(model, settings.packed_decode, ops, native_bf16, free_bytes)
    elif settings.packed_decode == "on":
        log.warning("packed decode weights not used: it is a CPU bf16 path with our kernels "
                    "(dtype %s)", dtype)
    _block_weights(model, settings.blocked_weights, dtype)
    _onto_huge_pages(model)


# Buffers our kernels stream a step's weights from (packed_linear.py, w8a8.py, quant.py).
STREAMED = ("packed", "qweight")


def _onto_huge_pages(model: nn.Module) -> None:
    """Our kernels' weight copies, moved together onto huge pages
    (``huge_pages.gather``): a decode step streams them front to back, and
    on 4 KiB pages every 4 KiB of weights costs a TLB miss."""
    from carpool.model import huge_pages

    owners = [(module, name) for module in model.modules() for name in STREAMED
              if isinstance(module._buffers.get(name), torch.Tensor)]
    if not owners:
        return
    places = huge_pages.side_by_side([module._buffers[name] for module, name in owners])
    for (module, name), place in zip(owners, places):  # each old copy goes as it is moved
        module._buffers[name] = place.copy_(module._buffers[name])


def _quantize_for_decode(model: nn.Module, scheme: str, ops, dtype: torch.dtype) -> None:  # noqa: ANN001
    from carpool.model.quant import low_bit_unavailable, quantize_for_decode

    why = low_bit_unavailable(scheme, torch.device("cpu"))
    if why is not None:
        raise ValueError(f"--quantization {scheme} cannot run here: {why}")
    # Our INT4 kernel where it has its AVX512-BF16 path (``ops``); else ATen's.
    added = quantize_for_decode(model, scheme, kernels=ops)
    log.info("%s weights for decode steps of up to a few rows (+%.0f MiB beside the %s "
             "weights)", scheme.upper(), added / 2**20, str(dtype).removeprefix("torch."))


def _quantize_w8a8(model: nn.Module, plan: KernelPlan, ops) -> None:  # noqa: ANN001
    from carpool.model.w8a8 import quantize_w8a8, w8a8_unavailable

    why = (f"this CPU's kernel tier ({plan.isa}) has no AVX512-VNNI" if not plan.w8a8
           else w8a8_unavailable(torch.device("cpu"), ops))
    if why is not None:
        raise ValueError(f"--quantization w8a8 cannot run here: {why}")
    added = quantize_w8a8(model, ops)
    log.info("W8A8: INT8 weights (%.0f MiB) and INT8 activations (a scale per 32 inputs) on "
             "every step", added / 2**20)


def _pack_experts(model: nn.Module, mode: str, ops, pays: bool) -> None:  # noqa: ANN001
    """MoE experts packed for our fused kernel (carpool/model/moe_cpu.py),
    in place of the plain weights (no extra memory). ``auto``: where it
    ``pays``: the kernel has its AVX512-BF16 path and the CPU no AMX
    (whose oneDNN kernels, on blocked experts, win there)."""
    blocks = [layer.moe for layer in model.layers if layer.moe is not None]
    if mode == "off" or not blocks or (mode == "auto" and not pays):
        return
    made = sum(block.pack_experts(ops) for block in blocks)
    if made:
        log.info("MoE experts packed for the fused CPU kernel (%.0f MiB)", made / 2**20)


def _pack_for_decode(model: nn.Module, mode: str, ops, native_bf16: bool,  # noqa: ANN001
                     free_bytes: int) -> None:
    """Packed bf16 weights for small decode steps (carpool/model/packed_linear.py)."""
    from carpool.model.packed_linear import pack_for_decode, packed_bytes

    if mode == "off":
        return
    why = None
    if mode == "auto" and not native_bf16:
        why = "this CPU lacks AVX512-BF16 (the kernel's portable loop is no faster than ATen)"
    elif mode == "auto" and packed_bytes(model) > free_bytes // 4:
        why = "the packed copy would take over a quarter of the available memory"
    if why is not None:
        return
    added = pack_for_decode(model, ops)
    if added:
        log.info("packed bf16 weights for decode steps of up to a few rows (+%.0f MiB)",
                 added / 2**20)


def _block_weights(model: nn.Module, mode: str, dtype: torch.dtype) -> None:
    """oneDNN-blocked weights for the dense paths (carpool/model/blocked_linear.py)."""
    from carpool.model.blocked_linear import block_weights, blocked_unavailable

    if mode == "off":
        return
    why = blocked_unavailable(torch.device("cpu"), dtype)
    if why is not None:
        if mode == "on":
            log.warning("blocked weights not used: %s", why)
        return
    block_weights(model)
