"""How the adaptive controller keeps the TPOT target and notices surges.

Why the batch limit is what it is: under continuous batching every running
request gets one token per step, so its time per output token is the step
time, and the step time grows with the batch. Raising the batch limit with
demand (as the controller once did) turns a surge into slower tokens for
everybody; instead the limit is the largest batch whose steps stay within
the mode's share of the TPOT target, and what does not fit waits or is shed
at arrival (``shedding``), so admitted requests keep their targets.

- ``latency_limit``: the feed-forward term. In steady state each request
  brings its prompt's prefill along with its output tokens, so a step of
  ``n`` decodes also carries ``n x prefill_ratio`` prefill tokens on
  average (prompt tokens per output token of recent arrivals), up to the
  step's token budget; the limit is the largest ``n`` the online cost model
  puts within the step target with that load.
- ``StepCorrection``: the feedback term. The cost model only sees the
  model's compute; detokenizing, streaming and the HTTP server share the
  machine too, so the steps a request feels are longer. The correction
  multiplies the *step time* the limit is sized to (both the cost model's
  limit and the measured floor of ``proven_limit``), not the batch count:
  a factor on the count compounded with the floor (the floor is the
  running count itself, so 0.8 x it cut the limit again every tick and 1.2
  x it grew it again) and swung a live limit between 11 and 24. A request's
  TPOT is about proportional to the step time, so the move is
  proportional too: the factor x (the middle of the band / the TPOT seen),
  within ``CORRECTION_STEP`` per move; down after ``hold`` ticks in a row
  with the mean TPOT of the requests that just finished (fast window) over
  the band, up after ``hold`` ticks in a row under it while demand exceeds
  the limit, and never down again until the previous cut is in effect
  (running <= limit): a lower limit never preempts, so it takes a while to
  show, and cutting again meanwhile would overshoot. The streaks and the
  band keep alternating signals (or one burst of prefills) from moving the
  knobs back and forth.
- ``early_tick_cause``: events that bring the next tick forward.

Pure Python; times come from the caller.
"""
from __future__ import annotations

from carpool.scheduler.control.cost_model import StepCostModel

# The share of the TPOT target the feed-forward batch limit sizes a step to,
# in every mode: a request's TPOT is the mean of its steps, and the ones
# carrying prefill chunks run longer than the steady-state estimate. The same
# in every mode because the limit binds only when demand exceeds it: a
# smaller one in latency mode (light load) bit just as a surge arrived,
# shedding arrivals while the mode was still switching.
LIMIT_STEP_SHARE = 0.8
# The factor on the step time the limit is sized to. Above 1 too: the
# steady-state estimate spreads prefill over every step, and steps without
# a chunk are cheaper, so the mean TPOT can sit well under the step it sizes.
CORRECTION_RANGE = (0.25, 2.0)
CORRECTION_STEP = (0.7, 1.2)  # the most one move cuts or grows the factor by
CALM_SHARE = 0.7  # steps under this share of the step target are "well within"
# The band the correction keeps the mean TPOT of finished requests in, as
# shares of the TPOT target: cut above TPOT_HIGH, grow below TPOT_LOW while
# demand exceeds the limit. The target holds for the p99, and a request's
# TPOT spreads ~1.2x its mean here (p99 295 ms over a 249 ms mean at 0.6x
# load, default model, 2-core CPU), so the mean must stay below ~0.85.
TPOT_HIGH = 0.95
TPOT_LOW = 0.8
# A surge: arrivals in the fast window at this multiple of the slow rate,
# counting at least this many arrivals (a single pair is no surge).
SURGE_RATIO = 1.5
MIN_SURGE_ARRIVALS = 4


def latency_limit(cost: StepCostModel, step_seconds: float, cap: int,
                  prefill_ratio: float | None, token_budget: int) -> int:
    """The most decoding sequences whose step, carrying their steady-state
    share of prefill tokens, the cost model puts within ``step_seconds``
    (at least 1, at most ``cap``)."""
    ratio = max(0.0, prefill_ratio or 0.0)

    def step(n: int) -> float:
        tokens = min(n + n * ratio, max(n, token_budget))
        return cost.predict(int(round(tokens)), n) or 0.0

    low, high = 1, max(1, cap)
    while low < high:  # predict is monotone in n for a sane fit
        mid = (low + high + 1) // 2
        if step(mid) <= step_seconds:
            low = mid
        else:
            high = mid - 1
    return low


def proven_limit(anchor: tuple[float, float] | None, step_seconds: float) -> int:
    """The batch the measured steps show within ``step_seconds``: the mean
    running count of recent busy steps (``anchor``: mean count, mean wall
    seconds) when their mean took no longer, else 0. A floor under the cost
    model's limit: fitted on the small batches of a fresh server (a few
    decodes beside 100-token prefills), the model overpriced bigger ones,
    so the limit fell, the batches stayed small and the fit never learned
    otherwise (limits of 1-5 where 10 kept the target)."""
    if anchor is None or anchor[1] > step_seconds:
        return 0
    return int(anchor[0])


class StepCorrection:
    """Feedback factor on the step time the batch limit is sized to, from
    the time per token requests feel."""

    def __init__(self, hold: int = 2) -> None:
        self.hold = hold
        self.factor = 1.0
        self._calm = 0  # consecutive calm ticks with demand over the limit
        self._slow = 0  # consecutive ticks with steps over the target, the last cut in effect

    def update(self, step_time: float | None, step_target: float | None, running: int,
               limit: int, demand_over_limit: bool, steps_now: float | None = None,
               ) -> str | None:
        """Feed one tick; return the cause when the factor changed.
        ``step_time``: what requests felt per token lately (the controller
        passes the mean TPOT of those finished in the fast window: the mean
        of their steps, so one burst of prefill-heavy steps barely moves it).
        ``steps_now``: the mean step of the fast window; the limit never grows
        while it is over the target (those TPOTs are of requests that ran
        before the steps got slow)."""
        if step_time is None or step_target is None:
            # No request finished lately (light load): no evidence either way,
            # so the streaks stand (resetting them here kept a calm server
            # from ever growing a limit that shed its arrivals).
            return None
        low, high = CORRECTION_RANGE
        if step_time > TPOT_HIGH * step_target:
            self._calm = 0
            if running > limit:  # the last cut has not taken effect yet
                self._slow = 0
                return None
            self._slow += 1
            if self._slow < self.hold:  # a transient (a burst of prefills) is no trend
                return None
            new = max(low, self.factor * _proportional_move(step_time, step_target))
            cause = (f"steps {step_time * 1000:.0f} ms > {TPOT_HIGH:.0%} of target "
                     f"{step_target * 1000:.0f} ms with {running} running ({self.hold} ticks)")
        elif (step_time < TPOT_LOW * step_target and demand_over_limit
              and (steps_now is None or steps_now <= step_target)):
            self._slow = 0
            self._calm += 1
            if self._calm < self.hold:
                return None
            new = min(high, self.factor * _proportional_move(step_time, step_target))
            cause = (f"steps {step_time * 1000:.0f} ms < {TPOT_LOW:.0%} of "
                     f"{step_target * 1000:.0f} ms while demand exceeds the limit "
                     f"({self.hold} ticks)")
        else:
            self._calm = self._slow = 0
            return None
        self._calm = self._slow = 0
        if new == self.factor:
            return None
        self.factor = new
        return cause


def _proportional_move(step_time: float, step_target: float) -> float:
    """What brings a TPOT about proportional to the step time to the middle
    of the band, within ``CORRECTION_STEP``: small moves near the band, so
    one move does not jump over it (fixed +-20% moves crossed it and back)."""
    middle = (TPOT_LOW + TPOT_HIGH) / 2 * step_target
    low, high = CORRECTION_STEP
    return min(high, max(low, middle / step_time))


def early_tick_cause(*, waiting: int, running: int, limit: int, waiting_at_tick: int,
                     fast_rate: float, fast_arrivals: int, slow_rate: float,
                     step_time: float | None, step_target: float | None) -> str | None:
    """Why the next tick should not wait for the interval, or None:
    the queue grew past the free slots, arrivals surged, or steps got
    slower than the target."""
    if waiting > max(0, limit - running) and waiting > waiting_at_tick:
        return f"queue {waiting} > {max(0, limit - running)} free slots and growing"
    if fast_arrivals >= MIN_SURGE_ARRIVALS and fast_rate > SURGE_RATIO * slow_rate:
        return f"arrivals {fast_rate:.1f}/s > {SURGE_RATIO:g} x {slow_rate:.1f}/s"
    if step_time is not None and step_target is not None and step_time > step_target:
        return f"steps {step_time * 1000:.0f} ms > target {step_target * 1000:.0f} ms"
    return None
