"""Checks of a request's ``tools`` and ``tool_choice`` (plain functions:
each raises ValueError with a message that names the offending field).

The limits are this module's constants (not ``carpool.limits``, which is
outside the tool parsers' files): MAX_TOOLS tools, each ``parameters``
schema at most MAX_TOOL_SCHEMA_BYTES once serialized as compact JSON.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

MAX_TOOLS = 128
MAX_TOOL_SCHEMA_BYTES = 64 * 1024
MAX_TOOL_DESCRIPTION_CHARS = 16 * 1024
TOOL_NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
TOOL_CHOICE_MODES = ("none", "auto", "required")
EMPTY_PARAMETERS: Mapping[str, Any] = MappingProxyType({"type": "object", "properties": {}})


@dataclass(frozen=True)
class ToolSpec:
    """One checked ``{"type": "function", "function": {...}}`` entry."""

    name: str
    description: str | None
    parameters: Mapping[str, Any]


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` is none, auto, required or function (``name`` set for the last)."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None

    @property
    def constrains_output(self) -> bool:
        """Whether the output must be tool calls (a grammar applies)."""
        return self.mode in ("required", "function")


def validate_tools(tools: Any) -> tuple[ToolSpec, ...]:
    """The ``tools`` field (None or absent: no tools)."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of tool objects")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools has {len(tools)} entries; at most {MAX_TOOLS}")
    specs: list[ToolSpec] = []
    first_index: dict[str, int] = {}
    for index, tool in enumerate(tools):
        spec = _validate_tool(tool, f"tools[{index}]")
        if spec.name in first_index:
            raise ValueError(f"tools[{index}].function.name {spec.name!r} duplicates "
                             f"tools[{first_index[spec.name]}]")
        first_index[spec.name] = index
        specs.append(spec)
    return tuple(specs)


def _validate_tool(tool: Any, where: str) -> ToolSpec:
    if not isinstance(tool, dict):
        raise ValueError(f"{where} must be an object")
    if tool.get("type") != "function":
        raise ValueError(f"{where}.type must be 'function', got {str(tool.get('type'))[:40]!r}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME_PATTERN.match(name):
        raise ValueError(f"{where}.function.name must match {TOOL_NAME_PATTERN.pattern}, "
                         f"got {str(name)[:80]!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    if description is not None and len(description) > MAX_TOOL_DESCRIPTION_CHARS:
        raise ValueError(f"{where}.function.description has {len(description)} characters; "
                         f"at most {MAX_TOOL_DESCRIPTION_CHARS}")
    parameters = _validate_parameters(function.get("parameters"), f"{where}.function.parameters")
    return ToolSpec(name, description, parameters)


def _validate_parameters(parameters: Any, where: str) -> Mapping[str, Any]:
    if parameters is None:
        return EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise ValueError(f"{where} must be a JSON schema object")
    try:
        size = len(json.dumps(parameters, separators=(",", ":")).encode())
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} is not serializable JSON: {error}") from None
    if size > MAX_TOOL_SCHEMA_BYTES:
        raise ValueError(f"{where} is {size} bytes as JSON; at most {MAX_TOOL_SCHEMA_BYTES}")
    if parameters.get("type", "object") != "object":
        raise ValueError(f"{where}.type must be 'object', got {str(parameters['type'])[:40]!r}")
    if not isinstance(parameters.get("properties", {}), dict):
        raise ValueError(f"{where}.properties must be an object")
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(key, str) for key in required):
        raise ValueError(f"{where}.required must be a list of property names")
    return parameters


def validate_tool_choice(tool_choice: Any, tools: Sequence[ToolSpec]) -> ToolChoice:
    """The ``tool_choice`` field against the checked tools. Absent: ``auto``
    with tools, ``none`` without (OpenAI's defaults)."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICE_MODES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} "
                             f"or a function object, got {tool_choice[:40]!r}")
        if tool_choice == "required" and not tools:
            raise ValueError("tool_choice 'required' needs a non-empty tools list")
        return ToolChoice(tool_choice)  # type: ignore[arg-type]
    if not isinstance(tool_choice, dict):
        raise ValueError("tool_choice must be a string or an object")
    if tool_choice.get("type") != "function":
        raise ValueError("tool_choice.type must be 'function'")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice.function.name must be a string")
    if name not in {tool.name for tool in tools}:
        raise ValueError(f"tool_choice.function.name {name[:80]!r} is not one of the tools")
    return ToolChoice("function", name)
