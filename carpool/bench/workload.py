"""The requests a serving benchmark sends, and when.

A workload is a source of lengths (fixed synthetic lengths, a shared trace,
or a lengths file) plus an arrival process (constant, Poisson, gamma, or the
trace's own timestamps). `plan_workload` turns the command-line arguments
into lengths and send offsets without a tokenizer (enough for a
simulator); `build_workload` adds prompt text of the exact token counts.
The argument groups are shared by ``carpool bench serve`` and the commands
that replay the same workloads.
"""
from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from carpool.bench.arrivals import Ramp, Surge, arrival_offsets, describe_process
from carpool.bench.prompts import PromptFactory, TokenizerLike
from carpool.workload.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TRACE_FILES,
    TraceRequest,
    excerpt_note,
    has_arrivals,
    load_trace,
    loop_window,
    resolve_trace,
    scale_tokens,
    select_window,
    trace_attribution,
    trace_format,
)

SYNTHETIC = "synthetic"
ARRIVALS = ("constant", "poisson", "gamma", "trace")


@dataclass(frozen=True)
class BenchItem:
    """One request to send: ``offset`` seconds after the run starts, a
    ``prompt`` of exactly ``input_tokens`` tokens, ``output_tokens`` to generate."""

    index: int
    offset: float
    prompt: str
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


def add_workload_args(parser: argparse.ArgumentParser, *, seed_flag: str = "--seed") -> None:
    """Groups "workload" and "arrivals". Dests: workload, num_requests,
    input_len, output_len, token_scale, max_input_len, max_output_len,
    trace_start, workload_seed, arrival, rate, burstiness, time_scale, surge,
    ramp, trace_loop. ``seed_flag`` renames ``--seed`` on parsers that also take the
    engine flags (which have their own ``--seed``)."""
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", default=SYNTHETIC,
                       help=f"'{SYNTHETIC}' (fixed lengths), a trace under ../shared/traces "
                            f"({', '.join(TRACE_FILES)}; $CARPOOL_TRACES overrides the folder) "
                            f"or the path of such a file")
    group.add_argument("--num-requests", type=int, default=100)
    group.add_argument("--input-len", type=int, default=128, help="synthetic prompt tokens")
    group.add_argument("--output-len", type=int, default=128, help="synthetic output tokens")
    group.add_argument("--token-scale", type=float, default=1.0,
                       help="multiply trace token counts by this (e.g. 0.125 for a small "
                            "CPU model); Mooncake prefix blocks shrink by the same factor")
    group.add_argument("--max-input-len", type=int, default=1024, help="cap on trace prompts")
    group.add_argument("--max-output-len", type=int, default=512, help="cap on trace outputs")
    group.add_argument("--trace-start", type=float, default=0.0,
                       help="seconds into a timed trace where the replay starts")
    group.add_argument("--trace-loop", action="store_true",
                       help="a timed trace shorter than --num-requests replays back to back "
                            "(with --time-scale 0.1: ten copies at 10x the rate)")
    group.add_argument(seed_flag, dest="workload_seed", type=int, default=0, metavar="SEED",
                       help="seed for arrivals, sampled lengths and prompt text")
    arrivals = parser.add_argument_group("arrivals")
    arrivals.add_argument("--arrival", choices=ARRIVALS, default="poisson",
                          help="arrival process; 'trace' replays a timed trace's timestamps")
    arrivals.add_argument("--rate", type=float, default=2.0,
                          help="mean requests per second (ignored by --arrival trace)")
    arrivals.add_argument("--burstiness", type=float, default=1.0,
                          help="gamma shape: 1 = Poisson, < 1 burstier, > 1 smoother")
    arrivals.add_argument("--time-scale", type=float, default=1.0,
                          help="multiply trace gaps by this (4 = four times slower)")
    arrivals.add_argument("--surge", action="append", default=[], type=arg_type(Surge.parse),
                          metavar="FACTORx@START+DURATION",
                          help="multiply the rate over a window of seconds, e.g. 3x@20+30 "
                               "(repeatable)")
    arrivals.add_argument("--ramp", action="append", default=[], type=arg_type(Ramp.parse),
                          metavar="FROMx-TOx@START+DURATION",
                          help="move the rate multiplier linearly over a window, e.g. "
                               "1x-3x@10+20 (repeatable; multiplies with surges)")


def plan_workload(args: argparse.Namespace) -> list[TraceRequest]:
    """Final lengths and send offsets (``arrival``, seconds from the run
    start) of every request, without prompt text."""
    _validate(args)
    requests = _source_requests(args)
    if args.arrival == "trace":
        offsets = [r.arrival * args.time_scale for r in requests]
    else:
        offsets = arrival_offsets(len(requests), args.rate, args.workload_seed, args.burstiness,
                                  args.surge, ramps=args.ramp, process=args.arrival)
    return [TraceRequest(offset, r.input_len, r.output_len, r.hash_ids)
            for offset, r in zip(offsets, requests)]


def build_workload(args: argparse.Namespace, tokenizer: TokenizerLike) -> list[BenchItem]:
    """The requests to send, prompts of exact lengths for ``tokenizer``.

    Trace requests with hash ids (Mooncake) get prompts whose blocks of
    ``mooncake_block_tokens(args.token_scale)`` tokens repeat wherever the
    trace's hash ids do, so prefix sharing survives the scaling.
    """
    plan = plan_workload(args)
    factory = PromptFactory(tokenizer, seed=args.workload_seed)
    block = mooncake_block_tokens(args.token_scale)
    items = []
    for index, request in enumerate(plan):
        if request.hash_ids:
            prompt = factory.prefixed_text(request.hash_ids, block, request.input_len, key=index)
        else:
            prompt = factory.text(request.input_len, key=index)
        items.append(BenchItem(index, request.arrival, prompt, request.input_len,
                               request.output_len, request.hash_ids))
    return items


def describe_workload(args: argparse.Namespace, items: Sequence[BenchItem] | None = None,
                      plan: Sequence[TraceRequest] | None = None) -> dict:
    """JSON-able description for results and reports: the source and its
    attribution, both scales, the arrival process and its parameters, the
    seed, and the offered rate of the actual schedule (``items`` or its
    ``plan``, else planned again from ``args``)."""
    if items is None:
        plan = plan_workload(args) if plan is None else plan
        offsets = [r.arrival for r in plan]
        lengths = [(r.input_len, r.output_len) for r in plan]
    else:
        offsets = [item.offset for item in items]
        lengths = [(item.input_tokens, item.output_tokens) for item in items]
    synthetic = args.workload == SYNTHETIC
    path = None if synthetic else resolve_trace(args.workload)
    span = max(offsets, default=0.0) - min(offsets, default=0.0)
    generated = args.arrival != "trace"
    return {
        "name": args.workload, "path": str(path) if path else None,
        "format": trace_format(path) if path else SYNTHETIC,
        "attribution": trace_attribution(path) if path else None,
        "num_requests": len(offsets),
        "input_len": args.input_len if synthetic else None,
        "output_len": args.output_len if synthetic else None,
        "mean_input_tokens": _mean(i for i, _ in lengths),
        "mean_output_tokens": _mean(o for _, o in lengths),
        "token_scale": args.token_scale, "time_scale": args.time_scale,
        "max_input_len": args.max_input_len, "max_output_len": args.max_output_len,
        "trace_start": None if synthetic else args.trace_start,
        "trace_loop": bool(getattr(args, "trace_loop", False)),
        "mooncake_block_tokens": mooncake_block_tokens(args.token_scale),
        "arrival": args.arrival,
        "process": describe_process(args.arrival, args.burstiness) if generated else "trace",
        "rate": args.rate if generated else None,
        "burstiness": args.burstiness if args.arrival == "gamma" else None,
        "surges": [s.to_dict() for s in args.surge], "ramps": [r.to_dict() for r in args.ramp],
        "seed": args.workload_seed,
        "duration_s": span,
        "offered_rate": (len(offsets) - 1) / span if span > 0 else None,
        # Only when the file is the excerpt packaged with carpool, not the whole trace.
        **({"excerpt": note} if (note := path and excerpt_note(path)) else {}),
    }


def mooncake_block_tokens(token_scale: float) -> int:
    """Tokens per Mooncake hash block after scaling token counts (at least 1)."""
    return max(1, round(MOONCAKE_BLOCK_TOKENS * token_scale))


def _source_requests(args: argparse.Namespace) -> list[TraceRequest]:
    """``num_requests`` lengths (scaled, capped), with trace arrivals
    re-based to ``--trace-start`` when the trace has them."""
    count = args.num_requests
    if args.workload == SYNTHETIC:
        return [TraceRequest(None, args.input_len, args.output_len)] * count
    trace = load_trace(args.workload)
    if not has_arrivals(trace):
        rng = random.Random(f"{args.workload_seed}/lengths")
        chosen = [trace[rng.randrange(len(trace))] for _ in range(count)]
        return scale_tokens(chosen, args.token_scale, args.max_input_len, args.max_output_len)
    chosen = select_window(trace, start_s=args.trace_start, max_requests=count)
    # Scaled before looping (the same either way): the window is the smaller list.
    chosen = scale_tokens(chosen, args.token_scale, args.max_input_len, args.max_output_len)
    if len(chosen) < count and getattr(args, "trace_loop", False):
        chosen = loop_window(chosen, count)
    if len(chosen) < count:
        note = excerpt_note(resolve_trace(args.workload))
        raise ValueError(f"trace {args.workload!r} has only {len(chosen)} requests after "
                         f"--trace-start {args.trace_start:g}; lower --num-requests or "
                         f"--trace-start, or add --trace-loop" + (f" ({note})" if note else ""))
    return chosen


def _validate(args: argparse.Namespace) -> None:
    positive = {"--num-requests": args.num_requests, "--rate": args.rate,
                "--burstiness": args.burstiness, "--token-scale": args.token_scale,
                "--time-scale": args.time_scale, "--max-input-len": args.max_input_len,
                "--max-output-len": args.max_output_len}
    if args.workload == SYNTHETIC:
        positive.update({"--input-len": args.input_len, "--output-len": args.output_len})
    for flag, value in positive.items():
        if value <= 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if args.trace_start < 0:
        raise ValueError(f"--trace-start must be >= 0, got {args.trace_start}")
    if args.burstiness != 1 and args.arrival != "gamma":
        raise ValueError(f"--burstiness {args.burstiness:g} shapes gamma arrivals: add "
                         f"--arrival gamma (--arrival {args.arrival} ignores it)")
    if args.arrival != "trace":
        return
    if args.surge or args.ramp:
        raise ValueError("--surge and --ramp shape generated arrivals; they do not apply to "
                         "--arrival trace (use --time-scale to slow a trace down)")
    if args.workload == SYNTHETIC or not _timed(args.workload):
        raise ValueError(f"--arrival trace needs a trace with timestamps (azure-conv, "
                         f"azure-code, mooncake-conv, mooncake-synthetic); {args.workload!r} "
                         f"has lengths only; choose --arrival constant, poisson or gamma")


def _timed(workload: str) -> bool:
    return trace_format(resolve_trace(workload)) in ("azure", "mooncake")


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def arg_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """``parse`` with its ValueError shown by argparse word for word."""
    def parsed(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parsed.__name__ = parse.__name__
    return parsed
