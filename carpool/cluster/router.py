"""The fleet router: replica views, what it routed, and one policy.

The router is the single place that counts what each replica was sent and
has not finished (``ReplicaView.in_flight`` and the prompt tokens still
to prefill there); the driver (the simulator, or the live front) tells it
when a request's first token came and when it finished. Replicas' polled
stats and block events feed the rest of the views and the fleet prefix
index. Every decision is kept, with its cause, in a bounded log.
"""
from __future__ import annotations

import math
import re
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from carpool.cluster.hashring import HashRing
from carpool.cluster.policies import POLICIES, Policy, make_policy, predict_ttft_on
from carpool.cluster.prefix_index import ApproximatePrefixIndex, FleetPrefixIndex
from carpool.cluster.ttft_model import Features, TTFTModel, ttft_features
from carpool.cluster.view import (
    Health,
    ReplicaView,
    Role,
    RouteDecision,
    RouteRequest,
    RoutingError,
)

# A replica takes a request while it holds at most this many times the mean
# in-flight load (consistent hashing with bounded loads' c): the guard that
# keeps a hot cache, a stale view or a session from drawing all the traffic.
LOAD_BOUND = 1.5
# Weight of the newest finish in a replica's service-time estimate.
SERVICE_EWMA = 0.1
DECISION_LOG = 512  # decisions kept for /carpool/policy and reports
# Blocks the approximate baseline index keeps per replica.
APPROX_CAPACITY_BLOCKS = 1 << 16
# First tokens the TTFT prediction error is measured over (the latest ones).
TTFT_ERROR_WINDOW = 512
# A replica's index is resynced at most this often (seconds): under memory
# pressure an eviction between routing and admission is an honest miss too.
RESYNC_INTERVAL_S = 1.0

__all__ = ["POLICIES", "Router", "make_policy"]


class SharedKVPrice(Protocol):
    """What the router asks of a shared KV tier (``kv_tier.TierClient``)."""

    def count(self, hashes: Sequence[int]) -> int: ...

    def load_seconds(self, blocks: int) -> float: ...


@dataclass
class _Routed:
    replica_id: str
    sent_at: float
    pending_tokens: int  # uncached prompt tokens, until the first token
    prefilling: bool = True
    # What the decision expected: the prompt's leading blocks cached there
    # (by the fleet index) and the TTFT; checked when the first token comes.
    block_hashes: tuple[int, ...] = ()
    cached_blocks: int = 0
    predicted_ttft: float | None = None
    blocks: int = 0  # the prompt's KV blocks, active there until it finishes
    features: Features | None = None  # the TTFT model's inputs at routing time


class Router:
    """Routes requests among replicas with a ``Policy`` (by name or object).

    ``ttft_target`` (seconds) turns on fleet admission for policies that
    predict TTFTs: when even the best replica's prediction is over the
    target, ``route`` raises ``RoutingError`` (HTTP 429 at the front) with
    the excess as Retry-After, instead of queueing the request somewhere.
    ``shared_kv``: the fleet's shared KV tier, if any: a prompt's blocks
    there are priced at their load time instead of their prefill.
    """

    def __init__(self, policy: Policy | str = "predicted-ttft", *, seed: int = 0,
                 load_bound: float = LOAD_BOUND, ttft_target: float | None = None,
                 ring_key: bytes = b"", approx_capacity_blocks: int = APPROX_CAPACITY_BLOCKS,
                 shared_kv: SharedKVPrice | None = None) -> None:
        if load_bound < 1.0:
            raise ValueError(f"load_bound must be >= 1, got {load_bound}")
        self.policy = make_policy(policy, seed) if isinstance(policy, str) else policy
        self.load_bound = load_bound
        self.ttft_target = ttft_target
        self.shared_kv = shared_kv
        self.views: dict[str, ReplicaView] = {}
        self.prefix_index = FleetPrefixIndex()
        self.approximate_index = ApproximatePrefixIndex(approx_capacity_blocks)
        self.ring = HashRing(key=ring_key)
        self.decisions: deque[dict] = deque(maxlen=DECISION_LOG)
        self.causes: Counter[str] = Counter()
        self._routed: dict[str, _Routed] = {}
        self._joined = 0
        # |predicted - observed| / observed of the latest first tokens, and
        # the index corrections first tokens made (``first_token``).
        self.ttft_errors: deque[float] = deque(maxlen=TTFT_ERROR_WINDOW)
        self.index_corrections = 0
        # The driver's way to replace a replica's index entries with its
        # cache's snapshot (the live front asks the worker; the simulator
        # reads the pool); None: no resync. Asked by ``_reconcile``.
        self.resync_index: Callable[[str], None] | None = None
        self._resynced: dict[str, float] = {}
        # Fitted on every first token (its error is reported beside the
        # analytic one's); policies price with it when they ask (learned-ttft).
        self.ttft_model = TTFTModel()
        self.analytic_errors: deque[float] = deque(maxlen=TTFT_ERROR_WINDOW)
        self.learned_errors: deque[float] = deque(maxlen=TTFT_ERROR_WINDOW)
        # The same errors summed over every first token (sum, count), for a
        # whole run's MAPE: "decided" is the prediction the decision used.
        self.error_totals: dict[str, list[float]] = {
            "decided": [0.0, 0], "analytic": [0.0, 0], "learned": [0.0, 0]}

    # -- membership and stats -------------------------------------------------

    def add_replica(self, view: ReplicaView) -> None:
        if view.replica_id in self.views:
            raise ValueError(f"replica {view.replica_id!r} is already in the fleet")
        view.order = self._joined
        self._joined += 1
        self.views[view.replica_id] = view
        self.ring.add(view.replica_id)

    def remove_replica(self, replica_id: str) -> list[str]:
        """Drop a replica (it left or died); returns the ids of the requests
        it still had, which the driver fails or re-routes."""
        self.views.pop(replica_id, None)
        self.ring.remove(replica_id)
        self.prefix_index.remove_replica(replica_id)
        self.approximate_index.remove_replica(replica_id)
        lost = [rid for rid, routed in self._routed.items() if routed.replica_id == replica_id]
        for request_id in lost:
            del self._routed[request_id]
        return lost

    def set_health(self, replica_id: str, health: Health) -> None:
        """READY replicas take requests; a DRAINING or DEAD one takes none
        and leaves the session ring (its sessions move to their next replica)."""
        view = self.views[replica_id]
        view.health = health
        if health is Health.READY:
            self.ring.add(replica_id)
        else:
            self.ring.remove(replica_id)
        if health is Health.DEAD:
            self.prefix_index.remove_replica(replica_id)

    def update_stats(self, replica_id: str, now: float, *, waiting: int, running: int,
                     kv_usage: float = 0.0, free_blocks: int = 0,
                     waiting_tokens: int = 0) -> None:
        view = self.views[replica_id]
        view.waiting, view.running, view.waiting_tokens = waiting, running, waiting_tokens
        view.kv_usage, view.free_blocks, view.stats_time = kv_usage, free_blocks, now

    def block_events(self, replica_id: str, stored: Iterable[int], evicted: Iterable[int],
                     reset: bool = False) -> None:
        """A replica's drained cache events (``KvEventBatch``). ``reset``:
        ``stored`` is its whole cache (its engine restarted with an empty
        one, its buffer overflowed, or it was asked to resync): forget what
        the index held for it first. (The approximate index, a baseline
        that sees no events, keeps what it was sent.)"""
        if reset:
            self.prefix_index.remove_replica(replica_id)
        self.blocks_evicted(replica_id, evicted)
        self.blocks_stored(replica_id, stored)

    def blocks_stored(self, replica_id: str, hashes: Iterable[int]) -> None:
        if replica_id in self.views:
            self.prefix_index.stored(replica_id, hashes)

    def blocks_evicted(self, replica_id: str, hashes: Iterable[int]) -> None:
        self.prefix_index.evicted(replica_id, hashes)

    # -- routing --------------------------------------------------------------

    def route(self, request: RouteRequest, now: float,
              role: Role = Role.MIXED) -> RouteDecision:
        """Pick a ready replica of ``role`` for ``request`` and count it there."""
        if request.request_id in self._routed:
            raise ValueError(f"request {request.request_id!r} is already routed")
        candidates = self.candidates(role)
        if not candidates:
            raise RoutingError("no_replica", 1.0, f"no {role.value} replica is ready")
        decision = self.policy.choose(request, candidates, self, now)
        if (self.ttft_target is not None and decision.predicted_ttft is not None
                and decision.predicted_ttft > self.ttft_target):
            excess = decision.predicted_ttft - self.ttft_target
            self._log(now, request, RouteDecision("", "rejected: every replica over target"))
            raise RoutingError("predicted_ttft_miss", float(min(60, max(1, math.ceil(excess)))), (
                f"no replica can give a first token within the TTFT target "
                f"{self.ttft_target:.2f} s (best predicted {decision.predicted_ttft:.2f} s)"))
        self.assign(request, decision, now)
        return decision

    def candidates(self, *roles: Role) -> list[ReplicaView]:
        """Ready replicas of any of ``roles``, in join order."""
        return [v for v in self.views.values() if v.routable and v.role in roles]

    def assign(self, request: RouteRequest, decision: RouteDecision, now: float,
               prefill_tokens: int | None = None) -> None:
        """Count ``request`` on ``decision.replica_id`` (a choice made here or
        by a planner): in flight there, with ``prefill_tokens`` (default: the
        prompt's uncached part) still to prefill before its first token."""
        if request.request_id in self._routed:
            raise ValueError(f"request {request.request_id!r} is already routed")
        view = self.views[decision.replica_id]
        pending = (max(1, request.prompt_tokens - decision.cached_tokens)
                   if prefill_tokens is None else prefill_tokens)
        # The index's belief, as the engine counts hits: whole blocks, the
        # last prompt token always computed.
        held = (self.prefix_index.matches(request.block_hashes).get(view.replica_id, 0)
                if request.block_hashes else 0)
        analytic = predict_ttft_on(view, pending, self.cost_model_for(view))
        self._routed[request.request_id] = _Routed(
            view.replica_id, now, pending, block_hashes=tuple(request.block_hashes),
            cached_blocks=min(held, (request.prompt_tokens - 1) // view.block_size),
            predicted_ttft=decision.predicted_ttft,
            blocks=-(-request.prompt_tokens // view.block_size),
            # A decode leg's first token waits for its KV, not for a prefill.
            features=None if analytic is None or prefill_tokens is not None else ttft_features(
                analytic, pending, view.in_flight, view.kv_usage, view.running))
        view.in_flight += 1
        view.active_blocks += self._routed[request.request_id].blocks
        view.prefilling += 1
        view.pending_prefill_tokens += pending
        self._log(now, request, decision)

    def first_token(self, request_id: str, now: float,
                    cached_tokens: int | None = None, *, observed: bool = True) -> None:
        """The request's first token came: its prefill is no longer ahead of
        others. ``cached_tokens``: the prompt tokens its replica found cached
        (the engine's count), which checks the fleet index (``_reconcile``).
        ``observed=False``: it left without one (rejected, failed, aborted):
        its prefill is no longer ahead either, but there is no TTFT to
        learn from (a rejection a moment after routing is no 0.1 ms TTFT)."""
        routed = self._routed.get(request_id)
        if routed is None or not routed.prefilling:
            return
        routed.prefilling = False
        if observed and now > routed.sent_at:
            self._learn(routed, now - routed.sent_at)
        view = self.views.get(routed.replica_id)
        if view is not None:
            view.prefilling -= 1
            view.pending_prefill_tokens -= routed.pending_tokens
            if cached_tokens is not None:
                self._reconcile(routed, view, cached_tokens, now)

    def _reconcile(self, routed: _Routed, view: ReplicaView, cached_tokens: int,
                   now: float) -> None:
        """The engine found ``cached_tokens`` where the index expected
        ``routed.cached_blocks`` blocks. More: blocks the index missed (a
        lost store event, or loaded from a shared store): it holds them now.
        Fewer: the index held blocks that were gone, so an eviction event
        was lost or is late, and others may be too; the request computed
        its own again (they are there now), but what else the index claims
        there is in doubt: resync the replica's entries from its cache
        (``resync_index``, at most every ``RESYNC_INTERVAL_S``)."""
        found = min(cached_tokens // view.block_size, len(routed.block_hashes))
        expected = routed.cached_blocks
        if found > expected:
            self.prefix_index.stored(view.replica_id, routed.block_hashes[expected:found])
        elif found < expected and self.resync_index is not None and (
                now - self._resynced.get(view.replica_id, -math.inf) >= RESYNC_INTERVAL_S):
            self._resynced[view.replica_id] = now
            self.resync_index(view.replica_id)
        self.index_corrections += found != expected

    def _learn(self, routed: _Routed, observed: float) -> None:
        """Score the predictions against a first token, and fit on it."""
        if routed.predicted_ttft is not None:
            self.ttft_errors.append(self._tally("decided", routed.predicted_ttft, observed))
        if routed.features is None:
            return
        learned = self.ttft_model.predict(routed.features)
        if learned is not None:  # scored before it learns from this one
            self.learned_errors.append(self._tally("learned", learned, observed))
            self.analytic_errors.append(self._tally("analytic", routed.features[1], observed))
        self.ttft_model.record(routed.features, observed)

    def _tally(self, model: str, predicted: float, observed: float) -> float:
        error = abs(predicted - observed) / observed
        total = self.error_totals[model]
        total[0] += error
        total[1] += 1
        return error

    def run_errors(self) -> dict[str, float | None]:
        """Each prediction's MAPE over every first token so far."""
        return {model: (total[0] / total[1] if total[1] else None)
                for model, total in self.error_totals.items()}

    def ttft_errors_by_model(self) -> dict[str, float | None]:
        """The analytic and the learned predictions' MAPE over the same
        latest first tokens (those since the model was first fitted)."""
        def mean(values: deque[float]) -> float | None:
            return sum(values) / len(values) if values else None
        return {"analytic": mean(self.analytic_errors), "learned": mean(self.learned_errors),
                "samples": len(self.learned_errors)}

    @property
    def ttft_error(self) -> float | None:
        """Mean absolute percentage error of the predicted TTFTs over the
        latest first tokens (as a fraction; None before any)."""
        return sum(self.ttft_errors) / len(self.ttft_errors) if self.ttft_errors else None

    def finished(self, request_id: str, now: float, *, learn: bool = True,
                 queued_s: float = 0.0) -> None:
        """The request left its replica (finished, failed, aborted or
        rejected there); ``learn`` feeds its time there, less the
        ``queued_s`` it waited before its first step, into the replica's
        service time (queueing excluded: under a surge the queue wait is
        what grows, and a service time that counted it would size an
        autoscaled pool for the backlog rather than for the load)."""
        self.first_token(request_id, now, observed=False)
        routed = self._routed.pop(request_id, None)
        if routed is None:
            return
        view = self.views.get(routed.replica_id)
        if view is None:
            return
        view.in_flight -= 1
        view.active_blocks -= routed.blocks
        if learn:
            seconds = max(0.0, now - routed.sent_at - queued_s)
            view.service_time = (seconds if view.service_time is None else
                                 (1 - SERVICE_EWMA) * view.service_time + SERVICE_EWMA * seconds)

    def replica_of(self, request_id: str) -> str | None:
        routed = self._routed.get(request_id)
        return routed.replica_id if routed else None

    # -- what policies ask ----------------------------------------------------

    def within_load_bound(self, candidates: Sequence[ReplicaView]) -> list[ReplicaView]:
        """Candidates holding at most ``ceil(load_bound x (total + 1) / n)``
        requests once given this one (never empty: the least loaded passes)."""
        total = sum(v.in_flight for v in candidates)
        limit = math.ceil(self.load_bound * (total + 1) / len(candidates))
        within = [v for v in candidates if v.in_flight + 1 <= limit]
        return within or [min(candidates, key=lambda v: (v.in_flight, v.order))]

    def session_home(self, session_id: str | None,
                     candidates: Sequence[ReplicaView]) -> ReplicaView | None:
        """The session's replica among ``candidates`` by the bounded-load ring."""
        if session_id is None:
            return None
        by_id = {v.replica_id: v for v in candidates}
        home = self.ring.home(session_id, load=lambda rid: self.views[rid].in_flight,
                              bound=self.load_bound, eligible=by_id.__contains__)
        return by_id.get(home) if home is not None else None

    @staticmethod
    def cached_tokens(view: ReplicaView, blocks: int, request: RouteRequest) -> int:
        """Prompt tokens a hit of ``blocks`` leading blocks saves (the last
        prompt token is always computed, as the engine does)."""
        return max(0, min(blocks * view.block_size, request.prompt_tokens - 1))

    def predict_ttft(self, view: ReplicaView, uncached_tokens: int,
                     peers: Sequence[ReplicaView] = (), learned: bool = False) -> float | None:
        """``predict_ttft_on`` with ``cost_model_for(view, peers)``;
        ``learned``: the fitted ``TTFTModel`` on it, once it is fitted."""
        analytic = predict_ttft_on(view, uncached_tokens, self.cost_model_for(view, peers))
        if analytic is None or not (learned and self.ttft_model.ready):
            return analytic
        return self.ttft_model.predict(ttft_features(
            analytic, max(1, uncached_tokens), view.in_flight, view.kv_usage, view.running))

    def cost_model_for(self, view: ReplicaView, peers: Sequence[ReplicaView] = ()):
        """The replica's own cost model once ready, else a ready peer's, else
        any ready one of the fleet's (its replicas run one model on one kind
        of machine: a prefill pool that has not run yet is priced by the
        decode pool's steps); None while none is."""
        for candidate in (view, *peers, *self.views.values()):
            model = candidate.cost_model
            if model is not None and model.ready:
                return model
        return None

    def _log(self, now: float, request: RouteRequest, decision: RouteDecision) -> None:
        # Counted by the cause's words, numbers left out ("lowest predicted TTFT # s").
        self.causes[re.sub(r"\d+(\.\d+)?", "#", decision.cause)] += 1
        self.decisions.append({"time": now, "request_id": request.request_id,
                               "replica": decision.replica_id, "cause": decision.cause,
                               "cached_tokens": decision.cached_tokens,
                               "predicted_ttft": decision.predicted_ttft})
