"""``carpool bench compare a.json b.json ...``: bench results side by side.

Each file is a ``carpool bench serve`` result, or a ``carpool bench sweep``
result, which is compared through its highest-rate run (the run that pushes
the server hardest) and whose capacity and knee are listed beside it. One
table has a column per file and, for every file after the baseline (the
first), a ratio column: value / baseline value, for throughputs and latencies
alike (a TTFT ratio of 0.5 halves the latency, a throughput ratio of 2
doubles the rate). Runs with different token or time scales did not put the
same load on the server; a warning says so.
"""
from __future__ import annotations

import argparse
import html
import json
import string
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from carpool.report.run import (
    format_ms,
    html_page,
    html_table,
    plot_cdfs,
    workload_scales,
)
from carpool.settings_fields import add_setting_args, setting

KINDS = ("bench-serve", "bench-sweep")
VERSION = 1
# (row name, path into the summary, format)
SUMMARY_ROWS = (
    ("requests", ("requests",), "count"),
    ("completed", ("completed",), "count"),
    ("rejected %", ("rejected_share",), "pct"),
    ("req/s", ("request_throughput",), "rate"),
    ("output tok/s", ("output_throughput",), "rate"),
    ("TTFT p50 ms", ("ttft", "p50"), "ms"),
    ("TTFT p99 ms", ("ttft", "p99"), "ms"),
    ("TPOT p50 ms", ("tpot", "p50"), "ms"),
    ("TPOT p99 ms", ("tpot", "p99"), "ms"),
    ("ITL p99 ms", ("itl", "p99"), "ms"),
    ("E2E p50 ms", ("e2e", "p50"), "ms"),
    ("E2E p99 ms", ("e2e", "p99"), "ms"),
    ("goodput req/s", ("goodput",), "rate"),
    ("SLO attainment %", ("slo_attainment",), "pct"),
    ("prefix hit %", ("prefix_hit_rate",), "pct"),
)
# Per phase of a surge schedule (``stats.phase_summaries``).
PHASE_ROWS = (
    ("offered req/s", ("offered_rate",), "rate"),
    ("rejected %", ("rejected_share",), "pct"),
    ("TTFT p99 ms", ("ttft", "p99"), "ms"),
    ("TPOT p99 ms", ("tpot", "p99"), "ms"),
    ("completed req/s", ("completed_rate",), "rate"),
    ("goodput req/s", ("goodput",), "rate"),
)


@dataclass
class CompareOptions:
    """The flags of ``carpool bench compare`` (the result files are positional)."""

    html: Path | None = setting(
        None, "--html", "DIR", "also write DIR/compare.html with the table and overlaid CDFs",
        parse=Path)
    markdown: bool = setting(False, "--markdown", None, "print the table as Markdown",
                             parse=bool)


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``carpool bench compare``."""
    parser.add_argument("results", nargs="+", type=Path, metavar="RESULT.json",
                        help="bench serve (or bench sweep) result files; the first is the "
                             "baseline of the ratios")
    add_setting_args(parser, CompareOptions)


def load_result(path: Path) -> dict:
    """Read and check one result file; every problem is a ValueError naming it."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the result file: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON result file ({exc})") from exc
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind not in KINDS:
        what = f"kind {kind!r}" if isinstance(doc, dict) else f"a JSON {type(doc).__name__}"
        raise ValueError(f"{path}: {what} is not a bench result; expected kind 'bench-serve' "
                         f"(carpool bench serve) or 'bench-sweep' (carpool bench sweep)")
    if doc.get("version") != VERSION:
        raise ValueError(f"{path}: {kind} version {doc.get('version')!r} is not supported "
                         f"(this carpool reads version {VERSION})")
    if kind == "bench-serve" and not isinstance(doc.get("summary"), dict):
        raise ValueError(f"{path}: the bench-serve result has no summary")
    if kind == "bench-sweep" and not any(isinstance(r.get("result"), dict)
                                         for r in doc.get("runs") or []):
        raise ValueError(f"{path}: the bench-sweep result has no runs")
    return doc


def serve_view(doc: dict) -> tuple[dict, str | None]:
    """The bench-serve result to compare for a document, and a note: a sweep
    stands for its highest-rate run (label ``<sweep> @ <rate> req/s``), noted
    with its capacity and knee; a serve result stands for itself (no note)."""
    if doc["kind"] == "bench-serve":
        return doc, None
    runs = [r for r in doc["runs"] if isinstance(r.get("result"), dict)]
    top = max(runs, key=lambda r: -1.0 if r.get("rate") is None else r["rate"])
    rate = "?" if top.get("rate") is None else f"{top['rate']:g}"
    result = {**top["result"], "label": f"{doc.get('label') or 'sweep'} @ {rate} req/s"}
    capacity, knee = doc.get("capacity_rps"), doc.get("knee_rps")
    note = (f"sweep: capacity {'-' if capacity is None else f'{capacity:g}'} req/s, knee "
            f"{'-' if knee is None else f'{knee:g}'} req/s; compared at its highest-rate run "
            f"({top.get('mode', '?')}, {rate} req/s)")
    return result, note


def _tag(index: int) -> str:
    return string.ascii_uppercase[index] if index < 26 else f"R{index + 1}"


def _value(summary: dict, path: tuple[str, ...]) -> float | None:
    value: object = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, (int, float)) else None


def _format(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "count":
        return str(int(value))
    if kind == "pct":
        return f"{value * 100:.1f}"
    return format_ms(value) if kind == "ms" else f"{value:.2f}"


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "-"
    return f"{value / base:.2f}x"


def summary_rows(results: Sequence[dict], baseline_index: int = 0
                 ) -> tuple[list[str], list[list[str]]]:
    """The comparison as (headers, rows): a column per result (tagged A, B,
    ...) and, after each non-baseline result, its ratio to the baseline."""
    summaries = [r.get("summary") or {} for r in results]
    return _headers(len(results), baseline_index), _rows(summaries, SUMMARY_ROWS,
                                                         baseline_index)


def _headers(count: int, baseline_index: int, first: str = "metric") -> list[str]:
    headers = [first]
    for i in range(count):
        headers.append(_tag(i))
        if i != baseline_index:
            headers.append(f"{_tag(i)}/{_tag(baseline_index)}")
    return headers


def _rows(summaries: Sequence[dict], specs, baseline_index: int,
          prefix: str = "") -> list[list[str]]:
    rows = []
    for name, path, kind in specs:
        base = _value(summaries[baseline_index], path)
        row = [prefix + name]
        for i, summary in enumerate(summaries):
            row.append(_format(_value(summary, path), kind))
            if i != baseline_index:
                row.append(_ratio(_value(summary, path), base))
        rows.append(row)
    return rows


def phase_rows(results: Sequence[dict], baseline_index: int = 0
               ) -> tuple[list[str], list[list[str]]] | None:
    """Per-phase rows (calm / surge / calm ...) when every result has the
    same phases (``bench serve`` with ``--surge``), else None."""
    phase_lists = [r.get("phases") or [] for r in results]
    names = [[p["phase"] for p in phases] for phases in phase_lists]
    if len(names[0]) < 2 or any(n != names[0] for n in names):
        return None
    rows = []
    for index, name in enumerate(names[0]):
        summaries = [phases[index] for phases in phase_lists]
        rows += _rows(summaries, PHASE_ROWS, baseline_index, prefix=f"{name}: ")
    return _headers(len(results), baseline_index, "phase: metric"), rows


def _legend(results: Sequence[dict], sources: Sequence[str] | None) -> list[str]:
    lines = []
    for i, result in enumerate(results):
        tokens, time = workload_scales(result)
        source = f" [{sources[i]}]" if sources else ""
        lines.append(f"{_tag(i)}: {result.get('label') or 'unlabelled'} "
                     f"(token counts x{tokens:g}, time x{time:g}){source}")
    return lines


def format_summary_table(results: Sequence[dict], baseline_index: int = 0, *,
                         markdown: bool = False, sources: Sequence[str] | None = None) -> str:
    """bench-serve results side by side as aligned plain text (or Markdown),
    with ratios to ``results[baseline_index]`` and a legend of labels and
    scales (and ``sources``, one note per result, when given)."""
    headers, rows = summary_rows(results, baseline_index)
    legend = _legend(results, sources)
    phases = phase_rows(results, baseline_index)
    text = _table(headers, rows, markdown)
    if phases is not None:
        text += "\n\n" + _table(*phases, markdown)
    return text + "\n\n" + "\n".join((f"- {line}" for line in legend) if markdown else legend)


def _table(headers: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join([":--"] + ["--:"] * (len(headers) - 1)) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(row[c]) for row in [headers, *rows]) for c in range(len(headers))]
    return "\n".join("  ".join(cell.ljust(w) if c == 0 else cell.rjust(w)
                               for c, (cell, w) in enumerate(zip(row, widths))).rstrip()
                      for row in [headers, *rows])


def scale_warning(results: Sequence[dict]) -> str | None:
    """A warning when the results' (token_scale, time_scale) differ, else None."""
    scales = [workload_scales(r) for r in results]
    if len(set(scales)) <= 1:
        return None
    listed = ", ".join(f"{_tag(i)} x{t:g}/x{s:g}" for i, (t, s) in enumerate(scales))
    return (f"warning: the runs used different token/time scales ({listed}); they did not put "
            f"the same load on the server and are not comparable")


def write_compare_html(results: Sequence[dict], out_dir: Path,
                       sources: Sequence[str] | None = None) -> Path:
    """``out_dir/compare.html``: the table, the legend, any scale warning, and
    the latency CDFs of every result overlaid (``compare_cdf.png``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    slos = [(r.get("summary") or {}).get("slo") or {} for r in results]
    # one SLO line only when every run was judged against the same SLO
    plot_cdfs(results, out_dir / "compare_cdf.png", slos[0] if all(s == slos[0] for s in slos)
              else None)
    headers, rows = summary_rows(results)
    warning = scale_warning(results)
    parts = ["<h1>bench compare</h1>", html_table(headers, rows), "<ul>"]
    parts += [f"<li>{html.escape(line)}</li>" for line in _legend(results, sources)]
    parts.append("</ul>")
    if warning:
        parts.append(f'<p class="warn">{html.escape(warning)}</p>')
    parts.append('<p><img src="compare_cdf.png" alt="latency CDFs of every run"></p>')
    path = out_dir / "compare.html"
    path.write_text(html_page("bench compare", "\n".join(parts)), encoding="utf-8")
    return path


def run_compare(args: argparse.Namespace) -> int:
    """Print the comparison of ``args.results`` (and write ``--html``); 0 on success."""
    results, sources = [], []
    for path in args.results:
        result, note = serve_view(load_result(path))
        results.append(result)
        sources.append(f"{path}" + (f"; {note}" if note else ""))
    print(format_summary_table(results, markdown=args.markdown, sources=sources))
    warning = scale_warning(results)
    if warning:
        print(warning, file=sys.stderr)
    if args.html is not None:
        print(f"wrote {write_compare_html(results, args.html, sources)}")
    return 0
