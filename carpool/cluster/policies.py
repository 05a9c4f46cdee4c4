"""Routing policies: given a request and the routable replicas, pick one.

Every policy is deterministic given its inputs (``random`` draws from its
own seeded generator) and breaks ties by the order replicas joined. A
policy sees the ``Router`` for what the fleet knows as a whole (the prefix
indexes, the session ring, the load bound); it never changes the views:
the router counts what it routes.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from carpool.cluster.view import ReplicaView, RouteDecision, RouteRequest
from carpool.scheduler.control.shedding import predict_first_token_delay

# The default's preferences for where a request's KV is (its session's home
# replica; the replica with its longest cached prefix): kept while its
# predicted TTFT is within this factor and these seconds of the best.
# Measured on Mooncake conversations (8 replicas, 4,000 requests, KV room
# for 6.4M tokens per replica): the cached-prefix preference raised the hit
# rate from 76% to 82% of the ideal at equal TTFT; factors of 2 and 3 gave
# 85% / 87% at a TTFT p99 2-3% higher.
AFFINITY_FACTOR = 1.5
AFFINITY_SLACK_S = 0.05
# The share of affinity-kept requests ``learned-ttft/explore`` sends to the best.
EXPLORE_SHARE = 0.05


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaView],
               router, now: float) -> RouteDecision:
        """Pick one of ``candidates`` (ready replicas of the asked role, in
        join order); ``router`` is the ``Router`` asking (it imports this
        module, so it is not named here)."""


def _least_loaded(candidates: Sequence[ReplicaView]) -> ReplicaView:
    return min(candidates, key=lambda v: (v.in_flight, v.order))


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._random = random.Random(seed)

    def choose(self, request, candidates, router, now) -> RouteDecision:
        view = candidates[self._random.randrange(len(candidates))]
        return RouteDecision(view.replica_id, "random")


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request, candidates, router, now) -> RouteDecision:
        view = candidates[self._turn % len(candidates)]
        self._turn += 1
        return RouteDecision(view.replica_id, "in turn")


class LeastOutstandingPolicy:
    name = "least-outstanding"

    def choose(self, request, candidates, router, now) -> RouteDecision:
        view = _least_loaded(candidates)
        return RouteDecision(view.replica_id, f"fewest in flight ({view.in_flight})")


class ResponseTimePolicy:
    """Expected wait = the replica's service-time estimate x (in flight + 1);
    a replica with no finish yet is priced at the fleet's mean."""

    name = "response-time"

    def choose(self, request, candidates, router, now) -> RouteDecision:
        known = [v.service_time for v in candidates if v.service_time is not None]
        fallback = sum(known) / len(known) if known else 1.0

        def wait(view: ReplicaView) -> float:
            service = view.service_time if view.service_time is not None else fallback
            return service * (view.in_flight + 1)

        view = min(candidates, key=lambda v: (wait(v), v.order))
        return RouteDecision(view.replica_id, f"lowest expected wait {wait(view):.3f} s")


class SessionAffinityPolicy:
    """Consistent hashing with bounded load on the session id; requests
    without one go to the least loaded replica."""

    name = "session"

    def choose(self, request, candidates, router, now) -> RouteDecision:
        home = router.session_home(request.session_id, candidates)
        if home is None:
            view = _least_loaded(candidates)
            return RouteDecision(view.replica_id, "no session: fewest in flight")
        return RouteDecision(home.replica_id, "session home")


class CacheAwarePolicy:
    """The most cached blocks of the prompt by the precise fleet index, among
    replicas within the load bound; ties (and no hit) go to the least loaded."""

    name = "cache-aware"

    def choose(self, request, candidates, router, now) -> RouteDecision:
        within = router.within_load_bound(candidates)
        depth = router.prefix_index.matches(request.block_hashes)
        view = min(within, key=lambda v: (-depth.get(v.replica_id, 0), v.in_flight, v.order))
        cached = router.cached_tokens(view, depth.get(view.replica_id, 0), request)
        return RouteDecision(view.replica_id, f"most cached ({cached} tokens)", cached)


class ApproximateCacheAwarePolicy:
    """The baseline in the style of SGLang's router: a per-replica
    approximate index of what was sent, and a load-imbalance fallback to the
    least loaded replica when the busiest holds more than ``balance_abs``
    requests more *and* ``balance_rel`` times as many as the idlest.
    Otherwise the best match if it covers more than ``cache_threshold`` of
    the prompt, else the replica whose index is smallest (most room)."""

    name = "approx-cache-aware"

    def __init__(self, balance_abs: int = 32, balance_rel: float = 1.0001,
                 cache_threshold: float = 0.5) -> None:
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.cache_threshold = cache_threshold

    def choose(self, request, candidates, router, now) -> RouteDecision:
        index = router.approximate_index
        loads = [v.in_flight for v in candidates]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            view, cause = _least_loaded(candidates), "imbalanced: fewest in flight"
        else:
            blocks = max(1, len(request.block_hashes))
            view = min(candidates, key=lambda v: (-index.match(v.replica_id,
                                                                request.block_hashes), v.order))
            if index.match(view.replica_id, request.block_hashes) / blocks > self.cache_threshold:
                cause = "best approximate match"
            else:
                view = min(candidates, key=lambda v: (index.size(v.replica_id), v.order))
                cause = "no good match: smallest index"
        index.sent(view.replica_id, request.block_hashes)
        return RouteDecision(view.replica_id, cause)


class KVCostPolicy:
    """The baseline in the style of Dynamo's KV router: each replica's cost
    is ``overlap_weight`` x the prompt blocks it would prefill (those its
    cache lacks, by the precise fleet index) plus the KV blocks active
    there once this request joins (the router's own count of the prompts in
    flight); the lowest wins, ties to the fewest in flight. No load bound:
    the active blocks are its balance."""

    name = "kv-cost"

    def __init__(self, overlap_weight: float = 1.0) -> None:
        self.overlap_weight = overlap_weight

    def choose(self, request, candidates, router, now) -> RouteDecision:
        depth = router.prefix_index.matches(request.block_hashes)

        def cost(view: ReplicaView) -> float:
            blocks = -(-request.prompt_tokens // view.block_size)
            prefill = max(0, blocks - depth.get(view.replica_id, 0))
            return self.overlap_weight * prefill + view.active_blocks + blocks

        view = min(candidates, key=lambda v: (cost(v), v.in_flight, v.order))
        cached = router.cached_tokens(view, depth.get(view.replica_id, 0), request)
        return RouteDecision(view.replica_id, f"lowest KV cost {cost(view):.0f} blocks", cached)


@dataclass(frozen=True)
class AffinityGate:
    """When the default keeps a request where its KV is (its session's home,
    or the longest cached prefix) rather than on the lowest predicted TTFT:
    while the predicted penalty stays within ``factor`` x the best and
    ``slack_s`` seconds. ``explore``: the share of those kept requests sent
    to the best instead (drawn from the policy's seeded generator), so the
    TTFTs the router learns from include where affinity would not have
    gone; 0 keeps every one."""

    factor: float = AFFINITY_FACTOR
    slack_s: float = AFFINITY_SLACK_S
    explore: float = 0.0

    def keeps(self, kept: Scored, best: Scored, draw: Callable[[], float]) -> bool:
        if kept.seconds > best.seconds * self.factor + self.slack_s:
            return False
        return self.explore <= 0 or draw() >= self.explore


NEVER = AffinityGate(factor=0.0, slack_s=-math.inf)  # affinity off
ALWAYS = AffinityGate(factor=math.inf)  # affinity at any predicted penalty


class PredictedTTFTPolicy:
    """carpool's default: the lowest predicted TTFT (``Router.predict_ttft``:
    queue wait plus the prefill of the prompt's uncached part, priced by the
    replica's cost model), among replicas within the load bound (the guard
    against every request collapsing onto the hottest cache); the session's
    home replica, else the replica holding the longest cached prefix, is
    kept while ``gate`` keeps it (``AffinityGate``), so a conversation stays
    where its KV is. ``bounded=False`` drops the load bound (an ablation)."""

    name = "predicted-ttft"
    learned = False  # price with the router's TTFT model fitted on first tokens

    def __init__(self, gate: AffinityGate = AffinityGate(), bounded: bool = True,
                 seed: int = 0) -> None:
        self.gate = gate
        self.bounded = bounded
        self._random = random.Random(seed)
        self.explored = 0  # kept requests the gate's exploration sent to the best

    def _keeps(self, kept: Scored, best: Scored) -> bool:
        if self.gate.keeps(kept, best, self._random.random):
            return True
        if self.gate.keeps(kept, best, lambda: 1.0):
            self.explored += 1
        return False

    def choose(self, request, candidates, router, now) -> RouteDecision:
        within = router.within_load_bound(candidates) if self.bounded else list(candidates)
        scored = score_replicas(router, request, within, self.learned)
        best = min(scored, key=Scored.rank)
        home = router.session_home(request.session_id, within)
        if home is not None and home is not best.view:
            kept = next(row for row in scored if row.view is home)
            if self._keeps(kept, best):
                return RouteDecision(home.replica_id, "session home", kept.cached, kept.ttft)
        # The longest cached prefix is kept in the same way: the next turn of a
        # conversation finds its whole history there only if this one goes there.
        hottest = max(scored, key=lambda row: (row.cached, -row.view.order))
        if hottest.cached > best.cached and self._keeps(hottest, best):
            return RouteDecision(hottest.view.replica_id, f"longest cached prefix "
                                 f"({hottest.cached} tokens)", hottest.cached, hottest.ttft)
        cause = ("session home" if best.view is home else
                 "fewest in flight (no cost model yet)" if best.ttft is None else
                 f"lowest predicted TTFT {best.ttft:.3f} s")
        return RouteDecision(best.view.replica_id, cause, best.cached, best.ttft)


class LearnedTTFTPolicy(PredictedTTFTPolicy):
    """``predicted-ttft`` priced by the TTFT the router learned from the
    first tokens it saw (``carpool.cluster.ttft_model``) once it has
    enough, by the analytic prediction until then."""

    name = "learned-ttft"
    learned = True


@dataclass(frozen=True)
class Scored:
    """A replica priced for one request: the prompt tokens it holds cached
    and the predicted TTFT there (None without a cost model)."""

    view: ReplicaView
    cached: int
    ttft: float | None

    @property
    def seconds(self) -> float:
        return math.inf if self.ttft is None else self.ttft

    def rank(self) -> tuple[float, int, int]:
        """Lowest predicted TTFT, then fewest in flight, then join order."""
        return self.seconds, self.view.in_flight, self.view.order


def score_replicas(router, request: RouteRequest,
                   views: Sequence[ReplicaView], learned: bool = False) -> list[Scored]:
    """Each of ``views`` priced for ``request`` by the fleet prefix index and
    ``Router.predict_ttft`` (the views are each other's cost-model peers).
    With a shared KV tier, the prompt's blocks there beyond a replica's own
    hit cost their load time instead of their prefill (``cached`` stays
    the replica's own hit: what affinity prefers)."""
    depth = router.prefix_index.matches(request.block_hashes)
    tier = router.shared_kv
    shared = tier.count(request.block_hashes) if tier is not None else 0
    scored = []
    for view in views:
        local = depth.get(view.replica_id, 0)
        cached = router.cached_tokens(view, local, request)
        covered = router.cached_tokens(view, max(local, shared), request)
        ttft = router.predict_ttft(view, request.prompt_tokens - covered, views, learned)
        if ttft is not None and covered > cached:
            ttft += tier.load_seconds(-(-(covered - cached) // view.block_size))
        scored.append(Scored(view, cached, ttft))
    return scored


def predict_ttft_on(view: ReplicaView, uncached_tokens: int,
                    cost_model) -> float | None:
    """Seconds until a request with ``uncached_tokens`` to prefill gets its
    first token on ``view``: the router-counted prefill ahead of it and its
    own, beside the replica's decodes, priced by ``cost_model``; plus, when
    every sequence slot is taken, the wait for departures at the replica's
    learned service time. None without a ready cost model."""
    if cost_model is None or not cost_model.ready:
        return None
    # The prefill ahead: the router's own count, or the replica's polled
    # queue where that is more (other fronts sent it requests too).
    ahead = max(view.pending_prefill_tokens, view.waiting_tokens)
    delay = predict_first_token_delay(cost_model, ahead,
                                      max(1, uncached_tokens), view.decoding,
                                      view.max_num_batched_tokens)
    if delay is None:
        return None
    short = max(view.in_flight, view.waiting + view.running) + 1 - view.max_num_seqs
    if short > 0 and view.service_time is not None:
        delay += short * view.service_time / view.max_num_seqs
    return delay


POLICIES = {policy.name: policy for policy in (
    RandomPolicy, RoundRobinPolicy, LeastOutstandingPolicy, ResponseTimePolicy,
    SessionAffinityPolicy, CacheAwarePolicy, ApproximateCacheAwarePolicy, KVCostPolicy,
    PredictedTTFTPolicy, LearnedTTFTPolicy)}

# The default with one part changed, for measuring what each part buys
# (``carpool evaluate routing --policies``); not offered to ``serve``.
ABLATIONS: dict[str, Callable[[int], Policy]] = {
    "predicted-ttft/no-affinity": lambda seed: PredictedTTFTPolicy(NEVER, seed=seed),
    "predicted-ttft/no-gate": lambda seed: PredictedTTFTPolicy(ALWAYS, seed=seed),
    "predicted-ttft/no-bound": lambda seed: PredictedTTFTPolicy(bounded=False, seed=seed),
    "learned-ttft/explore": lambda seed: LearnedTTFTPolicy(
        AffinityGate(explore=EXPLORE_SHARE), seed=seed),
}


def make_policy(name: str, seed: int = 0) -> Policy:
    """A fresh policy by name (``POLICIES``, or one of ``ABLATIONS``);
    ``seed`` for ``random`` and the affinity gate's exploration."""
    if name in ABLATIONS:
        return ABLATIONS[name](seed)
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; one of {', '.join(POLICIES)}")
    if name == "random":
        return RandomPolicy(seed)
    if issubclass(POLICIES[name], PredictedTTFTPolicy):
        return POLICIES[name](seed=seed)
    return POLICIES[name]()
