#!/usr/bin/env python
"""Write the trace excerpts packaged in carpool/workload/excerpts/.

    python scripts/make_trace_excerpts.py [SOURCE_DIR]

SOURCE_DIR holds the whole traces in the layout of TRACE_FILES (default:
the folder carpool would read them from; ``carpool traces download``
fills one). Every source file is checked against its pinned sha256. An
excerpt is the file's first lines, unchanged (the header and the requests
of the first EXCERPT_SECONDS of a timed trace, or the first EXCERPT_ROWS of
a lengths file), gzipped without a timestamp so a rerun writes the same
bytes; manifest.json records what each holds, README.md the sources and
licences, licenses/ the licence texts.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import sys
from pathlib import Path

from carpool.workload.download import UPSTREAM
from carpool.workload.traces import (
    EXCERPTS_DIR,
    TRACE_FILES,
    excerpt_path,
    has_arrivals,
    load_trace,
    trace_dirs,
    whole_trace,
)

# Seconds of each timed trace kept; sized so tests' windows fit (Azure conv
# 600-660 s) and the package stays small (about 200 kB for all six).
EXCERPT_SECONDS = {"azure-conv": 900.0, "azure-code": 900.0, "mooncake-conv": 300.0,
                   "mooncake-synthetic": 120.0}
EXCERPT_ROWS = 2000  # of a lengths file
LICENCE_DIR = "licenses"


def _excerpt_lines(name: str, source: Path) -> tuple[list[str], dict]:
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    header = 0 if source.suffix == ".jsonl" else 1
    requests = load_trace(source)
    if has_arrivals(requests):
        # The files are in time order, so the first k requests are the first k rows.
        keep = sum(1 for r in requests if r.arrival < EXCERPT_SECONDS[name])
        span = EXCERPT_SECONDS[name]
    else:
        keep, span = EXCERPT_ROWS, None
    info = {"rows": keep, "of": len(requests), "span_s": span, "lines": header + keep,
            "source_sha256": UPSTREAM[name].sha256}
    return lines[:header + keep], info


def main(argv: list[str]) -> int:
    manifest = {}
    for name, (relative, _, _) in TRACE_FILES.items():
        # each whole trace from wherever carpool finds it (a cache may hold some only)
        source = Path(argv[0]) / relative if argv else whole_trace(name)
        if source is None or not source.is_file():
            searched = source or ", ".join(map(str, trace_dirs()))
            print(f"{name}: no whole trace found (searched {searched}); "
                  f"`carpool traces download {name}` fetches it", file=sys.stderr)
            return 1
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        if digest != UPSTREAM[name].sha256:
            print(f"{source}: sha256 {digest} is not the pinned {UPSTREAM[name].sha256}",
                  file=sys.stderr)
            return 1
        lines, manifest[name] = _excerpt_lines(name, source)
        target = excerpt_path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0,
                                                     filename="") as out:
            out.write("".join(lines).encode("utf-8"))
        if load_trace(target) != load_trace(source)[:manifest[name]["rows"]]:
            print(f"{target}: not the first rows of {source}", file=sys.stderr)
            return 1
        print(f"{name}: {manifest[name]['rows']} of {manifest[name]['of']} requests, "
              f"{target.stat().st_size:,} bytes")
    (EXCERPTS_DIR / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (EXCERPTS_DIR / LICENCE_DIR).mkdir(exist_ok=True)
    folders = [Path(argv[0])] if argv else trace_dirs()
    licences = next((d / LICENCE_DIR for d in folders if (d / LICENCE_DIR).is_dir()), None)
    if licences is None:  # e.g. traces from the download cache: the packaged texts stay
        print(f"no {LICENCE_DIR}/ beside the traces; the packaged licence texts are kept",
              file=sys.stderr)
    for source in {s.licence_file for s in UPSTREAM.values()} if licences else ():
        shutil.copyfile(licences / source, EXCERPTS_DIR / LICENCE_DIR / source)
    (EXCERPTS_DIR / "README.md").write_text(_readme(manifest))
    return 0


def _readme(manifest: dict) -> str:
    rows = []
    for name, (relative, _, attribution) in TRACE_FILES.items():
        up, info = UPSTREAM[name], manifest[name]
        kept = (f"first {info['span_s']:.0f} s: {info['rows']:,} of {info['of']:,}"
                if info["span_s"] else f"first {info['rows']:,} of {info['of']:,}")
        rows.append(f"| `{relative}.gz` | {up.repo} @ {up.commit[:8]}, `{up.path}` | {kept} | "
                    f"{up.licence} (`{LICENCE_DIR}/{up.licence_file}`) | {attribution} |")
    return "\n".join([
        "# Trace excerpts",
        "",
        "The first rows of each public trace carpool replays, unchanged and gzipped, so",
        "that every command and test works from a bare install. Written by",
        "`scripts/make_trace_excerpts.py` from the whole files (sha256-checked); the",
        "whole traces come with `carpool traces download` (same sources, same commits).",
        "Keep the attribution wherever a report quotes results measured on them.",
        "",
        "| file | source (repository @ commit, path) | requests kept | licence | attribution |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "Attribution: \"Azure LLM inference trace 2023\" (Microsoft, Splitwise, ISCA'24);",
        "\"Mooncake traces\" (Moonshot AI / Kimi, FAST'25); length files from the Vidur",
        "and Sarathi-Serve projects (Microsoft). The licence texts are in licenses/.",
        "",
    ])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
