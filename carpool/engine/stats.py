"""Engine counters and the point-in-time snapshot that metrics read.

The engine thread mutates ``EngineCounters``; other threads (the HTTP
server, the status line) only ever read an ``EngineStats`` snapshot, which
is built whole (``engine_stats``) and then published by a single
reference assignment.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from carpool.config import SchedulerConfig
from carpool.scheduler import Scheduler
from carpool.scheduler.pinned_prefixes import PinStats

# Prompts longer than this count as "long" in the share-of-long-requests metric.
LONG_PROMPT_TOKENS = 512


@dataclass
class EngineCounters:
    """Cumulative counters since start (for metrics and benchmarks)."""

    steps: int = 0
    requests_added: int = 0
    long_requests_added: int = 0  # prompts over LONG_PROMPT_TOKENS
    prompt_tokens: int = 0  # prompt tokens of finished requests
    generation_tokens: int = 0
    computed_tokens: int = 0  # real tokens run through the model, recomputation included
    # Token slots the model computed, padding included; equals computed_tokens
    # under continuous batching, which never pads.
    slot_tokens: int = 0
    # Occupancy under continuous batching, summed over steps: the live step
    # token budget (``max_num_batched_tokens``) and sequence slots
    # (``max_num_seqs``) each step was offered, and the sequences holding a
    # slot in it (running or loading). ``computed_tokens / budget_tokens`` is
    # the token budget's fill, ``slot_seqs / seq_slots`` the slots'.
    budget_tokens: int = 0
    seq_slots: int = 0
    slot_seqs: int = 0
    busy_seconds: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason

    def copy(self) -> "EngineCounters":
        return EngineCounters(**{**self.__dict__, "finished": dict(self.finished)})

    def count_offer(self, offer: "StepOffer") -> None:
        """Add one step's offered token budget and slots, and its slot holders."""
        self.budget_tokens += offer.budget_tokens
        self.seq_slots += offer.seq_slots
        self.slot_seqs += offer.slot_seqs


@dataclass(frozen=True)
class StepOffer:
    """What one step was offered: the live step token budget and sequence
    slots it was scheduled under, and the sequences holding a slot in it."""

    budget_tokens: int
    seq_slots: int
    slot_seqs: int

    @classmethod
    def of(cls, scheduler: Scheduler) -> "StepOffer":
        """Read after the scheduler picked the step (the knobs it used)."""
        knobs = scheduler.knobs
        return cls(knobs.max_num_batched_tokens, knobs.max_num_seqs,
                   len(scheduler.running) + len(scheduler.loading))


@dataclass(frozen=True)
class EngineStats:
    """One consistent view of the engine, taken between two steps."""

    time: float  # engine clock
    num_running: int
    num_waiting: int
    waiting_tokens: int
    kv_num_blocks: int
    kv_used_blocks: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    counters: EngineCounters
    rejections: dict[str, int]
    sessions: dict[str, int]
    knobs: dict[str, float]
    batching: str = "continuous"
    mode: str = "fixed"  # the adaptive controller's mode once it exists
    num_priority_preemptions: int = 0
    batches: int = 0  # request-level batches formed (static / dynamic batching)
    # Adaptive controller: decisions so far by (knob, reason), and the latest ones.
    decision_counts: dict[tuple[str, str], int] = field(default_factory=dict)
    recent_decisions: tuple[dict, ...] = ()
    # Whether the adaptive controller runs, and the latency targets the
    # engine serves (``carpool.slo.ServingSLO.as_dict``; None outside serve).
    adaptive: bool = False
    slo: dict | None = None
    # What admission predicts with: the online step-cost fit (seconds per
    # step, per token, per sequence; None until fitted) and the factor its
    # learned TTFT error adds to predictions (1 = none).
    predictions: dict | None = None
    # The shared KV store's counters and transfer-time histograms
    # (``StoreConnector.metrics``); empty without a store.
    kv_store: dict = field(default_factory=dict)
    # Arrivals that reached admission, admitted or rejected for any reason.
    arrivals: int = 0
    # Of them, arrivals admission started a step later than it could have,
    # so as not to make the first tokens of that step's requests late.
    deferred_arrivals: int = 0
    # The emergency switch's depth (``OverloadGuard.STAGES``; 0: normal).
    degrade_stage: int = 0
    # Pinned prefixes' counters (``scheduler.pinned_prefixes``), by pin id,
    # and the first admissions checked against them (the hit rate's base).
    pinned: tuple[PinStats, ...] = ()
    pinned_lookups: int = 0
    # Mixture-of-experts models (``carpool.executor.expert_load``): the
    # (token, expert) pairs each expert took, over MoE layers and steps,
    # and the busiest expert over the mean per expert (last step; mean).
    expert_tokens: tuple[int, ...] = ()
    # Expert parallel: the (token, expert) pairs each rank's experts took.
    expert_rank_tokens: tuple[int, ...] = ()
    # Expert parallel with a capacity: the rows past it, by the rank that
    # dropped them (computed by nobody: they add nothing to their tokens).
    expert_rank_dropped: tuple[int, ...] = ()
    expert_imbalance: float = 0.0
    expert_imbalance_mean: float = 0.0
    # A fleet's requests whose worker died: sent again to another before any
    # output reached the caller, or resumed there after the tokens that did.
    requests_rerouted: int = 0
    requests_resumed: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_num_blocks if self.kv_num_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


def _predictions(scheduler) -> dict:
    """The step-cost fit and TTFT error factor admission predicts with."""
    admission = scheduler.admission
    coef = admission.cost_model.coefficients
    cost = None if coef is None else dict(zip(("fixed_s", "per_token_s", "per_seq_s"), coef))
    return {"step_cost": cost,
            "ttft_error_factor": admission.prediction_error.factor(scheduler.clock()),
            "first_token_delivery_s": admission.delivery_lag}


def _knobs(scheduler: Scheduler) -> dict[str, float]:
    """The scheduler knobs exported as metrics (numbers only; None is left out):
    the live values where the adaptive controller moves them."""
    config = scheduler.config
    live = scheduler.knobs.as_dict()
    names = ["max_queue_requests", "long_prompt_threshold", "long_prefill_share",
             "aging_interval"]
    values = {name: getattr(config, name) for name in names}
    values.update({name: live.get(name) for name in ("max_num_seqs", "max_num_batched_tokens")})
    if _batching(scheduler) != "continuous":
        values.update({name: live.get(name) for name in
                       ("preferred_batch_size", "max_batch_size", "max_wait")})
    if scheduler.controller is not None:
        values["controller_alpha"] = scheduler.controller.alpha
        values["controller_latency_correction"] = scheduler.controller.correction.factor
    return {name: float(value) for name, value in values.items() if value is not None}


def _batching(scheduler: Scheduler) -> str:
    """The regime batches form under now: the emergency switch and schedule
    windows change it while the configured one stays (``set_batching``)."""
    return scheduler.gate.regime if scheduler.gate is not None else "continuous"


def _mode(scheduler: Scheduler) -> str:
    """fixed, the adaptive controller's mode, or degraded (emergency switch)."""
    if scheduler.overload is not None and scheduler.overload.degraded:
        return "degraded"
    return scheduler.controller.mode if scheduler.controller is not None else "fixed"


def _decisions(scheduler: Scheduler, latest: int = 20) -> dict:
    controller = scheduler.controller
    if controller is None:
        return {}
    recent = list(controller.decisions)[-latest:]
    return {"decision_counts": dict(controller.decision_counts),
            "recent_decisions": tuple(
                {"time": d.time, "knob": d.knob, "old": d.old, "new": d.new,
                 "reason": d.reason, "decision": d.describe()} for d in recent)}


def engine_stats(scheduler: Scheduler, counters: EngineCounters, now: float,
                 config: SchedulerConfig, slo=None, kv_store: dict | None = None) -> EngineStats:
    """The engine's snapshot: its scheduler's state, a copy of its counters,
    ``now`` on its clock, the SLO it serves (a ``ServingSLO``) if any.
    ``config`` is the configuration it started with; the batching regime is
    read live from the scheduler."""
    kv = scheduler.kv.stats()
    return EngineStats(
        time=now, num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        waiting_tokens=sum(r.num_pending_tokens for r in scheduler.waiting),
        kv_num_blocks=kv.num_blocks, kv_used_blocks=kv.used_blocks,
        prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits,
        num_preemptions=scheduler.num_preemptions, counters=counters.copy(),
        rejections=dict(scheduler.rejections),
        sessions=dict(scheduler.session_stats().__dict__),
        knobs=_knobs(scheduler), batching=_batching(scheduler), mode=_mode(scheduler),
        num_priority_preemptions=scheduler.num_priority_preemptions,
        batches=scheduler.gate_stats.batches,
        adaptive=scheduler.controller is not None,
        slo=slo.as_dict() if slo is not None else None,
        predictions=_predictions(scheduler), kv_store=kv_store or {},
        arrivals=scheduler.admission.arrivals, deferred_arrivals=scheduler.admission.deferred,
        degrade_stage=scheduler.overload.stage if scheduler.overload is not None else 0,
        pinned=scheduler.pins.stats(), pinned_lookups=scheduler.pins.lookups,
        **_decisions(scheduler))


def _summed(dicts) -> dict:
    total: dict = {}
    for values in dicts:
        for key, value in values.items():
            total[key] = total.get(key, 0) + value
    return total


def merge_stats(snapshots: list[EngineStats]) -> EngineStats:
    """One view of several engines (a fleet's replicas): counts and
    counters summed, the first snapshot's settings (knobs, mode, SLO,
    predictions: every replica runs one configuration), its latest time."""
    first = snapshots[0]
    if len(snapshots) == 1:
        return first
    counters = EngineCounters()
    for snapshot in snapshots:
        c = snapshot.counters
        for name in ("steps", "requests_added", "long_requests_added", "prompt_tokens",
                     "generation_tokens", "computed_tokens", "slot_tokens", "budget_tokens",
                     "seq_slots", "slot_seqs", "busy_seconds"):
            setattr(counters, name, getattr(counters, name) + getattr(c, name))
    counters.finished = _summed(s.counters.finished for s in snapshots)
    summed = {name: sum(getattr(s, name) for s in snapshots) for name in (
        "num_running", "num_waiting", "waiting_tokens", "kv_num_blocks", "kv_used_blocks",
        "prefix_queries", "prefix_hits", "num_preemptions", "num_priority_preemptions",
        "batches", "arrivals", "deferred_arrivals", "pinned_lookups", "requests_rerouted",
        "requests_resumed")}
    return dataclasses.replace(
        first, time=max(s.time for s in snapshots), counters=counters,
        rejections=_summed(s.rejections for s in snapshots),
        sessions=_summed(s.sessions for s in snapshots),
        decision_counts=_summed(s.decision_counts for s in snapshots),
        kv_store=_summed_store(s.kv_store for s in snapshots),
        degrade_stage=max(s.degrade_stage for s in snapshots),
        pinned=merge_pin_stats(s.pinned for s in snapshots),
        expert_tokens=_summed_experts(s.expert_tokens for s in snapshots),
        expert_rank_tokens=_summed_experts(s.expert_rank_tokens for s in snapshots),
        expert_rank_dropped=_summed_experts(s.expert_rank_dropped for s in snapshots),
        expert_imbalance=max(s.expert_imbalance for s in snapshots),
        expert_imbalance_mean=max(s.expert_imbalance_mean for s in snapshots), **summed)


def retired_stats(stats: EngineStats) -> EngineStats:
    """What an engine that left a fleet (dead, or scaled down) still adds
    to the fleet's totals: its cumulative counters, its point-in-time values
    (queues, KV blocks, live sessions, pinned blocks, stage) at zero. A
    fleet merges these so its summed counters never go backwards when a
    worker restarts from zero (a rate over them would turn negative)."""
    return dataclasses.replace(
        stats, num_running=0, num_waiting=0, waiting_tokens=0, kv_num_blocks=0,
        kv_used_blocks=0, degrade_stage=0, expert_imbalance=0.0, expert_imbalance_mean=0.0,
        sessions={**stats.sessions, "active_sessions": 0, "protected_blocks": 0},
        pinned=tuple(dataclasses.replace(p, blocks=0) for p in stats.pinned))


def _summed_experts(groups) -> tuple[int, ...]:  # noqa: ANN001
    """Replicas' expert token counts, expert by expert (replicas of one model)."""
    groups = [g for g in groups if g]
    return tuple(sum(column) for column in zip(*groups)) if groups else ()


def merge_pin_stats(groups) -> tuple[PinStats, ...]:
    """Several engines' pin counters, summed by pin id (a fleet's replicas')."""
    total: dict[str, PinStats] = {}
    for stats in groups:
        for s in stats:
            old = total.get(s.pin_id)
            total[s.pin_id] = s if old is None else PinStats(
                s.pin_id, s.name, old.blocks + s.blocks, old.hits + s.hits,
                old.hit_tokens + s.hit_tokens)
    return tuple(total[k] for k in sorted(total))


def _summed_store(stores) -> dict:
    """KV store metrics of several replicas: counters and histogram counts added."""
    total: dict = {}
    for values in stores:
        for key, value in values.items():
            if isinstance(value, list):
                old = total.get(key) or [0] * len(value)
                total[key] = [a + b for a, b in zip(old, value)]
            else:
                total[key] = total.get(key, 0) + value
    return total
