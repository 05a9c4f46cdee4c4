"""Prometheus metrics, named after vLLM's (``vllm:x`` -> ``carpool:x``).

The prefix is ``ServerConfig.metrics_prefix``: ``carpool`` (the default),
``vllm`` (an existing vLLM dashboard or alert rule works unchanged) or
``both``. Families are kept unprefixed and the exporter names them when
Prometheus scrapes, so under ``both`` every series appears twice from one
collection, with the same values.

Per-request latencies are observed by the server as outputs stream out
(``RequestTracker``): TTFT, inter-token gaps and end-to-end time on the
server's clock; queue, prefill, decode and inference (prefill + decode) time
from the engine's timestamps on each request's final output, as vLLM does.
Engine gauges and counters are read from the engine's published
``EngineStats`` snapshot when Prometheus scrapes (``metrics_engine``);
windowed rates (tokens/s, busy fraction, fill: the token budget's and the
sequence slots' occupancy, or padding under request-level batching, reject
rate, long share) come from ``RateWindow`` over the last ``WINDOW_S``
seconds; tokens per engine step from the engine's step log; the host's CPU
and, on CUDA, the GPUs' NVML readings from ``host_metrics``.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric

from carpool.engine.outputs import RequestOutput
from carpool.engine.stats import EngineCounters, EngineStats
from carpool.host_cpu import HostCpu
from carpool.server.host_metrics import (
    NvmlDevices,
    device_metrics,
    host_families,
    load_pynvml,
)
from carpool.server.metrics_engine import (
    RATE_HELP,
    engine_families,
    kernels_family,
    replica_families,
)

WINDOW_S = 10.0
# The series' prefixes for each ``metrics_prefix`` setting.
PREFIXES = {"carpool": ("carpool",), "vllm": ("vllm",), "both": ("carpool", "vllm")}
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
# vLLM's buckets for tokens per engine step.
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


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
            return dict.fromkeys(RATE_HELP, nan)
        (t0, old), (t1, new) = self._samples[0], self._samples[-1]
        span = max(t1 - t0, 1e-9)
        a, b = old.counters, new.counters
        arrivals = b.requests_added - a.requests_added
        rejected = sum(new.rejections.values()) - sum(old.rejections.values())
        # Every arrival, admitted or turned away for any reason. A request
        # admitted before the window and expired in it counts in ``rejected``
        # only: the rate is capped at 1.
        offered = new.arrivals - old.arrivals
        computed = b.computed_tokens - a.computed_tokens
        fills = _occupancy(a, b)
        padding_fill = _share(computed, b.slot_tokens - a.slot_tokens)
        return {
            "effective_tokens_per_second": computed / span,
            "generation_tokens_per_second": (b.generation_tokens - a.generation_tokens) / span,
            "engine_busy_fraction": min(1.0, (b.busy_seconds - a.busy_seconds) / span),
            "batch_fill_rate": (fills["token_budget_fill"] if new.batching == "continuous"
                                else padding_fill),
            **fills,
            "reject_rate": min(1.0, rejected / offered) if offered else nan,
            "long_request_share": ((b.long_requests_added - a.long_requests_added) / arrivals
                                   if arrivals else nan),
            "arrival_rate": offered / span,
        }


def _share(part: float, whole: float) -> float:
    """``part / whole`` capped at 1; NaN when ``whole`` is 0 (no step ran)."""
    return min(1.0, part / whole) if whole else math.nan


def _occupancy(a: EngineCounters, b: EngineCounters) -> dict[str, float]:
    """The token budget's and the sequence slots' fill over the steps
    between two counter snapshots, each step weighted by what it was offered."""
    return {"token_budget_fill": _share(b.computed_tokens - a.computed_tokens,
                                        b.budget_tokens - a.budget_tokens),
            "seq_slot_fill": _share(b.slot_seqs - a.slot_seqs, b.seq_slots - a.seq_slots)}


class Metrics:
    """All metrics of one server, in their own registry (no global state).

    ``registry`` is what /metrics renders. ``prefix`` may be changed until
    the first scrape (the server sets it from its config); ``bind_engine``
    adds what only the engine knows.
    """

    def __init__(self, model_name: str, stats_source, prefix: str = "carpool") -> None:
        self.model_name = model_name
        self.prefix = prefix
        self.window = RateWindow()
        self._stats_source = stats_source  # () -> EngineStats
        self._step_log = None  # the engine's StepLog, once bound
        self._steps_seen = 0  # steps of the log already observed
        self._cache: dict[str, str] | None = None
        self._kernels: dict[str, str] | None = None  # the CPU kernel plan's labels
        self.replica_stats = None  # a fleet's () -> {replica: EngineStats}, once bound
        self.host_cpu = HostCpu()
        self.devices: NvmlDevices | None = None  # NVML's GPU readings, on CUDA
        self._lock = threading.Lock()  # guards the step-log cursor
        self._live = CollectorRegistry(auto_describe=False)  # unprefixed families
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets,
                             registry=self._live).labels(model_name)

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
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "Time from first being scheduled to the first token.",
                                 _LATENCY_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds",
                                "Time from the first token to the last.", _LATENCY_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds",
                                   "Time from first being scheduled to the last token "
                                   "(prefill + decode).", _LATENCY_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.",
                                  _TOKEN_BUCKETS)
        self.generation_tokens = hist("request_generation_tokens",
                                      "Generated tokens per request.", _TOKEN_BUCKETS)
        self.max_generation_tokens = hist(
            "request_max_num_generation_tokens",
            "Per prompt: the most tokens any of its n samples generated.", _TOKEN_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total",
                                     "Tokens computed per engine step.", _STEP_TOKEN_BUCKETS)
        self.outcomes = Counter("request_outcomes", "Finished requests by outcome: "
                                "stop, length, abort, error, rejected:<reason>.",
                                labels + ["outcome"], registry=self._live)
        self.response_cache_hits = Counter(
            "response_cache_hits", "Requests answered from the response cache (the emergency "
            "switch's last step), by endpoint.", labels + ["endpoint"], registry=self._live)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Exporter(self))

    @property
    def prefix(self) -> str:
        return self._prefix

    @prefix.setter
    def prefix(self, value: str) -> None:
        if value not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(PREFIXES)}, "
                             f"got {value!r}")
        self._prefix = value

    def bind_engine(self, step_log, cache: dict[str, str], step_facts: dict | None = None,
                    load_nvml=load_pynvml) -> None:
        """Read what only the engine knows: the tokens of each step (its
        ``StepLog``, for ``iteration_tokens_total``), its KV cache settings
        (``EngineInfo.cache_info``, for ``cache_config_info``) and its device
        (``EngineInfo.step_facts``: on CUDA, the GPUs' NVML readings too;
        ``load_nvml``: what imports NVML)."""
        self._step_log = step_log
        self._cache = cache
        self._kernels = (step_facts or {}).get("kernels")
        device = str(((step_facts or {}).get("machine") or {}).get("device", "cpu"))
        self.devices = device_metrics(device, load_nvml)

    def engine_stats(self) -> EngineStats:
        """The engine's latest published snapshot (no rates)."""
        return self._stats_source()

    def outcome(self, outcome: str) -> None:
        self.outcomes.labels(self.model_name, outcome).inc()

    def trackers(self, num_prompts: int, n: int, received_at: float) -> list[RequestTracker]:
        """Trackers of one API call's ``num_prompts * n`` choices, choice
        ``p * n + i`` being sample ``i`` of prompt ``p``."""
        groups = [_SampleGroup(self, n) for _ in range(num_prompts)]
        return [RequestTracker(self, received_at, group) for group in groups for _ in range(n)]

    def snapshot(self) -> tuple[EngineStats, dict[str, float]]:
        stats = self._stats_source()
        self.window.update(stats)
        return stats, self.window.rates()

    def families(self) -> Iterator[Metric]:
        """Every family, unprefixed, from one snapshot of the engine."""
        self._observe_new_steps()
        stats, rates = self.snapshot()
        yield from self._live.collect()
        yield from engine_families(stats, rates, self.model_name, WINDOW_S, self._cache)
        if self._kernels:
            yield kernels_family(self._kernels, self.model_name)
        if self.replica_stats is not None:
            yield from replica_families(self.replica_stats(), self.model_name)
        yield from host_families(self.host_cpu, self.model_name)
        if self.devices is not None:
            yield from self.devices.families(self.model_name)

    def _observe_new_steps(self) -> None:
        """Observe the steps logged since the last scrape. Steps that left
        the log's ring between two scrapes (more than its capacity) and
        padded steps (static / dynamic batching), which the log leaves out,
        are not observed."""
        if self._step_log is None:
            return
        with self._lock:
            steps, total = self._step_log.snapshot()
            new = min(total - self._steps_seen, len(steps))
            for step in steps[len(steps) - new:]:
                self.iteration_tokens.observe(step.shape.tokens)
            self._steps_seen = total


class _Exporter:
    """Names every family with the prefix(es) in force when Prometheus scrapes."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # unchecked: the metric set is only known at collect time

    def collect(self) -> Iterator[Metric]:
        families = list(self.metrics.families())  # once: "both" shows the same values
        for prefix in PREFIXES[self.metrics.prefix]:
            for family in families:
                yield _renamed(family, prefix)


def _renamed(family: Metric, prefix: str) -> Metric:
    out = Metric(f"{prefix}:{family.name}", family.documentation, family.type, family.unit)
    out.samples = [s._replace(name=f"{prefix}:{s.name}") for s in family.samples]
    return out


class _SampleGroup:
    """The n samples of one prompt: vLLM observes the most tokens any of
    them generated (``request_max_num_generation_tokens``) once all ended."""

    def __init__(self, metrics: Metrics, size: int) -> None:
        self.metrics = metrics
        self.left = size
        self.most_tokens: int | None = None  # None while no sample finished with output

    def ended(self, output_tokens: int | None) -> None:
        if output_tokens is not None:
            self.most_tokens = max(self.most_tokens or 0, output_tokens)
        self.left -= 1
        if self.left == 0 and self.most_tokens is not None:
            self.metrics.max_generation_tokens.observe(self.most_tokens)


class RequestTracker:
    """Observes one choice's latencies as its outputs reach the server."""

    def __init__(self, metrics: Metrics, received_at: float,
                 group: _SampleGroup | None = None) -> None:
        self.metrics = metrics
        self.received_at = received_at
        self.group = group if group is not None else _SampleGroup(metrics, 1)
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
            self.group.ended(None)
            return
        m.outcome(output.finish_reason or "stop")
        m.e2e.observe(now - self.received_at)
        m.prompt_tokens.observe(output.num_prompt_tokens)
        m.generation_tokens.observe(output.num_output_tokens)
        self.group.ended(output.num_output_tokens)
        if self.first_token_at is not None and output.num_output_tokens > 1:
            m.tpot.observe((now - self.first_token_at) / (output.num_output_tokens - 1))
        _observe_phases(m, output)

    def close(self, outcome: str = "abort") -> None:
        """The choice ended without a final output (client left, engine died)."""
        if not self.done:
            self.done = True
            self.metrics.outcome(outcome)
            self.group.ended(None)


def _observe_phases(m: Metrics, output: RequestOutput) -> None:
    """Queue, prefill, decode and inference time of a finished request, from
    the engine's own timestamps (one clock, unaffected by the HTTP side)."""
    scheduled, first, last = (output.first_scheduled_time, output.first_token_time,
                              output.finish_time)
    if scheduled is not None:
        m.queue_time.observe(max(0.0, scheduled - output.arrival_time))
        if first is not None:
            m.prefill_time.observe(max(0.0, first - scheduled))
        if last is not None:
            m.inference_time.observe(max(0.0, last - scheduled))
    if first is not None and last is not None:
        m.decode_time.observe(max(0.0, last - first))
