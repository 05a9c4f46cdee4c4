"""What the engine hands back for a request, step by step."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob)


# The fields of a RequestOutput, in constructor order.
_FIELDS = ("request_id", "prompt_token_ids", "text", "token_ids", "delta_text",
           "delta_token_ids", "finished", "finish_reason", "stop_reason", "logprobs",
           "delta_logprobs", "num_cached_tokens", "arrival_time", "first_scheduled_time",
           "first_token_time", "finish_time", "reject_reason")


class RequestOutput:
    """Progress of one request after a step.

    ``delta_*`` fields hold what is new since the previous output of this
    request; ``text`` and ``token_ids`` are cumulative. ``finish_reason`` is
    ``stop``, ``length``, ``abort`` or ``rejected`` once ``finished``; a
    rejected request (it waited past its deadline or queue timeout) names
    why in ``reject_reason`` and never produced a token.

    A plain slotted class rather than a dataclass: the engine makes one per
    running request per step, so it is built positionally, and the
    cumulative ``token_ids`` (O(output length) to copy) is copied only when
    read (``of_request``): from the request's own token list, whose first
    ``stop`` entries never change once written.
    """

    __slots__ = (*(name for name in _FIELDS if name not in ("token_ids", "text")),
                 "_token_ids", "_source", "_start", "_stop", "_text", "_text_parts",
                 "_text_count")

    def __init__(self, request_id: str, prompt_token_ids: list[int], text: str,
                 token_ids: list[int], delta_text: str, delta_token_ids: list[int],
                 finished: bool = False, finish_reason: str | None = None,
                 stop_reason: str | int | None = None,
                 logprobs: list[TokenLogprob] | None = None,
                 delta_logprobs: list[TokenLogprob] | None = None,
                 num_cached_tokens: int = 0, arrival_time: float = 0.0,
                 first_scheduled_time: float | None = None,
                 first_token_time: float | None = None, finish_time: float | None = None,
                 reject_reason: str | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._text: str | None = text
        self._text_parts: list[str] = []
        self._text_count = 0
        self._token_ids: list[int] | None = token_ids
        self._source: Sequence[int] = ()
        self._start = self._stop = 0
        self.delta_text = delta_text
        self.delta_token_ids = delta_token_ids
        self.finished = finished
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason  # the stop string or token id that matched
        self.logprobs = logprobs  # cumulative, when requested
        self.delta_logprobs = delta_logprobs
        self.num_cached_tokens = num_cached_tokens
        self.arrival_time = arrival_time
        self.first_scheduled_time = first_scheduled_time
        self.first_token_time = first_token_time
        self.finish_time = finish_time
        self.reject_reason = reject_reason

    @classmethod
    def of_request(cls, request_id: str, prompt_token_ids: list[int], text_parts: list[str],
                   all_token_ids: Sequence[int], delta_text: str, delta_token_ids: list[int],
                   finished: bool, stop_reason: str | int | None,
                   logprobs: list[TokenLogprob] | None,
                   delta_logprobs: list[TokenLogprob] | None, num_cached_tokens: int,
                   arrival_time: float, first_scheduled_time: float | None,
                   first_token_time: float | None) -> RequestOutput:
        """An unfinished-reason output whose ``token_ids`` is
        ``all_token_ids[len(prompt_token_ids):]`` as it is now, copied when
        first read: ``all_token_ids`` may grow later (the request's live
        list) but its entries so far must not change. Its ``text`` is
        ``"".join(text_parts)`` as it is now, joined when first read, with
        the same rule for ``text_parts``: no per-step copy of everything
        generated so far (quadratic in the output's length). Sets the
        slots directly: the engine calls it for every running request every
        step."""
        self = object.__new__(cls)
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._text = None
        self._text_parts = text_parts
        self._text_count = len(text_parts)
        self._token_ids = None
        self._source = all_token_ids
        self._start = len(prompt_token_ids)
        self._stop = len(all_token_ids)
        self.delta_text = delta_text
        self.delta_token_ids = delta_token_ids
        self.finished = finished
        self.finish_reason = None
        self.stop_reason = stop_reason
        self.logprobs = logprobs
        self.delta_logprobs = delta_logprobs
        self.num_cached_tokens = num_cached_tokens
        self.arrival_time = arrival_time
        self.first_scheduled_time = first_scheduled_time
        self.first_token_time = first_token_time
        self.finish_time = None
        self.reject_reason = None
        return self

    @property
    def text(self) -> str:
        """The output's text so far (cumulative)."""
        if self._text is None:
            parts, count = self._text_parts, self._text_count
            self._text = parts[0] if count == 1 else "".join(parts[:count])
            self._text_parts = []
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text, self._text_parts = value, []

    @property
    def token_ids(self) -> list[int]:
        """The output's token ids so far (cumulative)."""
        if self._token_ids is None:
            ids = self._source[self._start:self._stop]
            self._token_ids = ids if isinstance(ids, list) else list(ids)
            self._source = ()
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids, self._source = value, ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        if self._token_ids is None:
            return self._stop - self._start
        return len(self._token_ids)

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in _FIELDS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RequestOutput):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass was

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in zip(_FIELDS, self._values()))
        return f"RequestOutput({fields})"
