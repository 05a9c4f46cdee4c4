"""One streaming request to an OpenAI-compatible server, timed on the client.

Works against any server speaking ``/v1/completions`` or
``/v1/chat/completions`` with server-sent events (carpool, vLLM, SGLang,
TGI, llama.cpp's server...). Output tokens come from the final usage chunk
(``stream_options.include_usage``); only servers that send none are counted
with our tokenizer (see ``send_request``). The same chunk's
``prompt_tokens_details.cached_tokens``, where the server sends it, is the
request's prefix-cache hit.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from carpool.workload.stats import FAILED, OK, REJECTED, RequestRecord

# "Not now" answers: the server shed load; counted apart from failures.
REJECT_STATUSES = {429: "http_429", 503: "http_503"}
# Bytes of an error body kept for the report.
_ERROR_BODY_CHARS = 300


@dataclass(frozen=True)
class Target:
    """Where and how to send: the endpoint kind and the fixed request fields."""

    base_url: str  # ends with /v1
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: tuple[tuple[str, object], ...] = ()
    # Completions only: send each prompt as token ids (what this turns its
    # text into) instead of text, as clients with their own tokenizer do.
    encode: Callable[[str], list[int]] | None = None

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/{path}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, prompt: str, max_tokens: int) -> dict:
        body: dict = {"model": self.model, "max_tokens": max_tokens, "stream": True,
                      "stream_options": {"include_usage": True},
                      "temperature": self.temperature}
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM/SGLang/TGI/carpool extension
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt if self.encode is None else self.encode(prompt)
        body.update(dict(self.extra_body))
        return body


async def send_request(client: httpx.AsyncClient, target: Target, prompt: str,
                       record: RequestRecord, clock: Callable[[], float],
                       count_tokens: Callable[[str], int] | None = None) -> None:
    """Send one request and fill ``record`` (sent, chunk times, finish,
    status). Never raises for a server or network problem: those become
    ``record.status`` REJECTED or FAILED with a reason."""
    record.sent = clock()
    try:
        async with client.stream("POST", target.url, json=target.payload(
                prompt, record.max_tokens), headers=target.headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                _refuse(record, response.status_code, body, clock())
                return
            usage = await _read_events(response, target.endpoint, record, clock)
    except httpx.TimeoutException:
        _fail(record, "timeout", clock())
        return
    except httpx.HTTPError as exc:
        _fail(record, "connection", clock(), str(exc))
        return
    # A server's usage is the truth: it counts the tokens it generated. Our
    # tokenizer sees only the text, and re-encoding decoded text need not give
    # those tokens back (BPE merges across token boundaries, stop strings are
    # cut, the server's tokenizer may not be ours), so cross-checking flagged
    # honest servers, and tokenizing every answer cost the event loop that
    # times the other requests. It is only the fallback for servers that send
    # no usage; ``counted_tokens`` is set exactly when it was used.
    if record.status == OK and not usage and count_tokens is not None:
        record.counted_tokens = record.output_tokens = count_tokens(record.text)


async def _read_events(response: httpx.Response, endpoint: str, record: RequestRecord,
                       clock: Callable[[], float]) -> bool:
    """Read the event stream into ``record``; True if it carried usage."""
    parts: list[str] = []
    usage_seen = False
    done = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        now = clock()
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            _fail(record, "bad_event", now, data[:_ERROR_BODY_CHARS])
            return
        if "error" in event:
            _fail(record, "stream_error", now, json.dumps(event["error"])[:_ERROR_BODY_CHARS])
            return
        text = _content(event, endpoint)
        if text:
            record.chunk_times.append(now)
            parts.append(text)
        usage = event.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            usage_seen = True
            record.output_tokens = int(usage["completion_tokens"])
            record.server_input_tokens = usage.get("prompt_tokens")
            record.cached_tokens = _cached_tokens(usage)
    record.finished = clock()
    record.text = "".join(parts)
    if not done:
        _fail(record, "incomplete_stream", record.finished)
    elif not record.chunk_times:
        _fail(record, "empty_response", record.finished)
    else:
        record.status = OK
    return usage_seen


def _cached_tokens(usage: dict) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field, which
    carpool and vLLM fill), or None when the server does not say."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def _content(event: dict, endpoint: str) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _refuse(record: RequestRecord, status: int, body: str, now: float) -> None:
    if status in REJECT_STATUSES:
        record.status, record.reason, record.finished = REJECTED, REJECT_STATUSES[status], now
        record.error = body[:_ERROR_BODY_CHARS]  # why (the server's code and message)
    else:
        _fail(record, f"http_{status}", now, body[:_ERROR_BODY_CHARS])


def _fail(record: RequestRecord, reason: str, now: float, detail: str = "") -> None:
    record.status, record.reason, record.finished = FAILED, reason, now
    record.error = detail
