"""Reasoning parsers, by vLLM's ``--reasoning-parser`` names: split a
model's thought (``<think>...</think>``) from its answer, whole or streamed.

``qwen3``: the output is reasoning only when it opens with ``<think>``
(after whitespace); without it (``enable_thinking=False``, whose template
closes an empty thought in the prompt) everything is content, verbatim.
``deepseek_r1``: the template opens ``<think>`` in the prompt, so the output
starts inside the thought whether or not it repeats the tag; reasoning runs
to ``</think>``, or to the end of the output when the tag never comes. A
chat template that ends the prompt inside a thought (Qwen3's "-Thinking"
models) wants ``starts_in_reasoning=True`` on qwen3 as well (the server can
see it: the rendered prompt ends with ``<think>`` and whitespace).

Both: reasoning is stripped of surrounding whitespace, content after
``</think>`` of its leading whitespace; empty parts are None. The streamed
parts concatenate to exactly the non-streamed ones. A tag cut between two
deltas is held back, never emitted and then retracted.

Order with a tool parser: reasoning first. Feed each delta here, pass the
``content`` part on to the tool-call stream (``carpool.server.tools``), and
send the ``reasoning`` part as ``delta.reasoning_content``; for a whole
output, ``split`` first and parse tool calls in the content alone.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ReasoningDelta(NamedTuple):
    """What one delta adds to each part ("" when nothing)."""

    reasoning: str
    content: str


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_in_reasoning: bool
    open_tag: str = THINK_OPEN
    close_tag: str = THINK_CLOSE

    def split(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output."""
        stripped = text.lstrip()
        if stripped.startswith(self.open_tag):
            body = stripped[len(self.open_tag):]
        elif self.starts_in_reasoning:
            body = text
        else:
            return None, text or None
        reasoning, closed, content = body.partition(self.close_tag)
        return reasoning.strip() or None, (content.lstrip() or None) if closed else None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


REASONING_PARSERS: Mapping[str, ReasoningFormat] = MappingProxyType({
    "qwen3": ReasoningFormat("qwen3", starts_in_reasoning=False),
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_in_reasoning=True),
})


def reasoning_parser(name: str, starts_in_reasoning: bool | None = None) -> ReasoningFormat:
    """The format for a ``--reasoning-parser`` name; ``starts_in_reasoning``
    overrides its default (see the module's docstring)."""
    try:
        found = REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; "
                         f"one of {', '.join(sorted(REASONING_PARSERS))}") from None
    if starts_in_reasoning is None or starts_in_reasoning == found.starts_in_reasoning:
        return found
    return ReasoningFormat(name, starts_in_reasoning, found.open_tag, found.close_tag)


def _held_tag_length(text: str, tag: str) -> int:
    """The longest end of ``text`` that ``tag`` starts with (not all of it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ReasoningStream:
    """One request's streamed split: ``feed(delta)``, then ``finish()`` once."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self._format = fmt
        self._pending = ""  # text not yet classified (a possible tag)
        self._phase = "opening"  # opening -> reasoning -> content | plain
        self._reasoning_started = False
        self._reasoning_whitespace = ""  # trailing whitespace, sent once more text follows
        self._content_started = False
        self._done = False

    def feed(self, delta: str) -> ReasoningDelta:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._pending += delta
        return self._advance(at_end=False)

    def finish(self) -> ReasoningDelta:
        if self._done:
            return ReasoningDelta("", "")
        out = self._advance(at_end=True)
        self._done = True
        return out

    def _advance(self, at_end: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        if self._phase == "opening":
            self._open(at_end)
        if self._phase == "reasoning":
            reasoning.append(self._think(at_end))
        if self._phase == "content":
            content.append(self._answer())
        if self._phase == "plain":
            content.append(self._pending)
            self._pending = ""
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _open(self, at_end: bool) -> None:
        stripped = self._pending.lstrip()
        tag = self._format.open_tag
        if stripped.startswith(tag):
            self._pending = stripped[len(tag):]
            self._phase = "reasoning"
        elif tag.startswith(stripped) and not at_end:
            return
        else:
            self._phase = "reasoning" if self._format.starts_in_reasoning else "plain"

    def _think(self, at_end: bool) -> str:
        tag = self._format.close_tag
        before, closed, after = self._pending.partition(tag)
        if closed:
            self._pending = after
            self._phase = "content"
            out = self._trimmed_reasoning(before)
            self._reasoning_whitespace = ""
            return out
        held = 0 if at_end else _held_tag_length(before, tag)
        self._pending = before[len(before) - held:]
        out = self._trimmed_reasoning(before[:len(before) - held])
        if at_end:
            self._reasoning_whitespace = ""
        return out

    def _trimmed_reasoning(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        combined = self._reasoning_whitespace + text
        kept = combined.rstrip()
        self._reasoning_whitespace = combined[len(kept):]
        return kept

    def _answer(self) -> str:
        text, self._pending = self._pending, ""
        if not self._content_started:
            text = text.lstrip()
            self._content_started = bool(text)
        return text


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    return reasoning_parser(parser).split(text)
