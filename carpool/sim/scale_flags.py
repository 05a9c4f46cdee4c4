"""The reactive autoscaling rules' flags, shared by ``carpool simulate``
and ``carpool evaluate autoscale`` (defaults: the seeds' thresholds)."""
from __future__ import annotations

import argparse

from carpool.cluster.autoscaler import AutoscaleConfig

_DEFAULTS = AutoscaleConfig()


def add_reactive_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--scale-out-backlog", type=int, default=_DEFAULTS.scale_out_backlog,
                       help="scale out when more than this many requests wait (default "
                            f"{_DEFAULTS.scale_out_backlog}) ...")
    group.add_argument("--scale-out-wait", type=float, default=_DEFAULTS.scale_out_wait_s,
                       help="... and they would wait longer than this many seconds at the "
                            "recent arrival rate (0: the count alone; default "
                            f"{_DEFAULTS.scale_out_wait_s:g})")
    group.add_argument("--scale-in-utilization", type=float,
                       default=_DEFAULTS.scale_in_utilization,
                       help="scale in when utilisation stays under this (default "
                            f"{_DEFAULTS.scale_in_utilization:g}) ...")
    group.add_argument("--scale-in-after", type=float, default=_DEFAULTS.scale_in_after_s,
                       help=f"... for this many seconds (default {_DEFAULTS.scale_in_after_s:g})")


def reactive_knobs(args: argparse.Namespace) -> dict:
    """``AutoscaleConfig`` fields from the flags of ``add_reactive_args``."""
    return {"scale_out_backlog": args.scale_out_backlog, "scale_out_wait_s": args.scale_out_wait,
            "scale_in_utilization": args.scale_in_utilization,
            "scale_in_after_s": args.scale_in_after}


def parse_scale_schedule(text: str) -> tuple[tuple[float, int], ...]:
    """``SECONDS:REPLICAS,...`` (seconds into the run, ascending) for
    ``--autoscale schedule``: the pool holds each count from its time on."""
    table = []
    for part in text.split(","):
        try:
            at, count = part.split(":")
            table.append((float(at), int(count)))
        except ValueError:
            raise ValueError(f"a scale schedule is SECONDS:REPLICAS,..., got {part!r}") from None
    if [t for t, _ in table] != sorted(t for t, _ in table) or any(n < 1 for _, n in table):
        raise ValueError(f"a scale schedule needs ascending times and counts >= 1, got {text!r}")
    return tuple(table)
