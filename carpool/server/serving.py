"""Turn API requests into engine requests and engine outputs into responses.

One API call becomes ``len(prompts) * n`` engine requests ("choices"),
choice ``p * n + i`` being sample ``i`` of prompt ``p``. A streaming call
waits for its first output before sending headers, so a request rejected
while queued still gets a proper 429 instead of a broken stream.

Invariant: every engine request a call creates ends when the call does —
finished, or aborted at once when the call fails part-way (one choice
refused), is cancelled (the client left) or its response is abandoned.
Every prompt of a call is checked before any choice is queued.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.responses import JSONResponse, StreamingResponse

from carpool.engine.front import ContextLengthError, FrontEngine
from carpool.engine.outputs import RequestOutput
from carpool.engine.streams import EngineDeadError, RequestStream
from carpool.model.grammar import GrammarCompiler
from carpool.sampling_params import SamplingParams
from carpool.scheduler import RejectedError
from carpool.scheduler.control.overload import OverloadGuard
from carpool.server.auth import ANONYMOUS, Principal
from carpool.server.chat_output import ChatPlan, ChatShape, plan_chat
from carpool.server.config import ServerConfig
from carpool.server.errors import APIError, bad_request
from carpool.server.metrics import Metrics, RequestTracker
from carpool.server.prepare import (
    Extensions,
    PrepPool,
    chat_tokens,
    check_chars,
    encode_text,
    extensions,
)
from carpool.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
)
from carpool.server.response_cache import ResponseCache, cache_key, is_deterministic
from carpool.server.responses import SSE_DONE, ResponseBuilder, sse, usage_of
from carpool.structured_output import StructuredOutput

# The emergency switch's step that answers from the response cache.
RESPONSE_CACHE_STAGE = OverloadGuard.STAGES.index("response_cache")
_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: distinct seeds for the n samples of one seed


@dataclass
class ServerContext:
    """What every route needs; one per server (no module globals)."""

    engine: FrontEngine  # one engine (a thread, a worker process) or a fleet of them
    tokenizer: Any
    model_name: str
    max_model_len: int
    config: ServerConfig
    metrics: Metrics
    draining: bool = False
    started_at: float = dataclasses.field(default_factory=time.time)
    prep: PrepPool | None = None  # defaults to config.prep_workers threads

    def __post_init__(self) -> None:
        if self.prep is None:
            self.prep = PrepPool(self.config.prep_workers)
        self._grammars: GrammarCompiler | None = None
        self.response_cache = ResponseCache(self.config.response_cache_entries,
                                            self.config.response_cache_bytes,
                                            self.config.response_cache_ttl)
        # The metrics take this server's prefix and read what only the engine knows.
        self.metrics.prefix = self.config.metrics_prefix
        info = self.engine.info
        self.metrics.bind_engine(self.engine.step_log, info.cache_info, info.step_facts)
        self.metrics.replica_stats = self.engine.replica_stats  # a fleet's: one series each

    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler here, to refuse (400) what the engine
        could not compile; the engine compiles its own (cached by spec)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.engine.info.vocab_size)
        return self._grammars

    @property
    def max_prompt_chars(self) -> int:
        return self.config.prompt_chars_cap(self.max_model_len)


@dataclass
class _Call:
    """One generation call, prepared (in a worker thread) and ready to queue."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    builder: ResponseBuilder


class OpenAIServing:
    """The two generation endpoints, sharing one request pipeline."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    # -- request -> engine inputs (worker threads) -----------------------------------

    def _check_common(self, body: _SamplingFields) -> None:
        cfg = self.ctx.config
        if body.model is not None and body.model != self.ctx.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{self.ctx.model_name!r}", code="model_not_found", param="model")
        if body.n > cfg.max_n:
            raise bad_request(f"n must be <= {cfg.max_n}, got {body.n}", "n")
        if len(body.stop_list()) > cfg.max_stop:
            raise bad_request(f"at most {cfg.max_stop} stop strings", "stop")

    def _sampling(self, body: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                  prompt: list[int], structured: StructuredOutput | None = None,
                  ) -> SamplingParams:
        """The sampling parameters of one prompt, which must fit the context."""
        cfg = self.ctx.config
        if logprobs is not None and logprobs > cfg.max_logprobs:
            raise bad_request(f"logprobs must be <= {cfg.max_logprobs}", "logprobs")
        if max_tokens is None:  # as vLLM: whatever room the context leaves (within the cap)
            max_tokens = max(1, min(self.ctx.max_model_len - len(prompt),
                                    cfg.max_tokens_cap or self.ctx.max_model_len))
        elif cfg.max_tokens_cap is not None and max_tokens > cfg.max_tokens_cap:
            raise bad_request(f"max_tokens must be <= {cfg.max_tokens_cap}", "max_tokens")
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                top_p=body.top_p, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                seed=body.seed, stop=body.stop_list(), stop_token_ids=body.stop_token_ids or [],
                ignore_eos=body.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                structured=structured or body.structured_output())
            self.ctx.engine.check_prompt(prompt, params)
            if params.structured is not None:  # a 400 now for what cannot compile
                self.ctx.grammars().compile(params.structured)
        except ContextLengthError as exc:
            raise APIError(400, str(exc), code="context_length_exceeded") from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        return params

    def _completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if len(prompts) > self.ctx.config.max_prompts:
            raise bad_request(f"at most {self.ctx.config.max_prompts} prompts per request",
                              "prompt")
        check_chars(sum(len(p) for p in prompts if isinstance(p, str)),
                    self.ctx.max_prompt_chars, "prompt")
        return [encode_text(self.ctx.tokenizer, p, raw_prompt=True) if isinstance(p, str)
                else p for p in prompts]

    def prepare_completion(self, body: CompletionRequest) -> _Call:
        self._check_common(body)
        prompts = self._completion_prompts(body)
        params = [self._sampling(body, body.max_tokens, body.logprobs, p) for p in prompts]
        builder = ResponseBuilder("completion", f"cmpl-{uuid.uuid4().hex}", self.ctx.model_name,
                                  self.ctx.tokenizer, body.logprobs)
        return _Call(prompts, params, builder)

    def chat_prompt(self, messages, add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of chat messages (and tools), within the server's limits."""
        if len(messages) > self.ctx.config.max_messages:
            raise bad_request(f"at most {self.ctx.config.max_messages} messages", "messages")
        check_chars(sum(len(m.text()) for m in messages), self.ctx.max_prompt_chars,
                    "messages")
        return chat_tokens(self.ctx.tokenizer, messages, add_generation_prompt,
                           self.ctx.config.special_tokens_in_content, tools, template_kwargs)

    def _chat_plan(self, body: ChatCompletionRequest) -> ChatPlan:
        cfg = self.ctx.config
        try:
            plan = plan_chat(body.tools, body.tool_choice, cfg.tool_call_parser,
                             cfg.enable_auto_tool_choice, cfg.reasoning_parser)
        except ValueError as exc:
            field = "tool_choice" if "tool_choice" in str(exc) else "tools"
            raise bad_request(str(exc), field) from None
        if plan.structured is not None and body.structured_output() is not None:
            raise bad_request("a forced tool_choice and a structured output cannot both "
                              "constrain the reply", "tool_choice")
        return plan

    def prepare_chat(self, body: ChatCompletionRequest) -> _Call:
        self._check_common(body)
        plan = self._chat_plan(body)
        prompt = self.chat_prompt(body.messages, body.add_generation_prompt,
                                  plan.template_tools(), body.chat_template_kwargs)
        plan = plan.opened_by(self.ctx.tokenizer.decode(prompt[-8:], False))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = self._sampling(body, max_tokens, logprobs, prompt,
                                plan.constraint(body.structured_output()))
        builder = ResponseBuilder("chat", f"chatcmpl-{uuid.uuid4().hex}", self.ctx.model_name,
                                  self.ctx.tokenizer, logprobs, ChatShape(plan))
        return _Call([prompt], [params], builder)

    # -- endpoints -------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, headers: Mapping[str, str],
                          principal: Principal = ANONYMOUS, received_at: float | None = None):
        """``received_at``: ``time.monotonic()`` when the request came in."""
        received_at = time.monotonic() if received_at is None else received_at
        call = await self.ctx.prep.run(self.prepare_completion, body)
        return await self._generate(body, headers, principal, call, received_at)

    async def chat(self, body: ChatCompletionRequest, headers: Mapping[str, str],
                   principal: Principal = ANONYMOUS, received_at: float | None = None):
        received_at = time.monotonic() if received_at is None else received_at
        call = await self.ctx.prep.run(self.prepare_chat, body)
        return await self._generate(body, headers, principal, call, received_at)

    # -- shared pipeline -----------------------------------------------------------------

    async def _generate(self, body: _SamplingFields, headers: Mapping[str, str],
                        principal: Principal, call: _Call, received_at: float):
        if self.ctx.draining:
            raise APIError(503, "the server is shutting down", code="draining")
        ext = extensions(body, headers, principal)
        builder = call.builder
        key = None
        if not body.stream and is_deterministic(call.params):
            # The tenant, and the client's cache_salt: a client that splits its
            # prefix cache off splits its cached answers off too.
            key = cache_key(f"{principal.tenant}\0{ext.cache_salt or ''}",
                            "chat" if builder.chat else "completions",
                            call.prompts, call.params, body.n)
            cached = self._from_cache(key, builder)
            if cached is not None:
                return JSONResponse(cached)
        streams = await self._start(call.prompts, call.params, body.n, ext, call.builder.id,
                                    received_at)
        trackers = self.ctx.metrics.trackers(len(call.prompts), body.n, received_at)
        merged = _merge(streams, trackers)
        try:
            first = await anext(merged)
            _raise_if_rejected(first[1])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await merged.aclose()
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _stream_events(first, merged, builder, len(streams), body.n, include_usage)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        result = await _collect(first, merged, builder, len(streams), body.n)
        if key is not None:
            self.ctx.response_cache.put(key, result)
        return JSONResponse(result)

    def _from_cache(self, key: str, builder: ResponseBuilder) -> dict[str, Any] | None:
        """A stored answer, only while the emergency switch is at its last
        step (``OverloadGuard.STAGES``): otherwise the engine answers."""
        if self.ctx.metrics.engine_stats().degrade_stage < RESPONSE_CACHE_STAGE:
            return None
        cached = self.ctx.response_cache.get(key, builder.id)
        if cached is not None:
            self.ctx.metrics.response_cache_hits.labels(
                self.ctx.model_name, "chat" if builder.chat else "completions").inc()
        return cached

    async def _start(self, prompts: list[list[int]], params: list[SamplingParams], n: int,
                     ext: Extensions, base_id: str, received_at: float | None = None,
                     ) -> list[RequestStream]:
        """Queue every choice; if one is refused (or this is cancelled), abort
        those already queued before raising."""
        jobs = []
        for p, (prompt, sampling) in enumerate(zip(prompts, params)):
            for i in range(n):
                choice = sampling
                if sampling.seed is not None and i:
                    seed = (sampling.seed + i * _SEED_STRIDE) % 2**63
                    choice = dataclasses.replace(sampling, seed=seed)
                # One API call is one turn of its session: only its first choice
                # carries the session id, so n samples are not serialized.
                session_id = ext.session_id if p == i == 0 else None
                jobs.append(self.ctx.engine.add_request(
                    prompt, choice, request_id=f"{base_id}-{p * n + i}", priority=ext.priority,
                    session_id=session_id, deadline=ext.deadline, max_wait=ext.max_wait,
                    cache_salt=ext.cache_salt, received_at=received_at))
        # Each add aborts its own request if cancelled while being accepted.
        results = await asyncio.gather(*jobs, return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is None:
            return list(results)
        for result in results:
            if isinstance(result, RequestStream):
                await result.aclose()
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # cancellation
        for result in results:
            if isinstance(result, RejectedError):
                self.ctx.metrics.outcome(f"rejected:{result.reason}")
        raise _api_error(failure)


def _api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RejectedError):
        retry = max(1, int(exc.retry_after + 0.999))
        return APIError(429, str(exc), code=exc.reason, headers={"Retry-After": str(retry)})
    if isinstance(exc, EngineDeadError):  # a fleet restarts its dead workers meanwhile
        return APIError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), code="invalid_value")
    raise exc


def _raise_if_rejected(output: RequestOutput) -> None:
    if output.finish_reason == "rejected":
        reason = output.reject_reason or "rejected"
        raise APIError(429, f"the request was not scheduled in time ({reason})", code=reason,
                       headers={"Retry-After": "1"})


async def _merge(streams: list[RequestStream],
                 trackers: list[RequestTracker]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the choices' outputs as they come; closing this aborts the rest."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for output in streams[index]:
                trackers[index].observe(output)
                await queue.put((index, output))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    live = len(streams)
    try:
        while live:
            index, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                for tracker in trackers:
                    tracker.close("error")
                raise _api_error(item)
            else:
                yield index, item
    finally:
        # Cancelling a pump aborts its engine request (the stream's own cleanup).
        for task in tasks:
            task.cancel()
        for tracker in trackers:
            tracker.close("abort")
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams:  # a pump cancelled before it started never read its stream
                await stream.aclose()


async def _collect(first: tuple[int, RequestOutput], merged, builder: ResponseBuilder,
                   num_choices: int, n: int) -> dict[str, Any]:
    finals: list[RequestOutput | None] = [None] * num_choices
    item = first
    try:
        while True:
            index, output = item
            _raise_if_rejected(output)
            if output.finished:
                finals[index] = output
            try:
                item = await anext(merged)
            except StopAsyncIteration:
                break
    finally:
        with anyio.CancelScope(shield=True):
            await merged.aclose()
    return builder.final(finals, n)


async def _stream_events(first: tuple[int, RequestOutput], merged, builder: ResponseBuilder,
                         num_choices: int, n: int, include_usage: bool) -> AsyncIterator[str]:
    finals: list[RequestOutput | None] = [None] * num_choices
    try:
        if builder.chat:
            for index in range(num_choices):
                yield sse(builder.role_chunk(index))
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            index, output = item
            _raise_if_rejected(output)
            if output.finished:
                finals[index] = output
            if output.delta_text or output.finished or output.delta_logprobs:
                for chunk in builder.chunks(index, output):
                    yield sse(chunk)
            item = await anext(merged, None)
        if include_usage:
            yield sse(builder.usage_chunk(usage_of(finals, n)))
        yield SSE_DONE
    except APIError as exc:  # headers are gone: the error is the stream's last event
        yield exc.sse_event()
        yield SSE_DONE
    finally:
        # Starlette cancels this generator's scope when the client leaves;
        # shielded, the cleanup (aborting the choices) still runs to the end.
        with anyio.CancelScope(shield=True):
            await merged.aclose()
