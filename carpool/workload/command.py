"""The workload's command-line flags (one set for every command that
replays a workload, and the one place they become a `WorkloadSpec`), and
``carpool traces``: where each trace is found, and fetching the whole ones."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from carpool.paths import default_cache_dir
from carpool.workload.arrivals import Ramp, Surge
from carpool.workload.download import (
    BASE_URL_ENV,
    DEFAULT_BASE_URL,
    UPSTREAM,
    TraceDownloadError,
    download_traces,
)
from carpool.workload.spec import ARRIVALS, SYNTHETIC, WorkloadSpec
from carpool.workload.traces import TRACE_FILES, TRACES_ENV, excerpt_note, resolve_trace

# The flags' defaults are the spec's: one place to change them.
DEFAULTS = WorkloadSpec()


def add_workload_args(parser: argparse.ArgumentParser, *, seed_flag: str = "--seed") -> None:
    """Groups "workload" and "arrivals". Dests: workload, num_requests,
    input_len, output_len, token_scale, max_input_len, max_output_len,
    trace_start, workload_seed, arrival, rate, burstiness, time_scale, surge,
    ramp, trace_loop. ``seed_flag`` renames ``--seed`` on parsers that also take the
    engine flags (which have their own ``--seed``)."""
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", default=DEFAULTS.workload,
                       help=f"'{SYNTHETIC}' (fixed lengths), a trace by name "
                            f"({', '.join(TRACE_FILES)}: `carpool traces list` shows the file "
                            f"each reads) or the path of such a file")
    group.add_argument("--num-requests", type=int, default=DEFAULTS.num_requests)
    group.add_argument("--input-len", type=int, default=DEFAULTS.input_len,
                       help="synthetic prompt tokens")
    group.add_argument("--output-len", type=int, default=DEFAULTS.output_len,
                       help="synthetic output tokens")
    group.add_argument("--token-scale", type=float, default=DEFAULTS.token_scale,
                       help="multiply trace token counts by this (e.g. 0.125 for a small "
                            "CPU model); Mooncake prefix blocks shrink by the same factor")
    group.add_argument("--max-input-len", type=int, default=DEFAULTS.max_input_len,
                       help="cap on trace prompts")
    group.add_argument("--max-output-len", type=int, default=DEFAULTS.max_output_len,
                       help="cap on trace outputs")
    group.add_argument("--trace-start", type=float, default=DEFAULTS.trace_start,
                       help="seconds into a timed trace where the replay starts")
    group.add_argument("--trace-loop", action="store_true",
                       help="a timed trace shorter than --num-requests replays back to back "
                            "(with --time-scale 0.1: ten copies at 10x the rate)")
    group.add_argument(seed_flag, dest="workload_seed", type=int,
                       default=DEFAULTS.workload_seed, metavar="SEED",
                       help="seed for arrivals, sampled lengths and prompt text")
    arrivals = parser.add_argument_group("arrivals")
    arrivals.add_argument("--arrival", choices=ARRIVALS, default=DEFAULTS.arrival,
                          help="arrival process; 'trace' replays a timed trace's timestamps")
    arrivals.add_argument("--rate", type=float, default=DEFAULTS.rate,
                          help="mean requests per second (ignored by --arrival trace)")
    arrivals.add_argument("--burstiness", type=float, default=DEFAULTS.burstiness,
                          help="gamma shape: 1 = Poisson, < 1 burstier, > 1 smoother")
    arrivals.add_argument("--time-scale", type=float, default=DEFAULTS.time_scale,
                          help="multiply trace gaps by this (4 = four times slower)")
    arrivals.add_argument("--surge", action="append", default=[], type=arg_type(Surge.parse),
                          metavar="FACTORx@START+DURATION",
                          help="multiply the rate over a window of seconds, e.g. 3x@20+30 "
                               "(repeatable)")
    arrivals.add_argument("--ramp", action="append", default=[], type=arg_type(Ramp.parse),
                          metavar="FROMx-TOx@START+DURATION",
                          help="move the rate multiplier linearly over a window, e.g. "
                               "1x-3x@10+20 (repeatable; multiplies with surges)")


def arg_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """``parse`` with its ValueError shown by argparse word for word."""
    def parsed(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parsed.__name__ = parse.__name__
    return parsed


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The workload the flags of `add_workload_args` describe."""
    return WorkloadSpec(
        workload=args.workload, num_requests=args.num_requests, input_len=args.input_len,
        output_len=args.output_len, token_scale=args.token_scale,
        max_input_len=args.max_input_len, max_output_len=args.max_output_len,
        trace_start=args.trace_start, trace_loop=args.trace_loop,
        workload_seed=args.workload_seed, arrival=args.arrival, rate=args.rate,
        burstiness=args.burstiness, time_scale=args.time_scale, surge=tuple(args.surge),
        ramp=tuple(args.ramp))


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
