"""Request limits are defined once (carpool.limits): the HTTP request models,
SamplingParams and the server's header parsing accept exactly the same values."""
from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from carpool import limits
from carpool.sampling_params import SamplingParams
from carpool.server.protocol import ChatCompletionRequest, CompletionRequest

# (field, its bound, a value inside, values outside)
SAMPLING = [
    ("top_p", limits.TOP_P, 0.5, [0.0, 1.01]),
    ("min_p", limits.MIN_P, 0.5, [-0.1, 1.1]),
    ("repetition_penalty", limits.REPETITION_PENALTY, 1.1, [0.001, 11.0]),
    ("presence_penalty", limits.PRESENCE_PENALTY, 1.0, [-2.5, 2.5]),
    ("frequency_penalty", limits.FREQUENCY_PENALTY, -1.0, [-2.5, 2.5]),
    ("top_k", limits.TOP_K, 5, [-2, 2**31, 10**30]),
    ("max_tokens", limits.MAX_TOKENS, 3, [0, 2**31]),
    ("logprobs", limits.LOGPROBS, 20, [-1, 21]),
]


@pytest.mark.parametrize("name,bound,inside,outside", SAMPLING)
def test_http_model_and_sampling_params_agree(name, bound, inside, outside):
    CompletionRequest(prompt="x", **{name: inside})
    SamplingParams(**{name: inside})
    for value in outside:
        assert not bound.contains(value)
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="x", **{name: value})
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: value})


def test_temperature_keeps_openais_range_over_http_and_more_offline():
    """OpenAI's API (and carpool's before the limits moved) answers 400 above
    2; the engine, as vLLM's, samples up to 100."""
    CompletionRequest(prompt="x", temperature=limits.API_TEMPERATURE.hi)
    SamplingParams(temperature=limits.TEMPERATURE.hi)
    for value in (-0.1, 2.5):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="x", temperature=value)
        with pytest.raises(ValidationError):
            ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                  temperature=value)
    SamplingParams(temperature=2.5)
    for value in (-0.1, limits.TEMPERATURE.hi + 1):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=value)


def test_the_openapi_schema_states_the_limits():
    schema = CompletionRequest.model_json_schema()["properties"]
    assert schema["temperature"]["maximum"] == limits.API_TEMPERATURE.hi == 2.0
    assert schema["top_p"]["exclusiveMinimum"] == 0.0
    assert schema["session_id"]["anyOf"][0]["maxLength"] == limits.MAX_SESSION_ID_CHARS
    chat = ChatCompletionRequest.model_json_schema()["properties"]
    assert chat["top_logprobs"]["anyOf"][0]["maximum"] == limits.LOGPROBS.hi


def test_extension_limits():
    CompletionRequest(prompt="x", session_id="s" * limits.MAX_SESSION_ID_CHARS,
                      deadline_ms=limits.DEADLINE_MS.hi)
    for bad in ({"session_id": "s" * (limits.MAX_SESSION_ID_CHARS + 1)}, {"deadline_ms": 0},
                {"deadline_ms": limits.DEADLINE_MS.hi + 1}, {"max_wait_ms": -1}, {"n": 0}):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="x", **bad)
    stops = ["s"] * limits.MAX_STOP_STRINGS
    SamplingParams(stop=stops)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stops + ["t"])
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x" * (limits.MAX_STOP_STRING_CHARS + 1)])


def test_sampling_params_are_checked_once_and_immutable():
    params = SamplingParams(max_tokens=4, stop="end")
    assert params.stop == ["end"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 50.0  # would skip the check the engine relies on
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(params, temperature=-1.0)  # a copy is checked again


@pytest.mark.parametrize("bound,text", [
    (limits.TEMPERATURE, "[0, 100]"), (limits.TOP_P, "(0, 1]"), (limits.Bound(1), ">= 1"),
    (limits.MAX_TOKENS, "[1, 2147483647]"),
    (limits.DEADLINE_MS, "(0, 86400000]"), (limits.REPETITION_PENALTY, "[0.01, 10]"),
])
def test_bounds_describe_themselves(bound, text):
    assert bound.describe() == text
    assert not bound.contains(float("nan"))
