"""Fuzz a live ``carpool serve`` (tiny model) over HTTP: no request, however
malformed, gets a 5xx, and every refusal is OpenAI's error JSON.

1. Schema-driven bodies for each POST route, built from the app's own
   ``/openapi.json``: mostly well-typed, sometimes out of range, wrongly
   typed, null, missing required fields or carrying unknown ones.
2. Raw bytes: garbage, truncated JSON, invalid UTF-8, JSON that is no object.
3. The ``x-priority`` / ``x-session-id`` / ``x-deadline-ms`` extension headers.
4. Every number a body takes, out of its range (beyond 64 bits, inf, nan,
   1e308 included): always a 400 naming the field.

The last test checks the engine survived it all and nothing logged a traceback.
"""
from __future__ import annotations

import json
import string
from typing import Any

import httpx
import pytest
from fuzz_strategies import _TEXT, MAX_TOKENS_CAP, SchemaStrategies, numeric_slots
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import ServerProcess

API_KEY = "fuzzkey"
MAX_BODY_BYTES = 65536
POST_ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
               "/carpool/prefixes"]
GENERATION_ROUTES = POST_ROUTES[:2]

FUZZ = settings(max_examples=100, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.filter_too_much, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess([str(tiny_model_dir), "--attention-backend", "torch",
                        "--max-tokens-cap", str(MAX_TOKENS_CAP), "--api-key", API_KEY,
                        "--max-body-bytes", str(MAX_BODY_BYTES)]) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    with server.client(api_key=API_KEY, timeout=30.0) as c:
        yield c


@pytest.fixture(scope="module")
def openapi(client) -> dict:
    response = client.get("/openapi.json")
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


# -- checks ------------------------------------------------------------------------------


def _tail(server: ServerProcess, chars: int = 4000) -> str:
    return server.text()[-chars:]


def _describe(body: Any, response: httpx.Response, server: ServerProcess) -> str:
    sent = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True)[:2000]
    return (f"\nrequest: {sent!r}\nstatus: {response.status_code}\n"
            f"response: {response.text[:2000]!r}\nserver output tail:\n{_tail(server)}")


def _assert_error_json(response: httpx.Response, why: str) -> None:
    try:
        payload = response.json()
    except ValueError:
        raise AssertionError("error response is not JSON" + why) from None
    assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), why
    error = payload["error"]
    assert isinstance(error.get("message"), str) and error["message"], why
    assert isinstance(error.get("type"), str) and error["type"], why
    assert "param" in error and "code" in error, why
    assert error["param"] is None or isinstance(error["param"], str), why
    assert error["code"] is None or isinstance(error["code"], str), why


def _assert_sse_complete(response: httpx.Response, why: str) -> None:
    assert response.headers["content-type"].startswith("text/event-stream"), why
    text = response.text
    assert text.endswith("data: [DONE]\n\n"), why
    events = [e for e in text.split("\n\n") if e]
    assert events and events[-1] == "data: [DONE]", why
    for event in events[:-1]:
        assert event.startswith("data: "), why
        chunk = json.loads(event[len("data: "):])
        assert isinstance(chunk, dict) and ("choices" in chunk or "error" in chunk), why
    assert all(e != "data: [DONE]" for e in events[:-1]), why


def _check_response(path: str, body: Any, response: httpx.Response, server: ServerProcess,
                    streaming: bool) -> None:
    why = _describe(body, response, server)
    assert response.status_code < 500, "server error" + why
    if response.status_code >= 300:
        _assert_error_json(response, why)
        return
    # A new pin is 201 Created, the same prefix again 200 with that pin.
    assert response.status_code in ((200, 201) if path == "/carpool/prefixes" else (200,)), why
    if streaming:
        _assert_sse_complete(response, why)
        return
    payload = response.json()
    assert isinstance(payload, dict), why
    if path in GENERATION_ROUTES:
        assert payload["choices"] and "usage" in payload, why
    elif path == "/tokenize":
        assert payload["count"] == len(payload["tokens"]), why
    elif path == "/carpool/prefixes":
        assert payload["id"] and payload["tokens"] >= 1, why
    else:
        assert isinstance(payload["prompt"], str), why


def _encode(body: Any) -> bytes:
    try:
        return json.dumps(body, ensure_ascii=False, allow_nan=True).encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: send them as \ud8xx escapes
        return json.dumps(body, ensure_ascii=True, allow_nan=True).encode("ascii")


def _post(server: ServerProcess, client: httpx.Client, path: str, content: bytes,
          headers: dict | None = None, content_type: str = "application/json") -> httpx.Response:
    try:
        return client.post(path, content=content,
                           headers={"content-type": content_type, **(headers or {})})
    except httpx.TransportError as exc:  # a hang (timeout) or a dead server
        alive = server.proc is not None and server.proc.poll() is None
        raise AssertionError(f"{path}: {exc!r} (server alive: {alive})\nrequest: "
                             f"{content[:2000]!r} headers={headers!r}\n"
                             f"server output tail:\n{_tail(server)}") from exc


@pytest.fixture(scope="module")
def strategies(openapi, model_name) -> dict[str, Any]:
    builder = SchemaStrategies(openapi, model_name)
    out = {}
    for path in POST_ROUTES:
        operation = openapi["paths"][path]["post"]
        schema = operation["requestBody"]["content"]["application/json"]["schema"]
        out[path] = builder.body(schema)
    return out


def test_openapi_lists_every_post_route(openapi):
    posts = sorted(p for p, ops in openapi["paths"].items() if "post" in ops)
    assert posts == sorted(POST_ROUTES)
    for path in POST_ROUTES:
        body = openapi["paths"][path]["post"]["requestBody"]
        assert "$ref" in body["content"]["application/json"]["schema"]


# -- 1. schema-driven bodies ------------------------------------------------------------------

_LONG_PROMPTS = st.sampled_from([
    "The quick brown fox jumps over the lazy dog. " * 60,  # > 512 tokens
    list(range(3, 303)) * 2,  # 600 token ids
    [[5] * 520],
    ["a", "b " * 700],
])


@pytest.mark.parametrize("path", POST_ROUTES)
@FUZZ
@given(data=st.data())
def test_schema_fuzz_never_5xx(server, client, strategies, path, data):
    body = data.draw(strategies[path], label="body")
    if path == "/v1/completions" and isinstance(body, dict) and data.draw(
            st.integers(0, 9), label="long") == 0:
        body["prompt"] = data.draw(_LONG_PROMPTS, label="long prompt")
    streaming = isinstance(body, dict) and body.get("stream") is True
    response = _post(server, client, path, _encode(body))
    _check_response(path, body, response, server, streaming)


# -- 2. raw bytes -------------------------------------------------------------------------------

_VALID_BODIES = {
    "/v1/completions": {"prompt": "Hello there", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "héllo 😀"}],
                             "max_tokens": 2},
    "/tokenize": {"prompt": "héllo 😀 world"},
    "/detokenize": {"tokens": [5, 6, 7]},
    "/carpool/prefixes": {"prompt": "You are a helpful assistant. " * 8, "name": "fuzz-pin"},
}


@st.composite
def _raw_bodies(draw, path: str) -> bytes:
    valid = json.dumps(_VALID_BODIES[path], ensure_ascii=False).encode()
    kind = draw(st.sampled_from(["random", "truncated", "bad_utf8", "not_object", "junk_tail",
                                 "empty", "deep"]))
    if kind == "random":
        return draw(st.binary(min_size=1, max_size=200))
    if kind == "truncated":
        return valid[:draw(st.integers(1, len(valid) - 1))]
    if kind == "bad_utf8":
        cut = draw(st.integers(0, len(valid)))
        junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xc3\x28", b"\xed\xa0\x80",
                                     b"\xf8\x88\x80\x80\x80", b"\xc0\xaf", b"\xfe\xff",
                                     b"\x80"]))
        # Inside a string value, so the body is otherwise well-formed JSON.
        quote = valid.rfind(b'"', 0, cut)
        at = quote + 1 if quote >= 0 else cut
        return valid[:at] + junk + valid[at:]
    if kind == "not_object":
        return json.dumps(draw(st.one_of(
            st.none(), st.booleans(), st.integers(), st.floats(), _TEXT,
            st.lists(st.integers(), max_size=3), st.just([_VALID_BODIES[path]]))),
            allow_nan=True).encode()
    if kind == "junk_tail":
        return valid + draw(st.sampled_from([b"}", b",", b" x", b"{}", b"\x00", b"]"]))
    if kind == "empty":
        return draw(st.sampled_from([b"", b" ", b"\n", b"\xef\xbb\xbf", b"\xef\xbb\xbf{}"]))
    depth = draw(st.sampled_from([100, 2000, 20000]))
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("path", POST_ROUTES)
@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_raw_bytes_are_4xx_error_json(server, client, path, data):
    content = data.draw(_raw_bodies(path), label="content")
    content_type = data.draw(st.sampled_from(["application/json", "application/json",
                                              "application/json; charset=utf-8"]),
                             label="content-type")
    response = _post(server, client, path, content, content_type=content_type)
    why = _describe(content, response, server)
    assert 400 <= response.status_code < 500, why
    _assert_error_json(response, why)


# -- 3. extension headers ---------------------------------------------------------------------

_PRINTABLE = st.text(
    st.sampled_from(string.ascii_letters + string.digits + string.punctuation + " "),
    max_size=40).map(str.strip)
_HEADER_SPECIALS = {
    "x-priority": ["0", "-1", "1", "high", "normal", "low", "HIGH", "--1", "-", "1.5", "1e3",
                   "99999999999999999999999", "-99999999999999999999999", "0x10", "+1", "1 1",
                   "None", "null", ""],
    "x-session-id": ["a", "s" * 256, "s" * 257, "sess-1", "a b", "../../etc/passwd", "%00"],
    "x-deadline-ms": ["1", "0", "-1", "0.0001", "86400000", "86400001", "nan", "NaN", "inf",
                      "-inf", "1e308", "1e-308", "abc", "1_000", "5 5", "0x10", ""],
}


def _header_value(name: str):
    return st.one_of(st.sampled_from(_HEADER_SPECIALS[name]), _PRINTABLE)


@st.composite
def _extension_headers(draw) -> dict[str, str]:
    names = draw(st.lists(st.sampled_from(sorted(_HEADER_SPECIALS)), min_size=1, unique=True))
    return {name: draw(_header_value(name)) for name in names}


@settings(FUZZ, max_examples=100)
@given(headers=_extension_headers(),
       extra=st.fixed_dictionaries({}, optional={
           "stream": st.booleans(), "n": st.integers(1, 2),
           "priority": st.one_of(st.none(), st.sampled_from(["high", "low"]), st.integers(-3, 3)),
           "session_id": st.sampled_from(["body-session", "x" * 256]),
           "deadline_ms": st.sampled_from([1, 5000.5, None])}))
def test_extension_headers_never_5xx(server, client, headers, extra):
    body = {"prompt": "The quick brown", "max_tokens": 2, **extra}
    response = _post(server, client, "/v1/completions", _encode(body), headers=headers)
    _check_response("/v1/completions", {"headers": headers, "body": body}, response, server,
                    streaming=body.get("stream") is True)


# -- 4. numbers out of range ---------------------------------------------------------------

NUMERIC_ROUTES = ["/v1/completions", "/v1/chat/completions", "/detokenize"]


@pytest.fixture(scope="module")
def slots(openapi, model_name) -> dict[str, list]:
    builder = SchemaStrategies(openapi, model_name)
    return {path: numeric_slots(builder, openapi["paths"][path]["post"]["requestBody"]
                                ["content"]["application/json"]["schema"])
            for path in NUMERIC_ROUTES}


def test_every_number_a_body_takes_has_a_range(slots):
    fields = {path: {slot.field for slot in found} for path, found in slots.items()}
    assert {"top_k", "stop_token_ids", "logit_bias", "seed", "n", "max_tokens", "prompt",
            "best_of", "temperature"} <= fields["/v1/completions"]
    assert {"max_completion_tokens", "top_logprobs"} <= fields["/v1/chat/completions"]
    assert fields["/detokenize"] == {"tokens"}
    unbounded = [(path, slot.field) for path, found in slots.items() for slot in found
                 if None in slot.bounds()]
    assert not unbounded


def _assert_400_naming(response: httpx.Response, field: str, why: str) -> None:
    assert response.status_code == 400, why
    _assert_error_json(response, why)
    param = response.json()["error"]["param"] or ""
    assert param == field or param.startswith(field + "."), why


@pytest.mark.parametrize("path", NUMERIC_ROUTES)
@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_out_of_range_numbers_are_a_400_naming_the_field(server, client, slots, path, data):
    slot = data.draw(st.sampled_from(slots[path]), label="slot")
    value = data.draw(slot.out_of_range(), label=f"{slot.field} ({slot.shape})")
    body = slot.put(json.loads(json.dumps(_VALID_BODIES[path])), value)
    response = _post(server, client, path, _encode(body))
    _assert_400_naming(response, slot.field, _describe(body, response, server))


@pytest.mark.parametrize("path", GENERATION_ROUTES)
@pytest.mark.parametrize("field, value", [("top_k", 10**30), ("stop_token_ids", [10**30]),
                                          ("max_tokens", 10**30), ("seed", 2**64),
                                          ("n", 10**30), ("logit_bias", {str(10**30): 1})])
def test_huge_integers_are_a_400_not_a_500(server, client, path, field, value):
    """The issue's cases: top_k and stop_token_ids of 10**30 reached the
    engine's wire format and came back as 500 internal_error."""
    body = {**_VALID_BODIES[path], field: value}
    response = _post(server, client, path, _encode(body))
    _assert_400_naming(response, field, _describe(body, response, server))


# -- afterwards -------------------------------------------------------------------------------


def test_server_survived_the_fuzzing(server, client):
    health = client.get("/health")
    assert health.status_code == 200, health.text + _tail(server)
    for path in ("/v1/models", "/version", "/metrics", "/carpool/policy"):
        assert client.get(path).status_code == 200, path
    after = client.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 2})
    assert after.status_code == 200, after.text + _tail(server)
    assert "Traceback" not in server.text(), _tail(server, 20000)
