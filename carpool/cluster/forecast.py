"""Arrival-rate forecasters for predictive autoscaling, behind one interface.

A forecaster sees the arrival rate per bucket (``RateHistory.buckets``:
requests per second over each ``forecast_bucket_s``, oldest first) and
says the rates of the next buckets. ``PredictivePolicy`` sizes the pool
for the highest of them over a start-up and its horizon.

- ``holt``: damped Holt (level and trend; the damping keeps a trend fitted
  to noise from being extrapolated a quarter hour ahead at full slope).
- ``seasonal``: the daily shape: the rate one day earlier at each coming
  bucket, scaled by how the last hour compares with the same hour a day
  earlier; Holt until it has a day of history.
- ``arima``: an ARIMA(2,1,1) from statsmodels on the last six hours,
  refitted every 15 buckets; Holt until it has an hour.

Pure Python except ``arima`` (statsmodels, imported when first fitted:
``pip install 'carpool[forecast]'``). Deterministic: the same buckets give
the same forecast.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

DAY_S = 86400.0


class Forecaster(Protocol):
    name: str

    def forecast(self, buckets: Sequence[float], steps: int) -> list[float] | None:
        """The rates of the bucket in progress and the ``steps`` after it
        (``steps + 1`` values, each >= 0), given every finished bucket so
        far (the same list, grown, at each call); None without enough
        history to say."""


class HoltForecaster:
    """Damped Holt's linear trend (module docstring), folding in only the
    buckets it has not seen."""

    name = "holt"

    def __init__(self, alpha: float = 0.5, beta: float = 0.2, phi: float = 0.9,
                 min_buckets: int = 3) -> None:
        self.alpha, self.beta, self.phi, self.min_buckets = alpha, beta, phi, min_buckets
        self._level: float | None = None
        self._trend = 0.0
        self._seen = 0

    def _update(self, buckets: Sequence[float]) -> None:
        for value in buckets[self._seen:]:
            if self._level is None:
                self._level = value
                continue
            previous = self._level
            # A rate is never negative: unclamped, a falling trend carries the
            # level below zero and back (a pool at zero would flap).
            self._level = max(0.0, self.alpha * value + (1 - self.alpha) * (
                self._level + self.phi * self._trend))
            self._trend = self.beta * (self._level - previous) + (1 - self.beta) * (
                self.phi * self._trend)
        self._seen = len(buckets)

    def forecast(self, buckets: Sequence[float], steps: int) -> list[float] | None:
        self._update(buckets)
        if self._seen < self.min_buckets or self._level is None:
            return None
        out, damped = [self._level], 0.0
        for k in range(1, steps + 1):
            damped += self.phi ** k
            out.append(max(0.0, self._level + self._trend * damped))
        return out


class SeasonalForecaster:
    """Yesterday's shape, today's level (module docstring)."""

    name = "seasonal"

    def __init__(self, bucket_s: float, day_s: float = DAY_S, match_s: float = 3600.0) -> None:
        self.season = max(1, round(day_s / bucket_s))
        self.match = max(1, round(match_s / bucket_s))
        self.fallback = HoltForecaster()

    def forecast(self, buckets: Sequence[float], steps: int) -> list[float] | None:
        fallback = self.fallback.forecast(buckets, steps)  # kept current either way
        now = len(buckets)
        if now < self.season + self.match:
            return fallback
        recent = sum(buckets[now - self.match:])
        then = sum(buckets[now - self.season - self.match:now - self.season])
        scale = recent / then if then > 0 else 1.0
        # Yesterday's coming buckets; past a day ahead (a horizon longer than
        # the season) the latest day repeats.
        return [max(0.0, scale * buckets[now - self.season + (k % self.season)])
                for k in range(steps + 1)]


class ARIMAForecaster:
    """ARIMA(``order``) from statsmodels on the last ``window`` buckets,
    refitted every ``refit_every`` buckets (module docstring)."""

    name = "arima"

    def __init__(self, bucket_s: float, order: tuple[int, int, int] = (2, 1, 1),
                 window_s: float = 6 * 3600.0, min_s: float = 3600.0,
                 refit_every: int = 15) -> None:
        self.order = order
        self.window = max(8, round(window_s / bucket_s))
        self.min_buckets = max(8, round(min_s / bucket_s))
        self.refit_every = refit_every
        self.fallback = HoltForecaster()
        self._refit_at = -math.inf  # buckets seen at the last fit
        self._fed = 0  # buckets folded into the fitted model
        self._result = None
        # The last answer, by (buckets seen, steps): ticks within one bucket
        # ask again with nothing new, and a forecast costs milliseconds.
        self._answered: tuple[int, int, list[float] | None] | None = None

    def forecast(self, buckets: Sequence[float], steps: int) -> list[float] | None:
        now = len(buckets)
        if self._answered is not None and self._answered[:2] == (now, steps):
            return self._answered[2]
        values = self._forecast(buckets, steps)
        self._answered = (now, steps, values)
        return values

    def _forecast(self, buckets: Sequence[float], steps: int) -> list[float] | None:
        fallback = self.fallback.forecast(buckets, steps)
        now = len(buckets)
        if now < self.min_buckets:
            return fallback
        if now - self._refit_at >= self.refit_every:
            self._result = self._fit(buckets[-self.window:])
            self._refit_at = self._fed = now
        elif self._result is not None and now > self._fed:  # new buckets, same parameters
            self._result = self._result.append(list(buckets[self._fed:now]))
            self._fed = now
        if self._result is None:
            return fallback
        return [max(0.0, float(v)) for v in self._result.forecast(steps + 1)]

    def _fit(self, series: Sequence[float]):
        import warnings

        from statsmodels.tsa.arima.model import ARIMA  # the optional dependency

        with warnings.catch_warnings():  # convergence chatter on flat or short series
            warnings.simplefilter("ignore")
            try:
                return ARIMA(list(series), order=self.order).fit()
            except (ValueError, ArithmeticError, IndexError):  # a degenerate series
                return None


FORECASTERS = ("holt", "seasonal", "arima")


def make_forecaster(name: str, bucket_s: float) -> Forecaster:
    """A fresh forecaster by name (``FORECASTERS``)."""
    if name == "holt":
        return HoltForecaster()
    if name == "seasonal":
        return SeasonalForecaster(bucket_s)
    if name == "arima":
        return ARIMAForecaster(bucket_s)
    raise ValueError(f"unknown forecaster {name!r}; one of {', '.join(FORECASTERS)}")
