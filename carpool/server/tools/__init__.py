"""Tool calling on the text side: parsing model output into OpenAI tool
calls (whole or streamed), checking a request's ``tools`` and
``tool_choice``, and the constraint forced tool choices put on the output.
No torch, no engine: plain Python.

Order with a reasoning parser: the reasoning parser splits the output first;
only its content (the text after ``</think>``) goes on to the tool parser,
so a call written inside the thought is never executed.
"""
from .constraints import ToolCallConstraint, tool_call_constraint
from .events import (
    ContentDelta,
    DeltaEvent,
    ParsedTools,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    accumulate,
    has_tool_calls,
    merge_events,
    new_tool_call_id,
)
from .formats import (
    TOOL_PARSERS,
    HermesToolStream,
    Llama3JsonToolStream,
    MistralToolStream,
    parse_tool_calls,
    tool_parser,
)
from .streaming import ToolCallStream
from .validation import (
    MAX_TOOL_SCHEMA_BYTES,
    MAX_TOOLS,
    TOOL_NAME_PATTERN,
    ToolChoice,
    ToolSpec,
    validate_tool_choice,
    validate_tools,
)

__all__ = [
    "MAX_TOOLS", "MAX_TOOL_SCHEMA_BYTES", "TOOL_NAME_PATTERN", "TOOL_PARSERS",
    "ContentDelta", "DeltaEvent", "HermesToolStream", "Llama3JsonToolStream",
    "MistralToolStream", "ParsedTools", "ToolCall", "ToolCallArguments",
    "ToolCallConstraint", "ToolCallStart", "ToolCallStream", "ToolChoice", "ToolSpec",
    "accumulate", "has_tool_calls", "merge_events", "new_tool_call_id", "parse_tool_calls",
    "tool_call_constraint", "tool_parser", "validate_tool_choice", "validate_tools",
]
