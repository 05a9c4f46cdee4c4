"""Prefill/decode placement: colocated, or prefill on one pool and decode on another.

Per request the planner compares two predicted first tokens:

- colocated: the best mixed or decode replica prefills the prompt's
  uncached part itself (``Router.predict_ttft``);
- disaggregated: the best prefill replica computes it, then its KV moves
  to the decode replica over the link. Sent layer by layer while the next
  layers compute, only part of the transfer shows: the last layer's share,
  or what the transfer takes beyond the compute it hides behind
  (``exposed_transfer_seconds``). The first token is then one step of the
  decode replica: a handoff queues ahead of that replica's own prefills
  (``Request.kv_handoff``), so it does not queue a second time.

Remote prefill is chosen only when it pays: the uncached prompt is at least
``min_remote_tokens`` long (0 by default: the comparison decides; a floor
as in vLLM's and Dynamo's conditional disaggregation, where short prompts
stay local), the transfer alone takes less than the prefill it saves the
decode replica, and the disaggregated first token is predicted no later
than the colocated one plus what the colocated prefill would cost the
decode replica's running requests: each of them waits that prefill out
once (one longer inter-token gap), so colocating adds ``decoding x
prefill`` request-seconds besides the request's own TTFT, weighed by
``stall_weight`` (0 by default: the request's own first token alone; 1: a
second of anyone's wait counts the same). Otherwise the request stays
colocated. Measured (docs/numbers/pd.md): at 1, Azure's 2P:6D fell from 100% to 87%
in SLO (its small prefill pool queued) while 4P:4D rose from 99.1% to
99.5%; a stall once per request barely moves a TPOT averaged over its
tokens, so request-seconds overprice it where TPOT does not bind.
``always`` disaggregates every request (static disaggregation). Pure
Python, like the router it asks.

Measured (docs/numbers/pd.md, ``carpool evaluate pd``): a fixed 512-token floor kept
44% of Azure's conversation prompts on a 4P:4D fleet's decode pool, where
its decodes had no room for them (92% in SLO against 99% without the
floor), and without the handoff's place at the queue's front a remote
request queued twice, at the prefill replica and behind the decode
replica's own prefills (Mooncake 4P:4D: 28% in SLO; 54% with it).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from carpool.cluster.policies import Scored, score_replicas
from carpool.cluster.router import Router
from carpool.cluster.view import ReplicaView, Role, RouteDecision, RouteRequest, RoutingError
from carpool.scheduler.control.shedding import predict_first_token_delay

# conditional: remote prefill only where it pays; always: every request.
PD_MODES = ("conditional", "always")


@dataclass(frozen=True)
class KVShape:
    """A model's KV cache per token: keys and values of every layer
    (``tensors`` 2), or one latent row per layer (MLA: ``tensors`` 1, one
    "head" of the latent's width)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: float = 2.0
    tensors: int = 2

    @property
    def bytes_per_token(self) -> float:
        return (self.tensors * self.num_layers * self.num_kv_heads * self.head_dim
                * self.dtype_bytes)


@dataclass(frozen=True)
class Link:
    """A path between two replicas: bytes per second and a fixed latency."""

    bandwidth: float = 50e9  # 400 Gb/s RDMA
    latency: float = 20e-6

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, got {self}")

    def seconds(self, num_bytes: float) -> float:
        return self.latency + num_bytes / self.bandwidth


def exposed_transfer_seconds(total: float, compute: float, num_layers: int,
                             latency: float = 0.0) -> float:
    """What a layer-by-layer transfer of ``total`` seconds adds after a
    prefill of ``compute`` seconds: each layer is sent once computed, so
    the transfer overlaps the remaining layers' compute, and what shows is
    the last layer's share or the excess over the hidden compute."""
    per_layer = total / num_layers
    hidden = compute * (num_layers - 1) / num_layers
    return latency + max(per_layer, total - hidden)


def _prefill_seconds(view: ReplicaView, tokens: int, router: Router | None = None
                     ) -> float | None:
    """A prefill of ``tokens`` alone on ``view``, by its cost model (or,
    given the ``router``, the fleet's fallback: ``Router.cost_model_for``);
    None while there is no ready one."""
    model = router.cost_model_for(view) if router is not None else view.cost_model
    if model is None or not model.ready:
        return None
    return predict_first_token_delay(model, 0, max(1, tokens), 0, view.max_num_batched_tokens)


def _step_seconds(view: ReplicaView, router: Router) -> float | None:
    """One step of ``view``'s decodes with one prompt token (a handed-over
    request's first token); None while there is no ready cost model."""
    model = router.cost_model_for(view)
    if model is None or not model.ready:
        return None
    return predict_first_token_delay(model, 0, 1, view.decoding, view.max_num_batched_tokens)


@dataclass(frozen=True)
class PDPlan:
    """Where a request runs: ``prefill`` is None when colocated."""

    decode: RouteDecision
    prefill: RouteDecision | None
    cause: str
    transfer_s: float = 0.0  # whole KV transfer
    exposed_s: float = 0.0  # the part not hidden behind compute
    predicted_ttft: float | None = None

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


class PDPlanner:
    """Plans and counts each request's placement on a ``Router``'s fleet."""

    def __init__(self, router: Router, kv: KVShape, link: Link | None = None,
                 min_remote_tokens: int = 0, always: bool = False,
                 links: Mapping[tuple[str, str], Link] | None = None,
                 stall_weight: float = 0.0) -> None:
        """``link``: between any prefill and decode replica; ``links``: the
        ones that differ, by (prefill replica id, decode replica id);
        ``stall_weight``: see the module docstring."""
        if not stall_weight >= 0:
            raise ValueError(f"stall_weight must be >= 0, got {stall_weight}")
        self.router, self.kv = router, kv
        self.link = link or Link()
        self.links = dict(links or {})
        self.min_remote_tokens = min_remote_tokens
        self.stall_weight = stall_weight
        # Every request prefilled remotely while there is a prefill replica
        # (static disaggregation, the baseline the conditional choice beats).
        self.always = always

    def plan(self, request: RouteRequest, now: float) -> PDPlan:
        """Choose and count: the decode leg under ``request.request_id``, a
        remote prefill leg under ``prefill_leg(request_id)``."""
        router = self.router
        # Both legs' ids checked before either is counted: a plan never
        # leaves half a request routed.
        for request_id in (request.request_id, self.prefill_leg(request.request_id)):
            if router.replica_of(request_id) is not None:
                raise ValueError(f"request {request_id!r} is already routed")
        local = router.candidates(Role.MIXED, Role.DECODE)
        if not local:
            raise RoutingError("no_replica", 1.0, "no mixed or decode replica is ready")
        home, home_cached, home_ttft = self._best(request, local)
        plan = self._remote(request, home, home_cached, home_ttft)
        if plan is None:
            decision = RouteDecision(home.replica_id, "colocated: remote prefill does not pay",
                                     home_cached, home_ttft)
            router.assign(request, decision, now)
            return PDPlan(decision, None, decision.cause, predicted_ttft=home_ttft)
        # The decode replica waits for the KV, not for a prefill of its own.
        router.assign(RouteRequest(self.prefill_leg(request.request_id), request.prompt_tokens,
                                   request.block_hashes), plan.prefill, now)
        router.assign(request, plan.decode, now, prefill_tokens=1)
        return plan

    @staticmethod
    def prefill_leg(request_id: str) -> str:
        """The id a request's remote prefill is counted under in the router."""
        return f"{request_id}:prefill"

    def _best(self, request: RouteRequest,
              views: list[ReplicaView]) -> tuple[ReplicaView, int, float | None]:
        best = min(score_replicas(self.router, request, self.router.within_load_bound(views)),
                   key=Scored.rank)
        return best.view, best.cached, best.ttft

    def _remote(self, request: RouteRequest, home: ReplicaView,
                home_cached: int, home_ttft: float | None) -> PDPlan | None:
        """The disaggregated plan if it pays (see the module docstring) or
        the planner always disaggregates, else None."""
        prefill_pool = self.router.candidates(Role.PREFILL)
        uncached = request.prompt_tokens - home_cached
        if not prefill_pool or (not self.always and (
                home_ttft is None or uncached < self.min_remote_tokens)):
            return None
        worker, cached, ttft = self._best(request, prefill_pool)
        compute = _prefill_seconds(worker, request.prompt_tokens - cached, self.router)
        link = self.link_between(worker.replica_id, home.replica_id)
        # Blocks the decode replica holds need not move.
        total = uncached * self.kv.bytes_per_token / link.bandwidth
        exposed = exposed_transfer_seconds(total, compute or 0.0, self.kv.num_layers,
                                           link.latency)
        # The first token is the decode replica's: one of its steps once the
        # KV is there (a handoff queues ahead of its own prefills).
        handoff_step = _step_seconds(home, self.router)
        remote_ttft = None if ttft is None or handoff_step is None \
            else ttft + exposed + handoff_step
        if not self.always:
            saved = _prefill_seconds(home, uncached, self.router)
            if remote_ttft is None or saved is None or compute is None:
                return None
            if total + link.latency >= saved:
                return None  # the transfer alone costs more than the prefill it saves
            # Colocated, the prefill stalls each running decode there once.
            stall = self.stall_weight * home.decoding * saved
            if remote_ttft > home_ttft + stall:
                return None
        shown = "?" if remote_ttft is None else f"{remote_ttft:.3f} s"
        cause = (f"disaggregated: {uncached} uncached tokens, TTFT {shown}"
                 + ("" if home_ttft is None else f" vs {home_ttft:.3f} s colocated")
                 + f", transfer {total * 1e3:.1f} ms ({exposed * 1e3:.1f} ms exposed)")
        return PDPlan(RouteDecision(home.replica_id, cause, home_cached, remote_ttft),
                      RouteDecision(worker.replica_id, cause, cached, ttft), cause,
                      total + link.latency, exposed, remote_ttft)

    def link_between(self, prefill_id: str, decode_id: str) -> Link:
        """The link a transfer from ``prefill_id`` to ``decode_id`` takes."""
        return self.links.get((prefill_id, decode_id), self.link)
