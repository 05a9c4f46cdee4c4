"""The cost model and a replica's KV pool from the command line: the
flags ``carpool simulate``, ``plan`` and ``evaluate`` share."""
from __future__ import annotations

import argparse
from pathlib import Path

from carpool.config import EngineConfig, parse_size
from carpool.sim.costs import CostModel, kv_bytes_per_token

# The measured model of carpool's development machine (2-core CPU, default
# model, bf16): what a simulation uses when given no cost model.
DEFAULT_COST_MODEL = Path(__file__).parent / "data" / "dev-cpu-smollm2-bf16.json"


def add_cost_model_args(parser: argparse.ArgumentParser) -> None:
    """Group "cost model": a saved model (``carpool measure``'s or an
    analytic one) or an analytic model from presets."""
    group = parser.add_argument_group("cost model")
    group.add_argument("--cost-model", default=None,
                       help="a cost model JSON (carpool measure --out); default: the analytic "
                            "model when --hardware is given, else the measured model of "
                            "carpool's 2-core development CPU (default model, bf16)")
    group.add_argument("--hardware", default=None,
                       help="analytic model: accelerator preset (h100-sxm, h200, a100-80gb, l4)")
    group.add_argument("--model-shape", default=None,
                       help="analytic model: model preset (llama-3-8b, llama-3-70b, qwen2-7b, "
                            "smollm2-135m)")
    group.add_argument("--dtype-bytes", type=float, default=2.0,
                       help="analytic model: bytes per weight and KV value")


def cost_model_from_args(args: argparse.Namespace) -> CostModel:
    """The cost model the flags name; a measured one from another machine
    (or one that does not say) is warned about on stderr."""
    from carpool.sim.costs import load_cost_model, warn_if_elsewhere

    if args.cost_model and (args.hardware or args.model_shape):
        raise ValueError("give either --cost-model or --hardware/--model-shape, not both")
    if args.cost_model:
        cost = load_cost_model(args.cost_model)
        warn_if_elsewhere(cost)
        return cost
    if args.hardware or args.model_shape:
        if not (args.hardware and args.model_shape):
            raise ValueError("the analytic cost model needs both --hardware and --model-shape")
        from carpool.sim.analytic import analytic_from_names

        return analytic_from_names(args.hardware, args.model_shape, args.dtype_bytes)
    cost = load_cost_model(DEFAULT_COST_MODEL)
    warn_if_elsewhere(cost)
    return cost


def pool_blocks(config: EngineConfig, cost: CostModel, memory_set: bool) -> int:
    """KV blocks of one replica: ``--num-blocks``; else ``--kv-cache-memory``
    over the KV bytes per token the cost model knows; an analytic model
    without ``--kv-cache-memory`` (``memory_set``) fills 90% of the
    accelerator after the weights, as a GPU engine would."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cost.kind == "analytic" and not memory_set:
        return max(1, cost.max_kv_tokens(0.9) // cache.block_size)
    per_token = kv_bytes_per_token(cost)
    if not per_token:
        raise ValueError("the cost model does not say how many KV bytes a token takes; "
                         "pass --num-blocks")
    blocks = int(parse_size(cache.kv_cache_memory) // (per_token * cache.block_size))
    if blocks < 1:
        raise ValueError(f"kv_cache_memory {cache.kv_cache_memory} holds no KV block")
    return blocks
