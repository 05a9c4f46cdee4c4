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
from carpool.server.errors import APIError
from carpool.server.middleware import GuardMiddleware
from carpool.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest)
from carpool.server.serving import OpenAIServing, ServerContext, chat_tokens, encode_text

log = logging.getLogger("carpool.server")


def build_app(ctx: ServerContext) -> FastAPI:
    """The ASGI app for one engine; ``ctx`` carries all its state."""
    app = FastAPI(title="carpool", version=carpool.__version__,
                  description="OpenAI-compatible LLM server")
    app.state.ctx = ctx
    serving = OpenAIServing(ctx)
    _add_error_handlers(app)
    _add_generation_routes(app, serving)
    _add_info_routes(app, ctx)
    app.add_middleware(GuardMiddleware, max_body_bytes=ctx.config.max_body_bytes,
                       max_header_bytes=ctx.config.max_header_bytes, api_key=ctx.config.api_key)
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
    async def invalid_body(_: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = first.get("msg", "invalid request")
        if loc:
            message = f"{'.'.join(loc)}: {message}"
        return APIError(400, message, code="invalid_value",
                        param=".".join(loc) or None).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail), code=None).response()

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


def _add_generation_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _until_disconnect(request, serving.completions(body, request.headers))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _until_disconnect(request, serving.chat(body, request.headers))


def _add_info_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health")
    async def health() -> Response:
        reason = health_problem(ctx)
        if reason:
            return APIError(503, reason, code="unhealthy").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": carpool.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": int(ctx.started_at),
            "owned_by": "carpool", "root": ctx.model_name, "max_model_len": ctx.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        # Counted exactly as the generation endpoints count them.
        if body.prompt is not None:
            tokens = encode_text(ctx.tokenizer, body.prompt, raw_prompt=True)
        else:
            tokens = chat_tokens(ctx.tokenizer, body.messages or [], body.add_generation_prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        vocab = ctx.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", code="invalid_value",
                           param="tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/carpool/policy")
    async def policy() -> JSONResponse:
        stats, rates = ctx.metrics.snapshot()
        return JSONResponse({"batching": stats.batching, "mode": stats.mode,
                             "knobs": stats.knobs, "rates": _finite(rates),
                             "running": stats.num_running, "waiting": stats.num_waiting,
                             "kv_usage": stats.kv_usage, "sessions": stats.sessions,
                             "rejections": stats.rejections,
                             "decisions": list(stats.recent_decisions)})


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


def _finite(values: dict[str, float]) -> dict[str, float | None]:
    return {k: (v if v == v else None) for k, v in values.items()}  # NaN -> null in JSON
