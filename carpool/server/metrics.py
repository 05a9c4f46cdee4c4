"""Prometheus metrics, named after vLLM's (``vllm:x`` -> ``carpool:x``).

Per-request latencies are observed by the server as outputs stream out
(``RequestTracker``); engine gauges and counters are read from the engine's
published ``EngineStats`` snapshot when Prometheus scrapes; windowed rates
(tokens/s, busy fraction, fill rate, reject rate, long share) come from
``RateWindow`` over the last ``WINDOW_S`` seconds.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from carpool.engine.outputs import RequestOutput
from carpool.engine.stats import EngineStats

WINDOW_S = 10.0
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class RateWindow:
    """Rates over a sliding window of engine snapshots."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, EngineStats]] = deque()

    def update(self, stats: EngineStats, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._samples and now - self._samples[-1][0] < 0.2:
            self._samples[-1] = (now, stats)  # scrapes in a burst: keep the newest
        else:
            self._samples.append((now, stats))
        # Keep one sample older than the window as the base of the rates.
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rates(self) -> dict[str, float]:
        """Windowed rates; NaN where undefined (no time elapsed, no traffic)."""
        nan = math.nan
        if len(self._samples) < 2:
            return dict.fromkeys(("effective_tokens_per_second", "generation_tokens_per_second",
                                  "engine_busy_fraction", "batch_fill_rate", "reject_rate",
                                  "long_request_share", "arrival_rate"), nan)
        (t0, old), (t1, new) = self._samples[0], self._samples[-1]
        span = max(t1 - t0, 1e-9)
        a, b = old.counters, new.counters
        arrivals = b.requests_added - a.requests_added
        rejected = sum(new.rejections.values()) - sum(old.rejections.values())
        offered = arrivals + sum(new.rejections.get(r, 0) - old.rejections.get(r, 0)
                                 for r in ("queue_full", "queue_tokens"))
        slots = b.slot_tokens - a.slot_tokens
        return {
            "effective_tokens_per_second": (b.computed_tokens - a.computed_tokens) / span,
            "generation_tokens_per_second": (b.generation_tokens - a.generation_tokens) / span,
            "engine_busy_fraction": min(1.0, (b.busy_seconds - a.busy_seconds) / span),
            "batch_fill_rate": (b.computed_tokens - a.computed_tokens) / slots if slots else nan,
            "reject_rate": rejected / offered if offered else nan,
            "long_request_share": ((b.long_requests_added - a.long_requests_added) / arrivals
                                   if arrivals else nan),
            "arrival_rate": offered / span,
        }


class Metrics:
    """All metrics of one server, in their own registry (no global state)."""

    def __init__(self, model_name: str, stats_source) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.window = RateWindow()
        self._stats_source = stats_source  # () -> EngineStats
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"carpool:{name}", doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (server side).",
                         _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive tokens.",
                        _LATENCY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Per request: (E2E - TTFT) / (output tokens - 1).", _LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.",
                        _LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds",
                               "Time from arrival to first being scheduled.", _LATENCY_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.",
                                  _TOKEN_BUCKETS)
        self.generation_tokens = hist("request_generation_tokens",
                                      "Generated tokens per request.", _TOKEN_BUCKETS)
        self.outcomes = Counter("carpool:request_outcomes", "Finished requests by outcome: "
                                "stop, length, abort, error, rejected:<reason>.",
                                labels + ["outcome"], registry=self.registry)
        self.registry.register(_EngineCollector(self))

    def outcome(self, outcome: str) -> None:
        self.outcomes.labels(self.model_name, outcome).inc()

    def snapshot(self) -> tuple[EngineStats, dict[str, float]]:
        stats = self._stats_source()
        self.window.update(stats)
        return stats, self.window.rates()


class _EngineCollector:
    """Reads the engine snapshot at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # unchecked: the metric set is only known at collect time

    def collect(self) -> Iterator[Metric]:
        stats, rates = self.metrics.snapshot()
        model = [self.metrics.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"carpool:{name}", doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"carpool:{name}", doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        c = stats.counters
        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("num_tokens_waiting", "Tokens still to compute for waiting requests.",
                    stats.waiting_tokens)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", stats.kv_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.prefix_hits)
        yield counter("num_preemptions", "Preemptions (by recompute).", stats.num_preemptions)
        yield counter("num_priority_preemptions",
                      "Preemptions that made room for a better-priority request.",
                      stats.num_priority_preemptions)
        yield counter("batches", "Request-level batches formed (static / dynamic batching).",
                      stats.batches)
        yield counter("prompt_tokens", "Prompt tokens of finished requests.", c.prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", c.generation_tokens)
        yield counter("engine_steps", "Scheduler steps run.", c.steps)
        yield counter("engine_busy_seconds", "Seconds the engine spent running steps.",
                      c.busy_seconds)
        finished = CounterMetricFamily(
            "carpool:request_success", "Requests the engine finished, by reason (stop, "
            "length, abort, rejected).", labels=["model_name", "finished_reason"])
        for reason, count in sorted(c.finished.items()):
            finished.add_metric(model + [reason], count)
        yield finished
        rejected = CounterMetricFamily("carpool:requests_rejected",
                                       "Requests rejected by admission control, by reason.",
                                       labels=["model_name", "reason"])
        for reason, count in sorted(stats.rejections.items()):
            rejected.add_metric(model + [reason], count)
        yield rejected
        for name, value in rates.items():
            yield gauge(name, f"{name.replace('_', ' ')} over the last {WINDOW_S:g} s.", value)
        yield from _policy_metrics(stats, model)


def _policy_metrics(stats: EngineStats, model: list[str]) -> Iterator[Metric]:
    mode = GaugeMetricFamily("carpool:controller_mode", "1 for the scheduler's current mode.",
                             labels=["model_name", "mode", "batching"])
    mode.add_metric(model + [stats.mode, stats.batching], 1.0)
    yield mode
    knobs = GaugeMetricFamily("carpool:scheduler_knob", "Current value of each scheduler knob.",
                              labels=["model_name", "knob"])
    for knob, value in sorted(stats.knobs.items()):
        knobs.add_metric(model + [knob], value)
    yield knobs
    decisions = CounterMetricFamily(
        "carpool:controller_decisions", "Adaptive controller decisions by knob and reason.",
        labels=["model_name", "knob", "reason"])
    for (knob, reason), count in sorted(stats.decision_counts.items()):
        decisions.add_metric(model + [knob, reason], count)
    yield decisions
    sessions = GaugeMetricFamily("carpool:sessions", "Session stats (counts are cumulative).",
                                 labels=["model_name", "stat"])
    for name, value in sorted(stats.sessions.items()):
        sessions.add_metric(model + [name], value)
    yield sessions


class RequestTracker:
    """Observes one choice's latencies as its outputs reach the server."""

    def __init__(self, metrics: Metrics, received_at: float) -> None:
        self.metrics = metrics
        self.received_at = received_at
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.done = False

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        if output.delta_token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
                self.metrics.ttft.observe(now - self.received_at)
            else:
                self.metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
        if output.finished:
            self._finish(output, now)

    def _finish(self, output: RequestOutput, now: float) -> None:
        self.done = True
        m = self.metrics
        if output.finish_reason == "rejected":
            m.outcome(f"rejected:{output.reject_reason}")
            return
        m.outcome(output.finish_reason or "stop")
        m.e2e.observe(now - self.received_at)
        m.prompt_tokens.observe(output.num_prompt_tokens)
        m.generation_tokens.observe(output.num_output_tokens)
        if output.first_scheduled_time is not None:
            m.queue_time.observe(max(0.0, output.first_scheduled_time - output.arrival_time))
        if self.first_token_at is not None and output.num_output_tokens > 1:
            m.tpot.observe((now - self.first_token_at) / (output.num_output_tokens - 1))

    def close(self, outcome: str = "abort") -> None:
        """The choice ended without a final output (client left, engine died)."""
        if not self.done:
            self.done = True
            self.metrics.outcome(outcome)
