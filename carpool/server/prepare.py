"""API request -> engine inputs, off the event loop.

Parsing a large body, rendering a chat template and tokenizing are CPU
work that grows with what a client sends; on the event loop one maximal
body would stall every other connection (``/health`` included). They run
in a small bounded pool of worker threads (``PrepPool``); the tokenizer and
pydantic's JSON parser release the GIL for most of it. The extensions a
client may set are bound here to what its key allows (``Principal``).
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from pydantic import BaseModel, ValidationError

from carpool import limits
from carpool.server.auth import ANONYMOUS, PRIORITY_CLASSES, Principal
from carpool.server.errors import APIError, bad_request
from carpool.server.protocol import ChatMessage, _SamplingFields, template_messages

Model = TypeVar("Model", bound=BaseModel)
Result = TypeVar("Result")


class PrepPool:
    """At most ``workers`` preparations (parsing included) run at once, each
    in a thread; the rest wait their turn without holding a thread (or a
    parsed body).

    One worker by default: pydantic's JSON parser, ``set``/``min``/``max``
    over a million token ids and the like hold the GIL for tens of
    milliseconds each, and the engine thread needs a core of its own. Under
    the test's flood of maximal bodies on a 2-core machine, /health took at
    most 24-40 ms with one worker and 100-150 ms with two. Tokenizing
    releases the GIL.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._limiter: anyio.CapacityLimiter | None = None  # made on the loop (anyio needs one)

    async def start(self) -> None:
        """Make the limiter and start a worker now: the first use imports
        anyio's thread machinery (~0.2 s), which must not stall a request."""
        await self.run(int)

    async def run(self, fn: Callable[..., Result], *args: Any) -> Result:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.workers)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def parse(self, model: type[Model], raw: bytes) -> Model:
        """``raw`` JSON validated as ``model``; a 400 naming the field if not."""
        try:
            return await self.run(model.model_validate_json, raw)
        except ValidationError as exc:
            raise invalid_body(exc.errors(include_url=False)) from None


def invalid_body(errors: list[dict]) -> APIError:
    """The first validation error as OpenAI's 400 (``param`` = the field path)."""
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = first.get("msg", "invalid request")
    if loc:
        message = f"{'.'.join(loc)}: {message}"
    return APIError(400, message, code="invalid_value", param=".".join(loc) or None)


@dataclass
class Extensions:
    """carpool's extension fields of one call, as the engine takes them."""

    priority: int = 0
    session_id: str | None = None  # scoped by tenant
    deadline: float | None = None  # engine clock (monotonic)
    max_wait: float | None = None  # seconds request-level batching may hold it
    cache_salt: str | None = None  # prefix-cache namespace


def extensions(body: _SamplingFields, headers: Mapping[str, str],
               principal: Principal = ANONYMOUS) -> Extensions:
    """The extension fields (the body wins over ``x-*`` headers), bound to the caller.

    Priority is clamped into the classes high..low and to the best class the
    caller's key may claim; a session id and the prefix cache are scoped by
    tenant, so no client can join another tenant's session or probe its
    cached prompts.
    """
    return Extensions(principal.clamp_priority(_priority(body, headers)),
                      _session(body, headers, principal), _deadline(body, headers),
                      body.max_wait_ms / 1000 if body.max_wait_ms is not None else None,
                      _cache_salt(body, principal))


def _priority(body: _SamplingFields, headers: Mapping[str, str]) -> int:
    priority: Any = body.priority if body.priority is not None else headers.get("x-priority")
    if isinstance(priority, str):
        if re.fullmatch(r"-?[0-9]{1,9}", priority):
            priority = int(priority)
        elif priority in PRIORITY_CLASSES:
            priority = PRIORITY_CLASSES[priority]
        else:
            raise bad_request(f"priority must be an integer or one of "
                              f"{sorted(PRIORITY_CLASSES)}, got {priority[:40]!r}", "priority")
    return int(priority or 0)


def _session(body: _SamplingFields, headers: Mapping[str, str],
             principal: Principal) -> str | None:
    session_id = body.session_id or headers.get("x-session-id") or None
    if session_id is None:
        return None
    if len(session_id) > limits.MAX_SESSION_ID_CHARS:
        raise bad_request(f"session_id is longer than {limits.MAX_SESSION_ID_CHARS} characters",
                          "session_id")
    # Length-prefixed, so no choice of tenant and id can spell another pair.
    return f"{len(principal.tenant)}:{principal.tenant}/{session_id}"


def _deadline(body: _SamplingFields, headers: Mapping[str, str]) -> float | None:
    deadline_ms: Any = body.deadline_ms
    if deadline_ms is None and "x-deadline-ms" in headers:
        try:
            deadline_ms = float(headers["x-deadline-ms"])
        except ValueError:
            raise bad_request("x-deadline-ms must be a number of milliseconds",
                              "deadline_ms") from None
        if not limits.DEADLINE_MS.contains(deadline_ms):
            raise bad_request(f"deadline_ms must be in {limits.DEADLINE_MS.describe()}",
                              "deadline_ms")
    return time.monotonic() + deadline_ms / 1000 if deadline_ms is not None else None


def _cache_salt(body: _SamplingFields, principal: Principal) -> str | None:
    """Each tenant its own prefix-cache namespace, unless its key opts into
    the shared one; a client's ``cache_salt`` splits it further (as vLLM's)."""
    base = None if principal is ANONYMOUS or principal.share_prefix_cache else principal.tenant
    if body.cache_salt is None:
        return None if base is None else f"tenant:{base}"
    return f"tenant:{base or ''}\x00{body.cache_salt}"


def encode_text(tokenizer, text: str, raw_prompt: bool) -> list[int]:
    """Token ids of client text. As vLLM, a raw prompt gets the model's BOS
    framing; a rendered chat template already carries its own."""
    _check_unicode(text)
    return tokenizer.encode(text, add_special_tokens=raw_prompt)


def chat_tokens(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                special_tokens_in_content: bool = False,
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Render messages (and ``tools``, and the client's ``template_kwargs``:
    ``enable_thinking``...) with the model's chat template, then
    tokenize; special-token text in content stays plain text unless allowed.
    A template that leaves the tools out of the prompt is a 400: the model
    would be asked to call functions it was never shown."""
    for message in messages:
        _check_unicode(message.text())
    rendered = template_messages(messages)
    extra = dict(template_kwargs or {})
    try:
        if tools and (tokenizer.apply_chat_template(rendered, add_generation_prompt, tools=tools,
                                                    **extra)
                      == tokenizer.apply_chat_template(rendered, add_generation_prompt, **extra)):
            raise bad_request("this model's chat template does not render tools; serve it with "
                              "--chat-template set to a template that does", "tools")
        variables = {**extra, "tools": tools} if tools else extra
        return tokenizer.encode_chat(rendered, add_generation_prompt, special_tokens_in_content,
                                     **variables)
    except ValueError as exc:  # ChatTemplateError: the template refused these messages
        raise bad_request(str(exc), "messages") from None


def _check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, e.g. from a "\ud800" JSON escape
        raise bad_request("the text is not valid Unicode (lone surrogate)") from None


def check_chars(count: int, cap: int, param: str) -> None:
    """A 400 when a request's prompt text is over the character cap."""
    if count > cap:
        raise bad_request(f"the {param} text is {count} characters; this server accepts at "
                          f"most {cap} per request", param, code="prompt_too_long")
