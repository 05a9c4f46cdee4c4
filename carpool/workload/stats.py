"""Per-request records of a serving benchmark and the numbers derived from them.

Everything is measured on the client. Times are seconds from the run's
start (one monotonic clock). Definitions, as in vLLM's ``bench serve``:

- TTFT: send to the first chunk that carries content.
- E2E: send to the end of the response.
- TPOT: (E2E - TTFT) / (output tokens - 1); undefined for one token.
- ITL: every gap between consecutive content chunks (a chunk may carry
  more than one token when the server holds text back).
- Rejected (HTTP 429 / 503, the server's "not now") is counted apart from
  failed (any other error) and never enters the latency statistics.

Percentiles interpolate linearly between order statistics (numpy's
default, as vLLM reports them). Goodput counts completed requests that meet
every given SLO, per second of the run; attainment is that count over all
requests sent, so rejected and failed requests count as misses.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 95, 99)
OK, REJECTED, FAILED = "ok", "rejected", "failed"


@dataclass
class RequestRecord:
    """What the client saw of one request (times from the run start)."""

    index: int
    scheduled: float
    input_tokens: int
    max_tokens: int
    sent: float | None = None
    status: str = "pending"  # then OK, REJECTED or FAILED
    reason: str | None = None  # http_429, http_503, timeout, http_400, connection, ...
    chunk_times: list[float] = field(default_factory=list)  # content chunks only
    finished: float | None = None
    output_tokens: int = 0  # the server's usage (else our tokenizer's count)
    counted_tokens: int | None = None  # our tokenizer on the returned text
    server_input_tokens: int | None = None
    # Prompt tokens served from the prefix cache (the server's usage, the
    # simulated scheduler's count); None when the server reported none.
    cached_tokens: int | None = None
    text: str = ""  # the answer's text (not stored in reports)
    error: str = ""  # the start of an error body or message (failed or rejected)

    @property
    def ok(self) -> bool:
        return self.status == OK and bool(self.chunk_times)

    def latencies(self) -> tuple[float, float | None, float] | None:
        """(TTFT, TPOT, E2E) in one go, None unless completed; TPOT is None
        for fewer than two tokens. Summaries of many records use this."""
        if not self.ok:
            return None
        ttft, e2e = self.chunk_times[0] - self.sent, self.finished - self.sent
        tpot = (e2e - ttft) / (self.output_tokens - 1) if self.output_tokens >= 2 else None
        return ttft, tpot, e2e

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.ok else None

    @property
    def e2e(self) -> float | None:
        return self.finished - self.sent if self.ok else None

    @property
    def tpot(self) -> float | None:
        latencies = self.latencies()
        return None if latencies is None else latencies[1]

    @property
    def itl(self) -> list[float]:
        times = self.chunk_times if self.ok else []
        return [b - a for a, b in pairwise(times)]

    def to_dict(self) -> dict:
        """The record as the JSON report stores it (no text, no raw chunk times)."""
        return {"index": self.index, "scheduled": self.scheduled, "sent": self.sent,
                "status": self.status, "reason": self.reason, "ttft": self.ttft,
                "e2e": self.e2e, "tpot": self.tpot, "itl": self.itl,
                "first_token": self.chunk_times[0] if self.ok else None,
                "finished": self.finished, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "counted_tokens": self.counted_tokens,
                "server_input_tokens": self.server_input_tokens,
                "cached_tokens": self.cached_tokens, "error": self.error or None}


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p95, p99 and max (None for no values)."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}, "max": None}
    array = np.asarray(values, dtype=float)
    out = {"mean": float(array.mean())}
    out.update({f"p{q}": float(np.percentile(array, q)) for q in PERCENTILES})
    out["max"] = float(array.max())
    return out


_SLO_METRICS = ("ttft", "tpot", "e2e")  # the order of RequestRecord.latencies()


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Completed, and every SLO metric within its limit: ttft, tpot, e2e,
    and for itl every gap between chunks; a one-token answer has no TPOT
    and cannot miss a TPOT limit."""
    return _within(record, record.latencies(), slo)


def _within(record: RequestRecord, latencies: tuple[float, float | None, float] | None,
            slo: dict[str, float]) -> bool:
    """``meets_slo`` given the record's ``latencies()``."""
    if latencies is None:
        return False
    for metric, value in zip(_SLO_METRICS, latencies):
        limit = slo.get(metric)
        if limit is not None and value is not None and value > limit:
            return False
    limit = slo.get("itl")
    return limit is None or all(gap <= limit for gap in record.itl)


def prefix_cache(records: list[RequestRecord]) -> dict:
    """Over completed ``records`` that report cached tokens: their cached
    and prompt tokens and the hit rate (None when none reports any)."""
    reported = [r for r in records if r.ok and r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in reported)
    prompt = sum(r.input_tokens if r.server_input_tokens is None else r.server_input_tokens
                 for r in reported)
    return {"prefix_hit_rate": cached / prompt if reported and prompt else None,
            "cached_tokens": cached if reported else None,
            "cache_reported": len(reported)}


def peak_concurrency(records: list[RequestRecord]) -> int:
    """The most requests in flight (sent, not yet answered) at any instant;
    callers leave out rejected ones, which were never being served."""
    spans = [(r.sent, r.finished) for r in records if r.sent is not None and r.finished is not None]
    if not spans:
        return 0
    times = np.array(spans, dtype=float).T.ravel()  # every start, then every finish
    steps = np.repeat([1, -1], len(spans))
    # at equal times a finish goes first: back-to-back requests do not overlap
    order = np.lexsort((steps, times))
    return int(max(0, np.cumsum(steps[order]).max()))


def summarize(records: list[RequestRecord], duration: float,
              slo: dict[str, float] | None = None) -> dict:
    """The summary block of a report (see the module docstring for definitions)."""
    slo = slo or {}
    sent = [r for r in records if r.sent is not None]
    done = [r for r in sent if r.ok]
    rejected = Counter(r.reason for r in sent if r.status == REJECTED)
    failed = Counter(r.reason for r in sent if r.status == FAILED)
    duration = max(duration, 1e-9)
    input_tokens = sum(r.input_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    latencies = [r.latencies() for r in done]
    good = sum(_within(r, values, slo) for r, values in zip(done, latencies)) if slo else None
    return {
        "requests": len(sent), "completed": len(done),
        "rejected": sum(rejected.values()), "failed": sum(failed.values()),
        "unsent": len(records) - len(sent),
        "rejected_by_reason": dict(rejected), "failed_by_reason": dict(failed),
        "rejected_share": sum(rejected.values()) / max(1, len(sent)),
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "input_tokens": input_tokens, "output_tokens": output_tokens,
        "ttft": distribution([values[0] for values in latencies]),
        "tpot": distribution([values[1] for values in latencies if values[1] is not None]),
        "itl": distribution([gap for r in done if len(r.chunk_times) > 1 for gap in r.itl]),
        "e2e": distribution([values[2] for values in latencies]),
        "slo": dict(slo),
        "goodput": good / duration if slo else None,
        "slo_attainment": good / max(1, len(sent)) if slo else None,
        "peak_concurrency": peak_concurrency([r for r in sent if r.status != REJECTED]),
        # Completed responses counted by our tokenizer because the server
        # reported no usage (a server's own usage is never second-guessed:
        # re-encoding decoded text need not give back the tokens generated).
        "tokenizer_counted": sum(r.counted_tokens is not None for r in done),
        **prefix_cache(done),
    }


def timeseries(records: list[RequestRecord], duration: float,
               server_samples: list[tuple[float, float | None, float | None]],
               max_points: int = 400) -> dict:
    """Per-interval series for the report: requests in flight (at each bin's
    end), output tokens/s (each request's tokens spread over its chunks), and
    the server's waiting/running gauges when it exposes them."""
    interval = max(0.5, duration / max_points)
    bins = max(1, int(np.ceil(duration / interval)))
    edges = [interval * (i + 1) for i in range(bins)]
    tokens = np.zeros(bins)
    for r in records:
        if r.ok:
            share = r.output_tokens / len(r.chunk_times)
            for t in r.chunk_times:
                tokens[min(bins - 1, int(t // interval))] += share
    # In flight at an edge: sent by then and not finished by then (a
    # request finishes after it is sent, so the second count is a subset).
    sent = sorted(r.sent for r in records if r.sent is not None)
    done = sorted(r.finished for r in records if r.sent is not None and r.finished is not None)
    in_flight = [bisect.bisect_right(sent, edge) - bisect.bisect_right(done, edge)
                 for edge in edges]
    return {"interval": interval, "t": [interval * i for i in range(bins)],
            "in_flight": in_flight, "output_tok_s": list(tokens / interval),
            "server_waiting": _resample(server_samples, 1, edges),
            "server_running": _resample(server_samples, 2, edges)}


def _resample(samples: list[tuple], column: int, edges: list[float]) -> list | None:
    """The last sample at or before each edge (None before the first)."""
    usable = [(s[0], s[column]) for s in samples if s[column] is not None]
    if not usable:
        return None
    out, k, last = [], 0, None
    for edge in edges:
        while k < len(usable) and usable[k][0] <= edge:
            last = usable[k][1]
            k += 1
        out.append(last)
    return out


def phase_windows(surges: list[dict], end: float) -> list[tuple[str, float, float]]:
    """(name, start, end) of the phases a schedule's surges cut it into, by
    send time: ``calm 1``, ``surge 1 x3``, ``calm 2``, ... (overlapping
    surges merge into one; without surges a single ``all`` phase)."""
    spans = sorted((s["start"], s["start"] + s["duration"], s.get("factor", 1.0))
                   for s in surges or [])
    merged: list[list[float]] = []
    for start, stop, factor in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
            merged[-1][2] = max(merged[-1][2], factor)
        else:
            merged.append([start, stop, factor])
    if not merged:
        return [("all", 0.0, end)]
    phases, cursor = [], 0.0
    for index, (start, stop, factor) in enumerate(merged, 1):
        if start > cursor:
            phases.append((f"calm {index}", cursor, start))
        phases.append((f"surge {index} x{factor:g}", start, stop))
        cursor = stop
    if end > cursor:
        phases.append((f"calm {len(merged) + 1}", cursor, end))
    return phases


def phase_summaries(records: list[RequestRecord], surges: list[dict],
                    slo: dict[str, float] | None = None) -> list[dict]:
    """Per phase (``phase_windows``; a request belongs to the phase it was
    scheduled in): offered rate, rejected share, TTFT and TPOT p99 of the
    completed requests, and goodput (requests meeting every SLO limit per
    second of the phase). Only requests sent count (a time limit may have
    left some unsent); the last phase ends at the last scheduled send.

    ``backlog_until``: when the last request of the phase before that was
    served had its first token; until then arrivals of this phase queue
    behind the work the phase before left (after a surge: the queue its
    admission filled up to the TTFT allowance), and
    ``rejected_after_backlog`` counts only the rejections of arrivals after it."""
    records = [r for r in records if r.sent is not None]
    end = max((r.scheduled for r in records), default=0.0) + 1e-9
    out = []
    backlog_until = 0.0
    for name, start, stop in phase_windows(surges, end):
        sent = [r for r in records if start <= r.scheduled < stop]
        seconds = max(min(stop, end) - start, 1e-9)
        done = [r for r in sent if r.ok]
        latencies = [r.latencies() for r in done]
        rejected = sum(r.status == REJECTED for r in sent)
        good = sum(_within(r, values, slo) for r, values in zip(done, latencies)) if slo else None
        out.append({
            "phase": name, "start": start, "end": min(stop, end), "requests": len(sent),
            "offered_rate": len(sent) / seconds, "completed": len(done),
            "rejected": rejected, "rejected_share": rejected / max(1, len(sent)),
            "failed": sum(r.status == FAILED for r in sent),
            "ttft": distribution([v[0] for v in latencies]),
            "tpot": distribution([v[1] for v in latencies if v[1] is not None]),
            "completed_rate": len(done) / seconds,
            "goodput": good / seconds if slo else None,
            "slo_attainment": good / max(1, len(sent)) if slo else None,
            "backlog_until": max(start, backlog_until),
            "rejected_after_backlog": sum(r.status == REJECTED and r.scheduled >= backlog_until
                                          for r in sent)})
        backlog_until = max((r.chunk_times[0] for r in done), default=start)
    return out
