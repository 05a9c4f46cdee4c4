"""Engine counters and the point-in-time snapshot that metrics read.

The engine thread mutates ``EngineCounters``; other threads (the HTTP
server, the status line) only ever read an ``EngineStats`` snapshot, which
is built whole and then published by a single reference assignment.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
    busy_seconds: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason

    def copy(self) -> "EngineCounters":
        return EngineCounters(**{**self.__dict__, "finished": dict(self.finished)})


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

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_num_blocks if self.kv_num_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
