"""CPU tensors backed by transparent huge pages.

Paged decode attention reads each sequence's KV blocks wherever the block
pool put them: at 64 sequences the blocks of a step are scattered over a
cache of hundreds of MB, and with 4 KiB pages nearly every 2 KiB block
read also misses the TLB. Backing the cache with 2 MiB pages removes most
of those misses: 30 layers x 64 sequences x 280 tokens of scattered blocks
take 32 ms instead of 43 (``scripts/kv_huge_pages_bench.py``; blocks in
sequence order take 26-28 either way).

Many Linux machines ship transparent huge pages in ``madvise`` mode: a
region gets them only when asked with ``madvise(MADV_HUGEPAGE)`` before
its pages are first touched. ``zeros`` asks for them on a 2 MiB-aligned
slice of a larger, untouched allocation and then zeroes it. Where the
call is unavailable (another OS, THP disabled) the tensor is an ordinary
one: huge pages are only ever a speed-up, never a requirement.
"""
from __future__ import annotations

import ctypes
import math
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def _madvise_huge(address: int, length: int) -> bool:
    """Ask the kernel to back ``[address, address + length)`` with huge pages."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed contiguous CPU tensor, on huge pages where the OS allows.

    The returned tensor is a view into a slightly larger byte buffer (at
    most one huge page more, never touched, so it costs address space, not
    memory); it owns that buffer like any view owns its storage.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    length = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES  # whole huge pages only
    _madvise_huge(raw.data_ptr() + offset, length)
    tensor = raw[offset:offset + nbytes].view(dtype).view(shape)
    return tensor.zero_()


def side_by_side(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zeroed tensors shaped as ``tensors``, side by side in one buffer on
    huge pages, each starting on a 64-byte line (copy each one in, then
    drop the original: the peak is the buffer plus one original).

    Why: a decode step of one sequence streams every weight once, and most
    of a small model's matrices are under one huge page each (the default
    model's 576 x 576 is 0.6 MiB), so only one buffer for all of them gets
    2 MiB pages. Measured on a 2-core AMD EPYC, the default model's packed
    bf16 weights at one row: 10.1 ms on 4 KiB pages, 7.9 ms together on
    huge pages (27 and 34 GB/s).
    """
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // 64) * 64
    arena = zeros((max(total, 1),), torch.uint8)
    return [arena[offset:offset + tensor.numel() * tensor.element_size()]
            .view(tensor.dtype).view(tensor.shape) for tensor, offset in zip(tensors, offsets)]
