"""Row reductions of the sampler that give a row the same bits whatever
its batch: on the CPU torch's own, elsewhere spelled out in a fixed order
(GPU kernels lay threads out by the batch's shape). ``off_cpu`` is looked
up on this module at every call, so a test can route the CPU through the
device path."""
from __future__ import annotations

import torch


def off_cpu(t: torch.Tensor) -> bool:
    """Off the CPU, row reductions are spelled out in a fixed order (kernels there lay
    threads out by the batch's shape) and host syncs are avoided."""
    return not t.is_cpu


def row_sum(t: torch.Tensor) -> torch.Tensor:
    """Sums over the last dim; off the CPU by pairwise halving (elementwise adds)."""
    if not off_cpu(t):
        return t.sum(dim=-1)
    width = 1 << (t.shape[-1] - 1).bit_length()
    if width != t.shape[-1]:
        t = torch.nn.functional.pad(t, (0, width - t.shape[-1]))
    while width > 1:
        width //= 2
        t = t[..., :width] + t[..., width:]
    return t.squeeze(-1)


def row_cumsum(t: torch.Tensor) -> torch.Tensor:
    """Running sums along rows, in order and in float64 like the CPU's. Off the CPU
    as an outer-dim scan (a thread per row) over >= 2 rows (one takes a parallel scan)."""
    if not off_cpu(t):
        return t.cumsum(dim=-1)
    cols = t.double().t()
    cols = torch.cat([cols, cols], dim=1) if cols.shape[1] == 1 else cols.contiguous()
    return cols.cumsum(dim=0)[:, :t.shape[0]].t().to(t.dtype).contiguous()


def softmax(z: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; off the CPU on ``row_sum``."""
    if not off_cpu(z):
        return torch.softmax(z, dim=-1)
    e = (z - z.amax(dim=-1, keepdim=True)).exp_()
    return e.div_(row_sum(e).unsqueeze(1))
