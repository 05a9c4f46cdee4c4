#!/usr/bin/env python
"""Step time and communication of a tensor-parallel replica on this machine.

    python scripts/tp_step_bench.py                 # TP 1 (2 threads) vs TP 2 (2 x 1 thread)
    python scripts/tp_step_bench.py --layers 4 --steps 10
    python scripts/tp_step_bench.py --device cuda     # two GPUs: rank r on cuda:r

A random-weight Llama-shaped model (hidden 512, 8 heads, 4 KV heads, MLP
1536, vocab 32768; ``--layers``) in ``--dtype``, through ``TorchExecutor``
and its paged KV pool: decode steps of ``--batch`` sequences at 256 tokens
of context, and prefill steps of two 256-token prompts. Per step: the median
time and the time the forward waited on collectives (all-reduce,
all-gather): with one batch all of the communication, with two
micro-batches (``--micro-batches on``) what the other batch's compute did
not hide. Each rank is a process of this script (gloo on 127.0.0.1).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, HEADS, KV_HEADS, MLP, VOCAB = 512, 8, 4, 1536, 32768


def _weights(layers: int):  # noqa: ANN202
    import torch

    from carpool.model.config import ModelConfig
    from carpool.model.hf_names import layer_names

    config = ModelConfig("llama", VOCAB, HIDDEN, MLP, layers, HEADS, KV_HEADS, HIDDEN // HEADS,
                         1e-5, 10000.0, None, 2048, True, False, 1, [2])
    gen = torch.Generator().manual_seed(0)
    dim, kv = HIDDEN // HEADS, KV_HEADS * (HIDDEN // HEADS)
    shapes = {"q": (HIDDEN, HIDDEN), "k": (kv, HIDDEN), "v": (kv, HIDDEN), "o": (HIDDEN, HIDDEN),
              "gate": (MLP, HIDDEN), "up": (MLP, HIDDEN), "down": (HIDDEN, MLP)}
    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02,
               "model.norm.weight": torch.ones(HIDDEN)}
    for index in range(layers):
        names = layer_names(index)
        for role, shape in shapes.items():
            weights[names[role]] = torch.randn(*shape, generator=gen) * 0.02
        weights[names["input_norm"]] = torch.ones(HIDDEN)
        weights[names["post_norm"]] = torch.ones(HIDDEN)
    del dim
    return config, weights


def _time_steps(executor, tp, items_of, steps: int, sync) -> dict:  # noqa: ANN001
    times, comm, tokens = [], [], []
    for step in range(steps + 2):  # two warm-up steps
        before = tp.comm_seconds if tp else 0.0
        start = time.perf_counter()
        results = executor.execute(items_of(step))
        sync()
        if step >= 2:
            times.append(time.perf_counter() - start)
            comm.append((tp.comm_seconds if tp else 0.0) - before)
        tokens.append([r.token_id for r in results])
    return {"step_ms": 1e3 * statistics.median(times), "comm_ms": 1e3 * statistics.median(comm),
            "tokens": tokens}


def run_rank(args: argparse.Namespace) -> dict:
    import torch

    from carpool.config import CacheConfig
    from carpool.executor.base import BatchItem
    from carpool.executor.torch_executor import TorchExecutor
    from carpool.model.sampler import SamplingRow
    from carpool.model_settings import ModelSettings
    from carpool.parallel.group import TensorParallelGroup
    from carpool.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    device = torch.device("cuda", args.rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = (TensorParallelGroup.join(args.rank, args.size, args.port, device)
          if args.size > 1 else None)
    config, weights = _weights(args.layers)
    blocks = 16 * (args.batch + 1) * 2
    settings = ModelSettings(dtype=args.dtype, device=args.device, enforce_eager=True,
                             micro_batches=args.micro_batches)
    executor = TorchExecutor(config, weights, settings,
                             CacheConfig(block_size=16, num_blocks=blocks), 2048, tp=tp)
    row = SamplingRow(SamplingParams(temperature=0.0), 0, 0)
    context = list(range(3, 259))

    def decodes(step: int) -> list[BatchItem]:
        return [BatchItem(str(i), context, 255, 1, list(range(i * 16, i * 16 + 16)), row)
                for i in range(args.batch)]

    def prefill(step: int) -> list[BatchItem]:  # two prompts: both micro-batches have work
        first = args.batch * 16
        return [BatchItem(f"p{i}", list(range(3, 259)), 0, 256,
                          list(range(first + 16 * i, first + 16 * i + 16)), row) for i in (0, 1)]

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result = {"decode": _time_steps(executor, tp, decodes, args.steps, sync),
              "prefill": _time_steps(executor, tp, prefill, max(3, args.steps // 3), sync)}
    if tp is not None:
        tp.close()
    return result


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(size: int, threads: int, micro_batches: str, args: argparse.Namespace) -> dict:
    port = _free_port()
    common = ["--layers", str(args.layers), "--steps", str(args.steps), "--batch",
              str(args.batch), "--dtype", args.dtype, "--micro-batches", micro_batches,
              "--device", args.device]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--size", str(size),
                               "--port", str(port), "--threads", str(threads), *common],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": str(threads)})
             for rank in range(size)]
    outputs = [proc.communicate(timeout=900)[0] for proc in procs]
    return json.loads(outputs[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="decode sequences per step")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: rank r on cuda:r (NCCL), so TP 2 needs two GPUs")
    parser.add_argument("--json", default=None, help="write the rows here too")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--micro-batches", default="off", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        result = run_rank(args)
        if args.rank == 0:
            print(json.dumps(result))
        return 0
    cores = os.cpu_count() or 2
    half = max(1, cores // 2)
    rows = [("TP 1", launch(1, cores, "off", args)),
            ("TP 2, one batch", launch(2, half, "off", args)),
            ("TP 2, two micro-batches", launch(2, half, "on", args))]
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows), indent=1))
    print(f"{args.layers} layers, {args.dtype}, {cores} cores, decode batch {args.batch}, "
          f"prefill 2 x 256 | step median ms (of which waiting on collectives)")
    for name, result in rows:
        cells = [f"{kind} {result[kind]['step_ms']:.1f} ({result[kind]['comm_ms']:.1f})"
                 for kind in ("decode", "prefill")]
        print(f"{name:<24} " + " | ".join(cells))
    for kind in ("decode", "prefill"):
        whole, left = rows[1][1][kind]["comm_ms"], rows[2][1][kind]["comm_ms"]
        print(f"{kind}: {100 * (1 - left / whole):.0f}% of the one-batch wait hidden" if whole
              else f"{kind}: no communication")
    return 0


if __name__ == "__main__":
    sys.exit(main())
