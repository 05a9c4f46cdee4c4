"""The engine core: one step of serving, shared by the live engine and the
simulated replica.

A step is ``begin`` (schedule, and hand out what expired while waiting),
the executor running the batch (the live engine's model, or the
simulator's cost model on a virtual clock), then ``complete`` (commit the
computed tokens and the sampled ones, feed the online cost model, finish
what reached its length). ``fast_forward`` applies a run of identical
decode steps in one go with the same effects. What differs between the two
drivers stays with them: the live engine checks stop tokens and strings
(the ``stop`` hook of ``complete``) and streams text, the simulator keeps
per-request records. Pure Python; time comes from the scheduler's clock.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from carpool.scheduler.fast_forward import apply_decode_steps, decode_run_limit
from carpool.scheduler.request import Request, RequestStatus
from carpool.scheduler.scheduler import Scheduler
from carpool.scheduler.step import SchedulerOutput

# Told that a request sampled one of its ``stop_token_ids`` (the token
# given), before the core finishes it FINISHED_STOPPED: the live engine
# records why it stopped.
StopHook = Callable[[Request, int], None]


class EngineCore:
    """A scheduler and the rules of a step; see the module docstring.

    ``max_model_len`` (None: no limit) finishes a request whose tokens fill
    the context, as ``max_tokens`` does.
    """

    def __init__(self, scheduler: Scheduler, max_model_len: int | None = None) -> None:
        self.scheduler = scheduler
        self.max_model_len = max_model_len

    def begin(self) -> tuple[SchedulerOutput, list[Request]]:
        """This step's batch, and the requests rejected since the last step
        (expired in the queue: the driver reports them)."""
        output = self.scheduler.schedule()
        self.scheduler.kv.note_exports(output.spans)  # P/D prefills' blocks stream per layer
        return output, self.scheduler.pop_rejected()

    def complete(self, output: SchedulerOutput, sampled: Iterable[tuple[Request, int]],
                 seconds: float, on_stop: StopHook | None = None,
                 ) -> tuple[list[Request], list[Request]]:
        """Commit ``output`` (which took ``seconds``) with the ``sampled``
        tokens. Returns (progressed: the sampled requests still running when
        the step ended, in batch order; ``sampled`` is read once; finished: those of them that ended
        now: at one of their ``stop_token_ids`` (FINISHED_STOPPED, after
        ``on_stop``), else at their length)."""
        scheduler = self.scheduler
        scheduler.commit_spans(output)
        scheduler.record_step(output.num_tokens, len(output.spans), seconds)
        progressed, finished = [], []
        running, length = RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH
        context = self.max_model_len if self.max_model_len is not None else math.inf
        now = scheduler.clock()
        for request, token_id in sampled:  # every request, every step: kept lean
            if request.status is not running:
                continue  # aborted while the step ran
            # scheduler.append_token, inlined
            tokens = request.token_ids
            tokens.append(token_id)
            if request.first_token_time is None:
                scheduler.first_token(request, now)
            request.last_token_time = now
            progressed.append(request)
            num_tokens = len(tokens)
            if token_id in request.stop_token_ids:
                if on_stop is not None:
                    on_stop(request, token_id)
                status = RequestStatus.FINISHED_STOPPED
            elif num_tokens >= request.max_num_tokens or num_tokens >= context:  # _at_length
                status = length
            else:
                continue
            scheduler.finish_request(request, status)
            finished.append(request)
        return progressed, finished

    def decode_run_limit(self, most: int | None = None) -> int:
        """How many identical decode steps ``fast_forward`` may apply now:
        the scheduler's limit, ending as well with the step in which a
        request fills the context (``max_model_len``)."""
        limit = decode_run_limit(self.scheduler, most)
        if limit and self.max_model_len is not None:
            room = min(self.max_model_len - r.num_tokens for r in self.scheduler.running)
            limit = min(limit, max(0, room))
        return limit

    def fast_forward(self, seconds: Sequence[float], step_ends: Sequence[float],
                     set_time: Callable[[float], None], token_id: int) -> list[Request]:
        """Apply ``len(seconds)`` decode steps (at most ``decode_run_limit``)
        sampling ``token_id``; finish and return, in the order the steps
        visited them, the requests that reached their length. Only for
        drivers without a stop check (every step samples the same token)."""
        order = apply_decode_steps(self.scheduler, seconds, step_ends, set_time, token_id)
        finished = [request for request in order if self._at_length(request)]
        for request in finished:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)
        return finished

    def _at_length(self, request: Request) -> bool:
        """The length rule: ``max_tokens`` generated, or the context full."""
        return (request.num_output_tokens >= request.max_tokens
                or (self.max_model_len is not None
                    and request.num_tokens >= self.max_model_len))
