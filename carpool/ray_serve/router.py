"""carpool's router as a Ray Serve request router.

Ray Serve runs one request router per deployment handle (here: in each
ingress replica, for the engine deployment) and asks ``choose_replicas``
for each request. This adapter keeps a ``carpool.cluster.router.Router``
whose views are the engine replicas Ray reports, and lets its policy
choose (session affinity, the prefix cache, predicted TTFT, ... as
``--routing`` names it): the decision is carpool's, Ray only carries it out.

What feeds the views:

- counted here, exact for this router: what it sent each replica and has
  not seen complete (``Router.assign`` on routing, ``finished`` when Ray
  reports the request completed);
- each replica's ``ReplicaReport`` (its routing stats, refreshed every
  ``request_routing_stats_period_s``): waiting, running, KV, its prefix
  cache's block hashes (the fleet prefix index, replaced by each report)
  and its recent steps (its ``StepCostModel``).

Ray's handle does not tell the router when a stream's first token comes,
so a request counts as prefilling until it completes (the predicted TTFT
of a replica with long decodes errs high, never low).

Other methods than ``generate`` (the ingress's stats polls) go round robin.

Each decision (replica, cause, cached tokens, predicted TTFT) is added to
the request as ``Routed`` bytes (``generate``'s ``routed`` argument); the
replica returns it with its ``Accepted`` event, and the ingress's
``RayEngine`` logs it for ``/carpool/policy``. The router object itself is
Ray's (one per handle, possibly on its own event loop): nothing of it is
shared with the ingress's code.

Ray ships this module to each router by value (cloudpickle), so it holds
no module-level objects but classes and functions (no msgspec decoders).
"""
from __future__ import annotations

import logging
import time

import msgspec
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from carpool.cluster.policies import make_policy
from carpool.cluster.router import Router
from carpool.cluster.view import ReplicaView, Role, RouteDecision, RouteRequest
from carpool.ray_serve.wire import REPORT_KEY, ROUTED_KWARG, ReplicaReport, Routed, RouteHint
from carpool.scheduler.control.cost_model import StepCostModel

log = logging.getLogger("carpool.server")

class CarpoolRequestRouter(FIFOMixin, RequestRouter):
    """Routes the engine deployment's requests with carpool's ``Router``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.router = Router("predicted-ttft")
        self._reports: dict[str, bytes] = {}  # replica -> the report its view has applied
        self._routed: dict[str, RouteHint] = {}  # Ray's internal request id -> the request
        self._turn = 0

    def initialize_state(self, policy: str = "predicted-ttft", seed: int = 0, **_) -> None:
        """Ray passes ``request_router_kwargs`` here: the policy's name."""
        self.router.policy = make_policy(policy, seed)

    # -- replicas ------------------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        names = {r.replica_id.unique_id for r in replicas}
        for name in [n for n in self.router.views if n not in names]:
            self.router.remove_replica(name)
            self._reports.pop(name, None)
        self._refresh(replicas)

    def _refresh(self, replicas: list[RunningReplica]) -> None:
        """Apply each replica's newest ``ReplicaReport`` to its view."""
        now = time.monotonic()
        for replica in replicas:
            name = replica.replica_id.unique_id
            if name not in self.router.views:
                self.router.add_replica(ReplicaView(name, cost_model=StepCostModel()))
            data = (replica.routing_stats or {}).get(REPORT_KEY)
            if not isinstance(data, bytes) or data == self._reports.get(name):
                continue
            self._reports[name] = data
            try:
                report = msgspec.msgpack.decode(data, type=ReplicaReport)
            except msgspec.DecodeError as exc:
                log.warning("replica %s sent an unreadable routing report: %s", name, exc)
                continue
            view = self.router.views[name]
            view.max_num_seqs, view.block_size = report.max_num_seqs, report.block_size
            view.max_num_batched_tokens = report.max_num_batched_tokens
            self.router.update_stats(name, now, waiting=report.waiting, running=report.running,
                                     kv_usage=report.kv_usage, free_blocks=report.free_blocks,
                                     waiting_tokens=report.waiting_tokens)
            self.router.prefix_index.remove_replica(name)  # a snapshot replaces the last
            self.router.blocks_stored(name, report.held)
            costs = StepCostModel()
            for tokens, seqs, seconds in report.steps:
                costs.record(tokens, seqs, seconds)
            view.cost_model = costs

    # -- routing -------------------------------------------------------------------------

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        """carpool's choice first; the others as Ray's fallback rank (the
        chosen one full: Ray's max_ongoing_requests)."""
        if not candidate_replicas:
            return []
        hint = _hint_of(pending_request)
        if hint is None:  # not a generation (the stats polls): round robin
            self._turn += 1
            k = self._turn % len(candidate_replicas)
            return [candidate_replicas[k:] + candidate_replicas[:k]]
        self._refresh(candidate_replicas)
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [v for v in self.router.candidates(Role.MIXED) if v.replica_id in by_name]
        if not views:
            return [candidate_replicas]
        now = time.monotonic()
        if self.router.replica_of(hint.request_id) is not None:  # Ray retries the routing
            self.router.finished(hint.request_id, now, learn=False)
        request = _route_request(hint)
        decision = self.router.policy.choose(request, views, self.router, now)
        self.router.assign(request, decision, now)
        self._routed[pending_request.metadata.internal_request_id] = hint
        # The decision rides with the request; its replica returns it to the
        # ingress's RayEngine (/carpool/policy's routing section).
        pending_request.kwargs[ROUTED_KWARG] = msgspec.msgpack.encode(Routed(
            decision.replica_id, decision.cause, decision.cached_tokens,
            decision.predicted_ttft))
        chosen = by_name[decision.replica_id]
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """Ray sent it elsewhere than chosen (the choice was full): count it there."""
        hint = self._routed.get(pending_request.metadata.internal_request_id)
        name = replica_id.unique_id
        if hint is None or self.router.replica_of(hint.request_id) in (None, name):
            return
        if name in self.router.views:
            now = time.monotonic()
            self.router.finished(hint.request_id, now, learn=False)
            self.router.assign(_route_request(hint), RouteDecision(name, "fallback: chosen full"),
                               now)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        """The stream ended (finished, failed, aborted): no longer in flight there."""
        hint = self._routed.pop(internal_request_id, None)
        if hint is not None:
            self.router.finished(hint.request_id, time.monotonic())


def _hint_of(pending_request: PendingRequest | None) -> RouteHint | None:
    if pending_request is None or pending_request.metadata.call_method != "generate":
        return None
    args = pending_request.args
    if len(args) < 2 or not isinstance(args[1], bytes):
        return None
    try:
        return msgspec.msgpack.decode(args[1], type=RouteHint)
    except msgspec.DecodeError:
        return None


def _route_request(hint: RouteHint) -> RouteRequest:
    return RouteRequest(hint.request_id, hint.prompt_tokens, hint.block_hashes,
                        hint.session_id, hint.priority)
