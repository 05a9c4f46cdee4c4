"""A tensor-parallel follower: rank r of a replica whose rank 0 started it
(``carpool.executor.tensor_parallel``). It loads the model, cuts its slice,
joins the group and runs every step rank 0 sends until the stop message or
rank 0's end."""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import msgspec

from carpool.child_process import die_with_parent
from carpool.config import EngineConfig
from carpool.executor.loading import load_served_model
from carpool.executor.tensor_parallel import FollowerLaunch, device_of, follow
from carpool.executor.torch_executor import TorchExecutor
from carpool.parallel.group import TensorParallelGroup
from carpool.settings_fields import add_setting_args, setting


@dataclass
class FollowerArgs:
    """What rank 0 starts a follower with (the engine settings come on stdin)."""

    rank: int = setting(1, "--rank", None, "this process's rank (1..size-1)", parse=int)
    size: int = setting(2, "--size", None, "the replica's processes", parse=int)
    port: int = setting(0, "--port", None, "rank 0's port on 127.0.0.1", parse=int)
    parent_pid: int | None = setting(None, "--parent-pid", None,
                                     "rank 0's pid: the follower ends when it does", parse=int)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m carpool.executor.tp_follower",
                                     allow_abbrev=False,
                                     description="a tensor-parallel follower (started by rank 0)")
    add_setting_args(parser, FollowerArgs)
    args = parser.parse_args(argv)
    die_with_parent()
    if args.parent_pid is not None and os.getppid() != args.parent_pid:
        return 1
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=FollowerLaunch).config
    serve_rank(config, args.rank, args.size, args.port)
    return 0


def serve_rank(config: EngineConfig, rank: int, size: int, port: int) -> None:
    """Rank ``rank`` of ``config``'s replica: join the group at rank 0's
    ``port``, load and cut the model, run rank 0's steps until it stops."""
    tp = TensorParallelGroup.join(rank, size, port, device_of(config, rank))
    loaded, max_len = load_served_model(config.model)
    executor = TorchExecutor(loaded.config, loaded.weights, config.model, config.cache, max_len,
                             max_num_seqs=config.scheduler.max_num_seqs, tp=tp)
    loaded.weights.clear()
    follow(executor, tp)
    tp.close()


if __name__ == "__main__":
    sys.exit(main())
