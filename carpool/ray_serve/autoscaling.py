"""carpool's autoscaler as a Ray Serve custom autoscaling policy.

Ray Serve's controller calls the policy with an ``AutoscalingContext``
every control-loop round; this adapter turns the context into carpool's
``PoolSignals`` once per ``tick_s`` and lets ``carpool.cluster.autoscaler``'s
``PoolScaler`` (reactive or predictive, cooldowns and the scale-in window
included) decide the count. The builder turns Ray's own delays off
(``upscale_delay_s = downscale_delay_s = 0``): the decision is carpool's.

The signals: the engine replicas' ``record_autoscaling_stats`` (waiting,
running, slots, their arrivals counter) and the requests queued at the
handles (part of the backlog).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from carpool.cluster.autoscaler import AutoscaleConfig, PoolSignals, make_scaler

# The import path Ray's AutoscalingPolicy takes.
POLICY_PATH = "carpool.ray_serve.autoscaling:CarpoolAutoscalingPolicy"


def policy_kwargs(policy: str, replicas: int, config: AutoscaleConfig) -> dict[str, Any]:
    """The JSON ``policy_kwargs`` that rebuild this policy in Ray's controller."""
    return {"policy": policy, "replicas": replicas, **dataclasses.asdict(config)}


class CarpoolAutoscalingPolicy:
    """Called as ``policy(ctx) -> (replicas, policy_state)`` (Ray's protocol);
    Ray builds one per deployment with ``policy_kwargs`` (``policy_kwargs()``)."""

    def __init__(self, policy: str = "reactive", replicas: int = 1, **config: Any) -> None:
        self.config = AutoscaleConfig(**config).validate()
        self.scaler = make_scaler(policy, self.config, replicas)
        self._added: dict[str, float] = {}  # replica -> its arrivals counter at the last tick
        self._last_tick: float | None = None

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time if ctx.current_time is not None else time.time()
        if self._last_tick is None or now - self._last_tick >= self.config.tick_s:
            self._last_tick = now
            self.scaler.tick(self.signals(ctx, now))
        last = self.scaler.events[-1] if self.scaler.events else None
        state = {"carpool_cause": last.cause} if last is not None else {}
        return self.scaler.replicas, state

    def signals(self, ctx, now: float) -> PoolSignals:
        """``PoolSignals`` from Ray's context (see the module docstring)."""
        metrics = ctx.aggregated_metrics or {}

        def total(name: str) -> float:
            return sum(metrics.get(name, {}).values())

        added = {_name(r): v for r, v in metrics.get("requests_added", {}).items()}
        arrivals = sum(max(0.0, v - self._added.get(r, 0.0)) for r, v in added.items())
        self._added = added
        slots = total("slots")
        queued = ctx.total_queued_requests or 0.0
        return PoolSignals(
            now=now, replicas=max(ctx.current_num_replicas, ctx.target_num_replicas),
            ready=len(ctx.running_replicas), backlog=round(total("waiting") + queued),
            in_flight=round(ctx.total_num_requests or 0.0), arrivals=round(arrivals),
            utilization=total("running") / slots if slots else 0.0)


def _name(replica) -> str:
    return getattr(replica, "unique_id", None) or str(replica)
