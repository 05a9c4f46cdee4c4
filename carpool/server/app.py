"""The FastAPI application: routes, error handlers and guards."""
from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

import carpool
from carpool.engine.step_log import STEP_LOG_CAPACITY, steps_document
from carpool.scheduler.control.overload import OverloadGuard
from carpool.server.auth import ANONYMOUS, KeyRing
from carpool.server.errors import APIError, bad_request
from carpool.server.middleware import GuardMiddleware
from carpool.server.openapi import install_openapi, json_body
from carpool.server.pins_api import PinRequest, add_pin_routes
from carpool.server.prepare import check_chars, encode_text, invalid_body
from carpool.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from carpool.server.serving import OpenAIServing, ServerContext

log = logging.getLogger("carpool.server")


def build_app(ctx: ServerContext) -> FastAPI:
    """The ASGI app for one engine; ``ctx`` carries all its state."""
    # No slash redirects: their Location would be built from the Host header.
    app = FastAPI(title="carpool", version=carpool.__version__, redirect_slashes=False,
                  description="OpenAI-compatible LLM server")
    app.state.ctx = ctx
    serving = OpenAIServing(ctx)
    _add_error_handlers(app)
    _add_generation_routes(app, serving)
    _add_info_routes(app, serving)
    add_pin_routes(app, serving)  # operator-pinned prefixes (/carpool/prefixes)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                          DetokenizeRequest, PinRequest])
    keyring = KeyRing.from_config(ctx.config.api_key, ctx.config.api_keys)
    app.add_middleware(GuardMiddleware, max_body_bytes=ctx.config.max_body_bytes,
                       max_header_bytes=ctx.config.max_header_bytes, keyring=keyring,
                       allowed_hosts=ctx.config.host_allow_list(keyring.enabled),
                       body_timeout=ctx.config.body_timeout,
                       body_min_rate=ctx.config.body_min_rate)
    if ctx.config.cors_origins:  # outermost, so preflights are answered without a key
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=ctx.config.cors_origins,
                           allow_methods=["*"], allow_headers=["*"])
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> Response:
        return invalid_body(list(exc.errors())).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        error = APIError(exc.status_code, str(exc.detail), code=None,
                         headers=dict(exc.headers or {}))  # 405 keeps its Allow
        return error.response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error while serving a request")
        return APIError(500, f"internal error: {type(exc).__name__}",
                        code="internal_error").response()


async def _until_disconnect(request: Request, work) -> Response:
    """Run ``work``; if the client leaves first, cancel it (which aborts its
    engine requests, freeing their blocks before the next step)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)


def _principal(request: Request):
    return getattr(request.state, "principal", ANONYMOUS)


def _add_generation_routes(app: FastAPI, serving: OpenAIServing) -> None:
    # Bodies are parsed in the worker pool, not by FastAPI on the event loop.
    prep = serving.ctx.prep

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        received = time.monotonic()  # before parsing: the client's TTFT starts here
        body = await prep.parse(CompletionRequest, await request.body())
        return await _until_disconnect(request, serving.completions(
            body, request.headers, _principal(request), received))

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        received = time.monotonic()
        body = await prep.parse(ChatCompletionRequest, await request.body())
        return await _until_disconnect(request, serving.chat(
            body, request.headers, _principal(request), received))


def _add_info_routes(app: FastAPI, serving: OpenAIServing) -> None:
    ctx = serving.ctx

    @app.get("/health")
    async def health() -> Response:
        reason = health_problem(ctx)
        if reason:
            return APIError(503, reason, code="unhealthy").response()
        degraded = ctx.engine.degraded  # a fleet below its size
        if degraded:
            return JSONResponse({"status": "degraded", "reason": degraded})
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict:
        return {"version": carpool.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": int(ctx.started_at),
            "owned_by": "carpool", "root": ctx.model_name, "max_model_len": ctx.max_model_len}]}

    def count_tokens(body: TokenizeRequest) -> list[int]:
        # Counted exactly as the generation endpoints count them, within their limits.
        if body.prompt is not None:
            check_chars(len(body.prompt), ctx.max_prompt_chars, "prompt")
            return encode_text(ctx.tokenizer, body.prompt, raw_prompt=True)
        return serving.chat_prompt(body.messages or [], body.add_generation_prompt)

    def decode(body: DetokenizeRequest) -> str:
        vocab = ctx.tokenizer.vocab_size
        if len(body.tokens) > ctx.max_model_len:
            raise APIError(400, f"at most {ctx.max_model_len} tokens", code="invalid_value",
                           param="tokens")
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", code="invalid_value",
                           param="tokens")
        return ctx.tokenizer.decode(body.tokens)

    @app.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
    async def tokenize(request: Request) -> dict:
        body = await ctx.prep.parse(TokenizeRequest, await request.body())
        tokens = await ctx.prep.run(count_tokens, body)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len}

    @app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
    async def detokenize(request: Request) -> dict:
        body = await ctx.prep.parse(DetokenizeRequest, await request.body())
        return {"prompt": await ctx.prep.run(decode, body)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/carpool/steps", openapi_extra={"parameters": [{
        "name": "limit", "in": "query", "required": False,
        "schema": {"type": "integer", "minimum": 1, "maximum": STEP_LOG_CAPACITY},
        "description": "the most recent steps to return (default: all kept)"}]})
    async def steps(request: Request) -> JSONResponse:
        """The engine's recent steps (shape, wall seconds, start), for
        ``carpool measure --from``; operators only: they show everyone's load."""
        if not _principal(request).operator:
            raise APIError(403, "the step log is for operator keys (operator: true in the "
                                "keys file)", code="forbidden")
        limit = _step_limit(request.query_params.get("limit"))
        return JSONResponse(await ctx.prep.run(steps_document, ctx.engine.step_log,
                                                ctx.engine.info.step_facts, limit))

    @app.get("/carpool/policy")
    async def policy() -> JSONResponse:
        stats, rates = ctx.metrics.snapshot()
        return JSONResponse({"batching": stats.batching, "mode": stats.mode,
                             "knobs": stats.knobs, "rates": _finite(rates),
                             "running": stats.num_running, "waiting": stats.num_waiting,
                             "kv_usage": stats.kv_usage, "sessions": stats.sessions,
                             "rejections": stats.rejections,
                             "decisions": list(stats.recent_decisions),
                             # the latency targets, their sources and the calibration rule
                             "adaptive": stats.adaptive, "slo": stats.slo,
                             "admission": _admission(stats),
                             "predictions": stats.predictions, **ctx.engine.routing()})


def health_problem(ctx: ServerContext) -> str | None:
    """Why the server is unhealthy, or None when the engine makes progress."""
    engine = ctx.engine
    if not engine.is_alive:
        return "the engine loop is dead"
    if ctx.draining:
        return "the server is draining"
    stalled = time.monotonic() - engine.last_progress
    if stalled > ctx.config.stall_timeout:
        return f"the engine made no progress for {stalled:.0f} s"
    return None


def _admission(stats) -> dict:
    """Which regime admission runs in, and why (``ServingSLO.regime``), and
    the emergency switch's step (``OverloadGuard.STAGES``)."""
    emergency = OverloadGuard.STAGES[stats.degrade_stage]
    if stats.slo is None:
        return {"regime": "queue", "reason": "the adaptive controller is off: arrivals queue "
                                             "up to the queue bounds", "emergency": emergency}
    return {"regime": stats.slo.get("regime", "queue"),
            "reason": stats.slo.get("regime_reason", ""), "emergency": emergency}


def _step_limit(text: str | None) -> int:
    if text is None:
        return STEP_LOG_CAPACITY
    # Length first: int() refuses strings of over 4300 digits (a 500 before).
    if not (text.isdigit() and len(text) <= 9) or not 1 <= int(text) <= STEP_LOG_CAPACITY:
        raise bad_request(f"limit must be an integer from 1 to {STEP_LOG_CAPACITY}", "limit")
    return int(text)


def _finite(values: dict[str, float]) -> dict[str, float | None]:
    return {k: (v if v == v else None) for k, v in values.items()}  # NaN -> null in JSON
