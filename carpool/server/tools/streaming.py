"""The per-request state machine every tool-call format builds on.

The stream keeps the whole output so far (``_text``) and a cursor (``_pos``)
up to which it has decided what the text is. Each state is a method that
reads from the cursor, emits events, moves the cursor and returns True when
it made progress; it returns False when it needs more text. Text that could
still be the start of a marker is never emitted as content: it waits until
the next delta, or the end of the stream, decides it.

Content rules, the same streamed and not: text outside tool-call blocks is
content, verbatim, except that when the output holds at least one call the
content's trailing whitespace is dropped (the newlines models put between
and after calls). A malformed block (bad JSON, a missing name, arguments
that are not an object, the output ending inside a call) turns the whole
output into plain content with no calls, as vLLM does; the stream can only
honour that while it has not yet emitted a call, so a block that goes wrong
after its call's name was streamed leaves that call as streamed and the rest
of the output (from the failed block on) arrives as content.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from .events import (
    ContentDelta,
    DeltaEvent,
    ParsedTools,
    RandomSource,
    ToolCallArguments,
    ToolCallStart,
    accumulate,
    default_random_source,
    merge_events,
    new_tool_call_id,
)
from .json_scan import ObjectScanner

_WHITESPACE = " \t\n\r"
_ARGUMENT_KEYS = ("arguments", "parameters")


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def partial_marker_length(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that a marker starts with
    (and that is not the whole marker): the part to hold back."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def find_first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(text.find(marker), marker) for marker in markers if marker in text]
    return min(found) if found else None


@dataclass
class _OpenCall:
    """The JSON object being scanned. ``name_in_object``: the object is
    ``{"name": ..., "arguments": {...}}``; otherwise it is the arguments
    themselves and the call was started before it (Mistral's ``[ARGS]``)."""

    scanner: ObjectScanner
    name_in_object: bool
    index: int | None = None
    arguments_sent_to: int | None = None
    arguments_key: str = "arguments"


class ToolCallStream:
    """Parses one request's output as it streams. ``feed(delta)`` and, once,
    ``finish()`` return the events to send; ``parse(text)`` does a whole output."""

    start_markers: tuple[str, ...] = ()

    def __init__(self, rng: RandomSource | None = None) -> None:
        self._rng = rng if rng is not None else default_random_source()
        self._text = ""
        self._pos = 0
        self._eof = False
        self._events: list[DeltaEvent] = []
        self._held_whitespace = ""
        self._call_count = 0
        self._region_start = 0
        self._failure: str | None = None
        self._call: _OpenCall | None = None
        self._after_object: Callable[[], bool] = self._in_content
        self._state: Callable[[], bool] = self._initial_state()

    @classmethod
    def parse(cls, text: str, rng: RandomSource | None = None) -> ParsedTools:
        """The non-streamed result; a malformed block makes it all content."""
        stream = cls(rng)
        events = stream.feed(text) + stream.finish()
        if stream.failure is not None:
            return ParsedTools(text or None, [])
        return accumulate(events)

    @property
    def failure(self) -> str | None:
        """Why a tool-call block was rejected, or None."""
        return self._failure

    @property
    def call_count(self) -> int:
        return self._call_count

    def feed(self, delta: str) -> list[DeltaEvent]:
        if self._eof:
            raise RuntimeError("feed() after finish()")
        self._text += delta
        self._run()
        return self._take_events()

    def finish(self) -> list[DeltaEvent]:
        if self._eof:
            return []
        self._eof = True
        self._run()
        if not self._call_count:
            self._events.append(ContentDelta(self._held_whitespace))
        self._held_whitespace = ""
        return self._take_events()

    def _initial_state(self) -> Callable[[], bool]:
        return self._in_content

    def _after_marker(self, marker: str) -> Callable[[], bool]:
        raise NotImplementedError

    def _run(self) -> None:
        while self._state():
            pass

    def _take_events(self) -> list[DeltaEvent]:
        events, self._events = merge_events(self._events), []
        return events

    # --- content -----------------------------------------------------------

    def _emit_content(self, text: str) -> None:
        combined = self._held_whitespace + text
        kept = combined.rstrip()
        if kept:
            self._events.append(ContentDelta(kept))
        self._held_whitespace = combined[len(kept):]

    def _in_content(self) -> bool:
        rest = self._text[self._pos:]
        hit = find_first_marker(rest, self.start_markers)
        if hit is not None:
            index, marker = hit
            self._emit_content(rest[:index])
            self._region_start = self._pos + index
            self._pos = self._region_start + len(marker)
            self._state = self._after_marker(marker)
            return True
        sendable = len(rest) - (0 if self._eof else partial_marker_length(rest, self.start_markers))
        self._emit_content(rest[:sendable])
        self._pos += sendable
        return False

    def _in_passthrough(self) -> bool:
        if self._pos < len(self._text):
            self._events.append(ContentDelta(self._text[self._pos:]))
            self._pos = len(self._text)
        return False

    def _fail(self, reason: str) -> bool:
        """Rejects the current block: it and everything after is content."""
        self._failure = reason
        self._events.append(ContentDelta(self._held_whitespace))
        self._held_whitespace = ""
        self._call = None
        self._pos = self._region_start
        self._state = self._in_passthrough
        return True

    # --- helpers for the format states ---------------------------------------

    def _next_char(self) -> str | None:
        """Skips whitespace; the next character, or None when there is none yet."""
        while self._pos < len(self._text) and self._text[self._pos] in _WHITESPACE:
            self._pos += 1
        return self._text[self._pos] if self._pos < len(self._text) else None

    def _match(self, literal: str) -> bool | None:
        """Whether the text at the cursor is ``literal``; None while undecided."""
        rest = self._text[self._pos:self._pos + len(literal)]
        if rest == literal:
            return True
        return None if literal.startswith(rest) else False

    def _wait(self, at_end: Callable[[], bool]) -> bool:
        """Needs more text; at the end of the output, ``at_end`` decides."""
        return at_end() if self._eof else False

    def _end_inside_block(self) -> bool:
        return self._fail("the output ended inside a tool-call block")

    def _accept_end(self) -> bool:
        self._pos = len(self._text)
        self._state = self._in_content
        return False

    def _start_call(self, name: str) -> int:
        index = self._call_count
        self._call_count += 1
        self._events.append(ToolCallStart(index, new_tool_call_id(self._rng), name))
        return index

    # --- JSON objects ---------------------------------------------------------

    def _begin_object(self, name_in_object: bool, then: Callable[[], bool],
                      index: int | None = None) -> bool:
        self._call = _OpenCall(ObjectScanner(self._pos), name_in_object, index)
        if index is not None:
            self._call.arguments_sent_to = self._pos
        self._after_object = then
        self._state = self._in_object
        return True

    def _in_object(self) -> bool:
        call = self._call
        assert call is not None
        call.scanner.scan(self._text)
        self._pos = call.scanner.cursor
        problem = call.scanner.error or self._publish(call)
        if problem is None and call.scanner.closed:
            problem = self._complete(call)
            if problem is None:
                self._call = None
                self._state = self._after_object
                return True
        if problem is not None:
            return self._fail(problem)
        return self._wait(self._end_inside_block)

    def _publish(self, call: _OpenCall) -> str | None:
        """Emits what the object's text so far decides: the call's start once
        its name is complete, then its arguments text up to the scan position."""
        if call.index is None:
            problem = self._publish_name(call)
            if problem is not None or call.index is None:
                return problem
        if call.arguments_sent_to is None:
            keys = [key for key in _ARGUMENT_KEYS if key in call.scanner.members]
            if not keys:
                return None
            if len(keys) > 1:
                return "a tool call has both 'arguments' and 'parameters'"
            start = call.scanner.members[keys[0]].start
            if self._text[start] != "{":
                return "a tool call's arguments are not a JSON object"
            call.arguments_sent_to = start
            call.arguments_key = keys[0]
        end = (call.scanner.open_member_end(call.arguments_key) if call.name_in_object
               else call.scanner.cursor)
        self._events.append(ToolCallArguments(call.index, self._text[call.arguments_sent_to:end]))
        call.arguments_sent_to = end
        return None

    def _publish_name(self, call: _OpenCall) -> str | None:
        span = call.scanner.members.get("name")
        if span is None or span.end is None:
            return None
        try:
            name = json.loads(self._text[span.start:span.end])
        except ValueError:
            name = None
        if not isinstance(name, str) or not name:
            return "a tool call's name is not a non-empty string"
        call.index = self._start_call(name)
        return None

    def _complete(self, call: _OpenCall) -> str | None:
        scanner = call.scanner
        try:
            json.loads(self._text[scanner.start:scanner.closed_at],
                       parse_constant=_reject_constant)
        except ValueError as error:
            return f"a tool call is not valid JSON: {error}"
        if call.index is None:
            return "a tool call has no name"
        if call.arguments_sent_to is None:
            self._events.append(ToolCallArguments(call.index, "{}"))
        return None
