"""A tensor-parallel group: this process's rank of ``size`` and the three
collectives a sliced model needs, on ``torch.distributed`` (gloo on the CPU,
NCCL on CUDA for the model's tensors; the step's control bytes always go
through a gloo group, on the host).

Every rank calls every collective in the same order: the model's layers do,
since every rank runs the same forward over the same step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# gloo reduces these natively; anything else (bf16, fp16) is widened for the
# sum and narrowed back (the sum of fp32 partials is the reference's order of
# magnitude; the widened bytes are 2x, still small beside a step's matmuls).
_GLOO_NATIVE = (torch.float32, torch.float64, torch.int32, torch.int64)


@dataclass
class PendingSum:
    """An all-reduce in flight: its handle (None: nothing to wait for), the
    tensor it sums into and the dtype the sum is returned in."""

    handle: object
    tensor: torch.Tensor
    dtype: torch.dtype


@dataclass
class TensorParallelGroup:
    """Rank ``rank`` of ``size``; ``group`` carries the model's tensors,
    ``control`` (gloo) the step descriptions rank 0 sends its followers and
    ``kv`` (gloo) the KV blocks that leave or enter the replica
    (``carpool.parallel.kv_slices``: their own channel, so a gather inside
    a forward never queues behind the model's sums in flight)."""

    rank: int
    size: int
    group: object = None
    control: object = None
    kv: object = None
    backend: str = "gloo"
    # Seconds the forward waited on the model's collectives so far: the
    # communication left exposed (all of it, where nothing overlaps it).
    comm_seconds: float = 0.0

    @classmethod
    def join(cls, rank: int, size: int, port: int, device: torch.device,
             timeout_s: float = 120.0) -> TensorParallelGroup:
        """Join the group whose rank 0 listens on 127.0.0.1:``port``."""
        from datetime import timedelta

        backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=size, timeout=timedelta(seconds=timeout_s))
        control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        kv = dist.new_group(backend="gloo")
        return cls(rank, size, dist.group.WORLD, control, kv, backend)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of each one's ``tensor``, in place where it
        can be (the callers pass a layer's fresh output)."""
        if self.size == 1:
            return tensor
        start = time.perf_counter()
        if self.backend == "gloo" and tensor.dtype not in _GLOO_NATIVE:
            wide = tensor.float()
            dist.all_reduce(wide, group=self.group)
            tensor = wide.to(tensor.dtype)
        else:
            tensor = tensor.contiguous()
            dist.all_reduce(tensor, group=self.group)
        self.comm_seconds += time.perf_counter() - start
        return tensor

    def start_all_reduce(self, tensor: torch.Tensor) -> PendingSum:
        """Begin ``all_reduce``; ``finish`` waits for it. Another batch's
        compute runs meanwhile (gloo and NCCL move the bytes on their own threads)."""
        if self.size == 1:
            return PendingSum(None, tensor, tensor.dtype)
        work = tensor.float() if self.backend == "gloo" and tensor.dtype not in _GLOO_NATIVE \
            else tensor.contiguous()
        handle = dist.all_reduce(work, group=self.group, async_op=True)
        return PendingSum(handle, work, tensor.dtype)

    def ready(self, tensor: torch.Tensor) -> PendingSum:
        """A sum that needs no communication (``finish`` returns ``tensor``)."""
        return PendingSum(None, tensor, tensor.dtype)

    def finish(self, pending: PendingSum) -> torch.Tensor:
        """The sum ``start_all_reduce`` began (the wait counts as exposed)."""
        if pending.handle is not None:
            start = time.perf_counter()
            pending.handle.wait()
            self.comm_seconds += time.perf_counter() - start
        return pending.tensor.to(pending.dtype)

    def all_gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """[rows, cols] from every rank, side by side: [rows, size * cols]."""
        if self.size == 1:
            return tensor
        start = time.perf_counter()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self.group)
        self.comm_seconds += time.perf_counter() - start
        return torch.cat(parts, dim=-1)

    def smallest(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. KV blocks each can hold:
        the scheduler's one pool must fit every rank's slice of it)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (others pass None): its length,
        then the bytes, over the host's gloo group."""
        length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.control)
        buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0
                  else torch.empty(int(length.item()), dtype=torch.uint8))
        if buffer.numel():
            dist.broadcast(buffer, src=0, group=self.control)
        return bytes(buffer.numpy()) if self.rank != 0 else data

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
