"""The one interface a front engine offers, and the prologue every front shares.

A *front engine* is what the HTTP server drives: one ``LLMEngine`` on a
thread (``AsyncEngine``), one engine worker process (``EngineClient``), a
fleet of worker processes behind carpool's router (``fleet.local.FleetEngine``),
prefill/decode pools (``fleet.pd.PDFleet``), or Ray Serve replicas
(``ray_serve.engine.RayEngine``). They differ in where the engine runs,
not in what they offer, which ``FrontEngine`` writes down; the server
never asks a front what it is. ``tests/test_front_engine.py`` checks that
each implements every member with a compatible signature.

``RequestIntake`` is the ``add_request`` prologue they share: refuse when
the front is dead or stopping, name the request, refuse a duplicate id,
tokenize a text prompt.
"""
from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any, Protocol

from carpool.engine.stats import EngineStats
from carpool.engine.step_log import StepLog
from carpool.engine.streams import EngineDeadError, RequestStream
from carpool.engine.wire import EngineInfo
from carpool.sampling_params import SamplingParams
from carpool.scheduler.pinned_prefixes import PinSpec


class ContextLengthError(ValueError):
    """Prompt plus max_tokens exceed the model's context length."""


def check_prompt(token_ids: list[int], params: SamplingParams, max_model_len: int,
                 vocab_size: int) -> None:
    """``ValueError`` (``ContextLengthError`` for the length) unless the
    prompt can run in a ``max_model_len`` context of a ``vocab_size`` model;
    pure, so callers may check every prompt of a call before queueing any."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    total = len(token_ids) + params.max_tokens
    if total > max_model_len:  # first: it is O(1), the id range check is not
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens; the request "
            f"asks for {total} ({len(token_ids)} in the prompt + {params.max_tokens} max_tokens)")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")


class FrontEngine(Protocol):
    """What the server drives, whatever runs the engine.

    Requests: ``add_request`` queues one and returns its ``RequestStream``
    (``ValueError`` for bad input, ``RejectedError`` when admission turns
    it away, ``EngineDeadError`` when nothing can serve it); ``abort`` ends
    one from the event loop, ``abort_without_lock`` from any thread (a
    stream's finalizer). State: ``stats`` (merged over replicas),
    ``replica_stats()`` (per replica; one engine: empty), ``routing()``
    (the router's view and recent decisions; one engine: empty),
    ``degraded`` (why a fleet runs below its size, else None). Pinned
    prefixes: ``pin_prefix`` / ``unpin_prefix`` / ``pinned_prefixes``.
    Drain: stop taking requests with ``shutdown()``, then ``wait_closed``.
    """

    info: EngineInfo
    tokenizer: Any
    step_log: StepLog
    on_failure: Callable[[BaseException], None] | None

    @property
    def stats(self) -> EngineStats: ...

    @property
    def is_alive(self) -> bool: ...

    @property
    def degraded(self) -> str | None: ...

    @property
    def last_progress(self) -> float: ...

    @property
    def num_in_flight(self) -> int: ...

    def check_prompt(self, token_ids: list[int], params: SamplingParams) -> None: ...

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0,
                          session_id: str | None = None, deadline: float | None = None,
                          max_wait: float | None = None, cache_salt: str | None = None,
                          received_at: float | None = None) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    def abort_without_lock(self, request_id: str) -> None: ...

    def first_token_seen(self, first_token_time: float) -> None: ...

    async def pin_prefix(self, spec: PinSpec) -> tuple[PinSpec, bool]: ...

    def unpin_prefix(self, pin_id: str) -> bool: ...

    def pinned_prefixes(self) -> list[PinSpec]: ...

    def replica_stats(self) -> dict[str, EngineStats]: ...

    def routing(self) -> dict: ...

    def shutdown(self) -> None: ...

    async def wait_closed(self, timeout: float = 10.0) -> None: ...


class RequestIntake:
    """The ``add_request`` prologue of every front (one place for it).

    A front sets ``tokenizer``; ``error`` once its engine failed and
    ``_stopping`` once shut down; ``_new_request_id`` names requests
    without an id (``req-1``, ``req-2``... per front unless overridden)."""

    tokenizer: Any
    info: EngineInfo
    error: BaseException | None = None
    _stopping = False
    _next_id = 0

    def _new_request_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    def check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        """``ValueError`` unless the prompt fits this front's engines (``check_prompt``)."""
        check_prompt(token_ids, params, self.info.max_model_len, self.info.vocab_size)

    def _intake(self, prompt: str | Sequence[int], params: SamplingParams | None,
                request_id: str | None, live: Container[str]
                ) -> tuple[str, list[int], SamplingParams]:
        """(the request id, the prompt's token ids, the params); raises
        ``EngineDeadError`` when this front cannot take requests and
        ``ValueError`` for an id ``live`` holds already."""
        if self.error is not None:
            raise EngineDeadError(f"engine loop failed: {self.error!r}")
        if self._stopping:
            raise EngineDeadError("the engine is shut down")
        if request_id is None:
            request_id = self._new_request_id()
        if request_id in live:
            raise ValueError(f"duplicate request id {request_id!r}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        return request_id, ids, params or SamplingParams()
