"""What a fleet policy may know of a replica, and what it is asked to route.

A ``ReplicaView`` mixes two kinds of knowledge, kept apart on purpose:

- counted by the router itself, exact at every decision: the requests it
  sent there and not yet seen finish (``in_flight``) and, of those, the
  prompt tokens still to prefill (``pending_prefill_tokens``,
  ``prefilling``). Two routers' worth of arrivals between two stats polls
  cannot pile onto one replica unseen, the failure that collapses traffic
  in routers that read only polled load;
- polled from the replica, stale by up to a poll interval: its waiting and
  running counts, KV usage and free blocks, and its learned step-cost
  model (``StepCostModel``), which prices the work ahead.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from carpool.scheduler.control.cost_model import StepCostModel


class Role(enum.Enum):
    """What a replica serves: whole requests, or one side of a P/D split."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


class Health(enum.Enum):
    """Only READY replicas take new requests; DRAINING ones finish theirs."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


class RoutingError(Exception):
    """No replica can take the request (none ready, or all over the SLO).

    ``retry_after`` is a whole number of seconds for an HTTP Retry-After.
    """

    def __init__(self, reason: str, retry_after: float, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


@dataclass
class ReplicaView:
    """One replica as the router sees it (see the module docstring)."""

    replica_id: str
    role: Role = Role.MIXED
    health: Health = Health.READY
    # Engine limits: sequences per step, tokens per step, tokens per block.
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # Counted by the router (exact).
    in_flight: int = 0
    prefilling: int = 0  # of in_flight: first token not seen yet
    pending_prefill_tokens: int = 0  # their uncached prompt tokens
    active_blocks: int = 0  # KV blocks of in_flight's prompts (the router's count)
    # Polled from the replica (stale by up to a poll interval).
    waiting: int = 0
    # Prompt tokens waiting there, as polled: every front's, where the
    # router's own count (pending_prefill_tokens) has only what it sent.
    waiting_tokens: int = 0
    running: int = 0
    kv_usage: float = 0.0
    free_blocks: int = 0
    stats_time: float = 0.0
    cost_model: StepCostModel | None = None
    # Mean seconds a request spent on this replica, learned from finishes.
    service_time: float | None = None
    # Ties are broken by the order replicas joined, never by chance.
    order: int = field(default=0, compare=False)

    @property
    def routable(self) -> bool:
        return self.health is Health.READY

    @property
    def decoding(self) -> int:
        """Requests past their first token (each decodes one token a step)."""
        return max(0, self.in_flight - self.prefilling)


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request before it is sent.

    ``block_hashes`` are the chained hashes of the prompt's full blocks,
    the keys replicas report in their block-stored / block-evicted events,
    so the fleet prefix index can say how much of it each replica holds.
    """

    request_id: str
    prompt_tokens: int
    block_hashes: Sequence[int] = ()
    session_id: str | None = None
    priority: int = 0


@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes and why (``cause`` is logged and shown)."""

    replica_id: str
    cause: str
    cached_tokens: int = 0
    predicted_ttft: float | None = None
