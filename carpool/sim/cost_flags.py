"""The cost model and a replica's KV pool from the command line: the
flags ``carpool simulate``, ``plan`` and ``evaluate`` share."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from carpool.config import EngineConfig, parse_size
from carpool.settings_fields import add_setting_args, setting
from carpool.sim.costs import CostModel, kv_bytes_per_token
from carpool.sim.model_shapes import MODELS

# The measured model of carpool's development machine (2-core CPU, default
# model, bf16): what a simulation uses when given no cost model.
DEFAULT_COST_MODEL = Path(__file__).parent / "data" / "dev-cpu-smollm2-bf16.json"


@dataclass(frozen=True)
class CostModelFlags:
    """The cost model a command simulates with: a saved one (``carpool
    measure``'s or an analytic one) or an analytic model from presets
    (``cost_model_from_args`` reads them)."""

    cost_model: str | None = setting(
        None, "--cost-model", None,
        "a cost model JSON (carpool measure --out); default: the analytic model when "
        "--hardware is given, else the measured model of carpool's 2-core development CPU "
        "(default model, bf16)")
    hardware: str | None = setting(
        None, "--hardware", None,
        "analytic model: accelerator preset (h100-sxm, h200, a100-80gb, l4, h800, h800-fp8; "
        "8xh100-sxm, 8xh200: a whole node as one replica)")
    model_shape: str | None = setting(
        None, "--model-shape", None,
        f"analytic model: model preset ({', '.join(MODELS)})")
    dtype_bytes: float = setting(2.0, "--dtype-bytes", None,
                                 "analytic model: bytes per weight and KV value", parse=float)
    # None (not 1.0): given without an analytic model it is an error
    expert_imbalance: float | None = setting(
        None, "--expert-imbalance", None,
        "analytic model, MoE presets: the busiest expert's tokens over the mean, scaling the "
        "routed experts' FLOPs (default 1.0: balanced)", parse=float)


def add_cost_model_args(parser: argparse.ArgumentParser) -> None:
    """Group "cost model": `CostModelFlags` and a replica's slicing over GPUs
    (``parallel.ParallelShape``)."""
    from carpool.sim.parallel import ParallelShape

    group = parser.add_argument_group("cost model")
    add_setting_args(group, CostModelFlags)
    add_setting_args(group, ParallelShape)


def parallel_from_args(args: argparse.Namespace):
    """The ``ParallelShape`` the flags ask for (one GPU, no split, when a
    command does not take them)."""
    from carpool.settings_fields import values_from_args
    from carpool.sim.parallel import ParallelShape

    return values_from_args(ParallelShape, args)


def cost_model_from_args(args: argparse.Namespace) -> CostModel:
    """The cost model the flags name; a measured one from another machine
    (or one that does not say) is warned about on stderr."""
    from carpool.sim.costs import load_cost_model, warn_if_elsewhere

    imbalance = getattr(args, "expert_imbalance", None)
    if imbalance is not None and not (args.hardware or args.model_shape):
        raise ValueError("--expert-imbalance applies to the analytic model "
                         "(--hardware/--model-shape)")
    if args.cost_model and (args.hardware or args.model_shape):
        raise ValueError("give either --cost-model or --hardware/--model-shape, not both")
    parallel = parallel_from_args(args)
    if args.cost_model:
        if not parallel.trivial:
            raise ValueError("a saved cost model keeps its own slicing: the --sim-*-parallel-"
                             "size and --sim-micro-batches flags apply to --hardware/"
                             "--model-shape")
        cost = load_cost_model(args.cost_model)
        warn_if_elsewhere(cost)
        return cost
    if args.hardware or args.model_shape:
        if not (args.hardware and args.model_shape):
            raise ValueError("the analytic cost model needs both --hardware and --model-shape")
        from carpool.sim.parallel_cost import parallel_from_names

        return parallel_from_names(args.hardware, args.model_shape, parallel,
                                   args.dtype_bytes, 1.0 if imbalance is None else imbalance)
    if not parallel.trivial:
        raise ValueError("--sim-tensor-parallel-size, --sim-expert-parallel-size and "
                         "--sim-micro-batches apply to the analytic model "
                         "(--hardware/--model-shape)")
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
        return _analytic_blocks(cost, cache.block_size)
    per_token = kv_bytes_per_token(cost)
    if not per_token:
        raise ValueError("the cost model does not say how many KV bytes a token takes; "
                         "pass --num-blocks")
    blocks = int(parse_size(cache.kv_cache_memory) // (per_token * cache.block_size))
    if blocks < 1:
        raise ValueError(f"kv_cache_memory {cache.kv_cache_memory} holds no KV block")
    return blocks


def _analytic_blocks(cost, block_size: int) -> int:
    """KV blocks in 90% of an analytic model's accelerator after every
    weight (all experts); ValueError when not one fits."""
    blocks = cost.max_kv_tokens(0.9) // block_size
    if blocks >= 1:
        return blocks
    hardware, weights = cost.hardware, cost.model.params * cost.dtype_bytes
    if not hardware.memory_bytes:
        raise ValueError(f"{hardware.name} does not say its memory; pass --kv-cache-memory "
                         "or --num-blocks")
    raise ValueError(f"{cost.model.name}'s weights ({weights / 1e9:.0f} GB) leave no KV block "
                     f"in 90% of {hardware.name}'s {hardware.memory_bytes / 1e9:.0f} GB; choose "
                     "larger --hardware or smaller --dtype-bytes, or pass --kv-cache-memory "
                     "or --num-blocks")
