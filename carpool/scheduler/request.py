"""The scheduler's view of one request. Pure Python."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # admitted, its KV loading from an external store (kv_connector)
    PREEMPTED = "preempted"  # waiting again; its KV must be recomputed
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context limit
    FINISHED_ABORTED = "abort"
    FINISHED_REJECTED = "rejected"  # expired in the queue; see ``reject_reason``

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_REJECTED}


@dataclass(eq=False)
class Request:
    """Token state of one request.

    Invariant: ``token_ids`` = prompt followed by outputs, and the KV of
    ``token_ids[:num_computed_tokens]`` is in the request's blocks. A running
    request has ``num_computed_tokens < num_tokens`` when it is scheduled:
    the gap is either a prefill chunk or the one token sampled last step.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    priority: int = 0  # lower value = more important (vLLM's convention)
    # Opaque to the scheduler: the engine keeps sampling params, detokenizer...
    payload: Any = None
    # Requests sharing a session run in arrival order and keep their prefix cached.
    session_id: str | None = None
    # Clock time by which the request must first be scheduled; None = no deadline.
    deadline: float | None = None
    # Its prompt was computed by a prefill replica and its KV comes over the
    # KV connector: it queues ahead of the replica's own prefills (FIFO among
    # handoffs; see LaneQueue), since it did its queueing in the prefill pool
    # and behind this replica's prefills it would queue twice.
    kv_handoff: bool = False
    # Going on after output tokens another replica streamed before it died
    # (a resume): admitted once already, so admission does not turn it away
    # and it queues first, as a preempted request does.
    resumed: bool = False
    # The prefill part of such a split: its prompt blocks go to the decode
    # replica through the KV connector, whatever else that connector drops.
    kv_export: bool = False
    # Either part's handoff key (``wire.Handoff.parts_key``): its layer
    # parts' store keys mix it in, so they are this request's alone.
    handoff_key: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit on first admission, loaded ones included
    num_loaded_tokens: int = 0  # of those, loaded from an external store (kv_connector)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Chained hashes of the full blocks of token_ids, filled lazily by the KV
    # manager, and each block's prefix-cache key (parent hash and tokens, as bytes).
    block_hashes: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    first_scheduled_time: float | None = None
    reject_reason: str | None = None  # "deadline" or "queue_timeout" once rejected
    first_token_time: float | None = None  # clock times of the first and latest sampled token
    last_token_time: float | None = None
    predicted_ttft: float | None = None  # admission's estimate, to learn its error
    # Clock time by which admission promised the first token (arrival plus
    # the TTFT allowance; adaptive controller only): an arrival that would
    # share its step and push it later is turned away instead.
    first_token_due: float | None = None
    # The live sequence limit when admission accepted it (adaptive controller):
    # its first token was promised at that many slots, so a later cut of the
    # limit does not hold it back (it would break the promise for TPOT's sake).
    slot_limit: int | None = None
    # The first step (``Scheduler.steps_built`` numbering) it may start in:
    # admission defers an arrival whose prompt would make the first tokens of
    # its step mates late (``AdmissionControl._check_shared_step``).
    earliest_step: int = 0
    # Per-request cap on the request-level batching wait (seconds); None = the knob's.
    max_wait: float | None = None
    # Prefix-cache namespace: blocks are reused only between requests with an
    # equal salt (it seeds the first block's chain hash). None = the common one.
    cache_salt: str | None = None
    # Sampling one of these ends it (FINISHED_STOPPED): EOS unless the client
    # ignores it, and its stop token ids. The engine core checks them.
    stop_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        # Tokens (prompt and output) at which max_tokens is reached.
        self.max_num_tokens = len(self.prompt_token_ids) + self.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_output(self, token_id: int) -> None:
        self.token_ids.append(token_id)
