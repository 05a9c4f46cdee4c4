"""HTML reports with PNG plots for ``carpool bench serve`` and ``carpool bench
sweep`` results (the JSON documents those commands write), and ``find_knee``.

A report is ``report.html`` plus PNGs beside it, linked relatively, so the
folder can be moved or archived whole: no JavaScript, no external assets.
Latencies in the documents are seconds; the reports show milliseconds.
Plots are drawn on ``matplotlib.figure.Figure`` objects (no pyplot state).
"""
from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from carpool.workload.stats import LATENCY_METRICS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}
SUMMARY_STATS = ("mean", "p50", "p90", "p95", "p99", "max")
# the rolling TTFT percentiles trail over max(this, completed // 20) requests
ROLLING_MIN_WINDOW = 5
# legends right of the time-series axes keep the data and the surge labels clear
_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0)}
_WORKLOAD_TERMS = (("arrival", "{} arrivals"), ("num_requests", "{} requests"),
                   ("offered_rate", "offered {:.2f} req/s"))
_COUNT_ROWS = (("requests", "requests"), ("completed", "completed"), ("rejected", "rejected"),
               ("failed", "failed"), ("unsent", "unsent"), ("input tokens", "input_tokens"),
               ("output tokens", "output_tokens"), ("peak concurrency", "peak_concurrency"))
_CSS = ("body{font-family:sans-serif;margin:2em;max-width:80em}"
        "table{border-collapse:collapse;margin:.5em 0}"
        "td,th{border:1px solid #bbb;padding:.2em .6em;text-align:right}"
        "td:first-child,th:first-child{text-align:left}img{max-width:100%}"
        ".warn{color:#a40}")


class RawHtml(str):
    """A table cell that is already HTML (``html_table`` escapes every other cell)."""


def format_ms(seconds: float | None) -> str:
    """Seconds as milliseconds with one decimal; ``-`` for a missing value."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    return f"{seconds * 1000:.1f}"


def _num(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.1f}%"


def workload_of(doc: dict) -> dict:
    """``config.workload`` of a serve or sweep document (a sweep's first run's
    when its own config has none); ``{}`` when absent."""
    workload = (doc.get("config") or {}).get("workload")
    if not workload and doc.get("runs"):
        workload = (doc["runs"][0].get("result") or {}).get("config", {}).get("workload")
    return workload or {}


def workload_scales(doc: dict) -> tuple[float, float]:
    """(token_scale, time_scale) of the document's workload; 1.0 when unset."""
    workload = workload_of(doc)
    return (float(workload.get("token_scale") or 1.0), float(workload.get("time_scale") or 1.0))


def workload_line(doc: dict) -> str:
    """The workload in one line, always stating the token and time scales."""
    workload = workload_of(doc)
    tokens, time = workload_scales(doc)
    parts = [str(workload.get("name") or "unnamed workload")]
    parts += [template.format(workload[key]) for key, template in _WORKLOAD_TERMS
              if workload.get(key) is not None]
    parts += [f"{text} at {start:g}-{start + duration:g} s"
              for start, duration, text, _ in _regime_spans(workload)]
    parts.append(f"token counts x{tokens:g}, time x{time:g}")
    if workload.get("seed") is not None:
        parts.append(f"seed {workload['seed']}")
    return "; ".join(parts)


def _regime_spans(workload: dict) -> list[tuple[float, float, str, str]]:
    """(start, duration, label, colour) of each surge and ramp."""
    spans = [(s.get("start"), s.get("duration"), f"surge x{s.get('factor', 1):g}", "tab:orange")
             for s in workload.get("surges") or []]
    spans += [(r.get("start"), r.get("duration"),
               f"ramp x{r.get('start_factor', 1):g}->x{r.get('end_factor', 1):g}", "tab:purple")
              for r in workload.get("ramps") or []]
    return [span for span in spans if span[0] is not None and span[1] is not None]


def latency_samples(result: dict, metric: str) -> list[float]:
    """Per-request ``metric`` values (seconds) of the completed requests of a
    bench-serve result; for ``itl`` every inter-token gap, pooled."""
    values: list[float] = []
    for request in result.get("requests") or []:
        if request.get("status") != "ok":
            continue
        if metric == "itl":
            values.extend(v for v in request.get("itl") or [] if v is not None)
        elif request.get(metric) is not None:
            values.append(request[metric])
    return values


def new_figure(width: float, height: float) -> Figure:
    """A constrained-layout figure; matplotlib is imported on first use,
    so commands that draw nothing start without it."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=90)
    return path


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="gray")


def plot_cdfs(results: Sequence[dict], path: Path, slo: dict | None = None) -> Path:
    """2x2 empirical CDFs of TTFT, TPOT, ITL and E2E (ms), one line per
    bench-serve result (legend: its label), each SLO threshold (seconds, keyed
    by metric) as a vertical dashed line. Writes a PNG to ``path``."""
    fig = new_figure(11, 8)
    for ax, metric in zip(fig.subplots(2, 2).flat, LATENCY_METRICS):
        drawn = False
        for result in results:
            values = np.sort(np.asarray(latency_samples(result, metric), dtype=float)) * 1000
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                        label=str(result.get("label") or "run"))
                drawn = True
        limit = (slo or {}).get(metric)
        if limit is not None:
            ax.axvline(limit * 1000, color="red", linestyle="--", label=f"SLO {limit * 1000:g} ms")
        if not drawn:
            _no_data(ax)
        share = "inter-token gaps" if metric == "itl" else "requests"
        ax.set(title=f"{METRIC_NAMES[metric]} CDF", xlabel="ms", ylabel=f"share of {share}",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if drawn and (len(results) > 1 or limit is not None):
            ax.legend(fontsize="small")
    return _save(fig, path)


def _rolling_percentiles(values: np.ndarray, window: int, qs: tuple[float, ...]) -> np.ndarray:
    out = np.empty((len(qs), len(values)))
    for i in range(len(values)):
        out[:, i] = np.percentile(values[max(0, i - window + 1):i + 1], qs)
    return out


def _plot_ttft_over_time(ax, result: dict) -> None:
    requests = sorted((r for r in result.get("requests") or [] if r.get("sent") is not None),
                      key=lambda r: r["sent"])
    done = [(r["sent"], r["ttft"] * 1000) for r in requests
            if r.get("status") == "ok" and r.get("ttft") is not None]
    if done:
        sent, ttft = (np.array(axis) for axis in zip(*done))
        ax.scatter(sent, ttft, s=8, alpha=0.4, label="TTFT of each request")
        window = max(ROLLING_MIN_WINDOW, len(ttft) // 20)
        p50, p99 = _rolling_percentiles(ttft, window, (50, 99))
        ax.plot(sent, p50, label=f"rolling p50 ({window} requests)")
        ax.plot(sent, p99, label=f"rolling p99 ({window} requests)")
    else:
        _no_data(ax)
    dropped = [r["sent"] for r in requests if r.get("status") != "ok"]
    if dropped:  # at the foot of the axes: they have no TTFT
        ax.plot(dropped, [0.03] * len(dropped), "x", color="red",
                transform=ax.get_xaxis_transform(), label="rejected / failed (sent)")
    limit = ((result.get("summary") or {}).get("slo") or {}).get("ttft")
    if limit is not None:
        ax.axhline(limit * 1000, color="red", linestyle="--", label=f"SLO {limit * 1000:g} ms")
    ax.set(title="TTFT by send time", ylabel="ms")
    ax.set_ylim(bottom=0)
    if done or dropped:
        ax.legend(fontsize="small", **_OUTSIDE)


def _plot_queues(ax, series: dict) -> None:
    for key, label in (("in_flight", "in flight (client)"), ("server_waiting", "server waiting"),
                       ("server_running", "server running")):
        if series.get(key) is not None:
            ax.plot(series["t"], series[key], label=label)
    ax.set(title="Concurrency and server queue", ylabel="requests")
    ax.legend(fontsize="small", **_OUTSIDE)


def _shade_regimes(ax, workload: dict, annotate: bool) -> None:
    for start, duration, text, colour in _regime_spans(workload):
        ax.axvspan(start, start + duration, color=colour, alpha=0.15)
        if annotate:
            ax.text(start, 0.97, text, transform=ax.get_xaxis_transform(), va="top",
                    fontsize="small", color=colour,
                    bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": colour})


def plot_timeseries(result: dict, path: Path) -> Path:
    """Write ``timeseries_figure(result)`` as a PNG to ``path``."""
    return _save(timeseries_figure(result), path)


def timeseries_figure(result: dict) -> Figure:
    """The run over time (x: seconds from its start): TTFT by send time with
    rolling p50/p99, then (when the result has a time series) in-flight
    requests and the server queue, and output tok/s; surges and ramps shaded
    on every panel and labelled (``surge x3``, ``ramp x1->x3``) on the first."""
    series = result.get("timeseries") or {}
    rows = 3 if series.get("t") else 1
    fig = new_figure(11, 1 + 3 * rows)
    axes = np.atleast_1d(fig.subplots(rows, 1, sharex=True))
    _plot_ttft_over_time(axes[0], result)
    if rows == 3:
        _plot_queues(axes[1], series)
        axes[2].plot(series["t"], series.get("output_tok_s") or [0.0] * len(series["t"]))
        axes[2].set(title="Output throughput", ylabel="tok/s")
    workload = workload_of(result)
    for i, ax in enumerate(axes):
        _shade_regimes(ax, workload, annotate=i == 0)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds since the start of the run")
    return fig


def html_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An HTML table; every cell is escaped unless it is a ``RawHtml``."""
    def cell(tag: str, value: object) -> str:
        text = value if isinstance(value, RawHtml) else html.escape(str(value))
        return f"<{tag}>{text}</{tag}>"
    head = "".join(cell("th", h) for h in headers)
    body = "".join("<tr>" + "".join(cell("td", v) for v in row) + "</tr>\n" for row in rows)
    return f"<table>\n<tr>{head}</tr>\n{body}</table>"


def html_page(title: str, body: str) -> str:
    """A complete self-contained page (inline CSS) around ``body`` (HTML)."""
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n"
            f"<body>\n{body}\n</body></html>\n")


def _p(text: str) -> str:
    return f"<p>{html.escape(text)}</p>"


def _img(name: str, alt: str) -> str:
    return f'<p><img src="{html.escape(name)}" alt="{html.escape(alt)}"></p>'


def slo_terms(slo: dict | None) -> str:
    """``TTFT <= 500 ms, TPOT <= 100 ms`` for an SLO in seconds; '' for none."""
    return ", ".join(f"{METRIC_NAMES.get(m, m)} <= {v * 1000:g} ms" for m, v in (slo or {}).items())


def slo_line(summary: dict) -> str:
    """The SLO and how the run fared against it, in words."""
    terms = slo_terms(summary.get("slo"))
    if not terms:
        return "No SLO given: no goodput or attainment."
    return (f"SLO {terms}: goodput {_num(summary.get('goodput'))} req/s, "
            f"attainment {_pct(summary.get('slo_attainment'))} of requests.")


def _serve_tables(summary: dict) -> list[str]:
    latency = [[METRIC_NAMES[m]] + [format_ms((summary.get(m) or {}).get(s)) for s in SUMMARY_STATS]
               for m in LATENCY_METRICS]
    rejected = f"{summary.get('rejected', '-')} ({_pct(summary.get('rejected_share'))})"
    counts = [[name, rejected if key == "rejected" else summary.get(key, "-")]
              for name, key in _COUNT_ROWS if key in summary or key != "unsent"]
    counts += [["request throughput (req/s)", _num(summary.get("request_throughput"))],
               ["output throughput (tok/s)", _num(summary.get("output_throughput"), ".1f")],
               ["total token throughput (tok/s)", _num(summary.get("total_token_throughput"), ".1f")],
               ["prefix hit rate (cached / prompt tokens)", _pct(summary.get("prefix_hit_rate"))]]
    reasons = [[status, reason, n] for status in ("rejected", "failed")
               for reason, n in (summary.get(f"{status}_by_reason") or {}).items()]
    parts = ["<h2>Latency (ms)</h2>", html_table(["metric", *SUMMARY_STATS], latency),
             "<h2>Throughput</h2>", html_table(["", "value"], counts),
             "<h2>SLO</h2>", _p(slo_line(summary)), "<h2>Rejected and failed by reason</h2>"]
    parts.append(html_table(["status", "reason", "requests"], reasons) if reasons
                 else _p("None rejected or failed."))
    return parts


def _config_block(doc: dict) -> str:
    config = json.dumps(doc.get("config") or {}, indent=2, sort_keys=True, default=str)
    return f"<details><summary>Configuration</summary><pre>{html.escape(config)}</pre></details>"


def _header(doc: dict, title: str) -> list[str]:
    duration = f"; ran {doc['duration_s']:.1f} s" if doc.get("duration_s") is not None else ""
    return [f"<h1>{html.escape(title)}</h1>",
            _p(f"Started {doc.get('started_at') or 'at an unknown time'}{duration}."),
            _p(f"Workload: {workload_line(doc)}.")]


def serve_body(result: dict, out_dir: Path, extra: Sequence[str] = ()) -> str:
    """A bench-serve report's body; ``extra`` HTML parts go before the config."""
    plot_cdfs([result], out_dir / "latency_cdf.png", (result.get("summary") or {}).get("slo"))
    plot_timeseries(result, out_dir / "timeseries.png")
    parts = _header(result, str(result.get("label") or "bench serve"))
    parts += _serve_tables(result.get("summary") or {})
    parts += ["<h2>Plots</h2>", _img("latency_cdf.png", "latency CDFs"),
              _img("timeseries.png", "the run over time")]
    parts += extra
    parts.append(_config_block(result))
    return "\n".join(parts)
