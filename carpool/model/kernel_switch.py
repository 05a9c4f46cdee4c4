"""Serving while the C++ CPU kernels compile: the portable path first, the
kernels from the first step after they are built.

`SwitchingCpuOps` stands where the compiled module would (``DecoderModel.ops``
and the attention backend's kernel); `SwitchingCpuAttention` is the CPU
attention backend over it. The switch happens in ``build_metadata``, which
the executor calls once at the start of every step, before any layer runs:
a step runs on one path from its first op to its last (the LM head
included), so no step mixes the two. The KV cache needs no conversion: both
paths write and read the same layout (``TorchAttention.forward`` writes it
for both). Outputs then move from the portable path's to the kernels', by
no more than the tolerance the kernels are tested to (tests/test_attention.py).
"""
from __future__ import annotations

import logging
import time
from types import ModuleType

import torch
import torch.nn.functional as F

from carpool.model.attention import AttentionMetadata, CpuPagedAttention, TorchAttention
from carpool.model.grammar import apply_token_bitmask

log = logging.getLogger(__name__)


class SwitchingCpuOps:
    """The fused ops (RMSNorm, SwiGLU, paged decode attention): the portable
    torch path until `latch` finds the build done, then the kernels.

    ``build``: a ``carpool.model.cpu_kernels.KernelBuild`` (``done()``,
    ``module``, ``started``). Before the switch its ops compute exactly what
    the model computes with no ops at all (``decoder.py``'s portable path).
    Used by one thread (the engine's).
    """

    def __init__(self, build) -> None:  # noqa: ANN001 - a KernelBuild
        self._build = build
        self._kernels: ModuleType | None = None
        self._settled = False  # the build ended: nothing left to switch

    @property
    def active(self) -> bool:
        """Whether the kernels run (from the step after they were built)."""
        return self._kernels is not None

    def latch(self) -> bool:
        """Switch to the kernels if they are ready now; call between steps
        only. Returns ``active``."""
        if not self._settled and self._build.done():
            self._settled = True
            self._kernels = self._build.module
            if self._kernels is not None:
                took = time.monotonic() - self._build.started
                log.info("CPU kernels ready (built in %.0f s); switched to them", took)
        return self.active

    def wait(self) -> ModuleType | None:
        """Wait for the build to end, then `latch`; the kernels or None."""
        self._build.wait()
        self.latch()
        return self._kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of the rows of ``x``: fp32 math, cast back before the weight."""
        if self._kernels is not None:
            return self._kernels.rms_norm(x, weight, eps)
        x32 = x.float()  # llama.RMSNorm's portable path, op for op
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for rows of [gate | up]."""
        if self._kernels is not None:
            return self._kernels.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def row_argmax(self, x: torch.Tensor) -> torch.Tensor:
        """The first index of each row's max (as ``torch.max(dim)``, which
        the portable path is: the same indices either way)."""
        if self._kernels is not None:
            return self._kernels.row_argmax(x)
        return x.max(dim=-1).indices

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Structured outputs' mask, in place (the same result either way)."""
        if self._kernels is not None:
            return self._kernels.apply_token_bitmask(logits, bitmask)
        return apply_token_bitmask(logits, bitmask)

    # Ops with no portable twin here (their callers take the portable path
    # themselves until `active`): the kernels' own, once active.
    KERNEL_ONLY = ("packed_linear", "int4_linear", "w8a8_linear", "packed_moe_experts",
                   "decode_attention_block", "paged_decode_attention")

    def __getattr__(self, name: str):  # noqa: ANN204 - only for names not set on self
        if name not in SwitchingCpuOps.KERNEL_ONLY:
            raise AttributeError(name)

        def kernel_op(*args):  # noqa: ANN002, ANN202
            if self._kernels is None:
                raise RuntimeError("the CPU kernels are not active yet")
            return getattr(self._kernels, name)(*args)

        return kernel_op


class SwitchingCpuAttention(TorchAttention):
    """CPU attention while the kernels compile: `TorchAttention` until
    ``ops`` switches (at the start of a step), then the C++ decode kernel
    (as ``CpuPagedAttention``; prefill chunks run the same SDPA on both)."""

    name = "cpu"

    def __init__(self, ops: SwitchingCpuOps) -> None:
        self.ops = ops
        self._kernel = ops  # what CpuPagedAttention.decode_block calls, once active

    def build_metadata(self, spans, block_size: int,  # noqa: ANN001
                       device: torch.device) -> AttentionMetadata:
        """The step's metadata; first, the step boundary where ops may switch."""
        self.ops.latch()
        return super().build_metadata(spans, block_size, device)

    def decode_block(self, qkv, rope, kv, meta, heads, kv_heads, scale):  # noqa: ANN001, ANN201
        """The kernels' fused decode op once active (see `CpuPagedAttention`)."""
        if not self.ops.active:
            return None
        return CpuPagedAttention.decode_block(self, qkv, rope, kv, meta, heads, kv_heads, scale)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not self.ops.active:
            return super()._decode(q, k_cache, v_cache, meta, scale)
        return self.ops.paged_decode_attention(q, k_cache, v_cache, meta.decode_blocks,
                                               meta.decode_context_lens, scale)
