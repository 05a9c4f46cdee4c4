"""What a request's output must match (structured outputs), as the engine
takes it: one ``StructuredOutput`` in ``SamplingParams.structured``.

The request forms (OpenAI's ``response_format``; vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and the newer
``structured_outputs`` object) all become one of five kinds here
(``from_request``). Plain data: it crosses the front/worker boundary as
it is (msgspec), and each process compiles it into a grammar
(carpool/model/grammar.py), cached by ``key``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# A constraint's text (a schema, a regex, a grammar, the choices as JSON):
# compiled grammars grow with it, and compiling is CPU work a client sets.
MAX_SPEC_BYTES = 64 * 1024
MAX_CHOICES = 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Where the constraint starts when a reasoning parser runs (``reasoning``):
# "" at the first token; "optional": after a thought the output may open
# with ("<think>...</think>", Qwen3); "inside": after the thought the prompt
# opened (the output runs to "</think>" first, DeepSeek-R1).
REASONING_MODES = ("", "optional", "inside")


@dataclass(frozen=True)
class StructuredOutput:
    """``kind``: json (``value`` a JSON schema, as text), json_object (any
    JSON object; ``value`` empty), regex, choice (``value`` a JSON list of
    strings) or grammar (EBNF / GBNF, or Lark when it says so).
    ``reasoning``: one of ``REASONING_MODES``; the thought is free text."""

    kind: str
    value: str = ""
    reasoning: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError("a structured output's value must be text")
        size = len(self.value.encode("utf-8", "surrogatepass"))
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"the {self.kind} constraint is {size} bytes; at most "
                             f"{MAX_SPEC_BYTES}")
        if self.reasoning not in REASONING_MODES:
            raise ValueError(f"structured output reasoning must be one of {REASONING_MODES}")
        if self.kind != "json_object" and not self.value:
            raise ValueError(f"the {self.kind} constraint is empty")
        if self.kind == "choice":
            choices = json.loads(self.value)
            if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in choices)):
                raise ValueError(f"guided_choice must be 1 to {MAX_CHOICES} non-empty strings")

    @property
    def key(self) -> tuple[str, str, str]:
        """The grammar cache's key."""
        return (self.kind, self.value, self.reasoning)


def _schema_text(schema: Any, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field} is not valid JSON: {exc.msg}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field} must be a JSON schema object")
    return json.dumps(schema, sort_keys=True, ensure_ascii=False)


def _from_response_format(fmt: dict[str, Any]) -> StructuredOutput | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("response_format.json_schema must be an object with a 'schema'")
        return StructuredOutput("json", _schema_text(spec["schema"], "response_format.json_schema"
                                                                      ".schema"))
    raise ValueError(f"response_format.type must be text, json_object or json_schema, "
                     f"got {kind!r}")


def _from_fields(json_schema: Any, regex: Any, choice: Any, grammar: Any, json_object: Any,
                 prefix: str) -> list[StructuredOutput]:
    found = []
    if json_schema is not None:
        found.append(StructuredOutput("json", _schema_text(json_schema, f"{prefix}json")))
    if regex is not None:
        found.append(StructuredOutput("regex", str(regex)))
    if choice is not None:
        if not isinstance(choice, list):
            raise ValueError(f"{prefix}choice must be a list of strings")
        found.append(StructuredOutput("choice", json.dumps(choice, ensure_ascii=False)))
    if grammar is not None:
        found.append(StructuredOutput("grammar", str(grammar)))
    if json_object:
        found.append(StructuredOutput("json_object"))
    return found


def from_request(response_format: dict[str, Any] | None = None, guided_json: Any = None,
                 guided_regex: Any = None, guided_choice: Any = None, guided_grammar: Any = None,
                 structured_outputs: dict[str, Any] | None = None) -> StructuredOutput | None:
    """The one constraint a request's fields ask for, or None; ValueError
    naming the field when they are malformed or ask for more than one."""
    found = []
    if response_format:
        one = _from_response_format(response_format)
        found += [one] if one is not None else []
    found += _from_fields(guided_json, guided_regex, guided_choice, guided_grammar, None,
                          "guided_")
    if structured_outputs:
        unknown = set(structured_outputs) - {"json", "regex", "choice", "grammar",
                                             "json_object"}
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {sorted(unknown)}")
        so = structured_outputs
        found += _from_fields(so.get("json"), so.get("regex"), so.get("choice"),
                              so.get("grammar"), so.get("json_object"), "structured_outputs.")
    if len(found) > 1:
        raise ValueError("ask for one structured output (response_format, a guided_* field or "
                         "structured_outputs), not several")
    return found[0] if found else None
