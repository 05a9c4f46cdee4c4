"""Offline batch generation: ``LLM(model).generate(prompts, params)``."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from carpool.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.outputs import RequestOutput
from carpool.sampling_params import SamplingParams
from carpool.scheduler import RejectedError


class LLM:
    """Runs every prompt through one continuous batch and returns the final
    outputs in input order.

    ``LLM(model=None, **knobs)``: ``model`` is an HF directory or a .gguf
    file (None = the default SmolLM2-135M-Instruct); knobs are any
    ``EngineConfig`` field by name, e.g. ``dtype="float32"``,
    ``max_num_seqs=64``, ``kv_cache_memory="512MiB"``.
    """

    def __init__(self, model: str | None = None, config: EngineConfig | None = None,
                 **knobs: Any) -> None:
        config = config or EngineConfig()
        if model is not None:
            knobs["model"] = model
        config.update(knobs)
        self.engine = LLMEngine.from_config(config)
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """An ``LLM`` over an engine built elsewhere (its own executor)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        return llm

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Generate for all prompts (text or token ids) together.

        ``params`` is one ``SamplingParams`` for all or one per prompt.
        ``on_output`` sees every incremental output (e.g. for progress).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        pending = deque(zip(prompts, params))
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        while pending or self.engine.has_unfinished:
            while pending:
                try:
                    ids.append(self.engine.add_request(*pending[0]))
                except RejectedError:
                    break  # the waiting queue is full: feed the rest as it drains
                pending.popleft()
            for output in self.engine.step():
                if on_output is not None:
                    on_output(output)
                if output.finished:
                    final[output.request_id] = output
        return [final[i] for i in ids]

    def close(self) -> None:
        """End what the engine runs beside this process (a tensor-parallel
        replica's followers, the KV store's I/O thread); idempotent."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chat(self, messages: list[dict[str, str]],
             params: SamplingParams | None = None) -> RequestOutput:
        """One chat completion using the model's chat template."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(self.tokenizer.encode(prompt), params)[0]
