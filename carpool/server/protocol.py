"""Request bodies of the OpenAI-compatible API (pydantic, validated on entry).

Fields OpenAI defines but carpool does not implement are accepted only at
their neutral value; anything else is a 400 naming the field, never a
silently ignored knob. Unknown fields are ignored, as OpenAI clients send
extras (``user``, ``metadata``...).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

Priority = (Annotated[int, Field(strict=True, gt=-10**9, lt=10**9)]
            | Literal["high", "normal", "low"])
PRIORITY_CLASSES = {"high": -1, "normal": 0, "low": 1}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Sampling and carpool extension fields shared by both generation endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: StrictInt = Field(1, ge=1)
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    best_of: StrictInt | None = None
    logit_bias: dict[str, float] | None = None
    # carpool extensions (also accepted as x-priority / x-session-id / x-deadline-ms headers)
    priority: Priority | None = None
    session_id: str | None = Field(None, min_length=1, max_length=256)
    deadline_ms: float | None = Field(None, gt=0, le=86_400_000)
    # Request-level (static / dynamic) batching holds this request at most this long.
    max_wait_ms: float | None = Field(None, ge=0, le=60_000)

    @model_validator(mode="after")
    def _neutral_unsupported(self) -> "_SamplingFields":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (leave it unset or equal to n)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


Prompt = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: Prompt
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0)
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as a chat template expects them ("developer" is "system")."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages]


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0)
    add_generation_prompt: StrictBool = True
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_unsupported(self) -> "ChatCompletionRequest":
        if self.tools:
            raise ValueError("tools are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than text is not supported")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self



class TokenizeRequest(BaseModel):
    """``POST /tokenize``: either ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
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
    tokens: list[StrictInt]
