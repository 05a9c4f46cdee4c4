"""Tool-call parsers (carpool.server.tools): golden outputs of each format,
streamed == non-streamed under any split of the text (accumulated as the
openai client does), the request-side checks and the forced-choice constraints."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.server.tools import (
    MAX_TOOL_SCHEMA_BYTES,
    MAX_TOOLS,
    TOOL_PARSERS,
    ContentDelta,
    ParsedTools,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolChoice,
    has_tool_calls,
    parse_tool_calls,
    tool_call_constraint,
    tool_parser,
    validate_tool_choice,
    validate_tools,
)

accumulate_delta = pytest.importorskip("openai.lib.streaming._deltas").accumulate_delta

MARKER_CHARS = "<[{|"


def calls_of(parsed: ParsedTools) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in parsed.calls]


def stream_events(parser: str, pieces: list[str], seed: int = 0) -> list:
    stream = tool_parser(parser)(random.Random(seed))
    events = []
    for piece in pieces:
        events += stream.feed(piece)
    return events + stream.finish()


def client_view(events: list) -> ParsedTools:
    """What the openai client rebuilds from the chunks' deltas."""
    message: dict = {}
    for event in events:
        accumulate_delta(message, event.to_delta())
    calls = [(call["function"]["name"], call["function"]["arguments"], call["id"], call["type"])
             for call in message.get("tool_calls") or []]
    assert all(kind == "function" for *_, kind in calls)
    return ParsedTools(message.get("content") or None,
                       [ToolCall(id_, name, args) for name, args, id_, _ in calls])


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def assert_stream_matches(parser: str, text: str, pieces: list[str]) -> ParsedTools:
    """The streamed result equals the whole one; except that a block found
    malformed after its call's name was streamed keeps that call (the stream
    cannot take it back) and the whole text is then content."""
    whole = tool_parser(parser).parse(text, random.Random(7))
    stream = tool_parser(parser)(random.Random(7))
    events = [event for piece in pieces for event in stream.feed(piece)] + stream.finish()
    streamed = client_view(events)
    if whole.calls or not streamed.calls:
        assert streamed == whole
    else:
        assert stream.failure is not None and whole.content == text
        assert text.endswith(streamed.content or "")
    starts = [event.index for event in events if isinstance(event, ToolCallStart)]
    assert starts == list(range(len(streamed.calls)))  # each call's name once, in order
    seen: set[int] = set()
    for event in events:
        if isinstance(event, ToolCallStart):
            seen.add(event.index)
        elif isinstance(event, ToolCallArguments):
            assert event.index in seen  # arguments never before their call's name
    return whole


# --- golden examples --------------------------------------------------------

NESTED_ARGS = '{"code": "if (a) { b(\\"}\\"); }", "deep": {"list": [1, {"x": "]"}], "e": null}}'
UNICODE_ARGS = '{"city": "Zürich", "note": "漢字 🙂 \\u00e9"}'

GOLDEN = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", '{"city": "Paris"}')]),
    ("hermes", 'Let me check both.\n\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
     '<tool_call>\n{"arguments": {"n": 2}, "name": "b"}\n</tool_call>\n',
     "Let me check both.", [("a", "{}"), ("b", '{"n": 2}')]),
    ("hermes", f'<tool_call>{{"name": "run", "arguments": {NESTED_ARGS}}}</tool_call>',
     None, [("run", NESTED_ARGS)]),
    ("hermes", f'<tool_call>{{"name": "w", "arguments": {UNICODE_ARGS}}}', None,
     [("w", UNICODE_ARGS)]),  # closing tag cut off by the end of the output
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
    ("hermes", 'Use <tool_call> tags? 1 < 2', 'Use <tool_call> tags? 1 < 2', []),
    ("hermes", 'plain answer\n', 'plain answer\n', []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     None, [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": '
     f'{UNICODE_ARGS}}}', None, [("a", "{}"), ("b", UNICODE_ARGS)]),
    ("llama3_json", f'  {{"name": "run", "parameters": {NESTED_ARGS}}}\n', None,
     [("run", NESTED_ARGS)]),
    ("llama3_json", 'Sure: <|python_tag|>{"name": "a", "parameters": {"x": [1]}}',
     "Sure:", [("a", '{"x": [1]}')]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", 'The JSON is {"name": "x"}', 'The JSON is {"name": "x"}', []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}',
     []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     None, [("get_weather", '{"city": "Paris"}')]),
    ("mistral", f'Checking. [TOOL_CALLS] [{{"name": "a", "arguments": {NESTED_ARGS}}}, '
     f'{{"name": "b", "arguments": {UNICODE_ARGS}}}]', "Checking.",
     [("a", NESTED_ARGS), ("b", UNICODE_ARGS)]),
    ("mistral", f'[TOOL_CALLS]get_weather[ARGS]{{"city": "Paris"}}[TOOL_CALLS]run[ARGS]{NESTED_ARGS}',
     None, [("get_weather", '{"city": "Paris"}'), ("run", NESTED_ARGS)]),
    ("mistral", '[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{"x": 1}', None, [("f", '{"x": 1}')]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}',
     '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}', []),
    ("mistral", '[TOOL_CALLS]bad name[ARGS]{}', '[TOOL_CALLS]bad name[ARGS]{}', []),
    ("mistral", 'Arrays look like [1, 2].', 'Arrays look like [1, 2].', []),
]


@pytest.mark.parametrize("parser,text,content,calls", GOLDEN)
def test_golden_outputs_parse_and_stream_alike(parser, text, content, calls):
    parsed = parse_tool_calls(parser, text)
    assert parsed.content == content
    assert calls_of(parsed) == calls
    assert has_tool_calls(parsed) == bool(calls)
    for call in parsed.calls:
        assert json.loads(call.arguments) is not None
        assert call.id.startswith("call_") and len(call.id) == 29 and call.id[5:].isalnum()
    assert_stream_matches(parser, text, list(text))  # one character at a time
    for cut in range(len(text) + 1):
        assert_stream_matches(parser, text, split_at(text, [cut]))


def test_a_held_back_marker_prefix_is_content_once_the_output_ends():
    for parser, text, held in [("hermes", "a <tool_ca", " <tool_ca"),
                               ("llama3_json", "x <|python", " <|python"),
                               ("mistral", "y [TOOL_CA", " [TOOL_CA")]:
        stream = tool_parser(parser)()
        assert stream.feed(text) == [ContentDelta(text[:-len(held)])]
        assert stream.finish() == [ContentDelta(held)]


def test_content_is_never_shown_then_retracted():
    stream = tool_parser("hermes")(random.Random(0))
    assert stream.feed("Hi <tool") == [ContentDelta("Hi")]
    assert stream.feed("_call>") == []
    start = stream.feed('{"name": "f", "arguments": {"a"')
    assert isinstance(start[0], ToolCallStart) and start[0].name == "f"
    assert start[1:] == [ToolCallArguments(0, '{"a"')]
    assert stream.feed(': 1}}</tool_call>  ') == [ToolCallArguments(0, ": 1}")]
    assert stream.finish() == []


def test_event_deltas_have_openais_shapes():
    events = stream_events("hermes", ['ok <tool_call>{"name": "f", "arguments": {}}</tool_call>'],
                           seed=3)
    assert events[0].to_delta() == {"content": "ok"}
    start = events[1].to_delta()["tool_calls"][0]
    assert start["index"] == 0 and start["type"] == "function" and start["id"].startswith("call_")
    assert start["function"] == {"name": "f", "arguments": ""}
    assert events[2].to_delta() == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    call = parse_tool_calls("hermes", "<tool_call>{\"name\": \"f\"}</tool_call>").calls[0]
    assert call.to_openai()["function"] == {"name": "f", "arguments": "{}"}


def test_ids_come_from_the_injected_random_source():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    first = tool_parser("hermes").parse(text, random.Random(5)).calls[0].id
    assert first == tool_parser("hermes").parse(text, random.Random(5)).calls[0].id
    assert first != tool_parser("hermes").parse(text, random.Random(6)).calls[0].id


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        tool_parser("pythonic")
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}


def test_feed_after_finish_is_an_error():
    stream = tool_parser("hermes")()
    stream.finish()
    assert stream.finish() == []
    with pytest.raises(RuntimeError):
        stream.feed("x")


# --- streamed == non-streamed, for random calls in each format -------------

JSON_SCALARS = (st.none() | st.booleans() | st.integers(-10**12, 10**12)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)
ARGUMENTS = st.dictionaries(st.text(max_size=10), JSON_VALUES, max_size=5)
NAMES = st.from_regex(r"[a-zA-Z0-9_-]{1,24}", fullmatch=True)
# content free of every marker's first character, so that no content delta
# may hold a marker fragment; multi-byte and astral characters included
CONTENT = st.text(st.characters(blacklist_characters=MARKER_CHARS, blacklist_categories=("Cs",)),
                  max_size=30)
DUMP_STYLES = st.sampled_from([{}, {"ensure_ascii": False}, {"indent": 2},
                               {"separators": (",", ":"), "ensure_ascii": False}])


def render_call_object(draw, name: str, key: str, arguments_text: str) -> str:
    parts = [f'"name": {json.dumps(name)}', f'"{key}": {arguments_text}']
    if draw(st.booleans()):
        parts.reverse()
    return "{" + draw(st.sampled_from([", ", ",", ",\n  "])).join(parts) + "}"


@st.composite
def formatted_output(draw, parser: str):
    calls = [(draw(NAMES), json.dumps(draw(ARGUMENTS), **draw(DUMP_STYLES)))
             for _ in range(draw(st.integers(1, 3)))]
    prefix = draw(CONTENT)
    if parser == "hermes":
        blocks = [f"<tool_call>\n{render_call_object(draw, n, 'arguments', a)}\n</tool_call>"
                  for n, a in calls]
        text = prefix + "\n".join(blocks) + draw(st.sampled_from(["", "\n"]))
    elif parser == "llama3_json":
        objects = "; ".join(render_call_object(draw, n, "parameters", a) for n, a in calls)
        tagged = draw(st.booleans())
        prefix = prefix if tagged else draw(st.sampled_from(["", " ", "\n"]))
        text = prefix + ("<|python_tag|>" if tagged else "") + objects
    elif draw(st.booleans()):
        objects = ", ".join(render_call_object(draw, n, "arguments", a) for n, a in calls)
        text = f"{prefix}[TOOL_CALLS][{objects}]"
    else:
        text = prefix + "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in calls)
    return text, prefix.rstrip() or None, calls


def draw_pieces(draw, text: str) -> list[str]:
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=12))
    if draw(st.booleans()):  # also the token-like splits: a few characters each
        step = draw(st.integers(1, 4))
        cuts += list(range(0, len(text), step))
    return split_at(text, cuts)


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_streamed_calls_rebuild_the_non_streamed_parse(parser, data):
    text, content, calls = data.draw(formatted_output(parser))
    whole = assert_stream_matches(parser, text, draw_pieces(data.draw, text))
    assert whole.content == content
    assert calls_of(whole) == calls
    for event in stream_events(parser, draw_pieces(data.draw, text)):
        if isinstance(event, ContentDelta):
            assert not set(event.text) & set(MARKER_CHARS), event


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@settings(max_examples=100, deadline=None)
@given(text=st.text(st.sampled_from('<>[]{}|"\\:;, \nab_ntool_cal/TOOLS_CAR{}python_tag'),
                    max_size=60), data=st.data())
def test_arbitrary_text_never_crashes_and_streams_consistently(parser, text, data):
    assert_stream_matches(parser, text, draw_pieces(data.draw, text))


# --- request-side checks ------------------------------------------------------

def tool(name="get_weather", parameters=None, **function):
    spec = {"name": name, **function}
    if parameters is not None:
        spec["parameters"] = parameters
    return {"type": "function", "function": spec}


def test_valid_tools_and_choices():
    tools = validate_tools([tool(parameters={"type": "object",
                                             "properties": {"city": {"type": "string"}},
                                             "required": ["city"]}),
                            tool("noop", description="does nothing")])
    assert [t.name for t in tools] == ["get_weather", "noop"]
    assert tools[1].parameters == {"type": "object", "properties": {}}
    assert validate_tools(None) == ()
    assert validate_tool_choice(None, tools) == ToolChoice("auto")
    assert validate_tool_choice(None, ()) == ToolChoice("none")
    assert validate_tool_choice("required", tools).constrains_output
    assert validate_tool_choice({"type": "function", "function": {"name": "noop"}},
                                tools) == ToolChoice("function", "noop")


@pytest.mark.parametrize("tools,field", [
    ("nope", "tools must be a list"),
    ([tool()] * (MAX_TOOLS + 1), "at most 128"),
    ([{"type": "retrieval"}], r"tools\[0\].type"),
    ([tool(), tool()], r"tools\[1\].function.name 'get_weather' duplicates tools\[0\]"),
    ([tool("bad name")], r"tools\[0\].function.name must match"),
    ([tool("x" * 65)], r"tools\[0\].function.name"),
    ([{"type": "function"}], r"tools\[0\].function must be an object"),
    ([tool(parameters={"type": "array"})], r"tools\[0\].function.parameters.type"),
    ([tool(parameters=[1])], r"tools\[0\].function.parameters must be a JSON schema"),
    ([tool(parameters={"properties": []})], r"parameters.properties"),
    ([tool(parameters={"required": "city"})], r"parameters.required"),
    ([tool(parameters={"description": "x" * MAX_TOOL_SCHEMA_BYTES})], r"at most 65536"),
    ([tool(description=3)], r"tools\[0\].function.description"),
])
def test_bad_tools_name_the_field(tools, field):
    with pytest.raises(ValueError, match=field):
        validate_tools(tools)


@pytest.mark.parametrize("choice,field", [
    ("always", "tool_choice must be one of none, auto, required"),
    (3, "tool_choice must be a string or an object"),
    ({"type": "tool", "function": {"name": "f"}}, "tool_choice.type"),
    ({"type": "function"}, "tool_choice.function.name must be a string"),
    ({"type": "function", "function": {"name": "other"}}, "'other' is not one of the tools"),
])
def test_bad_tool_choices_name_the_field(choice, field):
    with pytest.raises(ValueError, match=field):
        validate_tool_choice(choice, validate_tools([tool()]))
    with pytest.raises(ValueError, match="needs a non-empty tools list"):
        validate_tool_choice("required", ())


# --- forced tool choice: the text the grammar must produce parses back --------

CONSTRAINT_TOOLS = [tool(parameters={"type": "object", "properties": {"city": {"type": "string"}}}),
                    tool("noop")]


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_constrained_text_parses_back_to_the_calls(parser):
    tools = validate_tools(CONSTRAINT_TOOLS)
    assert tool_call_constraint(parser, tools, ToolChoice("auto")) is None
    required = tool_call_constraint(parser, tools, ToolChoice("required"))
    assert required.max_calls is None
    assert [s["properties"]["name"]["const"] for s in required.call_schema["anyOf"]] == [
        "get_weather", "noop"]
    key = "parameters" if parser == "llama3_json" else "arguments"
    instances = [{"name": "get_weather", key: {"city": "Zürich"}}, {"name": "noop", key: {}}]
    text = required.separator.join(required.prefix + json.dumps(instance, ensure_ascii=False)
                                   + required.suffix for instance in instances)
    parsed = parse_tool_calls(parser, text)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Zürich"}), ("noop", {})]
    tagged = "".join(begin + json.dumps({"city": "Oslo"}) + end
                     for begin, _, end in required.structural_tags()[:1])
    assert calls_of(parse_tool_calls(parser, tagged)) == [("get_weather", '{"city": "Oslo"}')]
    named = tool_call_constraint(parser, tools, ToolChoice("function", "noop"))
    assert named.max_calls == 1
    assert named.call_schema["properties"]["name"] == {"const": "noop"}
    assert named.call_schema["required"] == ["name", key]
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_call_constraint("nope", tools, ToolChoice("required"))
