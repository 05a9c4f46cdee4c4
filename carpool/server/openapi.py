"""The OpenAPI document as the server really behaves.

Routes parse their JSON bodies themselves (off the event loop), so the
request schemas are declared here; FastAPI's default 422 is replaced by the
status codes the guards and routes actually return, each with OpenAI's
error body.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"},
    "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_WHY = {400: "Invalid request (body, field, Host header)", 401: "Missing or wrong API key",
        403: "The key may not read this (operator only)", 404: "Unknown model or route",
        405: "Method not allowed (see Allow)",
        409: "Conflicts with the pinned prefixes (a name taken, the pin count or block "
        "budget spent)",
        413: "Request body too large", 429: "Queue full or cannot be served in time "
        "(see Retry-After)", 431: "Request headers too large",
        503: "Draining, engine failure or unhealthy"}
# Every route passes the guards (Host, size caps, key), so any may return these.
_GUARDS = (400, 401, 413, 431)
_GENERATION = (*_GUARDS, 404, 429, 503)


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as a route's JSON request body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def install_openapi(app: FastAPI, bodies: list[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` build (once) the document described above;
    ``bodies`` are the models that ``json_body`` referred to."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in bodies:
            definition = model.model_json_schema(ref_template=_REF)
            components.update(definition.pop("$defs", {}))
            components[model.__name__] = definition
        components["Error"] = _ERROR
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                _set_responses(operation, path)
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = build


def _set_responses(operation: dict[str, Any], path: str) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    if path == "/health":
        codes: tuple[int, ...] = (400, 413, 431, 503)
    elif operation.get("requestBody") and path.startswith("/v1/"):
        codes = _GENERATION
    elif path == "/carpool/steps":
        codes = (*_GUARDS, 403)
    elif path.startswith("/carpool/prefixes"):  # operator-pinned prefixes
        codes = (*_GUARDS, 403, 404, 409, 503)
    else:
        codes = _GUARDS
    for code in codes:
        responses[str(code)] = {"description": _WHY[code], "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
