"""An incremental scanner for one JSON object in a growing text.

It follows the object's structure character by character (strings and their
escapes, nested brackets, the ``key: value`` grammar of the top level) and
records where each top-level member's value starts and ends, as offsets into
the text. It does not decode values: whoever needs one slices the raw text,
and the whole object is checked with ``json.loads`` once it has closed. That
is what lets a tool call's ``arguments`` be streamed as the exact text the
model wrote, piece by piece, while the non-streamed parse returns that same
text in one piece.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

_WHITESPACE = " \t\n\r"
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")
_CLOSER = {"{": "}", "[": "]"}


@dataclass
class MemberSpan:
    """The raw text span ``[start, end)`` of one top-level member's value;
    ``end`` is None while the value is still open."""

    start: int
    end: int | None = None


@dataclass
class ObjectScanner:
    """Scans the JSON object that starts at ``text[start]`` (which must be
    ``{``, or whitespace before it). Call ``scan(text)`` whenever the text has
    grown; it stops right after the object's closing brace."""

    start: int
    cursor: int = field(init=False)
    members: dict[str, MemberSpan] = field(default_factory=dict)
    closed_at: int | None = None
    error: str | None = None
    _nesting: list[str] = field(default_factory=list)
    _phase: str = "open"
    _in_string: bool = False
    _escaped: bool = False
    _token_start: int = 0
    _key: str | None = None

    def __post_init__(self) -> None:
        self.cursor = self.start

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    def open_member_end(self, key: str) -> int | None:
        """Where the raw text of ``key``'s value ends so far: its end once
        complete, else the scan position; None when the value has not begun."""
        span = self.members.get(key)
        if span is None:
            return None
        return span.end if span.end is not None else self.cursor

    def scan(self, text: str) -> None:
        while self.cursor < len(text) and self.closed_at is None and self.error is None:
            char = text[self.cursor]
            if self._in_string:
                self._string_char(text, char)
            elif self._nesting[1:]:
                self._nested_char(char)
            else:
                self._top_level_char(text, char)
            self.cursor += 1

    def _fail(self, message: str) -> None:
        self.error = f"{message} at offset {self.cursor - self.start}"

    def _string_char(self, text: str, char: str) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self._in_string = False
            if not self._nesting[1:]:
                self._end_top_level_string(text)
        elif char < " ":
            self._fail("a control character inside a string")

    def _end_top_level_string(self, text: str) -> None:
        raw = text[self._token_start:self.cursor + 1]
        if self._phase == "key":
            self._key = json.loads(raw)
            if self._key in self.members:
                self._fail(f"duplicate key {self._key!r}")
            self._phase = "colon"
        else:
            self._end_value(self.cursor + 1)

    def _nested_char(self, char: str) -> None:
        if char == '"':
            self._in_string = True
        elif char in _CLOSER:
            self._nesting.append(char)
        elif char in "}]":
            if _CLOSER[self._nesting[-1]] != char:
                self._fail(f"mismatched {char!r}")
                return
            self._nesting.pop()
            if not self._nesting[1:]:
                self._end_value(self.cursor + 1)

    def _top_level_char(self, text: str, char: str) -> None:
        if self._phase == "scalar":
            if char in _SCALAR_CHARS:
                return
            self._end_value(self.cursor)
        if char in _WHITESPACE:
            return
        handler = {"open": self._on_open, "key": self._on_key, "first_key": self._on_key,
                   "colon": self._on_colon, "value": self._on_value,
                   "after_value": self._on_after_value}[self._phase]
        handler(char)

    def _on_open(self, char: str) -> None:
        if char != "{":
            self._fail(f"expected '{{', got {char!r}")
            return
        self._nesting.append("{")
        self._phase = "first_key"

    def _on_key(self, char: str) -> None:
        if char == '"':
            self._in_string = True
            self._token_start = self.cursor
            self._phase = "key"
        elif char == "}" and self._phase == "first_key":
            self._close()
        else:
            self._fail(f"expected a key, got {char!r}")

    def _on_colon(self, char: str) -> None:
        if char == ":":
            self._phase = "value"
        else:
            self._fail(f"expected ':', got {char!r}")

    def _on_value(self, char: str) -> None:
        assert self._key is not None
        self.members[self._key] = MemberSpan(self.cursor)
        self._token_start = self.cursor
        if char == '"':
            self._in_string = True
            self._phase = "string"
        elif char in _CLOSER:
            self._nesting.append(char)
            self._phase = "nested"
        elif char in _SCALAR_CHARS:
            self._phase = "scalar"
        else:
            self._fail(f"expected a value, got {char!r}")

    def _on_after_value(self, char: str) -> None:
        if char == ",":
            self._phase = "key"
        elif char == "}":
            self._close()
        else:
            self._fail(f"expected ',' or '}}', got {char!r}")

    def _end_value(self, end: int) -> None:
        assert self._key is not None
        self.members[self._key].end = end
        self._phase = "after_value"

    def _close(self) -> None:
        self._nesting.pop()
        self.closed_at = self.cursor + 1
