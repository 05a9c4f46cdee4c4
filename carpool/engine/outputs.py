"""What the engine hands back for a request, step by step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob)


@dataclass
class RequestOutput:
    """Progress of one request after a step.

    ``delta_*`` fields hold what is new since the previous output of this
    request; ``text`` and ``token_ids`` are cumulative. ``finish_reason`` is
    ``stop``, ``length``, ``abort`` or ``rejected`` once ``finished``; a
    rejected request (it waited past its deadline or queue timeout) names
    why in ``reject_reason`` and never produced a token.
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that matched
    logprobs: list[TokenLogprob] | None = None  # cumulative, when requested
    delta_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    reject_reason: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
