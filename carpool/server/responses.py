"""OpenAI response bodies built from carpool ``RequestOutput``s."""
from __future__ import annotations

import json
import time
from typing import Any

from carpool.engine.outputs import RequestOutput, TokenLogprob
from carpool.server.chat_output import ChatShape, ChoiceStream


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ResponseBuilder:
    """Shapes chunks and final bodies for one API call (chat or completions)."""

    def __init__(self, kind: str, request_id: str, model: str, tokenizer,
                 logprobs: int | None, shape: ChatShape | None = None) -> None:
        self.chat = kind == "chat"
        # Chat: tool calls and reasoning split out of the text (chat_output.py).
        self.shape = shape if shape is not None and shape.active else None
        self._streams: dict[int, ChoiceStream] = {}
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.logprobs = logprobs  # None: not asked for
        self._text_offsets: dict[int, int] = {}

    def _header(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def role_chunk(self, index: int) -> dict[str, Any]:
        choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        return {**self._header(True), "choices": [choice]}

    def chunks(self, index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """The streaming chunks of what is new in ``output`` (with a chat
        shape, one per delta it makes; the last carries the finish)."""
        if self.shape is None:
            return [self.chunk(index, output)]
        stream = self._streams.setdefault(index, self.shape.stream())
        deltas = stream.feed(output.delta_text) if output.delta_text else []
        if output.finished:
            deltas += stream.finish()
        finish = output.finish_reason if output.finished else None
        if finish == "stop" and stream.called:
            finish = "tool_calls"
        logprobs = self._logprobs(index, output.delta_logprobs)
        if not deltas and not output.finished and logprobs is None:
            return []
        deltas = deltas or [{}]
        chunks = [{**self._header(True), "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs if i == 0 else None,
             "finish_reason": None}]} for i, delta in enumerate(deltas)]
        last = chunks[-1]["choices"][0]
        last["finish_reason"] = finish
        if output.finished:
            last["stop_reason"] = output.stop_reason
        return chunks

    def chunk(self, index: int, output: RequestOutput) -> dict[str, Any]:
        """A streaming chunk with what is new in ``output``."""
        finish = output.finish_reason if output.finished else None
        logprobs = self._logprobs(index, output.delta_logprobs)
        if self.chat:
            delta = {"content": output.delta_text} if output.delta_text else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": output.delta_text, "logprobs": logprobs,
                      "finish_reason": finish}
        if output.finished:
            choice["stop_reason"] = output.stop_reason
        return {**self._header(True), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._header(True), "choices": [], "usage": usage}

    def final(self, outputs: list[RequestOutput], n: int) -> dict[str, Any]:
        """The non-streaming body; ``outputs[i]`` is choice ``i``'s last output."""
        choices = []
        for index, output in enumerate(outputs):
            logprobs = self._logprobs(index, output.logprobs)
            if self.chat:
                message, finish = ({"role": "assistant", "content": output.text},
                                   output.finish_reason)
                if self.shape is not None:
                    message, finish = self.shape.message(output.text, finish)
                choice = {"index": index, "message": message, "logprobs": logprobs,
                          "finish_reason": finish}
            else:
                choice = {"index": index, "text": output.text, "logprobs": logprobs,
                          "finish_reason": output.finish_reason}
            choice["stop_reason"] = output.stop_reason
            choices.append(choice)
        return {**self._header(False), "choices": choices, "usage": usage_of(outputs, n)}

    # -- logprobs ------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if self.logprobs is None or entries is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = self._text_offsets.get(index, 0)
        for entry in entries:
            text = self._token_text(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            top.append({self._token_text(t): lp for t, lp in entry.top[:self.logprobs]}
                       if self.logprobs else None)
            offsets.append(offset)
            offset += len(text)
        self._text_offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}

    def _chat_entry(self, entry: TokenLogprob) -> dict[str, Any]:
        text = self._token_text(entry.token_id)
        top = [{"token": (t_text := self._token_text(t)), "logprob": lp,
                "bytes": list(t_text.encode())} for t, lp in entry.top[:self.logprobs]]
        return {"token": text, "logprob": entry.logprob, "bytes": list(text.encode()),
                "top_logprobs": top}


def usage_of(outputs: list[RequestOutput], n: int) -> dict[str, Any]:
    """OpenAI usage. Choice ``p * n + i`` is sample ``i`` of prompt ``p``; a
    prompt shared by its n choices is counted once, as OpenAI does."""
    prompts = outputs[::n]
    prompt_tokens = sum(o.num_prompt_tokens for o in prompts)
    completion_tokens = sum(o.num_output_tokens for o in outputs)
    cached = sum(o.num_cached_tokens for o in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}
