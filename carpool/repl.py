"""``carpool generate`` and ``carpool chat``: stream tokens to the terminal."""
from __future__ import annotations

import sys

from carpool.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.sampling_params import SamplingParams


def stream_one(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams) -> str:
    """Run one request to completion, printing text as it arrives."""
    request_id = engine.add_request(prompt_ids, params)
    text = []
    while engine.has_unfinished:
        for output in engine.step():
            if output.request_id == request_id and output.delta_text:
                sys.stdout.write(output.delta_text)
                sys.stdout.flush()
                text.append(output.delta_text)
    sys.stdout.write("\n")
    return "".join(text)


def run_generate(config: EngineConfig, prompt: str, params: SamplingParams, raw: bool) -> int:
    engine = LLMEngine.from_config(config)
    if not raw:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    stream_one(engine, engine.tokenizer.encode(prompt), params)
    return 0


def run_chat(config: EngineConfig, params: SamplingParams, system: str | None) -> int:
    engine = LLMEngine.from_config(config)
    messages = [{"role": "system", "content": system}] if system else []
    print("carpool chat: type a message, /reset to start over, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        messages.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(messages)
        try:
            reply = stream_one(engine, engine.tokenizer.encode(prompt), params)
        except ValueError as exc:  # e.g. the conversation outgrew the context
            print(f"carpool: {exc}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
