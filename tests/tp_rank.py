"""One rank of a tensor-parallel check (``python -m tests.tp_rank``): the
model of ``--model-dir`` cut over ``--size`` processes (``--micro-batches``
auto | on | off: two micro-batches per step or one), the same greedy
steps on every rank (ragged prefills of three prompts, then decodes, through
``TorchExecutor`` and its paged KV pool); each rank prints each prompt's tokens
and log-probabilities (and what it holds and counted) as JSON. ``--size 1`` is the whole model alone."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from carpool.config import CacheConfig
from carpool.executor.base import BatchItem
from carpool.executor.torch_executor import TorchExecutor
from carpool.model.loader import load_model_dir
from carpool.model.sampler import SamplingRow
from carpool.model_settings import ModelSettings
from carpool.parallel.group import TensorParallelGroup
from carpool.sampling_params import SamplingParams

PROMPTS = [[5, 9, 13, 21, 34], list(range(3, 40, 2)), [7] * 3 + list(range(50, 80))]
BLOCKS_PER_PROMPT = 8


def run(model_dir: str, rank: int, size: int, port: int, steps: int, dtype: str,
        micro_batches: str, expert_parallel: bool = False, capacity: float = 0.0) -> dict:
    torch.manual_seed(0)
    loaded = load_model_dir(model_dir)
    settings = ModelSettings(dtype=dtype, device="cpu", threads=1, micro_batches=micro_batches,
                             enable_expert_parallel=expert_parallel,
                             expert_capacity_factor=capacity)
    cache = CacheConfig(block_size=16, num_blocks=len(PROMPTS) * BLOCKS_PER_PROMPT)
    tp = TensorParallelGroup.join(rank, size, port, torch.device("cpu")) if size > 1 else None
    executor = TorchExecutor(loaded.config, loaded.weights, settings, cache, max_model_len=256,
                             tp=tp)
    params = SamplingParams(temperature=0.0, max_tokens=steps, logprobs=1)
    tokens = [list(p) for p in PROMPTS]
    tables = [list(range(i * BLOCKS_PER_PROMPT, (i + 1) * BLOCKS_PER_PROMPT))
              for i in range(len(PROMPTS))]
    out: list[list[int]] = [[] for _ in PROMPTS]
    logprobs: list[list[float]] = [[] for _ in PROMPTS]
    for step in range(steps):
        items = [BatchItem(str(i), tokens[i], 0 if step == 0 else len(tokens[i]) - 1,
                           len(tokens[i]) if step == 0 else 1, tables[i],
                           SamplingRow(params, seed=0, step=step))
                 for i in range(len(PROMPTS))]
        for i, result in enumerate(executor.execute(items)):
            tokens[i].append(result.token_id)
            out[i].append(result.token_id)
            logprobs[i].append(result.logprob)
    if tp is not None:
        tp.close()
    layer = executor.model.layers[-1]
    heads = layer.mla.heads if layer.mla is not None else layer.num_heads
    dispatches = [layer.moe.dispatch for layer in executor.model.layers
                  if layer.moe is not None and layer.moe.dispatch is not None]
    return {"tokens": out, "logprobs": logprobs, "heads": heads,
            "expert_rows": [d.received for d in dispatches],
            "dropped": [d.dropped for d in dispatches],
            "rank_dropped": [d.rank_dropped for d in dispatches],
            "vocab_rows": executor.model.embed_tokens.num_embeddings,
            "kv_pool_heads": executor.kv_caches[0][1].shape[0]}


def main() -> int:
    parser = argparse.ArgumentParser()
    for flag, kind in (("--model-dir", str), ("--rank", int), ("--size", int), ("--port", int),
                       ("--steps", int), ("--dtype", str), ("--micro-batches", str),
                       ("--expert-parallel", int), ("--capacity", float)):
        parser.add_argument(flag, type=kind, required=True)
    args = parser.parse_args()
    result = run(args.model_dir, args.rank, args.size, args.port, args.steps, args.dtype,
                 args.micro_batches, bool(args.expert_parallel), args.capacity)
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
