"""What a body costs to parse (issue 51): a body under the byte limit must
not expand into tens of MB of Python objects, nor into an error object per
bad element. Measured with tracemalloc through the guards and the request
pool's parser, as a route parses a body."""
from __future__ import annotations

import asyncio
import json
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.server.auth import KeyRing
from carpool.server.errors import APIError
from carpool.server.middleware import GuardMiddleware
from carpool.server.prepare import PrepPool
from carpool.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
)

LIMIT = 2 * 2**20  # the default --max-body-bytes
PEAK_BOUND = 8 * LIMIT  # before: 43 MiB for the empty lists, ~700 MiB for the stop ints
USER = [{"role": "user", "content": "x"}]


def _compact(value) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _fill(make, item_bytes: int) -> bytes:
    """``make(n)``'s body with as many items as fit in LIMIT."""
    return _compact(make((LIMIT - 200) // item_bytes))


UNITS = LIMIT // 6  # the JSON cost limit: a list 4 units, a string 2, a float 2, a number 1,
# an object's entry 1 besides its key and value
# (request model, body): the shapes just under LIMIT, and bodies of
# bad elements, ids, floats and lists just under the cost limit.
BODIES = {
    "empty lists": (CompletionRequest, _fill(lambda n: {"prompt": [[]] * n}, 3)),
    "empty objects": (ChatCompletionRequest,
                      _fill(lambda n: {"messages": USER, "tools": [{}] * n}, 3)),
    "bad stop items": (CompletionRequest, _fill(lambda n: {"prompt": "x", "stop": [1] * n}, 2)),
    "bad stop items, cost limit": (CompletionRequest,
                                   _compact({"prompt": "x", "stop": [1] * (UNITS - 100)})),
    "bad messages": (ChatCompletionRequest, _compact({"messages": [1] * (UNITS - 100)})),
    "bad stop ids": (CompletionRequest,
                     _compact({"prompt": "x", "stop_token_ids": [-1] * (UNITS - 100)})),
    "bad tokens": (DetokenizeRequest, _compact({"tokens": ["a"] * (UNITS // 3 - 100)})),
    "logit_bias keys": (CompletionRequest, _compact(
        {"prompt": "x", "logit_bias": {str(i): 1 for i in range(UNITS // 4 - 100)}})),
    "objects": (ChatCompletionRequest, _compact(
        {"messages": USER, "response_format": {f"k{i}": 0 for i in range(UNITS // 4 - 100)}})),
    "ids": (CompletionRequest, _compact({"prompt": [12345] * (UNITS - 100)})),
    "floats": (ChatCompletionRequest, _compact({"messages": USER,
                                                "tools": [0.5] * (UNITS // 2 - 100)})),
    "lists": (CompletionRequest, _compact({"prompt": [[]] * (UNITS // 5 - 100)})),
}


async def _guard_and_parse(model, body: bytes) -> int:
    """The status the guards and the parser give ``body`` (200: it parsed)."""
    prep = PrepPool(1)
    status = []

    async def route(scope, receive, send) -> None:
        try:
            await prep.parse(model, (await receive())["body"])
            status.append(200)
        except APIError as exc:
            status.append(exc.status)

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    guard = GuardMiddleware(route, LIMIT, 16384, KeyRing({}))
    await guard({"type": "http", "method": "POST", "path": "/", "headers": []}, receive, send)
    return status[0]


@pytest.mark.parametrize("name", list(BODIES))
def test_parsing_a_body_under_the_limit_peaks_under_8x_its_size(name):
    model, body = BODIES[name]
    assert len(body) <= LIMIT
    tracemalloc.start()
    try:
        status = asyncio.run(_guard_and_parse(model, body))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert status in (200, 400, 413)
    assert peak < PEAK_BOUND, f"{name}: {peak / 2**20:.1f} MiB (status {status})"


def test_the_largest_valid_request_passes_the_guards():
    """32 prompts of 8,192 five-digit token ids (the byte limit's own example)."""
    body = _compact({"prompt": [[12345] * 8192] * 32, "max_tokens": 1})
    assert asyncio.run(_guard_and_parse(CompletionRequest, body)) == 200


# -- json_cost counts what parsing builds ------------------------------------------------

_TEXT = st.text(st.sampled_from('ab,[]{}"\\:/ \n\u00e9\U0001f600'), max_size=8)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats() | _TEXT,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=30)


def _reference(value) -> int:
    if isinstance(value, str):
        return 2
    if isinstance(value, list):
        return 4 + max(len(value) - 1, 0) + sum(map(_reference, value))
    if isinstance(value, dict):
        return 4 + max(len(value) - 1, 0) + sum(3 + _reference(v) for v in value.values())
    return sum(json.dumps(value).count(c) for c in ".eE")  # a float's; true/false's e


@settings(max_examples=300, deadline=None)
@given(value=_JSON, ascii_only=st.booleans())
def test_json_cost_counts_values_outside_strings(value, ascii_only):
    from carpool.server.middleware import json_cost

    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert json_cost(body) == _reference(value)
