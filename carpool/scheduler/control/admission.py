"""Admission control: bounded queues, retry-after estimates and deadlines.

Pure Python; every time is a value of the scheduler's injected clock.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from carpool.config import SchedulerConfig
from carpool.scheduler.control.cost_model import StepCostModel
from carpool.scheduler.control.overload import (
    SHED_ABOVE_PRIORITY,
    BusyWindow,
    OverloadGuard,
    shed_victim,
)
from carpool.scheduler.control.shedding import (
    CalmTTFT,
    PredictionError,
    first_broken_promise,
    predict_first_token_delay,
    predict_slot_delay,
    ttft_allowance,
)
from carpool.scheduler.request import Request
from carpool.slo import CALIBRATION_PROMPT_TOKENS, class_share

# Seconds a first token's prediction error counts in the margin. The large
# misses come where the load changes (a surge's first seconds, while the
# batch limit moves); kept for 30 s they outlived a 30 s surge and shed the
# first arrivals of the calm after it.
MARGIN_MAX_AGE = 10.0
# Retry-after estimates are whole seconds in this range.
MIN_RETRY_AFTER = 1.0
MAX_RETRY_AFTER = 60.0
# Departures are counted over the last RATE_WINDOW seconds of busy time.
RATE_WINDOW = 30.0
# A single departure a few milliseconds into a busy period says little;
# rates are measured over at least this many seconds.
MIN_RATE_SPAN = 1.0


class RejectedError(Exception):
    """A request turned away by admission control; retrying later may work.

    ``reason`` is ``"queue_full"``, ``"queue_tokens"`` or ``"deadline"``;
    ``retry_after`` is a whole number of seconds in [1, 60] (the value for
    an HTTP ``Retry-After`` header).
    """

    def __init__(self, reason: str, retry_after: float, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class DepartureRate:
    """Online estimate of how fast requests leave the scheduler.

    Departures (finished, aborted or expired requests) are stamped in
    *busy time*: clock seconds during which the scheduler held at least one
    request. The rate is the number of departures in the last
    ``RATE_WINDOW`` busy seconds divided by the busy seconds observed in
    that window (at least ``MIN_RATE_SPAN``), so idle periods do not dilute
    the estimate of how fast a loaded server drains its queue.
    """

    def __init__(self) -> None:
        self._busy_total = 0.0  # busy seconds before _busy_since
        self._busy_since: float | None = None  # set while busy
        self._stamps: deque[float] = deque()  # busy-time stamps of departures, ascending

    def busy_time(self, now: float) -> float:
        """Busy seconds since the estimator was created, up to ``now``."""
        if self._busy_since is None:
            return self._busy_total
        return self._busy_total + max(0.0, now - self._busy_since)

    def set_busy(self, now: float, busy: bool) -> None:
        """Tell the estimator whether the scheduler holds any request from ``now``."""
        if busy and self._busy_since is None:
            self._busy_since = now
        elif not busy and self._busy_since is not None:
            self._busy_total = self.busy_time(now)
            self._busy_since = None

    def record(self, now: float) -> None:
        """Note one departure at ``now``."""
        stamp = self.busy_time(now)
        self._stamps.append(stamp)
        self._prune(stamp)

    def rate(self, now: float) -> float | None:
        """Departures per second, or ``None`` when none was seen in the window."""
        busy = self.busy_time(now)
        self._prune(busy)
        if not self._stamps:
            return None
        span = max(MIN_RATE_SPAN, min(RATE_WINDOW, busy))
        return len(self._stamps) / span

    def retry_after(self, now: float, departures_needed: int) -> float:
        """Seconds until ``departures_needed`` more requests have left.

        ``ceil(departures_needed / rate)`` clamped to [1, 60]. With no
        departure in the window the rate is taken as one per busy second
        observed so far (at least one per ``MIN_RATE_SPAN``): a cold server
        answers 1 s, a stalled one backs clients off longer and longer.
        """
        rate = self.rate(now)
        if rate is None:
            span = min(RATE_WINDOW, self.busy_time(now))
            rate = 1.0 / max(MIN_RATE_SPAN, span)
        seconds = math.ceil(max(1, departures_needed) / rate)
        return float(min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, seconds)))

    def _prune(self, busy: float) -> None:
        while self._stamps and self._stamps[0] < busy - RATE_WINDOW:
            self._stamps.popleft()


class AdmissionControl:
    """Decides at arrival whether a request may queue, and counts why not.

    In order: a deadline already past or predicted to be missed
    (``predictive_shedding``); degrade mode (``emergency_switch``: low
    priorities shed first, a better arrival displaces the worst waiting
    request from a full queue); the queue bounds in requests and tokens;
    then, under the adaptive controller, the TTFT target: an arrival whose
    predicted first token is later than its class's share of the target is
    rejected (``predicted_ttft_miss``). Nothing changes (no displacement)
    unless every check passed. Owns the estimators these need (departure
    rate, step-cost model, busy window, overload guard); the scheduler
    feeds them.
    """

    def __init__(self, config: SchedulerConfig, knobs=None,
                 ttft_target: float | None = None) -> None:
        self.config = config
        # The live knobs (``controller.LiveKnobs``) when an adaptive controller
        # moves the step budget and batch limit; else the configured values.
        self.knobs = knobs or config
        # Adaptive controller: arrivals without a deadline are shed when
        # their first token is predicted later than their share of this.
        self.ttft_target = ttft_target
        self.prediction_error = PredictionError(max_age=MARGIN_MAX_AGE)
        self.calm_ttft = CalmTTFT()  # the calm first tokens a surge's queue is held near
        # Seconds a server takes to hand a first token to its client after the
        # engine made it (set by ``AsyncEngine``; 0 for the offline engine and
        # the simulator): the TTFT target is what the client sees.
        self.delivery_lag = 0.0
        self.departures = DepartureRate()
        self.cost_model = StepCostModel()
        self.busy = BusyWindow()
        self.overload = (OverloadGuard(
            max(1, int(config.emergency_queue_share * config.max_queue_requests)),
            config.emergency_busy, config.emergency_sustain, config.emergency_host_cpu)
            if config.emergency_switch else None)
        self.rejections: dict[str, int] = {}  # by reason, at arrival and later (a counter)
        # Arrivals that reached admission, admitted or not (a counter): the
        # denominator of a reject rate, whatever the reason.
        self.arrivals = 0
        # Arrivals started a step later than they could have been, so as not
        # to delay the first tokens of their step mates (a counter).
        self.deferred = 0
        # The number of the step the scheduler builds next (set before each check).
        self.next_step = 0

    def count(self, reason: str) -> None:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def check_session_room(self, now: float, session_unfinished: int) -> None:
        """Reject a session's arrival while it already holds
        ``max_session_requests`` unfinished ones (they run one at a time, so
        more would only sit in the queue others need)."""
        limit = self.config.max_session_requests
        if session_unfinished >= limit:
            retry = self.departures.retry_after(now, 1)
            self._reject("session_full", retry, (
                f"the session already has {limit} unfinished requests (they run one at a "
                f"time); retry in ~{retry:.0f} s"))

    def check(self, request: Request, now: float, waiting, running: Sequence[Request],
              drop_waiting: Callable[[Request, str], None]) -> None:
        """Raise ``RejectedError`` if ``request`` may not queue now. In degrade
        mode it may instead displace a worse waiting request (``drop_waiting``)."""
        try:
            victim = self._admit(request, now, waiting, running)
        except RejectedError:
            self.calm_ttft.rejected(now)
            raise
        if victim is not None:
            drop_waiting(victim, "shed")

    def _admit(self, request: Request, now: float, waiting,
               running: Sequence[Request]) -> Request | None:
        """``check``'s rules in order; the waiting request to displace, if any."""
        if request.deadline is not None:
            self._check_deadline(request, now, waiting, running)
        victim = None
        if self.overload is not None and self.overload.degraded:
            victim = self._shed(request, now, waiting)
        queued = len(waiting)
        limit = self.config.max_queue_requests
        if queued >= limit and victim is None:
            retry = self.departures.retry_after(now, queued + 1 - limit)
            self._reject("queue_full", retry, f"the queue is full ({queued} requests waiting, "
                                              f"limit {limit}); retry in ~{retry:.0f} s")
        token_limit = self.config.max_queue_tokens
        tokens = waiting.num_prompt_tokens
        if token_limit is not None and tokens + request.num_prompt_tokens > token_limit:
            # The queue sheds whole requests: convert the excess at the mean size.
            mean = tokens / max(1, queued)
            excess = math.ceil((tokens + request.num_prompt_tokens - token_limit)
                               / max(1.0, mean))
            retry = self.departures.retry_after(now, excess)
            self._reject("queue_tokens", retry, (
                f"the queue holds too many prompt tokens ({tokens} waiting + "
                f"{request.num_prompt_tokens} in this request > limit {token_limit}); "
                f"retry in ~{retry:.0f} s"))
        if (request.deadline is None and self.ttft_target is not None
                and self.config.predictive_shedding):
            self._check_ttft_target(request, now, waiting, running)
        return victim

    def surge_target(self, now: float) -> float | None:
        """The TTFT admission holds arrivals to (before their class's share):
        the operator's target, or, when lower, the one that allows a normal
        request ``surge_ttft_factor`` x the live calm TTFT p99."""
        target, factor = self.ttft_target, self.config.surge_ttft_factor
        calm = None if factor is None or target is None else self.calm_ttft.p99(now)
        return target if calm is None else min(target, factor * calm / class_share(0))

    def _check_ttft_target(self, request: Request, now: float, waiting,
                           running: Sequence[Request]) -> None:
        delay = self._predict(request, now, waiting, running)
        if delay is None:
            return
        # Both drivers stamp a request when it arrives, not when the engine
        # takes it between two steps, so the wait for the step in flight is
        # in ``delay`` as it was (now - arrival) and in the TTFTs the margin
        # learns. (Once it was stamped at the step boundary and a whole mean
        # step was added for that wait: half a step too much on average,
        # which shed 8-11% of a calm phase the plain server kept in its SLO.)
        delay += self.delivery_lag
        budget = self.knobs.max_num_batched_tokens
        alone = predict_first_token_delay(self.cost_model, 0, request.num_prompt_tokens, 0,
                                          budget)
        reference = predict_first_token_delay(self.cost_model, 0, CALIBRATION_PROMPT_TOKENS, 0,
                                              budget)
        target = self.surge_target(now)
        allowed = ttft_allowance(target, request.priority, alone, reference)
        # Next in line for a free slot: as soon as any server could. Turning
        # it away helps nobody (and admitting it keeps the margin learning).
        if delay > allowed and not self._first_in_line(request, waiting, running):
            # The minimum needed: the work ahead must drain by the excess.
            self._reject("predicted_ttft_miss", delay - allowed, (
                f"the request would get its first token in ~{delay:.2f} s, over the "
                f"{allowed:.2f} s its priority class is allowed of the TTFT target "
                f"{target:.2f} s; retry in ~{math.ceil(delay - allowed):.0f} s"))
        request.first_token_due = request.arrival_time + allowed
        self._check_shared_step(request, now, waiting, running, allowed)

    def _check_shared_step(self, request: Request, now: float, waiting,
                           running: Sequence[Request], allowed: float) -> None:
        """When ``request`` would start in the next step beside requests
        still waiting for their first token, and the step its prompt
        lengthens would break one of their promises (``first_broken_promise``),
        it is deferred by one step (``request.earliest_step``): it starts in the
        step after theirs, when that still gives its first token within its
        own ``allowed`` seconds, and is rejected otherwise. When it breaks no
        promise, its step mates' first tokens are re-predicted with it in
        their step, so the margin learns the cost model's error, not this
        step's growth.

        Why defer: rejecting it turned away arrivals that were on time one
        step later (a quarter of one live surge's rejections, and the only
        ones of the calm after it), a prefill step being ~0.2 s on a 2-core
        CPU while the TTFT allowance is seconds."""
        # Who starts in the next step: the waiting requests ahead of it (of an
        # equal or better priority under ``policy: priority``) but those
        # deferred past it, and the running prompts not yet prefilled.
        waiting_ahead = [r for r in waiting if r.earliest_step <= self.next_step and (
            self.config.policy != "priority" or r.priority <= request.priority)]
        holding = running if self.config.policy != "priority" else [
            r for r in running if r.priority <= request.priority]
        prefilling = [r for r in running if r.num_pending_tokens > 1]
        decoding = sum(1 for r in running if r.num_pending_tokens == 1)
        budget = self.knobs.max_num_batched_tokens
        tokens = sum(r.num_prompt_tokens for r in waiting_ahead)
        tokens += sum(r.num_pending_tokens for r in prefilling)
        if (tokens + request.num_prompt_tokens > budget - min(decoding, budget - 1)
                or len(waiting_ahead) + 1 > self.knobs.max_num_seqs - len(holding)):
            return  # not one shared step: full steps ahead are priced full already
        members = [r for r in (*waiting_ahead, *prefilling) if r.first_token_due is not None]
        if not members:
            return
        seqs = decoding + len(members)
        step = self.cost_model.predict(decoding + tokens + request.num_prompt_tokens, seqs + 1)

        def margin(predicted: float) -> float:
            return self.prediction_error.margin(now, predicted)

        broken = first_broken_promise(members, now, step, self.delivery_lag, margin)
        if broken is None:
            for member in members:
                member.predicted_ttft = max(member.predicted_ttft or 0.0,
                                            now - member.arrival_time + step)
            return
        # Deferred: the members' step without it, then its own beside them.
        deferred = (now - request.arrival_time + self.cost_model.predict(decoding + tokens, seqs)
                    + self.cost_model.predict(seqs + request.num_prompt_tokens, seqs + 1))
        late = deferred + margin(deferred) + self.delivery_lag - allowed
        if late > 0:
            _, broken_by = broken
            self._reject("predicted_ttft_miss", max(late, broken_by), (
                f"the request would share the next step with requests ahead of it and "
                f"make their first tokens ~{broken_by:.2f} s later than the TTFT target "
                f"{self.ttft_target:.2f} s allows, and one step later its own would be "
                f"~{late:.2f} s late; retry in ~{math.ceil(max(late, broken_by)):.0f} s"))
        request.earliest_step = self.next_step + 1
        request.predicted_ttft = deferred
        self.deferred += 1

    def _check_deadline(self, request: Request, now: float, waiting,
                        running: Sequence[Request]) -> None:
        if request.deadline < now:
            self._reject("deadline", 1.0, f"the request's deadline ({request.deadline:.3f}) "
                                          f"passed before it arrived ({now:.3f})")
        if not self.config.predictive_shedding:
            return
        delay = self._predict(request, now, waiting, running)
        if delay is not None and request.arrival_time + delay > request.deadline:
            self._reject("predicted_deadline_miss", delay, (
                f"the request would get its first token in ~{delay:.2f} s, after its "
                f"deadline ({request.deadline - now:.2f} s from now)"))

    def observe_first_token(self, request: Request, now: float) -> None:
        """Learn the prediction error from a request's first token."""
        self.calm_ttft.record(request.arrival_time,
                              now - request.arrival_time + self.delivery_lag)
        if request.predicted_ttft is not None:
            self.prediction_error.record(request.predicted_ttft, now - request.arrival_time,
                                         now)

    def _predict(self, request: Request, now: float, waiting,
                 running: Sequence[Request]) -> float | None:
        """The predicted TTFT, counted from the request's arrival, plus the
        learned error margin; remembered on the request (without the margin)
        so its first token can correct the margin."""
        delay = self.predicted_first_token(request, now, waiting, running)
        if delay is None:
            request.predicted_ttft = None
            return None
        request.predicted_ttft = max(0.0, now - request.arrival_time) + delay
        return request.predicted_ttft + self.prediction_error.margin(now, request.predicted_ttft)

    def predicted_first_token(self, request: Request, now: float, waiting,
                              running: Sequence[Request]) -> float | None:
        """Seconds until ``request``'s first token if it queued now, or None
        while the cost model is not ready.

        The later of two estimates: compute (every prompt token ahead, then
        its own, at the step budget left beside the decodes) and slots (when
        no sequence slot is free, the requests ahead wait for departures: the
        lower of the running requests' remaining tokens at the decode step
        time and the measured departure rate, both upper bounds). Under
        ``policy: priority`` only work of an equal or better priority is
        ahead: worse waiting requests queue behind it and worse running ones
        give up their slots (priority preemption).
        """
        ahead_tokens, ahead, holding = self._ahead(request, waiting, running)
        prefilling = sum(r.num_pending_tokens for r in running if r.num_pending_tokens > 1)
        decoding = sum(1 for r in running if r.num_pending_tokens == 1)
        delay = predict_first_token_delay(
            self.cost_model, ahead_tokens + prefilling, request.num_prompt_tokens,
            decoding, self.knobs.max_num_batched_tokens)
        if delay is None:
            return None
        short = ahead + 1 - max(0, self.knobs.max_num_seqs - len(holding))
        if short <= 0:
            return delay
        # Two upper bounds on the wait for a slot; the lower one is the better guess.
        bounds = [predict_slot_delay(self.cost_model, [r.max_tokens - r.num_output_tokens
                                                       for r in holding], short,
                                     self.busy.mean_step(now))]
        rate = self.departures.rate(now)
        if rate:
            bounds.append(short / rate)
        bounds = [b for b in bounds if b is not None]
        if not bounds:
            return delay
        # Once its slot is free the prompt still has to be prefilled: the first
        # token comes a prefill step after the slot (the max of the two alone
        # came a step early every time a request waited for a slot).
        own = predict_first_token_delay(self.cost_model, 0, request.num_prompt_tokens,
                                        decoding, self.knobs.max_num_batched_tokens) or 0.0
        return max(delay, min(bounds) + own)

    def _ahead(self, request: Request, waiting, running: Sequence[Request],
               ) -> tuple[int, int, Sequence[Request]]:
        """(prompt tokens waiting ahead, requests waiting ahead, running
        requests holding slots it cannot take) for ``request``."""
        if self.config.policy != "priority":
            return waiting.num_prompt_tokens, len(waiting), running
        better = [r for r in waiting if r.priority <= request.priority]
        holding = [r for r in running if r.priority <= request.priority]
        return sum(r.num_prompt_tokens for r in better), len(better), holding

    def _first_in_line(self, request: Request, waiting, running: Sequence[Request]) -> bool:
        """Nothing waits ahead, no running prompt is still prefilling and a
        slot is free: the request starts in the next step. Turning it away
        helps nobody, and admitting it keeps the margin learning (a margin
        that rejected everything would otherwise never be corrected)."""
        _, ahead, holding = self._ahead(request, waiting, running)
        return (ahead == 0 and len(holding) < self.knobs.max_num_seqs
                and not any(r.num_pending_tokens > 1 for r in running))

    def _shed(self, request: Request, now: float, waiting) -> Request | None:
        """Degrade mode, lowest priorities first: a low arrival is turned
        away; a better one may take the place of the worst waiting request
        when the queue is full (returned; dropped once every check passed)."""
        if request.priority > SHED_ABOVE_PRIORITY:
            retry = self.departures.retry_after(now, 1)
            self._reject("shed", retry, f"overloaded ({self.overload.reason}): low-priority "
                                        f"requests are shed; retry in ~{retry:.0f} s")
        if len(waiting) >= self.config.max_queue_requests:
            return shed_victim(waiting, request)
        return None

    def _reject(self, reason: str, retry_after: float, message: str) -> None:
        self.count(reason)
        raise RejectedError(reason, min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER,
                                                             math.ceil(retry_after))), message)
