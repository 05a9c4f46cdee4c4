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

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
import torch

from carpool.config import EngineConfig
from carpool.executor.base import BatchItem, Executor, Padding
from carpool.executor.micro_batch_choice import MicroBatchChoice, StepShape, step_shape
from carpool.model.config import ModelConfig
from carpool.parallel.group import TensorParallelGroup
from carpool.parallel.kv_slices import ShardedBlockIO, answer, stream_layer
from carpool.parallel.shard import kv_head_span


class StepItem(msgspec.Struct, array_like=True):
    """One item of a step: the span's tokens (not the request's whole list),
    where they start, the request's block table, whether its row is sampled."""

    tokens: list[int]
    start: int
    block_table: list[int]
    sampled: bool


class StepMessage(msgspec.Struct, array_like=True):
    """A step for the followers, a KV order (``kv_op``: ``read`` or
    ``write`` of ``kv_blocks``, ``carpool.parallel.kv_slices``), or ``stop``.
    ``streamed``: blocks whose layers the step's forward sends out as each
    is written (a P/D prefill's), which each rank's layer hook gathers."""

    items: list[StepItem] = []
    pad_rows: int = 0
    pad_align: str = "right"
    stop: bool = False
    kv_op: str = ""
    kv_blocks: list[int] = []
    streamed: list[int] = []
    split: bool = False


class FollowerLaunch(msgspec.Struct, array_like=True):
    """What a follower builds: the replica's engine settings."""

    config: EngineConfig


logger = logging.getLogger(__name__)

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


def step_message(items: Sequence[BatchItem], padding: Padding | None,
                 streamed: list[int], split: bool) -> StepMessage:
    return StepMessage(
        [StepItem(list(item.token_ids[item.start:item.start + item.num_tokens]), item.start,
                  list(item.block_table), item.sampling is not None) for item in items],
        padding.rows if padding else 0, padding.align if padding else "right",
        streamed=streamed, split=split)


def follower_items(message: StepMessage) -> tuple[list[BatchItem], Padding | None]:
    items = [BatchItem("", _SpanTokens(item.start, item.tokens), item.start, len(item.tokens),
                       item.block_table, _SAMPLED if item.sampled else None)
             for item in message.items]
    return items, Padding(message.pad_rows, message.pad_align) if message.pad_rows else None


class TensorParallelExecutor(Executor):
    """Rank 0's executor: each step goes to the followers, then runs here."""

    def __init__(self, local: Executor, tp: TensorParallelGroup,
                 followers: list[Follower], model_config: ModelConfig) -> None:
        """``model_config``: the whole (unsliced) model's."""
        self.local, self.tp, self.followers = local, tp, followers
        self.model_config = model_config
        self.unsharded_fingerprint = local.unsharded_fingerprint
        self.choice = MicroBatchChoice()  # auto: one batch or two, by measured step times
        self.num_blocks, self.block_size = local.num_blocks, local.block_size
        self.overlaps_host = local.overlaps_host
        self._closed = False

    def __getattr__(self, name: str):  # noqa: ANN204 - the local executor's parts (model, sampler, ...)
        return getattr(self.local, name)

    def execute(self, items: Sequence[BatchItem], padding: Padding | None = None) -> list:
        return self.launch(items, padding)()

    def launch(self, items: Sequence[BatchItem], padding: Padding | None = None,
               ) -> Callable[[], list]:
        started = time.perf_counter()
        streamed = self.kv_worker.streaming_block_ids() if self.kv_worker is not None else []
        split, shape = self._split(items, padding)
        self.tp.broadcast_bytes(_step_encoder.encode(
            step_message(items, padding, streamed, split)))
        self.local.split_next = split
        wait = self.local.launch(items, padding)
        if shape is None:
            return wait

        def timed() -> list:  # the step's time, launch to results, for the choice
            results = wait()
            chosen = self.choice.record(shape, split, time.perf_counter() - started)
            if chosen is not None:
                logger.info("micro-batches: %s steps of up to %d tokens now run %s",
                            "decode" if shape[0] else "prefill or mixed", shape[1],
                            "split in two" if chosen else "as one batch")
            return results
        return timed

    def _split(self, items: Sequence[BatchItem], padding: Padding | None,
               ) -> tuple[bool, StepShape | None]:
        """Whether this step runs as two micro-batches and, where that was
        the live choice's (``auto``), the shape it is timed under."""
        mode = self.local.micro_batches
        if mode != "auto" or padding is not None or len(items) < 2:
            return mode == "on", None
        shape = step_shape(all(item.num_tokens == 1 for item in items),
                           sum(item.num_tokens for item in items))
        return self.choice.choose(shape), shape

    def block_io(self) -> ShardedBlockIO:
        """The whole replica's blocks, as one process's (``kv_slices``)."""
        size, config = self.tp.size, self.model_config
        return ShardedBlockIO(self.local.block_io(), self.tp,
                              [kv_head_span(config, rank, size) for rank in range(size)],
                              config.cache_heads, self._kv_order)

    def _kv_order(self, op: str, block_ids: list[int]) -> None:
        self.tp.broadcast_bytes(_step_encoder.encode(StepMessage(kv_op=op, kv_blocks=block_ids)))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the followers (each leaves its loop) and wait for them."""
        if self._closed:
            return
        self._closed = True
        self.tp.broadcast_bytes(_step_encoder.encode(StepMessage(stop=True)))
        for follower in self.followers:
            try:
                follower.wait(timeout)
            except Exception:  # noqa: BLE001 - not done in time (or gone): make sure
                follower.kill()
        self.tp.close()


def follow(executor: Executor, tp: TensorParallelGroup) -> None:
    """A follower's loop: run every step rank 0 sends and answer its KV
    orders, until it says stop."""
    io = executor.block_io()
    model = executor.model
    while True:
        message = _step_decoder.decode(tp.broadcast_bytes(None))
        if message.stop:
            return
        if message.kv_op:
            answer(io, tp, message.kv_op, message.kv_blocks)
            continue
        items, padding = follower_items(message)
        executor.split_next = message.split  # rank 0's choice: the same collectives
        if message.streamed:
            model.after_layer = stream_layer(io, tp, message.streamed)
        try:  # the forward and the gathered logits; no sampling
            executor.launch(items, padding)
        finally:
            model.after_layer = None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Follower(Protocol):
    """A running follower, as rank 0 ends it: a process, or a Ray actor's
    run (``carpool.ray_serve.tp_followers``)."""

    def wait(self, timeout: float) -> object:
        """Until it ended; raises if not within ``timeout`` seconds."""

    def kill(self) -> None: ...


#: Starts ranks 1..N-1 of a replica (its engine config, rank 0's port on
#: 127.0.0.1); the default runs each as a process (``start_processes``).
FollowerStarter = Callable[[EngineConfig, int], list[Follower]]


def start_processes(config: EngineConfig, port: int) -> list[Follower]:
    """Ranks 1..N-1 as ``python -m carpool.executor.tp_follower`` processes."""
    size = config.model.tensor_parallel_size
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
    return followers


def start_followers(config: EngineConfig, starter: FollowerStarter | None = None,
                    ) -> tuple[TensorParallelGroup, list[Follower]]:
    """Start ranks 1..N-1 of ``config``'s replica (by ``starter``; None:
    processes) and join the group as rank 0."""
    size = config.model.tensor_parallel_size
    port = _free_port()
    followers = (starter or start_processes)(config, port)
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
    if device.type == "cuda":  # a Ray actor sees only its own GPU: its cuda:0
        index = rank if torch.cuda.device_count() > rank else 0
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return device
