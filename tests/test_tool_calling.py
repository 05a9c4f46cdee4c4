"""Tool calling and reasoning output through a live ``carpool serve`` on the
real default model, with the official ``openai`` client: named and required
tool choices (grammar-forced), ``auto`` through the Hermes parser, streamed
tool-call deltas rebuilt by the client's own accumulator, a tool result
going back into the next turn, ``reasoning_content``, and the 400s."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from server_utils import ServerProcess

from carpool.server.chat_output import ChatShape, plan_chat
from carpool.structured_output import StructuredOutput

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = Path(__file__).resolve().parents[1] / "examples" / "tool_chat_template_hermes.jinja"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# The server runs a reasoning parser, so a constraint would start after a
# thought; this small model never closes one, so most requests here close it
# in the prompt (the template's Qwen3-style switch) and are constrained whole.
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def test_plans_follow_vllm_rules():
    named = plan_chat(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None,
                      False, None)
    assert named.structured == StructuredOutput("json", json.dumps(TIME, sort_keys=True))
    required = json.loads(plan_chat(TOOLS, "required", None, False, None).structured.value)
    assert required["minItems"] == 1 and len(required["items"]["anyOf"]) == 2
    assert plan_chat(TOOLS, "none", None, False, None).structured is None
    with pytest.raises(ValueError, match="enable-auto-tool-choice"):
        plan_chat(TOOLS, "auto", None, False, None)
    with pytest.raises(ValueError, match="not one of the tools"):
        plan_chat(TOOLS, {"type": "function", "function": {"name": "nope"}}, None, False, None)


def test_a_forced_call_after_a_thought_keeps_both():
    """With a reasoning parser a forced choice's constraint starts after the
    thought: the thought goes to reasoning_content, the rest is the call."""
    choice = {"type": "function", "function": {"name": "get_time"}}
    plan = plan_chat(TOOLS, choice, None, False, "qwen3")
    assert plan.constraint(None).reasoning == "optional"
    # A template that opens the thought in the prompt: the output starts inside it.
    opened = plan.opened_by("<|im_start|>assistant\n<think>\n")
    assert opened.reasoning.starts_in_reasoning and opened.constraint(None).reasoning == "inside"
    assert plan.opened_by("<|im_start|>assistant\n") is plan
    closed = plan.opened_by("assistant\n<think>\n\n</think>\n\n")
    assert closed.constraint(None).reasoning == "" and closed.reasoning is not None
    text = '<think>UTC is asked.</think>\n\n{"zone": "UTC"}'
    shape = ChatShape(plan)
    message, finish = shape.message(text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert message["reasoning_content"] == "UTC is asked."
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_time", "arguments": '{"zone": "UTC"}'}]
    stream = shape.stream()
    deltas = [d for i in range(0, len(text), 5) for d in stream.feed(text[i:i + 5])]
    deltas += stream.finish()
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "UTC is asked."
    arguments = "".join(c["function"]["arguments"] for d in deltas
                        for c in d.get("tool_calls", []))
    assert arguments == '{"zone": "UTC"}' and stream.called


@pytest.fixture(scope="module")
def server(real_model_path):
    with ServerProcess([str(real_model_path), "--served-model-name", MODEL,
                        "--max-num-seqs", "8", "--kv-cache-memory", "256MiB",
                        "--chat-template", str(TEMPLATE), "--tool-call-parser", "hermes",
                        "--enable-auto-tool-choice", "--reasoning-parser", "qwen3"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_always_called_with_valid_arguments(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           tool_choice=choice, max_tokens=60, temperature=0,
                                           extra_body=NO_THINK)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    _check_calls(message.tool_calls, {"get_weather"})
    # Streamed: the client's own accumulator rebuilds the same call.
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS,
                                        tool_choice=choice, max_tokens=60,
                                        temperature=0, extra_body=NO_THINK) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert final.choices[0].finish_reason == "tool_calls"


def test_required_calls_one_of_the_tools_streamed_and_not(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                  max_tokens=120, temperature=0, extra_body=NO_THINK)
    message = client.chat.completions.create(**kwargs).choices[0].message
    _check_calls(message.tool_calls, set(SCHEMAS))
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    assert [c.function.arguments for c in final.choices[0].message.tool_calls] == \
        [c.function.arguments for c in message.tool_calls]


def test_auto_parses_the_models_own_call_format_and_the_result_goes_back(client):
    # The model is steered (a regex) into Hermes' format; the parser finds the call.
    forced = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n' \
             r'</tool_call>'
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                  extra_body={"guided_regex": forced, **NO_THINK})
    reply = client.chat.completions.create(**kwargs)
    assert reply.choices[0].finish_reason == "tool_calls"
    call = reply.choices[0].message.tool_calls[0]
    _check_calls([call], {"get_time"})
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'}]
    after = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS,
                                           tool_choice="none", max_tokens=8, temperature=0)
    assert after.choices[0].message.tool_calls is None
    assert after.usage.prompt_tokens > reply.usage.prompt_tokens


def test_reasoning_goes_to_reasoning_content(client):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                  extra_body={"guided_regex": r"<think>[a-z ]{3,20}</think>[A-Z][a-z ]{2,20}",
                              **NO_THINK})
    message = client.chat.completions.create(**kwargs).choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert thought and "<think>" not in thought and "</think>" not in message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == thought
    assert "".join(d.content or "" for d in deltas) == message.content


def test_a_forced_call_leaves_the_thought_free(client):
    """Thinking allowed (the template leaves the thought open): the grammar
    waits for the thought, which is free text; this model rambles in it
    until the budget ends, so the reply is all reasoning and no call."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=40,
                  temperature=0)
    reply = client.chat.completions.create(**kwargs).choices[0]
    thought = reply.message.model_extra["reasoning_content"]
    assert reply.finish_reason == "length" and not reply.message.tool_calls
    assert len(thought.split()) > 5 and not thought.lstrip().startswith("{")
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                   for c in chunks if c.choices) == thought


@pytest.mark.parametrize("extra,needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not one of"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot both"),
    ({"chat_template_kwargs": {"tools": []}}, "cannot set tools"),
    ({"chat_template_kwargs": {"x": "y" * 5000}}, "over 4096 bytes"),
])
def test_bad_tool_requests_are_400s(client, extra, needle):
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError, match=needle):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                       extra_body=body)


def test_a_template_without_tools_refuses_them(real_model_path):
    with ServerProcess([str(real_model_path), "--served-model-name", MODEL,
                        "--kv-cache-memory", "64MiB"]) as proc:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not render tools"):
            client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           max_tokens=4)
