"""Request bodies of the OpenAI-compatible API (pydantic, validated on entry).

Fields OpenAI defines but carpool does not implement (``functions``,
``function_call``, ``logit_bias``, ``echo``...) are accepted only at their
neutral value; anything else
is a 400 naming the field, never a silently ignored knob. Unknown fields
are ignored, as OpenAI clients send extras (``user``, ``metadata``...).

Every number has a range (``carpool.limits``): no integer a client sends
reaches the engine unbounded. Lists stop at their first bad element
(``fail_fast``): a body of a million bad elements would otherwise build a
million error objects (seconds of CPU and ~1 GB for a 2 MiB body).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictInt,
    WithJsonSchema,
    model_validator,
)

from carpool import limits
from carpool.structured_output import MAX_CHOICES, StructuredOutput, from_request

# Any integer (clamped to the classes and to the key's privilege) or a class name.
Priority = (Annotated[int, Field(strict=True, gt=-10**9, lt=10**9)]
            | Literal["high", "normal", "low"])
TokenId = Annotated[int, Field(strict=True, **limits.TOKEN_ID.field())]


def _validate_logit_bias(value: Any) -> dict[str, float] | None:
    """``{"token id": bias}`` within OpenAI's count and range, checked
    before the entries are read one by one (a dict's errors are per key)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("logit_bias must be an object mapping token ids to biases")
    if len(value) > limits.MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(value)} entries; at most {limits.MAX_LOGIT_BIAS}")
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10
                and limits.TOKEN_ID.contains(int(key))):
            raise ValueError(f"logit_bias keys must be token ids in "
                             f"{limits.TOKEN_ID.describe()}, got {key[:40]!r}")
        if (isinstance(bias, bool) or not isinstance(bias, (int, float))
                or not limits.LOGIT_BIAS.contains(bias)):
            raise ValueError(f"logit_bias values must be numbers in "
                             f"{limits.LOGIT_BIAS.describe()}, got {str(bias)[:40]} for {key!r}")
    return value


LogitBias = Annotated[Any, PlainValidator(_validate_logit_bias), WithJsonSchema({
    "anyOf": [{"type": "object", "maxProperties": limits.MAX_LOGIT_BIAS,
               "propertyNames": {"pattern": "^[0-9]{1,10}$"},
               "additionalProperties": {"type": "number", "minimum": limits.LOGIT_BIAS.lo,
                                        "maximum": limits.LOGIT_BIAS.hi}},
              {"type": "null"}]})]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Sampling and carpool extension fields shared by both generation endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: StrictInt = Field(1, **limits.N.field())
    seed: StrictInt | None = Field(None, **limits.SEED.field())
    stop: str | Annotated[list[str], Field(max_length=limits.MAX_STOP_STRINGS,
                                           fail_fast=True)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, **limits.API_TEMPERATURE.field())
    top_p: float = Field(1.0, **limits.TOP_P.field())
    top_k: StrictInt = Field(0, **limits.TOP_K.field())
    min_p: float = Field(0.0, **limits.MIN_P.field())
    presence_penalty: float = Field(0.0, **limits.PRESENCE_PENALTY.field())
    frequency_penalty: float = Field(0.0, **limits.FREQUENCY_PENALTY.field())
    repetition_penalty: float = Field(1.0, **limits.REPETITION_PENALTY.field())
    ignore_eos: StrictBool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=limits.MAX_STOP_TOKEN_IDS,
                                                   fail_fast=True)] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    best_of: StrictInt | None = Field(None, **limits.N.field())
    logit_bias: LogitBias = None
    # carpool extensions (also accepted as x-priority / x-session-id / x-deadline-ms headers)
    priority: Priority | None = None
    session_id: str | None = Field(None, min_length=1, max_length=limits.MAX_SESSION_ID_CHARS)
    deadline_ms: float | None = Field(None, **limits.DEADLINE_MS.field())
    # Request-level (static / dynamic) batching holds this request at most this long.
    max_wait_ms: float | None = Field(None, **limits.MAX_WAIT_MS.field())
    # Prefix-cache namespace within the caller's tenant (vLLM's cache_salt).
    cache_salt: str | None = Field(None, min_length=1, max_length=limits.MAX_CACHE_SALT_CHARS)
    # Structured outputs: OpenAI's response_format, vLLM's guided_* fields
    # and its structured_outputs object (carpool/structured_output.py).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, max_length=MAX_CHOICES)
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _neutral_unsupported(self) -> "_SamplingFields":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (leave it unset or equal to n)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        self.structured_output()  # a ValueError names the malformed field
        return self

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint the request asks for (or None)."""
        return from_request(self.response_format, self.guided_json, self.guided_regex,
                            self.guided_choice, self.guided_grammar, self.structured_outputs)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def _is_token_ids(value: Any) -> bool:
    # C-level passes (set of types, min, max), not a Python loop: a maximal
    # body holds about a million ids, and a Python loop would hog the GIL for
    # ~0.1 s. The ids must fit the engine's int32 tensors (the vocabulary
    # bounds them further, once the prompt is known to fit the context).
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        return False
    if value and not (limits.TOKEN_ID.contains(min(value))
                      and limits.TOKEN_ID.contains(max(value))):
        raise ValueError(f"prompt token ids must be in {limits.TOKEN_ID.describe()}")
    return True


def _validate_prompt(value: Any) -> Any:
    """The prompt's shape in one pass with no per-element errors: a union
    validator would build an error object per element of every union member
    that fails (a 4 MiB body of ids cost ~0.9 GB that way)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str) and set(map(type, value)) == {str}:
            return value
        if type(first) is int and _is_token_ids(value):
            return value
        if isinstance(first, list) and all(_is_token_ids(p) for p in value):
            return value
    if isinstance(value, list) and not value:
        raise ValueError("prompt must not be empty")
    raise ValueError(f"prompt must be {_PROMPT_SHAPES}")


_TOKEN_ID_SCHEMA = {"type": "integer", "minimum": limits.TOKEN_ID.lo,
                    "maximum": limits.TOKEN_ID.hi}
Prompt = Annotated[Any, PlainValidator(_validate_prompt), WithJsonSchema({"anyOf": [
    {"type": "string"}, {"type": "array", "items": {"type": "string"}},
    {"type": "array", "items": _TOKEN_ID_SCHEMA},
    {"type": "array", "items": {"type": "array", "items": _TOKEN_ID_SCHEMA}}]})]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: Prompt
    max_tokens: StrictInt | None = Field(16, **limits.MAX_TOKENS.field())
    logprobs: StrictInt | None = Field(None, **limits.LOGPROBS.field())
    echo: StrictBool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_unsupported(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    name: str = Field(max_length=64)
    arguments: str


class MessageToolCall(BaseModel):
    """A past call in an assistant message (OpenAI's ``tool_calls[i]``)."""

    id: str = Field(max_length=128)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None = None
    name: str | None = None
    # An assistant's past calls, and a tool message's answer to one of them:
    # both go back to the chat template for the next turn.
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=128, fail_fast=True)] | None \
        = None
    tool_call_id: str | None = Field(None, max_length=128)
    function_call: Any = None

    @model_validator(mode="after")
    def _no_function_call(self) -> "ChatMessage":
        if self.function_call is not None:
            raise ValueError("function_call in messages is not supported (use tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _template_call(call: MessageToolCall) -> dict[str, Any]:
    """A past call as chat templates read it: the arguments as an object
    when they are JSON (templates write them with ``tojson``), else as sent."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as a chat template expects them ("developer" is "system")."""
    rendered = []
    for m in messages:
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                 "content": m.text()}
        if m.tool_calls:
            entry["tool_calls"] = [_template_call(call) for call in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            entry["name"] = m.name
        rendered.append(entry)
    return rendered


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_tokens: StrictInt | None = Field(None, **limits.MAX_TOKENS.field())
    max_completion_tokens: StrictInt | None = Field(None, **limits.MAX_TOKENS.field())
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, **limits.LOGPROBS.field())
    add_generation_prompt: StrictBool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: template variables
    functions: list[Any] | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def _chat_unsupported(self) -> "ChatCompletionRequest":
        if self.functions:
            raise ValueError("functions are not supported")
        if self.function_call not in (None, "none"):
            raise ValueError("function_call is not supported; leave it unset or 'none'")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        _check_template_kwargs(self.chat_template_kwargs)
        return self


# Variables the server itself gives the chat template: a client cannot set them.
_TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt", "bos_token",
                           "eos_token", "raise_exception"})
MAX_TEMPLATE_KWARGS_BYTES = 4096


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    if not kwargs:
        return
    taken = sorted(_TEMPLATE_OWN.intersection(kwargs))
    if taken:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}")
    if not all(key.isidentifier() for key in kwargs):
        raise ValueError("chat_template_kwargs' names must be identifiers")
    if len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"chat_template_kwargs is over {MAX_TEMPLATE_KWARGS_BYTES} bytes")



class TokenizeRequest(BaseModel):
    """``POST /tokenize``: either ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(fail_fast=True)] | None = None
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId] = Field(fail_fast=True)
