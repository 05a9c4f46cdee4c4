"""The sweep part of the bench report: latency and throughput against the
offered rate, the runs table, and ``find_knee``."""
from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from carpool.report.run import (
    METRIC_NAMES,
    RawHtml,
    _config_block,
    _header,
    _img,
    _num,
    _p,
    _pct,
    _save,
    format_ms,
    html_table,
    new_figure,
    slo_terms,
)

# find_knee: below this normalised distance from the chord there is no bend
KNEE_MIN_DISTANCE = 0.1
# find_knee: latency varying by less than this share of its maximum is flat
KNEE_FLAT_SPAN = 0.1


def find_knee(rates: Sequence[float], latencies: Sequence[float | None]) -> float | None:
    """The offered rate at which latency starts to climb: the knee of a sweep.

    Kneedle-style: the (rate, latency) pairs with finite values are sorted by
    rate and both axes are min-max normalised to [0, 1]; the knee is the point
    lying furthest below the chord from the first to the last point, which is
    where a convexly growing latency curve bends upward. Returns that point's
    rate (input units). None when there are fewer than 3 usable points, the
    rates span nothing, latency at the highest rate is not above that at the
    lowest, latency varies by less than ``KNEE_FLAT_SPAN`` of its maximum
    (flat), or no point lies at least ``KNEE_MIN_DISTANCE`` (normalised) below
    the chord: a straight or concave curve has no knee.
    """
    points = sorted((float(r), float(v)) for r, v in zip(rates, latencies)
                    if r is not None and v is not None
                    and math.isfinite(float(r)) and math.isfinite(float(v)))
    if len(points) < 3:
        return None
    x, y = (np.array(axis) for axis in zip(*points))
    x_span, y_span = x[-1] - x[0], y.max() - y.min()
    if x_span <= 0 or y[-1] <= y[0] or y_span < KNEE_FLAT_SPAN * abs(y.max()):
        return None
    xn, yn = (x - x[0]) / x_span, (y - y.min()) / y_span
    below = yn[0] + (yn[-1] - yn[0]) * xn - yn
    best = int(np.argmax(below))
    return float(x[best]) if below[best] >= KNEE_MIN_DISTANCE else None


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _sweep_points(sweep: dict) -> list[tuple[float, dict]]:
    runs = [(run["rate"], run.get("result") or {}) for run in sweep.get("runs") or []
            if run.get("rate") is not None]
    return sorted(runs, key=lambda point: point[0])


def _stat_ms(result: dict, metric: str, stat: str) -> float:
    return _or_nan(((result.get("summary") or {}).get(metric) or {}).get(stat)) * 1000


def _finish_sweep_axes(ax, sweep: dict, title: str, ylabel: str) -> None:
    """Knee and capacity as vertical lines, labels, grid, legend."""
    for key, text, colour in (("knee_rps", "knee", "tab:orange"),
                              ("capacity_rps", "capacity", "tab:green")):
        if sweep.get(key) is not None:
            ax.axvline(sweep[key], color=colour, linestyle=":", label=f"{text} {sweep[key]:.2f} req/s")
    ax.set(title=title, xlabel="offered rate (req/s)", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot_sweep_latency(sweep: dict, path: Path) -> Path:
    """TTFT and TPOT p50/p99 (ms) against the offered rate, with the SLO as a
    horizontal line and the knee and capacity as vertical lines."""
    points = _sweep_points(sweep)
    rates = [rate for rate, _ in points]
    fig = new_figure(11, 4.5)
    for ax, metric in zip(fig.subplots(1, 2), ("ttft", "tpot")):
        for stat, style in (("p50", "o-"), ("p99", "s-")):
            ax.plot(rates, [_stat_ms(result, metric, stat) for _, result in points], style,
                    label=f"{METRIC_NAMES[metric]} {stat}")
        limit = (sweep.get("slo") or {}).get(metric)
        if limit is not None:
            ax.axhline(limit * 1000, color="red", linestyle="--", label=f"SLO {limit * 1000:g} ms")
        _finish_sweep_axes(ax, sweep, f"{METRIC_NAMES[metric]} vs offered rate", "ms")
    return _save(fig, path)


def plot_sweep_throughput(sweep: dict, path: Path) -> Path:
    """Output tok/s, and completed req/s and goodput, against the offered rate."""
    points = _sweep_points(sweep)
    rates = [rate for rate, _ in points]
    summaries = [result.get("summary") or {} for _, result in points]
    fig = new_figure(11, 4.5)
    tokens, requests = fig.subplots(1, 2)
    tokens.plot(rates, [_or_nan(s.get("output_throughput")) for s in summaries], "o-",
                label="output tok/s")
    requests.plot(rates, [_or_nan(s.get("request_throughput")) for s in summaries], "o-",
                  label="completed req/s")
    if any(s.get("goodput") is not None for s in summaries):
        requests.plot(rates, [_or_nan(s.get("goodput")) for s in summaries], "s-", label="goodput")
    if rates:
        requests.plot([0, max(rates)], [0, max(rates)], color="gray", linestyle="--",
                      label="served = offered")
    _finish_sweep_axes(tokens, sweep, "Output throughput", "tok/s")
    _finish_sweep_axes(requests, sweep, "Request throughput", "req/s")
    return _save(fig, path)


def _sweep_rows(sweep: dict, links: list[str | None]) -> list[list[object]]:
    target = sweep.get("attainment_target")
    rows = []
    for run, link in zip(sweep.get("runs") or [], links):
        summary = (run.get("result") or {}).get("summary") or {}
        attained, meets = summary.get("slo_attainment"), run.get("meets_slo")
        if meets is None and attained is not None and target is not None:
            meets = attained >= target
        meets = "-" if meets is None else ("yes" if meets else "no")
        rate = run.get("rate")
        rows.append([run.get("mode", "-"), "-" if rate is None else f"{rate:.2f}",
                     _num(summary.get("request_throughput")),
                     _num(summary.get("output_throughput"), ".1f"),
                     *(format_ms((summary.get(m) or {}).get(s))
                       for m in ("ttft", "tpot") for s in ("p50", "p99")),
                     _pct(summary.get("rejected_share")), _pct(attained), meets,
                     RawHtml(f'<a href="{html.escape(link)}">report</a>') if link else "-"])
    return rows


def sweep_body(sweep: dict, out_dir: Path, run_reports: bool,
               write_report: Callable[[dict, Path], Path]) -> str:
    """The sweep page's body; ``write_report`` writes each run's own report."""
    plot_sweep_latency(sweep, out_dir / "latency_vs_rate.png")
    plot_sweep_throughput(sweep, out_dir / "throughput_vs_rate.png")
    links = [write_report(run["result"], out_dir / f"run-{i:02d}").relative_to(out_dir).as_posix()
             if run_reports and (run.get("result") or {}).get("kind") == "bench-serve" else None
             for i, run in enumerate(sweep.get("runs") or [])]
    target = sweep.get("attainment_target")
    verdict = (f"Capacity {_num(sweep.get('capacity_rps'))} req/s, knee "
               f"{_num(sweep.get('knee_rps'))} req/s (SLO attainment target {_pct(target)}).")
    headers = ["mode", "offered req/s", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
               "TPOT p50 ms", "TPOT p99 ms", "rejected", "attainment", "meets SLO?", "details"]
    parts = _header(sweep, str(sweep.get("label") or "bench sweep"))
    parts += [_p(f"SLO: {slo_terms(sweep.get('slo')) or 'none given'}."), _p(verdict),
              "<h2>Runs</h2>", html_table(headers, _sweep_rows(sweep, links)), "<h2>Plots</h2>",
              _img("latency_vs_rate.png", "latency vs offered rate"),
              _img("throughput_vs_rate.png", "throughput vs offered rate"), _config_block(sweep)]
    return "\n".join(parts)
