"""The engine's output stage: a committed step's tokens become text and outputs.

A step's commit (``EngineCore.complete``, on the engine's critical path)
appends the sampled token ids and applies the token-level stops only:
EOS, a stop token id, ``max_tokens`` and the context (integer checks,
``OutputStage.stop_token``). Everything per token that is text happens
here, after the commit: incremental detokenizing, stop strings, the
logprob lists and one ``RequestOutput`` per request. ``LLMEngine`` runs
this stage right after the commit, or, with overlap on, while the
executor runs the next step (``carpool.engine.llm_engine``). A stop string
found here ends its request late by at most that one step: the step in
flight computed one more token for it, which the commit drops, as vLLM's
output processor does across processes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from carpool.engine.detokenizer import IncrementalDetokenizer
from carpool.engine.outputs import RequestOutput, TokenLogprob
from carpool.engine.stats import EngineCounters
from carpool.executor.base import BatchItem
from carpool.model.sampler import SampleResult, SamplingRow
from carpool.sampling_params import SamplingParams
from carpool.scheduler import Request, RequestStatus

# How a request finished by the commit reads in its output.
FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length"}


@dataclass
class RequestState:
    """Engine-side state of a request (the scheduler's ``payload``)."""

    params: SamplingParams
    seed: int
    detokenizer: IncrementalDetokenizer
    text_parts: list[str] = field(default_factory=list)  # the output's text, append-only
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None
    token_stopped: bool = False  # its last token is a stop token: never detokenized
    sent_tokens: int = 0  # output tokens handed out in outputs so far
    num_detokenized: int = 0  # output tokens the detokenizer has seen
    sent_logprobs: int = 0
    handoff: str | None = None  # its P/D part (``wire.Handoff.role``), if split
    # The request's executor item and sampling row, made at its first step
    # and updated in place at each later one (see LLMEngine._batch_items).
    item: BatchItem | None = None
    row: SamplingRow | None = None
    # Structured outputs: the request's grammar state (carpool/model/grammar.py),
    # dropped with the request.
    constraint: Any = None


class OutputStage:
    """Token-level stops for the commit, text and outputs after it."""

    def __init__(self, eos_ids: set[int], counters: EngineCounters,
                 clock: Callable[[], float]) -> None:
        self.eos_ids = frozenset(eos_ids)
        self.counters = counters
        self.clock = clock
        self.num_logprob_requests = 0  # live requests that asked for logprobs

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that stop a request of these parameters (its
        ``Request.stop_token_ids``, which the engine core checks)."""
        stops = frozenset(params.stop_token_ids)
        return stops if params.ignore_eos else stops | self.eos_ids

    def record_logprobs(self, sampled: Sequence[Request], results: Sequence[SampleResult],
                        ) -> None:
        """Append a committed step's logprobs to the requests that asked for
        them (``params.logprobs``), before the commit: cheap when none did."""
        for request, result in zip(sampled, results):
            state: RequestState = request.payload
            if state.logprobs is not None and request.status is RequestStatus.RUNNING:
                state.logprobs.append(TokenLogprob(result.token_id, result.logprob,
                                                   result.top_logprobs or []))

    def on_stop_token(self, request: Request, token_id: int) -> None:
        """The engine core's hook at a stop token: EOS (stop_reason None, as
        vLLM) or a stop token id (the id). It is never detokenized."""
        state: RequestState = request.payload
        state.token_stopped = True
        state.stop_reason = None if token_id in self.eos_ids and not state.params.ignore_eos \
            else token_id

    def outputs(self, progressed: Sequence[Request]) -> tuple[list[RequestOutput], list[Request]]:
        """The outputs of a committed step's progressed requests (a final one
        for those the commit finished), and the still running requests a
        stop string ended now: the caller finishes them (FINISHED_STOPPED).
        A request aborted since the commit is left out: its abort output was
        its last."""
        outputs, stopped = [], []
        running = RequestStatus.RUNNING
        for request in progressed:  # every request, every step: kept lean
            status = request.status
            if status is running:
                delta = self._new_text(request)
                if request.payload.detokenizer.stopped:
                    stopped.append(request)
                    outputs.append(self.final(request, "stop", delta))
                else:
                    outputs.append(self._output(request, delta, False))
            elif status in FINISH_REASONS:
                delta = self._new_text(request)
                reason = FINISH_REASONS[status]
                if request.payload.detokenizer.stopped and status is not \
                        RequestStatus.FINISHED_STOPPED:
                    # A stop string on the token that also reached the length: a stop.
                    request.status, reason = RequestStatus.FINISHED_STOPPED, "stop"
                outputs.append(self.final(request, reason, delta))
        return outputs, stopped

    def final(self, request: Request, reason: str, delta: str | None = None) -> RequestOutput:
        """The request's last output (``reason``: stop, length, abort or
        rejected), its text caught up and what was held back released."""
        state: RequestState = request.payload
        if delta is None:
            delta = self._new_text(request)
        detokenizer = state.detokenizer
        if detokenizer.stopped:
            state.stop_reason = detokenizer.stop_reason
        elif not (reason == "length" and state.handoff == "prefill"):
            # Text that might have begun a stop string is released now; a
            # prefill part's stays held: its decode part goes on from it.
            delta += detokenizer.flush()
        if state.logprobs is not None:
            self.num_logprob_requests -= 1
        if reason != "rejected":
            self.counters.prompt_tokens += request.num_prompt_tokens
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        output = self._output(request, delta, True)
        output.finish_reason = reason
        output.finish_time = self.clock()
        output.reject_reason = request.reject_reason
        return output

    @staticmethod
    def _new_text(request: Request) -> str:
        """Feed the detokenizer the output tokens it has not seen (one, in a
        steady decode; never a final stop token) and return the new text."""
        state: RequestState = request.payload
        token_ids = request.token_ids
        num_prompt = len(request.prompt_token_ids)
        end = len(token_ids) - state.token_stopped
        start = num_prompt + state.num_detokenized
        if start >= end:
            return ""
        state.num_detokenized = end - num_prompt
        add_token = state.detokenizer.add_token
        if end - start == 1:
            return add_token(token_ids[start])[0]
        deltas = []
        for token_id in token_ids[start:end]:
            delta, stopped = add_token(token_id)
            deltas.append(delta)
            if stopped:
                break
        return "".join(deltas)

    @staticmethod
    def _output(request: Request, delta_text: str, finished: bool) -> RequestOutput:
        state: RequestState = request.payload
        if delta_text:
            state.text_parts.append(delta_text)  # joined only when an output's text is read
        token_ids = request.token_ids
        prompt = request.prompt_token_ids
        delta_ids = token_ids[len(prompt) + state.sent_tokens:]
        state.sent_tokens = len(token_ids) - len(prompt)
        logprobs = state.logprobs
        delta_logprobs = None
        if logprobs is not None:
            delta_logprobs = logprobs[state.sent_logprobs:]
            state.sent_logprobs = len(logprobs)
        # token_ids is copied from the request's own list only when read.
        return RequestOutput.of_request(
            request.request_id, prompt, state.text_parts, token_ids, delta_text, delta_ids,
            finished, state.stop_reason, logprobs, delta_logprobs, request.num_cached_tokens,
            request.arrival_time, request.first_scheduled_time, request.first_token_time)
