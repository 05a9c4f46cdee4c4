"""``/carpool/prefixes``: the operator API that pins prompt prefixes.

``POST /carpool/prefixes`` pins a prefix (``prompt``: text, framed as a raw
completion prompt is; ``prompt_token_ids``; or chat ``messages`` rendered
without a generation prompt, e.g. a system message) and answers once every
engine holds it (201; 200 with the existing pin when that prefix is
pinned already); ``GET`` lists the pins with their hits; ``DELETE
/carpool/prefixes/{id}`` unpins. Operator keys only (403 otherwise): a
pin takes KV memory from everyone.

Namespaces: a pin is hit only by requests of its prefix-cache namespace
(``prepare._cache_salt``). Without ``tenant``, that is the shared one:
requests without keys, with the single ``--api-key``, or with keys that
set ``share_prefix_cache``. With ``tenant: T``, that tenant's own (its keys
without ``share_prefix_cache``); ``cache_salt`` narrows either to the
requests that send that ``cache_salt``. Nothing pinned in one namespace
is visible from another.

The engine side is ``carpool.scheduler.pinned_prefixes``; the fronts'
side (every replica of a fleet, the restarted ones too) is
``carpool.engine.pins``.
"""
from __future__ import annotations

import re
from typing import Annotated

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.responses import JSONResponse

from carpool import limits
from carpool.engine.pins import PinFailed
from carpool.scheduler.pinned_prefixes import PinError, PinSpec, pin_id_of
from carpool.server.auth import ANONYMOUS, Principal
from carpool.server.errors import APIError, bad_request
from carpool.server.openapi import json_body
from carpool.server.prepare import _cache_salt, check_chars, encode_text
from carpool.server.protocol import ChatMessage, TokenId
from carpool.server.serving import _api_error

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")  # a metric label value
_STATUS = {"invalid": 400, "too_large": 413, "conflict": 409, "full": 409}


class PinRequest(BaseModel):
    """``POST /carpool/prefixes``: exactly one of ``prompt``,
    ``prompt_token_ids`` or ``messages``; ``name`` (the metric label,
    default: the pin's id); the namespace's ``tenant`` and ``cache_salt``."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    prompt_token_ids: Annotated[list[TokenId], Field(fail_fast=True, min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(fail_fast=True, min_length=1)] | None = None
    name: Annotated[str, Field(pattern=NAME.pattern)] | None = None
    tenant: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    cache_salt: Annotated[str, Field(min_length=1,
                                     max_length=limits.MAX_CACHE_SALT_CHARS)] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "PinRequest":
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        return self


def _operator(request: Request) -> None:
    if not getattr(request.state, "principal", ANONYMOUS).operator:
        raise APIError(403, "pinned prefixes are for operator keys (operator: true in the "
                            "keys file)", code="forbidden")


def _namespace(body: PinRequest) -> tuple[str | None, str]:
    """(the cache salt, its description) of the namespace the body names."""
    principal = ANONYMOUS if body.tenant is None else Principal(body.tenant)
    shown = "shared" if body.tenant is None else f"tenant:{body.tenant}"
    if body.cache_salt is not None:
        shown += f" cache_salt:{body.cache_salt}"
    return _cache_salt(body, principal), shown


def _describe(spec: PinSpec, block_size: int, stats) -> dict:  # noqa: ANN001 - PinStats
    """A pin as the API shows it: ``blocks`` each engine holds, ``held_blocks``
    all engines hold (as last reported), its hits summed over them."""
    return {"id": spec.pin_id, "name": spec.name, "namespace": spec.namespace,
            "tokens": len(spec.token_ids), "blocks": len(spec.token_ids) // block_size,
            "held_blocks": stats.blocks if stats is not None else 0,
            "hits": stats.hits if stats is not None else 0,
            "hit_tokens": stats.hit_tokens if stats is not None else 0}


def add_pin_routes(app: FastAPI, serving) -> None:  # noqa: ANN001 - OpenAIServing
    """The three routes of the module docstring, on ``serving``'s engine."""
    ctx = serving.ctx

    def tokens(body: PinRequest) -> list[int]:
        if body.prompt_token_ids is not None:
            vocab = ctx.tokenizer.vocab_size
            if any(t >= vocab for t in body.prompt_token_ids):
                raise bad_request(f"token ids must be in [0, {vocab})", "prompt_token_ids")
            return list(body.prompt_token_ids)
        if body.prompt is not None:
            check_chars(len(body.prompt), ctx.max_prompt_chars, "prompt")
            return encode_text(ctx.tokenizer, body.prompt, raw_prompt=True)
        return serving.chat_prompt(body.messages, False)

    def pin_stats() -> dict:
        return {s.pin_id: s for s in ctx.engine.stats.pinned}

    def block_size() -> int:
        limits = ctx.engine.info.pin_limits
        return limits.block_size if limits is not None else 1

    @app.post("/carpool/prefixes", openapi_extra=json_body(PinRequest))
    async def pin(request: Request) -> JSONResponse:
        """Pin a prefix on every engine (module docstring); operators only."""
        _operator(request)
        body = await ctx.prep.parse(PinRequest, await request.body())
        ids = await ctx.prep.run(tokens, body)
        salt, shown = _namespace(body)
        pin_id = pin_id_of(ids, salt)
        spec = PinSpec(pin_id, body.name or pin_id, tuple(ids), salt, shown)
        try:
            spec, created = await ctx.engine.pin_prefix(spec)
        except PinError as exc:
            raise APIError(_STATUS[exc.kind], str(exc), code=exc.kind) from None
        except PinFailed as exc:
            raise APIError(503, str(exc), code="pin_failed") from None
        except Exception as exc:  # refused or rejected by an engine, engine gone
            raise _api_error(exc) from None
        return JSONResponse(_describe(spec, block_size(), pin_stats().get(spec.pin_id)),
                            status_code=201 if created else 200)

    @app.get("/carpool/prefixes")
    async def listing(request: Request) -> JSONResponse:
        """The pinned prefixes with their hits (summed over a fleet's replicas)."""
        _operator(request)
        stats = pin_stats()
        return JSONResponse({"prefixes": [_describe(spec, block_size(), stats.get(spec.pin_id))
                                          for spec in ctx.engine.pinned_prefixes()],
                             "lookups": ctx.engine.stats.pinned_lookups})

    @app.delete("/carpool/prefixes/{pin_id}")
    async def unpin(request: Request, pin_id: str) -> JSONResponse:
        """Unpin: the prefix's blocks age out of the cache like any others."""
        _operator(request)
        if not ctx.engine.unpin_prefix(pin_id):
            raise APIError(404, f"no pinned prefix {pin_id[:64]!r}", code="not_found")
        return JSONResponse({"id": pin_id, "deleted": True})
