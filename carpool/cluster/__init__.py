"""Fleet policies: routing, prefill/decode placement and autoscaling.

Plain Python, like the scheduler: no torch, no Ray, time passed in by the
caller, deterministic given the inputs. The simulator and the live fleet
drive the same objects; only how views are fed and requests sent differ.
"""
from carpool.cluster.router import POLICIES, Router, make_policy
from carpool.cluster.view import (
    Health,
    ReplicaView,
    Role,
    RouteDecision,
    RouteRequest,
    RoutingError,
)

__all__ = ["POLICIES", "Health", "ReplicaView", "Role", "RouteDecision", "RouteRequest",
           "Router", "RoutingError", "make_policy"]
