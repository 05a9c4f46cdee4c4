"""The workload's command-line flags (one set for every command that
replays a workload, and the one place they become a `WorkloadSpec`), and
``carpool traces``: where each trace is found, and fetching the whole ones."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from carpool.paths import default_cache_dir
from carpool.settings_fields import (
    add_setting_args,
    flag_fields,
    register_flag,
    setting,
    values_from_args,
)
from carpool.workload.download import (
    BASE_URL_ENV,
    DEFAULT_BASE_URL,
    UPSTREAM,
    TraceDownloadError,
    download_traces,
)
from carpool.workload.flag_types import arg_type as arg_type  # re-exported
from carpool.workload.spec import ARRIVAL_FIELDS, WorkloadSpec
from carpool.workload.traces import TRACE_FILES, TRACES_ENV, excerpt_note, resolve_trace


def add_workload_args(parser: argparse.ArgumentParser, *, seed_flag: str = "--seed") -> None:
    """Groups "workload" and "arrivals": `WorkloadSpec`'s flags. Dests: its
    field names (workload, num_requests, ..., workload_seed, arrival, rate,
    ..., surge, ramp). ``seed_flag`` renames ``--seed`` on parsers that also
    take the engine flags (which have their own ``--seed``)."""
    fields = [name for name, _ in flag_fields(WorkloadSpec)]
    group = parser.add_argument_group("workload")
    add_setting_args(group, WorkloadSpec, skip=("workload_seed", *ARRIVAL_FIELDS))
    seed = dict(flag_fields(WorkloadSpec))["workload_seed"]
    register_flag(group, dataclasses.replace(seed, flag=seed_flag), "workload_seed",
                  WorkloadSpec.workload_seed, seed.help)
    arrivals = parser.add_argument_group("arrivals")
    add_setting_args(arrivals, WorkloadSpec,
                     skip=tuple(name for name in fields if name not in ARRIVAL_FIELDS))


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The workload the flags of `add_workload_args` describe."""
    return values_from_args(WorkloadSpec, args)


@dataclass(frozen=True)
class DownloadFlags:
    """``carpool traces download``'s flags."""

    dir: Path | None = setting(
        None, "--dir", None,
        "where to put them (default: <cache>/traces, the first place carpool looks after "
        "$CARPOOL_TRACES; cache: $CARPOOL_CACHE or ~/.cache/carpool)", parse=Path)
    # None: read $CARPOOL_TRACES_URL when the command runs, not at import
    base_url: str | None = setting(
        None, "--base-url", None,
        f"raw-file host serving OWNER/REPO/COMMIT/PATH (default ${BASE_URL_ENV} or "
        f"{DEFAULT_BASE_URL})")
    force: bool = setting(False, "--force", None,
                          "fetch again even when a file with the pinned sha256 is there",
                          parse=bool)
    progress: bool = setting(True, "--progress", None, "progress bars", parse=bool)


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
    add_setting_args(download, DownloadFlags)


def run_traces(args: argparse.Namespace) -> int:
    if args.traces_command == "list":
        missing = 0
        for name in TRACE_FILES:
            try:
                path = resolve_trace(name)
            except FileNotFoundError as exc:  # $CARPOOL_TRACES without it
                print(f"{name:<19} not found\n{'':<19} {exc}")
                missing += 1
                continue
            where = excerpt_note(path) or "whole trace"
            print(f"{name:<19} {path}\n{'':<19} {where}; {TRACE_FILES[name][2]}")
        return 1 if missing else 0
    names = args.names or list(TRACE_FILES)
    unknown = [n for n in names if n not in UPSTREAM]
    if unknown:
        print(f"carpool: error: unknown trace {', '.join(map(repr, unknown))}; known: "
              f"{', '.join(TRACE_FILES)}", file=sys.stderr)
        return 2
    dest = args.dir if args.dir is not None else default_cache_dir() / "traces"
    try:
        base_url = args.base_url or os.environ.get(BASE_URL_ENV, DEFAULT_BASE_URL)
        paths = download_traces(names, dest, base_url, force=args.force,
                                progress=args.progress, upstream=UPSTREAM)
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
