"""Reasoning parsers (carpool.server.reasoning_parsers): golden splits,
streamed == non-streamed under any split of the text, and the order with a
tool-call parser (reasoning first, its content on to the tool parser)."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.server.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningDelta,
    reasoning_parser,
    split_reasoning,
)
from carpool.server.tools import accumulate, tool_parser


def stream_deltas(parser, pieces: list[str]) -> list[ReasoningDelta]:
    stream = parser.stream()
    return [stream.feed(piece) for piece in pieces] + [stream.finish()]


def stream_split(parser, pieces: list[str]) -> tuple[str | None, str | None]:
    deltas = stream_deltas(parser, pieces)
    return ("".join(d.reasoning for d in deltas) or None,
            "".join(d.content for d in deltas) or None)


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


GOLDEN = [
    ("qwen3", "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
     "Let me think.", "The answer is 4."),
    ("qwen3", "The answer is 4.", None, "The answer is 4."),  # enable_thinking=False
    ("qwen3", "\n<think>\n\n</think>\n\nHi", None, "Hi"),
    ("qwen3", "<think>cut off by max_tokens", "cut off by max_tokens", None),
    ("qwen3", "a </think> b", None, "a </think> b"),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "  spaced  ", None, "  spaced  "),
    ("qwen3", "<think>2 < 3 and 5 > 4</think>Yes, 漢字 🙂", "2 < 3 and 5 > 4", "Yes, 漢字 🙂"),
    ("deepseek_r1", "Okay, so 2+2.\n</think>\n\n4", "Okay, so 2+2.", "4"),
    ("deepseek_r1", "<think>\nOkay.\n</think>\n\n4", "Okay.", "4"),
    ("deepseek_r1", "still thinking when it stopped", "still thinking when it stopped", None),
    ("deepseek_r1", "</think>direct", None, "direct"),
    ("deepseek_r1", "x</thi", "x</thi", None),
    ("deepseek_r1", "", None, None),
]


@pytest.mark.parametrize("name,text,reasoning,content", GOLDEN)
def test_golden_splits_stream_alike(name, text, reasoning, content):
    parser = reasoning_parser(name)
    assert parser.split(text) == (reasoning, content) == split_reasoning(name, text)
    assert stream_split(parser, list(text)) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert stream_split(parser, split_at(text, [cut])) == (reasoning, content)


def test_a_partial_tag_is_held_back_not_retracted():
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed("<th") == ReasoningDelta("", "")
    assert stream.feed("ink>Hmm </thi") == ReasoningDelta("Hmm", "")
    assert stream.feed("nk>\n\nSo") == ReasoningDelta("", "So")
    assert stream.finish() == ReasoningDelta("", "")
    with pytest.raises(RuntimeError):
        stream.feed("x")


def test_starts_in_reasoning_overrides_the_default():
    thinking_qwen = reasoning_parser("qwen3", starts_in_reasoning=True)
    assert thinking_qwen.split("Hmm.</think>Done") == ("Hmm.", "Done")
    assert reasoning_parser("deepseek_r1", starts_in_reasoning=False).split("Hi") == (None, "Hi")
    assert reasoning_parser("qwen3", starts_in_reasoning=False) is REASONING_PARSERS["qwen3"]
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser("granite")


TAGGY_TEXT = st.lists(st.sampled_from([*"<>/thinkTHINK ab\n漢🙂", "<think>", "</think>"]),
                      max_size=30).map("".join)
PLAIN_TEXT = st.text(st.characters(blacklist_characters="<", blacklist_categories=("Cs",)),
                     max_size=30)


@st.composite
def reasoning_output(draw):
    """(text, expected reasoning, expected content, starts_in_reasoning)."""
    thought, answer = draw(PLAIN_TEXT), draw(PLAIN_TEXT)
    shape = draw(st.sampled_from(["tagged", "untagged", "none", "unclosed"]))
    if shape == "none":
        return answer, None, answer or None, False
    if shape == "unclosed":
        thought, answer = thought + answer, ""
    opening = "<think>" if shape in ("tagged", "unclosed") else ""
    closing = "" if shape == "unclosed" else "</think>"
    text = draw(st.sampled_from(["", "\n"])) + opening + thought + closing + answer
    expected_content = None if shape == "unclosed" else answer.lstrip() or None
    return text, thought.strip() or None, expected_content, shape == "untagged"


def draw_pieces(draw, text: str) -> list[str]:
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=10))
    if draw(st.booleans()):
        cuts += list(range(0, len(text), draw(st.integers(1, 3))))
    return split_at(text, cuts)


@settings(max_examples=200, deadline=None)
@given(output=reasoning_output(), name=st.sampled_from(sorted(REASONING_PARSERS)),
       data=st.data())
def test_streamed_split_equals_the_whole_split(output, name, data):
    text, reasoning, content, starts_inside = output
    parser = reasoning_parser(name, starts_in_reasoning=starts_inside or None)
    if name == "qwen3" or starts_inside:
        assert parser.split(text) == (reasoning, content)
    deltas = stream_deltas(parser, draw_pieces(data.draw, text))
    assert ("".join(d.reasoning for d in deltas) or None,
            "".join(d.content for d in deltas) or None) == parser.split(text)
    for delta in deltas:  # the parts hold no "<": a tag's fragment never leaks
        assert "<" not in delta.reasoning + delta.content


@settings(max_examples=200, deadline=None)
@given(text=TAGGY_TEXT, name=st.sampled_from(sorted(REASONING_PARSERS)), data=st.data())
def test_tag_soup_streams_like_the_whole_split(text, name, data):
    parser = reasoning_parser(name)
    assert stream_split(parser, draw_pieces(data.draw, text)) == parser.split(text)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_reasoning_first_then_tool_calls_in_the_content(name):
    text = ('<think>\nMaybe <tool_call>{"name": "no", "arguments": {}}</tool_call>?\n</think>\n\n'
            'Checking.\n<tool_call>\n{"name": "get", "arguments": {"q": "x"}}\n</tool_call>')
    reasoning, content = reasoning_parser(name).split(text)
    assert reasoning.startswith("Maybe <tool_call>")
    whole = tool_parser("hermes").parse(content, random.Random(1))
    assert [(c.name, c.arguments) for c in whole.calls] == [("get", '{"q": "x"}')]
    thinking, tools = reasoning_parser(name).stream(), tool_parser("hermes")(random.Random(1))
    streamed_reasoning, events = "", []
    for piece in split_at(text, list(range(0, len(text), 3))):
        delta = thinking.feed(piece)
        streamed_reasoning += delta.reasoning
        events += tools.feed(delta.content)
    delta = thinking.finish()
    events += tools.feed(delta.content) + tools.finish()
    assert streamed_reasoning + delta.reasoning == reasoning
    assert accumulate(events) == whole
