"""One replica over ``--tensor-parallel-size`` processes.

Rank 0 is the engine's process: its scheduler, KV bookkeeping and sampler
stay there, and its executor (``TensorParallelExecutor``) sends each step's
items to the other ranks (``StepMessage``: msgpack with an explicit schema,
over the group's gloo channel) before running its own slice of the forward.
Ranks 1..N-1 are follower processes (``python -m carpool.executor.
tp_follower``): each loads the model, cuts its slice and runs every step
it is sent, so every rank calls the same collectives in the same order. The
logits are gathered on every rank; only rank 0 samples.

A follower dies with its parent (``PR_SET_PDEATHSIG``) and stops at the
stop message ``close`` sends.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence

import msgspec
import torch

from carpool.config import EngineConfig
from carpool.executor.base import BatchItem, Executor, Padding
from carpool.parallel.group import TensorParallelGroup


class StepItem(msgspec.Struct, array_like=True):
    """One item of a step: the span's tokens (not the request's whole list),
    where they start, the request's block table, whether its row is sampled."""

    tokens: list[int]
    start: int
    block_table: list[int]
    sampled: bool


class StepMessage(msgspec.Struct, array_like=True):
    """A step for the followers, or ``stop``."""

    items: list[StepItem] = []
    pad_rows: int = 0
    pad_align: str = "right"
    stop: bool = False


class FollowerLaunch(msgspec.Struct, array_like=True):
    """What a follower builds: the replica's engine settings."""

    config: EngineConfig


_step_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(StepMessage)


class _SpanTokens:
    """A follower's stand-in for a request's token list: only the span
    (``token_ids[start:start + n]``) is ever read, so only it is sent."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, span: slice) -> list[int]:
        return self.tokens[span.start - self.start:span.stop - self.start]


_SAMPLED = object()  # a follower's sampling row: the logits are made, never sampled


def step_message(items: Sequence[BatchItem], padding: Padding | None) -> StepMessage:
    return StepMessage(
        [StepItem(list(item.token_ids[item.start:item.start + item.num_tokens]), item.start,
                  list(item.block_table), item.sampling is not None) for item in items],
        padding.rows if padding else 0, padding.align if padding else "right")


def follower_items(message: StepMessage) -> tuple[list[BatchItem], Padding | None]:
    items = [BatchItem("", _SpanTokens(item.start, item.tokens), item.start, len(item.tokens),
                       item.block_table, _SAMPLED if item.sampled else None)
             for item in message.items]
    return items, Padding(message.pad_rows, message.pad_align) if message.pad_rows else None


class TensorParallelExecutor(Executor):
    """Rank 0's executor: each step goes to the followers, then runs here."""

    def __init__(self, local: Executor, tp: TensorParallelGroup,
                 followers: list[subprocess.Popen]) -> None:
        self.local, self.tp, self.followers = local, tp, followers
        self.num_blocks, self.block_size = local.num_blocks, local.block_size
        self.overlaps_host = local.overlaps_host
        self._closed = False

    def __getattr__(self, name: str):  # noqa: ANN204 - the local executor's parts (model, sampler, ...)
        return getattr(self.local, name)

    def execute(self, items: Sequence[BatchItem], padding: Padding | None = None) -> list:
        return self.launch(items, padding)()

    def launch(self, items: Sequence[BatchItem], padding: Padding | None = None,
               ) -> Callable[[], list]:
        self.tp.broadcast_bytes(_step_encoder.encode(step_message(items, padding)))
        return self.local.launch(items, padding)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the followers (each leaves its loop) and wait for them."""
        if self._closed:
            return
        self._closed = True
        self.tp.broadcast_bytes(_step_encoder.encode(StepMessage(stop=True)))
        for follower in self.followers:
            try:
                follower.wait(timeout)
            except subprocess.TimeoutExpired:
                follower.kill()
        self.tp.close()


def follow(executor: Executor, tp: TensorParallelGroup) -> None:
    """A follower's loop: run every step rank 0 sends, until it says stop."""
    while True:
        message = _step_decoder.decode(tp.broadcast_bytes(None))
        if message.stop:
            return
        items, padding = follower_items(message)
        executor.launch(items, padding)  # the forward and the gathered logits; no sampling


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_followers(config: EngineConfig) -> tuple[TensorParallelGroup, list[subprocess.Popen]]:
    """Start ranks 1..N-1 of ``config``'s replica and join the group as rank 0."""
    size = config.model.tensor_parallel_size
    port = _free_port()
    launch = msgspec.msgpack.encode(FollowerLaunch(config))
    followers = []
    for rank in range(1, size):
        proc = subprocess.Popen(
            [sys.executable, "-m", "carpool.executor.tp_follower", "--rank", str(rank),
             "--size", str(size), "--port", str(port), "--parent-pid", str(os.getpid())],
            stdin=subprocess.PIPE)
        proc.stdin.write(launch)
        proc.stdin.close()
        followers.append(proc)
    try:
        tp = TensorParallelGroup.join(0, size, port, device_of(config, 0))
    except Exception:
        for proc in followers:
            proc.kill()
        raise
    return tp, followers


def device_of(config: EngineConfig, rank: int) -> torch.device:
    from carpool.executor.torch_executor import resolve_device

    device = resolve_device(config.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return device
