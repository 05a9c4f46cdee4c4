"""Hypothesis strategies for fuzzing the HTTP API: edge values and JSON
bodies shaped by an OpenAPI schema (used by ``test_server_fuzz.py``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

# The fuzzed server runs with --max-tokens-cap 8: generation stays cheap.
MAX_TOKENS_CAP = 8

# -- strategies ---------------------------------------------------------------------------

SPECIAL_STRINGS = [
    "", " ", "\x00", "\n", "\r\n\r\n", "\t\x0b\x0c", "\x1b[31m", "\u202e\u200b\ufeff",
    "😀👍🏽🚗", "👨‍👩‍👧‍👦" * 8, "你好世界", "日本語のテキスト", "café naïve", "\U0010ffff",
    "<|im_start|>", "<|im_end|>", "<unk>", "<|im_start|>assistant\n", "{{ messages }}",
    "{% for x in y %}", "data: [DONE]\n\n", "NaN", "-1", "null", "high", "a" * 256,
    "a" * 257, "The quick brown fox " * 150,
]

_TEXT = st.one_of(
    st.text(max_size=24),
    st.text(st.characters(codec="ascii"), max_size=12),
    st.text(st.characters(min_codepoint=0, max_codepoint=0x1f), max_size=6),
    st.sampled_from(SPECIAL_STRINGS),
)
_LOOSE_TEXT = st.one_of(_TEXT, st.text(st.characters(categories=["Cs", "Co", "Cn"]), min_size=1,
                                       max_size=4))

_EDGE_INTS = [0, -1, 1, 7, 8, 9, 16, 17, 20, 21, 255, 256, 511, 512, 513, 2**31 - 1, 2**31,
              2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1, 10**30,
              -(10**30)]
_EDGE_FLOATS = [0.0, -0.0, 1e-300, -1e-300, 1.0000001, 2.0000001, -2.0000001, 10.5, 1e308,
                -1e308, 5e-324, math.inf, -math.inf, math.nan, 86_400_000.5, 0.5, 1.5]

WILD = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from(_EDGE_INTS),
              st.floats(), st.sampled_from(_EDGE_FLOATS), _LOOSE_TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(_TEXT, inner, max_size=3)),
    max_leaves=10,
)


# Structured-output fields: valid specs, specs that do not compile (a 400),
# and ones whose grammar is hard (nested quantifiers, deep recursion).
_STRUCTURED = {
    "guided_regex": [r"\d{3}-\d{4}", "([a-z", "(a+)+$", "a{1,99999}", "", "[^]"],
    "guided_json": [{"type": "object"}, {"type": "nonsense"}, "{not json",
                    {"$ref": "#/$defs/x", "$defs": {"x": {"type": "array", "items": {
                        "$ref": "#/$defs/x"}}}}, {"type": "string", "pattern": "(("}],
    "guided_choice": [["yes", "no"], [], [""], ["a" * 300]],
    "guided_grammar": ['root ::= "yes" | "no"', "root ::= ", "start: WORD", "root ::= root"],
    "response_format": [{"type": "json_object"}, {"type": "xml"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                            "type": "object", "properties": {"a": {"enum": [1, 2]}}}}}],
    "structured_outputs": [{"regex": "[ab]+"}, {"json": 1}, {"choice": ["a"], "regex": "b"}],
    "chat_template_kwargs": [{"enable_thinking": False}, {"messages": []}, {"not a name": 1},
                             {"x": "y" * 5000}, {}],
}


class SchemaStrategies:
    """Hypothesis strategies for JSON bodies shaped by an OpenAPI schema.

    ``valid=True`` draws values inside the declared types and bounds (the
    request may still be refused by cross-field rules); ``valid=False``
    also draws edge and out-of-range values of the declared types.
    """

    def __init__(self, openapi: dict, model_name: str) -> None:
        self.components = openapi["components"]["schemas"]
        self.model_name = model_name

    def resolve(self, schema: dict) -> dict:
        seen = 0
        while "$ref" in schema:
            assert schema["$ref"].startswith("#/components/schemas/"), schema
            schema = self.components[schema["$ref"].rsplit("/", 1)[-1]]
            seen += 1
            assert seen < 20, "cyclic $ref"
        return schema

    # one value --------------------------------------------------------------------------

    def value(self, schema: dict, valid: bool, name: str | None = None, depth: int = 0):
        override = self._field_override(name, valid)
        if override is not None:
            return override
        schema = self.resolve(schema)
        if depth > 6:
            return st.none()
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return st.one_of([self.value(s, valid, name, depth + 1) for s in schema[key]])
        if "allOf" in schema and len(schema["allOf"]) == 1:
            return self.value(schema["allOf"][0], valid, name, depth + 1)
        if "enum" in schema or "const" in schema:
            options = schema.get("enum", [schema.get("const")])
            strategy = st.sampled_from(options)
            return strategy if valid else st.one_of(strategy, strategy, _LOOSE_TEXT)
        kind = schema.get("type")
        if kind == "string":
            return self._string(schema, valid)
        if kind == "integer":
            return self._integer(schema, valid)
        if kind == "number":
            return self._number(schema, valid)
        if kind == "boolean":
            return st.booleans() if valid else st.one_of(st.booleans(), st.booleans(),
                                                         st.sampled_from([0, 1, "true", None]))
        if kind == "null":
            return st.none()
        if kind == "array":
            return self._array(schema, valid, depth)
        if kind == "object" or "properties" in schema:
            return self.object(schema, valid, depth)
        return WILD  # unconstrained (``Any``)

    def _field_override(self, name: str | None, valid: bool):
        """Keep generation cheap and interesting: few tokens, few choices,
        the served model name most of the time."""
        if name in ("max_tokens", "max_completion_tokens"):
            small = st.integers(1, MAX_TOKENS_CAP)
            if valid:
                return st.one_of(small, small, st.none())
            return st.one_of(small, st.none(), st.sampled_from(_EDGE_INTS))
        if name == "n":
            return st.integers(1, 3) if valid else st.one_of(st.integers(1, 3),
                                                              st.sampled_from(_EDGE_INTS))
        if name == "model":
            served = st.just(self.model_name)
            return st.one_of(served, served, st.none()) if valid else st.one_of(served, _TEXT)
        if name == "best_of":
            if valid:
                return st.sampled_from([None, 1])
            return st.one_of(st.none(), st.integers(-2, 20))
        if name in ("logprobs", "top_logprobs") and valid:
            return st.one_of(st.none(), st.integers(0, 5), st.booleans())
        if name in _STRUCTURED:  # plausible specs, broken ones and nothing, each often
            return st.one_of(st.none(), st.none(), st.sampled_from(_STRUCTURED[name]), WILD)
        return None

    def _string(self, schema: dict, valid: bool):
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if not valid:
            return _LOOSE_TEXT
        return _TEXT.filter(lambda s: lo <= len(s) and (hi is None or len(s) <= hi))

    def _integer(self, schema: dict, valid: bool):
        lo = schema.get("minimum")
        if "exclusiveMinimum" in schema:
            lo = math.floor(schema["exclusiveMinimum"]) + 1
        hi = schema.get("maximum")
        if "exclusiveMaximum" in schema:
            hi = math.ceil(schema["exclusiveMaximum"]) - 1
        lo = None if lo is None else int(lo)
        hi = None if hi is None else int(hi)
        if lo is None and hi is None:
            inner = st.integers(-5, 450)  # around the tiny vocabulary (~400 ids)
        elif hi is None:
            inner = st.integers(lo, lo + 400)
        elif lo is None:
            inner = st.integers(hi - 400, hi)
        else:
            inner = st.integers(lo, hi)
        if valid:
            return inner
        edges = [v for v in (lo, hi) if v is not None]
        edges += [v - 1 for v in edges] + [v + 1 for v in edges]
        return st.one_of(inner, inner, st.sampled_from(_EDGE_INTS + edges),
                         st.integers(-(2**70), 2**70), st.floats(-1e3, 1e3))

    def _number(self, schema: dict, valid: bool):
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        inner = st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_infinity=False,
                          exclude_min="exclusiveMinimum" in schema,
                          exclude_max="exclusiveMaximum" in schema)
        if valid:
            ints = st.integers(math.ceil(lo) if lo is not None else -3,
                               math.floor(hi) if hi is not None else 3)
            if "exclusiveMinimum" in schema or "exclusiveMaximum" in schema:
                ints = ints.filter(lambda v: v not in (lo, hi))
            return st.one_of(inner, inner, ints)
        edges = [v for v in (lo, hi) if v is not None]
        edges += [v - 1e-9 for v in edges] + [v + 1e-9 for v in edges]
        return st.one_of(inner, st.sampled_from(_EDGE_FLOATS + edges), st.floats(),
                         st.integers(-(2**70), 2**70))

    def _array(self, schema: dict, valid: bool, depth: int):
        items = self.value(schema.get("items", {}), valid, None, depth + 1)
        lo = schema.get("minItems", 0)
        hi = schema.get("maxItems", lo + 4)
        if valid:
            return st.lists(items, min_size=lo, max_size=hi)
        return st.one_of(st.lists(items, max_size=hi + 3),
                         st.lists(self.value(schema.get("items", {}), True, None, depth + 1),
                                  max_size=hi))

    # objects --------------------------------------------------------------------------------

    def object(self, schema: dict, valid: bool, depth: int = 0):
        schema = self.resolve(schema)
        properties = schema.get("properties", {})
        required = [k for k in schema.get("required", []) if k in properties]
        optional = sorted(set(properties) - set(required))
        extra = schema.get("additionalProperties")

        @st.composite
        def build(draw) -> dict:
            body = {k: draw(self.value(properties[k], valid, k, depth + 1)) for k in required}
            # A few optional fields at a time, so some bodies pass every cross-field rule.
            chosen = draw(st.lists(st.sampled_from(optional), unique=True,
                                   max_size=min(len(optional), 5 if valid else 10))) \
                if optional else []
            for k in chosen:
                body[k] = draw(self.value(properties[k], valid, k, depth + 1))
            if isinstance(extra, dict) and (extra or not properties):
                for k in draw(st.lists(_TEXT, max_size=3)):
                    body[k] = draw(self.value(extra, valid, None, depth + 1))
            return body

        return build()

    def body(self, schema: dict):
        """A top-level body: valid-ish, loose, or a valid one with a few mutations."""
        schema = self.resolve(schema)
        properties = schema.get("properties", {})

        @st.composite
        def build(draw) -> Any:
            mode = draw(st.sampled_from(["valid", "valid", "valid", "loose", "mutated",
                                         "mutated"]))
            body = draw(self.object(schema, valid=mode == "valid" or mode == "mutated"))
            if mode != "mutated":
                return body
            for _ in range(draw(st.integers(1, 3))):
                op = draw(st.sampled_from(["wild", "null", "edge", "drop", "extra", "wrap"]))
                if op == "drop" and body:
                    del body[draw(st.sampled_from(sorted(body)))]
                elif op == "extra":
                    body[draw(_LOOSE_TEXT)] = draw(WILD)
                elif op == "wrap":
                    body = draw(st.sampled_from([[body], {"body": body}, [body, body]]))
                    break
                elif properties:
                    name = draw(st.sampled_from(sorted(properties)))
                    if op == "null":
                        body[name] = None
                    elif op == "edge":
                        body[name] = draw(self.value(properties[name], False, name))
                    else:
                        body[name] = draw(WILD)
            return body

        return build()


# -- out-of-range numbers -------------------------------------------------------------------

# Beyond 32 and 64 bits (a JSON integer of over 4300 digits is invalid JSON,
# a 400 naming no field: these stay far below), and floats JSON can carry.
HUGE_INTS = [10**30, -(10**30), 2**63, -(2**63) - 1, 2**64, 2**31, -(2**31) - 1, 10**300]
NON_FINITE = [math.inf, -math.inf, math.nan, 1e308, -1e308]


@dataclass(frozen=True)
class NumericSlot:
    """Where a number goes in a body: ``field`` itself, an item of it (``[5, x]``),
    an item of its second list (``[[5], [5, x]]``), a value of it
    (``{"5": x}``) or a key of it (``{"x": 1.0}``)."""

    field: str
    schema: dict  # the integer or number schema (a key's: the token ids')
    shape: str = "value"

    def put(self, body: dict, value: Any) -> dict:
        body[self.field] = {"value": value, "item": [5, value], "nested": [[5], [5, value]],
                            "dict-value": {"5": value}, "dict-key": {str(value): 1.0}}[self.shape]
        return body

    def bounds(self) -> tuple[float | None, float | None]:
        lo = self.schema.get("minimum", self.schema.get("exclusiveMinimum"))
        hi = self.schema.get("maximum", self.schema.get("exclusiveMaximum"))
        return lo, hi

    def out_of_range(self):
        """Values the API must refuse here: below or above the range (none
        declared: 64 bits), beyond 64 bits, non-finite or huge floats."""
        lo, hi = self.bounds()
        lo = -(2**63) if lo is None else lo
        hi = 2**63 - 1 if hi is None else hi
        outside = [st.sampled_from([v for v in HUGE_INTS + NON_FINITE if not lo <= v <= hi])]
        if self.schema.get("type") == "integer":
            outside += [st.integers(-(2**200), math.ceil(lo) - 1),
                        st.integers(math.floor(hi) + 1, 2**200)]
        else:
            outside += [st.floats(max_value=lo, exclude_max="minimum" in self.schema),
                        st.floats(min_value=hi, exclude_min="maximum" in self.schema)]
        return st.one_of(outside)


def numeric_slots(strategies: SchemaStrategies, schema: dict) -> list[NumericSlot]:
    """Every place a body of ``schema`` takes a number, from its properties."""
    slots = []
    for name, prop in strategies.resolve(schema).get("properties", {}).items():
        for member in _members(strategies, prop):
            kind = member.get("type")
            if kind in ("integer", "number"):
                slots.append(NumericSlot(name, member))
            elif kind == "array":
                items = _members(strategies, member.get("items", {}))
                for item in items:
                    if item.get("type") in ("integer", "number"):
                        slots.append(NumericSlot(name, item, "item"))
                    elif item.get("type") == "array":
                        slots += [NumericSlot(name, inner, "nested")
                                  for inner in _members(strategies, item.get("items", {}))
                                  if inner.get("type") in ("integer", "number")]
            elif kind == "object" and isinstance(member.get("additionalProperties"), dict):
                values = member["additionalProperties"]
                if values.get("type") in ("integer", "number"):
                    slots.append(NumericSlot(name, values, "dict-value"))
                if "propertyNames" in member:  # token ids as keys
                    slots.append(NumericSlot(name, TOKEN_ID_KEY, "dict-key"))
    return slots


# A logit_bias key's range (JSON Schema states keys as strings, by a pattern).
TOKEN_ID_KEY = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}


def _members(strategies: SchemaStrategies, schema: dict) -> list[dict]:
    schema = strategies.resolve(schema)
    members = schema.get("anyOf") or schema.get("oneOf") or [schema]
    return [strategies.resolve(m) for m in members]
