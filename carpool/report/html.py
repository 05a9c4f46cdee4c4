"""``write_report``: the HTML report of a bench-serve or bench-sweep result.

The dispatcher sits above both page builders: a sweep's page links a
report per run, so the sweep page builder gets this function to call rather
than importing it (which made the two report modules import each other).
"""
from __future__ import annotations

import json
from pathlib import Path

from carpool.report.fleet import fleet_section
from carpool.report.run import html_page, serve_body
from carpool.report.sweep import sweep_body


def write_report(result: dict, out_dir: Path, *, run_reports: bool = True) -> Path:
    """Write ``out_dir/report.html`` and its PNGs for a bench-serve or
    bench-sweep document (dispatching on ``kind``); returns the HTML path.
    For a sweep, ``run_reports`` also writes each run's own report into
    ``run-NN/`` and links it from the runs table."""
    kind = result.get("kind")
    if kind not in ("bench-serve", "bench-sweep"):
        raise ValueError(f"cannot report on kind {kind!r}: expected 'bench-serve' or 'bench-sweep'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if kind == "bench-serve":
        body = serve_body(result, out_dir, fleet_section(result, out_dir))
    else:
        body = sweep_body(result, out_dir, run_reports, write_report)
    path = out_dir / "report.html"
    path.write_text(html_page(f"{kind}: {result.get('label') or ''}", body), encoding="utf-8")
    return path


def write_outputs(result: dict, json_path: str | None, html_dir: str | None) -> None:
    """Write a bench-serve result as JSON and/or as an HTML report (each if given)."""
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {json_path}")
    if html_dir:
        print(f"wrote {write_report(result, Path(html_dir))}")
