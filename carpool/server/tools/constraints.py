"""What constrained decoding must produce when ``tool_choice`` forces calls.

``tool_call_constraint(parser, tools, choice)`` describes the output as
``prefix JSON suffix`` repeated one to ``max_calls`` times with
``separator`` between the repeats, where each JSON text matches
``call_schema``. The integrator turns that into a grammar (a regex/EBNF
wrapper around the schema, or structural tags: ``structural_tags()`` gives
one ``(begin, arguments schema, end)`` triple per allowed tool). Per format:

- ``hermes``: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``,
  calls separated by a newline.
- ``llama3_json``: ``{"name": "f", "parameters": {...}}``, calls separated by
  ``; `` (no ``<|python_tag|>``: Llama 3.1's template emits that only for
  its built-in tools).
- ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}]``, one
  bracketed call per ``[TOOL_CALLS]`` (the parser also takes several calls in
  one array, and v11's ``[TOOL_CALLS]f[ARGS]{...}``, the form of the
  structural tags).

For a named function, ``max_calls`` is 1; for ``required`` it is None (one or
more calls, any of the tools). ``none`` and ``auto`` constrain nothing.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .validation import ToolChoice, ToolSpec


@dataclass(frozen=True)
class _FormatText:
    arguments_key: str
    prefix: str
    suffix: str
    separator: str
    tag_begin: str  # with {name} and {key}: the structural tag's text before the arguments
    tag_end: str


_FORMATS: Mapping[str, _FormatText] = MappingProxyType({
    "hermes": _FormatText("arguments", "<tool_call>\n", "\n</tool_call>", "\n",
                          '<tool_call>\n{{"name": "{name}", "{key}": ', "}\n</tool_call>"),
    "llama3_json": _FormatText("parameters", "", "", "; ",
                               '{{"name": "{name}", "{key}": ', "}"),
    "mistral": _FormatText("arguments", "[TOOL_CALLS][", "]", "",
                           "[TOOL_CALLS]{name}[ARGS]", ""),
})


@dataclass(frozen=True)
class ToolCallConstraint:
    parser: str
    call_schema: Mapping[str, Any]
    prefix: str
    suffix: str
    separator: str
    max_calls: int | None
    tools: tuple[ToolSpec, ...]

    def structural_tags(self) -> tuple[tuple[str, Mapping[str, Any], str], ...]:
        """``(begin, parameters schema, end)`` per allowed tool."""
        text = _FORMATS[self.parser]
        return tuple((text.tag_begin.format(name=tool.name, key=text.arguments_key),
                      tool.parameters, text.tag_end) for tool in self.tools)


def _one_call_schema(tool: ToolSpec, arguments_key: str) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": tool.name}, arguments_key: dict(tool.parameters)},
            "required": ["name", arguments_key],
            "additionalProperties": False}


def tool_call_constraint(parser: str, tools: Sequence[ToolSpec],
                         choice: ToolChoice) -> ToolCallConstraint | None:
    """None unless ``choice`` forces calls; ValueError for an unknown parser."""
    if parser not in _FORMATS:
        raise ValueError(f"unknown tool-call parser {parser!r}; one of {', '.join(_FORMATS)}")
    if not choice.constrains_output:
        return None
    text = _FORMATS[parser]
    allowed = tuple(tool for tool in tools if choice.mode == "required" or tool.name == choice.name)
    if not allowed:
        raise ValueError("tool_choice allows none of the tools")
    schemas = [_one_call_schema(tool, text.arguments_key) for tool in allowed]
    call_schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return ToolCallConstraint(parser, call_schema, text.prefix, text.suffix, text.separator,
                              1 if choice.mode == "function" else None, allowed)
