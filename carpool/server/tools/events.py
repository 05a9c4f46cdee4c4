"""What the tool-call parsers return: parsed calls, and the streamed delta
events that map one to one onto OpenAI's ``choices[0].delta``."""
from __future__ import annotations

import random
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

_ID_ALPHABET = string.ascii_letters + string.digits
TOOL_CALL_ID_LENGTH = 24


class RandomSource(Protocol):
    """What an id needs from a random source (``random.Random`` has it)."""

    def choices(self, population: str, *, k: int) -> list[str]: ...


def new_tool_call_id(rng: RandomSource) -> str:
    """OpenAI's shape: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(rng.choices(_ID_ALPHABET, k=TOOL_CALL_ID_LENGTH))


def default_random_source() -> RandomSource:
    return random.SystemRandom()


@dataclass(frozen=True)
class ToolCall:
    """One function call; ``arguments`` is a JSON text (OpenAI's wire shape),
    exactly as the model wrote it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The ``message.tool_calls[i]`` object of a non-streamed response."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedTools:
    """A whole output split into plain content (None when there is none) and calls."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


def has_tool_calls(parsed: ParsedTools) -> bool:
    """Whether the response's ``finish_reason`` must be ``"tool_calls"``."""
    return bool(parsed.calls)


@dataclass(frozen=True)
class ContentDelta:
    """Plain text: ``{"content": text}``."""

    text: str

    def to_delta(self) -> dict[str, Any]:
        return {"content": self.text}


@dataclass(frozen=True)
class ToolCallStart:
    """A new call; always the first event of its index, before any arguments."""

    index: int
    id: str
    name: str

    def to_delta(self) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.index, "id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": ""}}]}


@dataclass(frozen=True)
class ToolCallArguments:
    """The next piece of call ``index``'s arguments text (clients concatenate them)."""

    index: int
    text: str

    def to_delta(self) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.index, "function": {"arguments": self.text}}]}


DeltaEvent = Union[ContentDelta, ToolCallStart, ToolCallArguments]


def merge_events(events: Iterable[DeltaEvent]) -> list[DeltaEvent]:
    """Joins neighbouring content pieces, and neighbouring argument pieces of
    the same call; drops empty pieces. The order of everything else is kept."""
    merged: list[DeltaEvent] = []
    for event in events:
        if isinstance(event, (ContentDelta, ToolCallArguments)) and not event.text:
            continue
        last = merged[-1] if merged else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            merged[-1] = ContentDelta(last.text + event.text)
        elif (isinstance(event, ToolCallArguments) and isinstance(last, ToolCallArguments)
              and last.index == event.index):
            merged[-1] = ToolCallArguments(event.index, last.text + event.text)
        else:
            merged.append(event)
    return merged


def accumulate(events: Iterable[DeltaEvent]) -> ParsedTools:
    """Rebuilds a whole result from streamed events, as a client does."""
    content: list[str] = []
    calls: list[dict[str, str]] = []
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls.append({"id": event.id, "name": event.name, "arguments": ""})
        else:
            calls[event.index]["arguments"] += event.text
    return ParsedTools("".join(content) or None, [ToolCall(**call) for call in calls])
