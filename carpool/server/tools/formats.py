"""The tool-call formats, by vLLM's ``--tool-call-parser`` names.

``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): one or more
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, with
content before, between or after them; a last block whose closing tag is
cut off by the end of the output still counts.

``llama3_json`` (Llama 3.1/3.2 with JSON tool calls): an output that starts
(after whitespace) with ``{``, or holds ``<|python_tag|>`` followed by ``{``,
is one or more ``{"name": ..., "parameters": {...}}`` objects (``arguments``
is accepted too) separated by ``;``. Text after the last object is content.

``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
(tokenizers before v11) or ``[TOOL_CALLS]name[ARGS]{...}`` repeated once per
call (v11 and later; a ``[CALL_ID]id`` before ``[ARGS]`` is skipped, the
call gets our own id), with content before the first ``[TOOL_CALLS]``.

The markers ``<|python_tag|>``, ``[TOOL_CALLS]``, ``[ARGS]`` and
``[CALL_ID]`` are special tokens of their vocabularies: the detokenizer must
keep special tokens in the text it hands these parsers.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from types import MappingProxyType

from .events import ParsedTools, RandomSource
from .streaming import ToolCallStream


class HermesToolStream(ToolCallStream):
    OPEN_TAG = "<tool_call>"
    CLOSE_TAG = "</tool_call>"
    start_markers = (OPEN_TAG,)

    def _after_marker(self, marker: str) -> Callable[[], bool]:
        return self._open_block

    def _open_block(self) -> bool:
        char = self._next_char()
        if char is None:
            return self._wait(self._end_inside_block)
        if char != "{":
            return self._fail(f"expected a JSON object after {self.OPEN_TAG}")
        return self._begin_object(True, then=self._close_block)

    def _close_block(self) -> bool:
        if self._next_char() is None:
            return self._wait(self._accept_end)
        matched = self._match(self.CLOSE_TAG)
        if matched is None:
            return self._wait(self._accept_end)
        if not matched:
            return self._fail(f"expected {self.CLOSE_TAG} after a tool call")
        self._pos += len(self.CLOSE_TAG)
        self._state = self._in_content
        return True


class Llama3JsonToolStream(ToolCallStream):
    PYTHON_TAG = "<|python_tag|>"
    start_markers = (PYTHON_TAG,)

    def _initial_state(self) -> Callable[[], bool]:
        return self._output_start

    def _output_start(self) -> bool:
        rest = self._text[self._pos:]
        stripped = rest.lstrip()
        if not stripped and not self._eof:
            return False
        self._state = self._in_content
        if not stripped.startswith("{"):
            return True
        self._emit_content(rest[:len(rest) - len(stripped)])
        self._pos = self._region_start = len(self._text) - len(stripped)
        return self._begin_object(True, then=self._after_call)

    def _after_marker(self, marker: str) -> Callable[[], bool]:
        return self._next_object

    def _next_object(self) -> bool:
        char = self._next_char()
        if char is None:
            return self._wait(self._end_inside_block)
        if char != "{":
            return self._fail(f"expected a JSON object after {self.PYTHON_TAG}")
        return self._begin_object(True, then=self._after_call)

    def _after_call(self) -> bool:
        char = self._next_char()
        if char is None:
            return self._wait(self._accept_end)
        if char != ";":
            self._state = self._in_content
            return True
        self._pos += 1
        self._state = self._after_separator
        return True

    def _after_separator(self) -> bool:
        char = self._next_char()
        if char is None:
            return self._wait(self._accept_end)
        if char != "{":
            return self._fail("expected a JSON object after ';'")
        return self._begin_object(True, then=self._after_call)


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_MISTRAL_CALL_ID = re.compile(r"[A-Za-z0-9]{1,64}")


class MistralToolStream(ToolCallStream):
    TOOL_CALLS = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"
    start_markers = (TOOL_CALLS,)

    def __init__(self, rng: RandomSource | None = None) -> None:
        super().__init__(rng)
        self._pending_name = ""
        self._args_index = 0

    def _after_marker(self, marker: str) -> Callable[[], bool]:
        return self._open_block

    def _open_block(self) -> bool:
        char = self._next_char()
        if char is None:
            return self._wait(self._end_inside_block)
        if char == "[":
            self._pos += 1
            self._state = self._array_item
        else:
            self._state = self._call_name
        return True

    def _array_item(self) -> bool:
        char = self._next_char()
        if char is None:
            return self._wait(self._end_inside_block)
        if char != "{":
            return self._fail(f"expected a JSON object in the {self.TOOL_CALLS} array")
        return self._begin_object(True, then=self._array_next)

    def _array_next(self) -> bool:
        char = self._next_char()
        if char is None:
            return self._wait(self._accept_end)
        if char not in ",]":
            return self._fail(f"expected ',' or ']' in the {self.TOOL_CALLS} array")
        self._pos += 1
        self._state = self._array_item if char == "," else self._in_content
        return True

    def _call_name(self) -> bool:
        return self._word_then_tag(_MISTRAL_NAME, "name",
                                   {self.ARGS: self._on_args, self.CALL_ID: self._on_call_id})

    def _on_call_id(self, name: str) -> bool:
        self._pending_name = name
        self._state = self._call_id
        return True

    def _call_id(self) -> bool:
        return self._word_then_tag(_MISTRAL_CALL_ID, "call id",
                                   {self.ARGS: lambda _: self._on_args(self._pending_name)})

    def _word_then_tag(self, pattern: re.Pattern[str], what: str,
                       tags: Mapping[str, Callable[[str], bool]]) -> bool:
        """Reads a word up to the next ``[`` and the tag there; waits while
        either is cut off, and only then moves the cursor past both."""
        rest = self._text[self._pos:]
        bracket = rest.find("[")
        word = rest if bracket < 0 else rest[:bracket]
        if word and not pattern.fullmatch(word):
            return self._fail(f"a bad tool {what} after {self.TOOL_CALLS}")
        if bracket < 0:
            return self._wait(self._end_inside_block)
        if not word:
            return self._fail(f"no tool {what} after {self.TOOL_CALLS}")
        after = rest[bracket:]
        for tag, handler in tags.items():
            if after.startswith(tag):
                self._pos += bracket + len(tag)
                return handler(word)
        if any(tag.startswith(after) for tag in tags):
            return self._wait(self._end_inside_block)
        return self._fail(f"expected {' or '.join(tags)} after the tool {what}")

    def _on_args(self, name: str) -> bool:
        self._args_index = self._start_call(name)
        self._state = self._args_object
        return True

    def _args_object(self) -> bool:
        char = self._next_char()
        if char is None:
            return self._wait(self._end_inside_block)
        if char != "{":
            return self._fail(f"expected a JSON object after {self.ARGS}")
        return self._begin_object(False, then=self._in_content, index=self._args_index)


TOOL_PARSERS: Mapping[str, type[ToolCallStream]] = MappingProxyType({
    "hermes": HermesToolStream,
    "llama3_json": Llama3JsonToolStream,
    "mistral": MistralToolStream,
})


def tool_parser(name: str) -> type[ToolCallStream]:
    """The parser class for a ``--tool-call-parser`` name: ``cls.parse(text)``
    for a whole output, ``cls(rng)`` for a stream."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; "
                         f"one of {', '.join(sorted(TOOL_PARSERS))}") from None


def parse_tool_calls(parser: str, text: str, rng: RandomSource | None = None) -> ParsedTools:
    return tool_parser(parser).parse(text, rng)
