"""A chat request's tools and reasoning, from its fields to its response:
``plan_chat`` checks ``tools`` / ``tool_choice`` against the server's
parsers, and ``ChatShape`` turns the model's text into the message (or the
streamed deltas) OpenAI's clients read: ``content``, ``reasoning_content``
and ``tool_calls``, with ``finish_reason`` ``tool_calls`` when it called.

Tool choices, as vLLM serves them:

* ``auto`` (needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``):
  the model writes calls in its own format; the parser finds them.
* a named function: the output is constrained to that function's
  arguments (its JSON schema): the whole output is the call.
* ``required``: the output is constrained to a JSON list of
  ``{"name", "parameters"}`` objects, one of the tools each (at least one).
* ``none``: plain text, the tools still rendered into the prompt.

Reasoning (``--reasoning-parser``) splits the thought off first; the tool
parser (or a forced choice's reading) takes the content after it. A
constraint (a forced choice's, or ``response_format``'s) then starts after
the thought, as vLLM's does: the thought itself is free text.
"""
from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from typing import Any

from carpool.server.reasoning_parsers import ReasoningFormat, reasoning_parser
from carpool.server.tools import (
    ToolCall,
    ToolCallStream,
    ToolChoice,
    ToolSpec,
    new_tool_call_id,
    tool_parser,
    validate_tool_choice,
    validate_tools,
)
from carpool.structured_output import StructuredOutput


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request's tools and reasoning ask of the engine and the response."""

    tools: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = ToolChoice("none")
    parser: type[ToolCallStream] | None = None  # auto: the model's own call format
    reasoning: ReasoningFormat | None = None
    structured: StructuredOutput | None = None  # forced tool choices' constraint
    thought_closed: bool = False  # the prompt closed the thought (no constraint waits for it)

    def opened_by(self, prompt_tail: str) -> ChatPlan:
        """This plan for a prompt ending in ``prompt_tail``: a template that
        ends the prompt inside a thought (Qwen3's "Thinking" models) starts
        the output there, tag or not; one that closed it (Qwen3 with
        ``enable_thinking: false``) constrains the output from its start."""
        fmt, tail = self.reasoning, prompt_tail.rstrip()
        if fmt is None:
            return self
        if tail.endswith(fmt.close_tag):
            return dataclasses.replace(self, thought_closed=True)
        if not fmt.starts_in_reasoning and tail.endswith(fmt.open_tag):
            return dataclasses.replace(self, reasoning=reasoning_parser(fmt.name, True))
        return self

    def constraint(self, requested: StructuredOutput | None) -> StructuredOutput | None:
        """The reply's constraint (a forced choice's, else ``requested``);
        with a reasoning parser it starts after the thought, which stays free
        text (as vLLM's structured outputs do)."""
        structured = self.structured or requested
        if structured is None or self.reasoning is None or self.thought_closed:
            return structured
        mode = "inside" if self.reasoning.starts_in_reasoning else "optional"
        return dataclasses.replace(structured, reasoning=mode)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's request shape)."""
        if not self.tools:
            return None
        return [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            "parameters": dict(t.parameters)}} for t in self.tools]


def _required_schema(tools: tuple[ToolSpec, ...]) -> dict[str, Any]:
    calls = [{"type": "object", "properties": {"name": {"const": t.name},
                                               "parameters": dict(t.parameters)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def plan_chat(tools: Any, tool_choice: Any, parser_name: str | None, auto_enabled: bool,
              reasoning_name: str | None) -> ChatPlan:
    """ValueError naming the field for bad tools, an unknown function name
    or a choice this server cannot serve."""
    specs = validate_tools(tools)
    if not specs and tool_choice not in (None, "none"):
        raise ValueError("tool_choice needs a non-empty tools list")
    choice = validate_tool_choice(tool_choice, specs)
    reasoning = reasoning_parser(reasoning_name) if reasoning_name else None
    if choice.mode == "none" or not specs:
        return ChatPlan(specs, choice, reasoning=reasoning)
    if choice.mode == "auto":
        if not (auto_enabled and parser_name):
            raise ValueError('tool_choice "auto" needs the server started with '
                             "--enable-auto-tool-choice and --tool-call-parser")
        return ChatPlan(specs, choice, tool_parser(parser_name), reasoning)
    if choice.mode == "function":
        spec = next(t for t in specs if t.name == choice.name)
        schema = json.dumps(dict(spec.parameters), sort_keys=True, ensure_ascii=False)
    else:
        schema = json.dumps(_required_schema(specs), sort_keys=True, ensure_ascii=False)
    return ChatPlan(specs, choice, reasoning=reasoning, structured=StructuredOutput("json", schema))


def _forced_calls(plan: ChatPlan, text: str, rng: random.Random) -> list[ToolCall]:
    """The calls a forced choice's (constrained) output holds; none if it was cut short."""
    if plan.choice.mode == "function":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return []
        return [ToolCall(new_tool_call_id(rng), plan.choice.name or "", text)]
    try:
        listed = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [ToolCall(new_tool_call_id(rng), call["name"],
                     json.dumps(call["parameters"], ensure_ascii=False)) for call in listed]


class ChatShape:
    """Shapes one request's outputs by its ``ChatPlan`` (one per choice for streams)."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.rng = random.SystemRandom()  # tool call ids

    @property
    def active(self) -> bool:
        """Whether the text needs any shaping (else content is the text)."""
        return self.plan.parser is not None or self.plan.reasoning is not None or \
            self.plan.structured is not None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the message, the finish reason) of a whole output."""
        plan, message = self.plan, {"role": "assistant", "content": text}
        if plan.reasoning is not None:
            reasoning, text = plan.reasoning.split(text)
            message = {"role": "assistant", "content": text}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
        if plan.structured is not None:
            calls = _forced_calls(plan, text or "", self.rng)
            if calls:
                message.update(content=None, tool_calls=[c.to_openai() for c in calls])
                return message, "tool_calls" if finish_reason == "stop" else finish_reason
            return message, finish_reason
        if plan.parser is not None and message["content"]:
            parsed = plan.parser.parse(message["content"], self.rng)
            if parsed.calls:
                message["content"] = parsed.content
                message["tool_calls"] = [c.to_openai() for c in parsed.calls]
                return message, "tool_calls" if finish_reason == "stop" else finish_reason
        return message, finish_reason

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self.plan, self.rng)


class ChoiceStream:
    """One streamed choice: text deltas in, OpenAI ``delta`` objects out."""

    def __init__(self, plan: ChatPlan, rng: random.Random) -> None:
        self.plan, self.rng = plan, rng
        self.called = False
        self._reasoning = plan.reasoning.stream() if plan.reasoning is not None else None
        self._tools = plan.parser(rng) if plan.parser is not None else None
        self._forced: list[str] = []  # a forced choice's text so far
        self._forced_id: str | None = None

    def feed(self, text: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        content = text
        if self._reasoning is not None:
            part = self._reasoning.feed(text)
            if part.reasoning:
                deltas.append({"reasoning_content": part.reasoning})
            content = part.content
        if self.plan.structured is not None:
            return deltas + self._feed_forced(content)
        return deltas + self._content(content, self._tools.feed(content) if self._tools else None)

    def finish(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        content = ""
        if self._reasoning is not None:
            part = self._reasoning.finish()
            if part.reasoning:
                deltas.append({"reasoning_content": part.reasoning})
            content = part.content
        if self.plan.structured is not None:
            return deltas + self._feed_forced(content) + self._finish_forced()
        if self._tools is None:
            return deltas + ([{"content": content}] if content else [])
        events = (self._tools.feed(content) if content else []) + self._tools.finish()
        return deltas + self._content("", events)

    def _content(self, text: str, events: list | None) -> list[dict[str, Any]]:
        if events is None:
            return [{"content": text}] if text else []
        out = []
        for event in events:
            delta = event.to_delta()
            self.called = self.called or "tool_calls" in delta
            out.append(delta)
        return out

    def _feed_forced(self, text: str) -> list[dict[str, Any]]:
        self._forced.append(text)
        if self.plan.choice.mode != "function" or not text:
            return []  # required: a list of calls, sent whole at the end
        deltas = []
        if self._forced_id is None:
            self._forced_id = new_tool_call_id(self.rng)
            self.called = True
            deltas.append({"tool_calls": [{"index": 0, "id": self._forced_id, "type": "function",
                                           "function": {"name": self.plan.choice.name,
                                                        "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas

    def _finish_forced(self) -> list[dict[str, Any]]:
        if self.plan.choice.mode == "function":
            return []
        calls = _forced_calls(self.plan, "".join(self._forced), self.rng)
        if not calls:
            return [{"content": "".join(self._forced)}] if self._forced else []
        self.called = True
        return [{"tool_calls": [{"index": i, "id": c.id, "type": "function",
                                 "function": {"name": c.name, "arguments": c.arguments}}]}
                for i, c in enumerate(calls)]
