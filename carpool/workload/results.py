"""The bench-serve result document: what a run produced (`LoadRun`), the
JSON document made from it (`make_result`, written by ``carpool bench
serve`` and ``carpool simulate`` alike, read by ``carpool bench compare``
and the reports) and its text summary (`format_result`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from carpool.workload.stats import (
    LATENCY_METRICS,
    PERCENTILES,
    RequestRecord,
    phase_summaries,
    summarize,
    timeseries,
)

RESULT_KIND, RESULT_VERSION = "bench-serve", 1


@dataclass
class LoadRun:
    """What one run produced: per-request records, the run's wall duration
    and the server's queue gauges sampled over time (t, waiting, running)."""

    records: list[RequestRecord]
    duration: float
    server_samples: list[tuple[float, float | None, float | None]] = field(default_factory=list)


def make_result(label: str, config: dict, run: LoadRun, slo: dict[str, float],
                per_request: bool = True) -> dict:
    """The bench-serve JSON document (also what ``carpool simulate`` writes);
    without ``per_request`` its ``requests`` list is left empty (a result
    that is only printed)."""
    summary = summarize(run.records, run.duration, slo)
    return {
        "kind": RESULT_KIND, "version": RESULT_VERSION, "label": label,
        "started_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": config, "duration_s": run.duration,
        "summary": summary,
        "phases": phase_summaries(run.records, (config.get("workload") or {}).get("surges")
                                  or [], slo),
        "timeseries": timeseries(run.records, run.duration, run.server_samples),
        "requests": [r.to_dict() for r in run.records] if per_request else [],
    }


def format_result(result: dict) -> str:
    """The summary as text: counts, throughput, goodput, latency percentiles (ms)."""
    s, workload = result["summary"], result["config"].get("workload", {})
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(s["rejected_by_reason"].items()))
    failed = ", ".join(f"{k} {v}" for k, v in sorted(s["failed_by_reason"].items()))
    lines = [
        f"== {result['label']} ==",
        f"workload: {workload.get('name')} | token counts x{workload.get('token_scale', 1):g}, "
        f"time x{workload.get('time_scale', 1):g} | arrivals {workload.get('arrival')}"
        + (f"\nnote: {workload['excerpt']}" if workload.get("excerpt") else ""),
        f"requests {s['requests']}: completed {s['completed']}, rejected {s['rejected']}"
        f"{f' ({rejected})' if rejected else ''}, failed {s['failed']}"
        f"{f' ({failed})' if failed else ''}" + (f", unsent {s['unsent']}" if s["unsent"] else ""),
        f"duration {result['duration_s']:.1f} s | {s['request_throughput']:.2f} req/s | "
        f"output {s['output_throughput']:.1f} tok/s | total {s['total_token_throughput']:.1f} "
        f"tok/s | peak concurrency {s['peak_concurrency']}",
    ]
    if s["slo"]:
        limits = ", ".join(f"{k}<={v * 1000:g}ms" for k, v in s["slo"].items())
        lines.append(f"goodput {s['goodput']:.2f} req/s, {s['slo_attainment']:.1%} of "
                     f"requests meet {limits}")
    lines.append(format_prefix_cache(s))
    fallback = s.get("tokenizer_counted") or 0  # absent from results written before it
    if fallback:
        lines.append(f"note: {fallback} of {s['completed']} responses came without usage; "
                     f"their output tokens are our tokenizer's count of their text")
    lines += format_phases(result.get("phases") or [])
    header = f"{'ms':<6}" + "".join(f"{c:>9}" for c in ["mean", *[f"p{q}" for q in PERCENTILES]])
    lines.append(header)
    for metric in LATENCY_METRICS:
        values = s[metric]
        cells = [values["mean"], *[values[f"p{q}"] for q in PERCENTILES]]
        lines.append(f"{metric.upper():<6}" + "".join(
            f"{'-':>9}" if v is None else f"{v * 1000:>9.1f}" for v in cells))
    return "\n".join(lines)


def format_prefix_cache(summary: dict) -> str:
    """The prefix hit rate line; "-" when no request reported cached tokens
    (a server that does not say, or a result written before the field)."""
    rate = summary.get("prefix_hit_rate")
    if rate is None:
        return "prefix hit rate - (no cached-token counts)"
    reported, completed = summary.get("cache_reported"), summary["completed"]
    share = f", {reported} of {completed} requests reported" if reported != completed else ""
    return (f"prefix hit rate {rate:.1%}: {summary['cached_tokens']} prompt tokens from the "
            f"prefix cache{share}")


def format_phases(phases: list[dict]) -> list[str]:
    """One line per phase of a surge schedule (nothing for a single phase)."""
    if len(phases) < 2:
        return []

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = [f"{'phase':<14}{'offered/s':>10}{'sent':>6}{'rejected':>10}{'TTFT p99':>10}"
             f"{'TPOT p99':>10}{'goodput/s':>11}"]
    for p in phases:
        goodput = "-" if p["goodput"] is None else f"{p['goodput']:.2f}"
        lines.append(f"{p['phase']:<14}{p['offered_rate']:>10.2f}{p['requests']:>6}"
                     f"{p['rejected_share']:>9.1%} {ms(p['ttft']['p99']):>9}"
                     f"{ms(p['tpot']['p99']):>10}{goodput:>11}")
    return lines
