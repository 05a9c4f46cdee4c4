"""The reactive autoscaling rules' flags, shared by ``carpool simulate``
and ``carpool evaluate autoscale`` (defaults: the seeds' thresholds), and
the ``--scale-schedule`` parser."""
from __future__ import annotations

import argparse


def add_reactive_args(group: argparse._ArgumentGroup) -> None:
    """The reactive rules' thresholds, ``FleetConfig``'s flags (its
    defaults: the seeds' thresholds, ``AutoscaleConfig``'s)."""
    from carpool.cluster.fleet_config import FleetConfig
    from carpool.settings_fields import add_setting_args

    add_setting_args(group, FleetConfig, only=("scale_out_backlog", "scale_out_wait",
                                               "scale_in_utilization", "scale_in_after"))


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
