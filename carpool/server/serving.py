"""Turn API requests into engine requests and engine outputs into responses.

One API call becomes ``len(prompts) * n`` engine requests ("choices"),
choice ``p * n + i`` being sample ``i`` of prompt ``p``. A streaming call
waits for its first output before sending headers, so a request rejected
while queued still gets a proper 429 instead of a broken stream.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.responses import JSONResponse, StreamingResponse

from carpool.engine.async_engine import AsyncEngine, EngineDeadError
from carpool.engine.llm_engine import ContextLengthError
from carpool.engine.outputs import RequestOutput
from carpool.sampling_params import SamplingParams
from carpool.scheduler import RejectedError
from carpool.server.config import ServerConfig
from carpool.server.errors import APIError, bad_request
from carpool.server.metrics import Metrics, RequestTracker
from carpool.server.protocol import (PRIORITY_CLASSES, ChatCompletionRequest, ChatMessage,
                                     CompletionRequest, _SamplingFields, template_messages)
from carpool.server.responses import SSE_DONE, ResponseBuilder, sse, usage_of

_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: distinct seeds for the n samples of one seed


@dataclass
class ServerContext:
    """What every route needs; one per server (no module globals)."""

    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    config: ServerConfig
    metrics: Metrics
    draining: bool = False
    started_at: float = dataclasses.field(default_factory=time.time)


@dataclass
class _Extensions:
    priority: int = 0
    session_id: str | None = None
    deadline: float | None = None  # engine clock (monotonic)
    max_wait: float | None = None  # seconds request-level batching may hold it


def _extensions(body: _SamplingFields, headers: Mapping[str, str]) -> _Extensions:
    """carpool's extension fields; the body wins over ``x-*`` headers."""
    priority: Any = body.priority if body.priority is not None else headers.get("x-priority")
    if isinstance(priority, str):
        if re.fullmatch(r"-?[0-9]{1,9}", priority):
            priority = int(priority)
        elif priority in PRIORITY_CLASSES:
            priority = PRIORITY_CLASSES[priority]
        else:
            raise bad_request(f"priority must be an integer or one of "
                              f"{sorted(PRIORITY_CLASSES)}, got {priority[:40]!r}", "priority")
    session_id = body.session_id or headers.get("x-session-id") or None
    if session_id is not None and len(session_id) > 256:
        raise bad_request("session_id is longer than 256 characters", "session_id")
    deadline_ms: Any = body.deadline_ms
    if deadline_ms is None and "x-deadline-ms" in headers:
        try:
            deadline_ms = float(headers["x-deadline-ms"])
        except ValueError:
            raise bad_request("x-deadline-ms must be a number of milliseconds", "deadline_ms")
        if not 0 < deadline_ms <= 86_400_000:
            raise bad_request("deadline_ms must be in (0, 86400000]", "deadline_ms")
    deadline = time.monotonic() + deadline_ms / 1000 if deadline_ms is not None else None
    max_wait = body.max_wait_ms / 1000 if body.max_wait_ms is not None else None
    return _Extensions(int(priority or 0), session_id, deadline, max_wait)


def encode_text(tokenizer, text: str, raw_prompt: bool) -> list[int]:
    """Token ids of client text. As vLLM, a raw prompt gets the model's BOS
    framing; a rendered chat template already carries its own."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, e.g. from a "\ud800" JSON escape
        raise bad_request("the text is not valid Unicode (lone surrogate)") from None
    return tokenizer.encode(text, add_special_tokens=raw_prompt)


def chat_tokens(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """Render messages with the model's chat template, then tokenize."""
    try:
        text = tokenizer.apply_chat_template(template_messages(messages),
                                             add_generation_prompt=add_generation_prompt)
    except ValueError as exc:  # ChatTemplateError: the template refused these messages
        raise bad_request(str(exc), "messages") from None
    return encode_text(tokenizer, text, raw_prompt=False)


class OpenAIServing:
    """The two generation endpoints, sharing one request pipeline."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    # -- request -> engine inputs ---------------------------------------------------

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
                  prompt_len: int) -> SamplingParams:
        cfg = self.ctx.config
        if logprobs is not None and logprobs > cfg.max_logprobs:
            raise bad_request(f"logprobs must be <= {cfg.max_logprobs}", "logprobs")
        if max_tokens is None:  # as vLLM: whatever room the context leaves (within the cap)
            max_tokens = max(1, min(self.ctx.max_model_len - prompt_len,
                                    cfg.max_tokens_cap or self.ctx.max_model_len))
        elif cfg.max_tokens_cap is not None and max_tokens > cfg.max_tokens_cap:
            raise bad_request(f"max_tokens must be <= {cfg.max_tokens_cap}", "max_tokens")
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                top_p=body.top_p, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                seed=body.seed, stop=body.stop_list(), stop_token_ids=body.stop_token_ids or [],
                ignore_eos=body.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens)
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    def _completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and isinstance(prompt[0], list):
            prompts = list(prompt)
        elif prompt and isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise bad_request("prompt must not be empty", "prompt")
        if len(prompts) > self.ctx.config.max_prompts:
            raise bad_request(f"at most {self.ctx.config.max_prompts} prompts per request",
                              "prompt")
        self._check_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        return [encode_text(self.ctx.tokenizer, p, raw_prompt=True) if isinstance(p, str)
                else list(p) for p in prompts]

    def _check_chars(self, count: int, param: str) -> None:
        cap = self.ctx.config.max_prompt_chars
        if cap is not None and count > cap:
            raise bad_request(f"the {param} text is {count} characters; this server accepts at "
                              f"most {cap} per request", param, code="prompt_too_long")

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if len(body.messages) > self.ctx.config.max_messages:
            raise bad_request(f"at most {self.ctx.config.max_messages} messages", "messages")
        self._check_chars(sum(len(m.text()) for m in body.messages), "messages")
        return chat_tokens(self.ctx.tokenizer, body.messages, body.add_generation_prompt)

    # -- endpoints -------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, headers: Mapping[str, str]):
        self._check_common(body)
        prompts = self._completion_prompts(body)
        params = [self._sampling(body, body.max_tokens, body.logprobs, len(p)) for p in prompts]
        builder = ResponseBuilder("completion", f"cmpl-{uuid.uuid4().hex}", self.ctx.model_name,
                                  self.ctx.tokenizer, body.logprobs)
        return await self._generate(body, headers, prompts, params, builder)

    async def chat(self, body: ChatCompletionRequest, headers: Mapping[str, str]):
        self._check_common(body)
        prompt = self._chat_prompt(body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = self._sampling(body, max_tokens, logprobs, len(prompt))
        builder = ResponseBuilder("chat", f"chatcmpl-{uuid.uuid4().hex}", self.ctx.model_name,
                                  self.ctx.tokenizer, logprobs)
        return await self._generate(body, headers, [prompt], [params], builder)

    # -- shared pipeline -----------------------------------------------------------------

    async def _generate(self, body: _SamplingFields, headers: Mapping[str, str],
                        prompts: list[list[int]], params: list[SamplingParams],
                        builder: ResponseBuilder):
        if self.ctx.draining:
            raise APIError(503, "the server is shutting down", code="draining")
        received_at = time.monotonic()
        ext = _extensions(body, headers)
        streams = await self._start(prompts, params, body.n, ext, builder.id)
        trackers = [RequestTracker(self.ctx.metrics, received_at) for _ in streams]
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
        return JSONResponse(await _collect(first, merged, builder, len(streams), body.n))

    async def _start(self, prompts: list[list[int]], params: list[SamplingParams], n: int,
                     ext: _Extensions, base_id: str) -> list[AsyncIterator[RequestOutput]]:
        """Queue every choice; if one is refused, abort those already queued."""
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
                    session_id=session_id, deadline=ext.deadline, max_wait=ext.max_wait))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is None:
            return list(results)
        for result in results:
            if not isinstance(result, BaseException):
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
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
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


async def _merge(streams: list[AsyncIterator[RequestOutput]],
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
                yield sse(builder.chunk(index, output))
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
