"""``carpool traces``: where each trace is found, and fetching the whole ones."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from carpool.paths import default_cache_dir
from carpool.workload.download import (
    BASE_URL_ENV,
    DEFAULT_BASE_URL,
    UPSTREAM,
    TraceDownloadError,
    download_traces,
)
from carpool.workload.traces import TRACE_FILES, TRACES_ENV, excerpt_note, resolve_trace


def add_traces_args(parser: argparse.ArgumentParser) -> None:
    """``carpool traces list`` and ``carpool traces download [NAME ...]``."""
    actions = parser.add_subparsers(dest="traces_command", required=True)
    actions.add_parser("list", help="each trace: the file a run would read, its source and "
                                    "licence")
    download = actions.add_parser(
        "download", help="fetch whole traces from their public repositories at pinned "
                         "commits (sha256-checked) into the cache")
    download.add_argument("names", nargs="*", metavar="NAME",
                          help=f"traces to fetch (default: all): {', '.join(TRACE_FILES)}")
    download.add_argument("--dir", type=Path, default=None,
                          help="where to put them (default: <cache>/traces, the first place "
                               "carpool looks after $CARPOOL_TRACES; cache: $CARPOOL_CACHE or "
                               "~/.cache/carpool)")
    download.add_argument("--base-url", default=os.environ.get(BASE_URL_ENV, DEFAULT_BASE_URL),
                          help=f"raw-file host serving OWNER/REPO/COMMIT/PATH (default "
                               f"${BASE_URL_ENV} or {DEFAULT_BASE_URL})")
    download.add_argument("--force", action="store_true",
                          help="fetch again even when a file with the pinned sha256 is there")
    download.add_argument("--no-progress", action="store_true", help="no progress bars")


def run_traces(args: argparse.Namespace) -> int:
    if args.traces_command == "list":
        for name in TRACE_FILES:
            path = resolve_trace(name)
            where = excerpt_note(path) or "whole trace"
            print(f"{name:<19} {path}\n{'':<19} {where}; {TRACE_FILES[name][2]}")
        return 0
    names = args.names or list(TRACE_FILES)
    unknown = [n for n in names if n not in UPSTREAM]
    if unknown:
        print(f"carpool: error: unknown trace {', '.join(map(repr, unknown))}; known: "
              f"{', '.join(TRACE_FILES)}", file=sys.stderr)
        return 2
    dest = args.dir if args.dir is not None else default_cache_dir() / "traces"
    try:
        paths = download_traces(names, dest, args.base_url, force=args.force,
                                progress=not args.no_progress, upstream=UPSTREAM)
    except TraceDownloadError as exc:
        print(f"carpool: error: {exc}", file=sys.stderr)
        return 1
    for name, path in zip(names, paths):
        source = UPSTREAM[name]
        print(f"{name}: {path}\n  from {source.repo}@{source.commit[:8]}:{source.path}, "
              f"licence {source.licence} (text in {dest / 'licenses' / source.licence_file})\n"
              f"  attribution: {TRACE_FILES[name][2]}")
    if args.dir is not None:
        print(f"carpool reads them from there with {TRACES_ENV}={dest}")
    return 0
