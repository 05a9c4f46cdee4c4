"""``carpool evaluate``: fleet policies side by side in the simulator, as
sub-commands (``routing``: carpool/sim/evaluate.py; ``pd``:
carpool/sim/evaluate_pd.py; ``autoscale``: carpool/sim/evaluate_day.py;
``batching``: carpool/sim/evaluate_batching.py) sharing the workload,
cost-model and SLO flags."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from carpool.config import EngineConfig
from carpool.settings_fields import add_setting_args, setting
from carpool.sim import evaluate, evaluate_batching, evaluate_day, evaluate_pd
from carpool.sim.cost_flags import add_cost_model_args
from carpool.slo import parse_slo
from carpool.workload.command import add_workload_args, arg_type

_KINDS = {
    "routing": ("routing policies side by side", evaluate.add_routing_evaluation_args,
                evaluate.run_routing_evaluation),
    "pd": ("colocated against prefill/decode-disaggregated fleets of equal size",
           evaluate_pd.add_pd_evaluation_args, evaluate_pd.run_pd_evaluation),
    "autoscale": ("autoscaling policies over a full-size day (fluid, calibrated per request)",
                  evaluate_day.add_day_evaluation_args, evaluate_day.run_day_evaluation),
    "batching": ("the design's table: static vs dynamic batching vs dynamic batching with "
                 "two micro-batches overlapping communication, on a replica sliced over GPUs, "
                 "and their day", evaluate_batching.add_batching_evaluation_args,
                 evaluate_batching.run_batching_evaluation),
}


@dataclass(frozen=True)
class EvaluateFlags:
    """The flags every evaluation takes besides the workload and cost model."""

    slo: dict = setting(
        {"ttft": 2.0, "tpot": 0.05}, "--slo", None,
        "per-request limits for goodput (default ttft=2s,tpot=50ms)", parse=arg_type(parse_slo))


def add_evaluate_args(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The evaluations as sub-commands; returns them (each takes the engine flags)."""
    kinds = parser.add_subparsers(dest="evaluation", required=True)
    parsers = []
    for name, (help_text, add_args, _) in _KINDS.items():
        sub = kinds.add_parser(name, help=help_text)
        add_workload_args(sub, seed_flag="--workload-seed")
        add_cost_model_args(sub)
        add_setting_args(sub, EvaluateFlags)
        add_args(sub)
        parsers.append(sub)
    return parsers


def run_evaluate(config: EngineConfig, args: argparse.Namespace) -> int:
    return _KINDS[args.evaluation][2](config, args)
