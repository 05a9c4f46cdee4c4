"""The requests a benchmark or a simulation replays, and when.

A workload (`WorkloadSpec`) is a source of lengths (fixed synthetic
lengths, a trace, or a lengths file) plus an arrival process (constant,
Poisson, gamma, or the trace's own timestamps). `plan_workload` turns it
into lengths and send offsets without a tokenizer (enough for the
simulator); `build_workload` adds prompt text of the exact token counts
(``carpool bench serve`` and the in-process replays). Every command takes
the same flags (``carpool.workload.command.add_workload_args``).
"""
from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from carpool.settings_fields import setting
from carpool.workload.arrivals import Ramp, Surge, arrival_offsets, describe_process
from carpool.workload.flag_types import arg_type
from carpool.workload.prompts import PromptFactory, TokenizerLike
from carpool.workload.shapes import SHAPES
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
class WorkloadSpec:
    """What to replay: a source of lengths (``workload``: ``synthetic`` or a
    trace name or path) and an arrival process. Each field carries its
    command-line flag (``carpool.workload.command.add_workload_args``
    registers them, `workload_spec` builds one back). ``surge`` and
    ``ramp`` are tuples; the flags' lists become tuples here."""

    workload: str = setting(
        SYNTHETIC, "--workload", None,
        f"'{SYNTHETIC}' (fixed lengths), a trace by name ({', '.join(TRACE_FILES)}: "
        f"`carpool traces list` shows the file each reads), the path of such a file, or a "
        f"generated shape ({', '.join(SHAPES)}: carpool.workload.shapes)")
    num_requests: int = setting(100, "--num-requests", None, "requests to replay", parse=int)
    input_len: int = setting(128, "--input-len", None, "synthetic prompt tokens", parse=int)
    output_len: int = setting(128, "--output-len", None, "synthetic output tokens", parse=int)
    token_scale: float = setting(
        1.0, "--token-scale", None,
        "multiply trace token counts by this (e.g. 0.125 for a small CPU model); Mooncake "
        "prefix blocks shrink by the same factor", parse=float)
    max_input_len: int = setting(1024, "--max-input-len", None, "cap on trace prompts",
                                 parse=int)
    max_output_len: int = setting(512, "--max-output-len", None, "cap on trace outputs",
                                  parse=int)
    trace_start: float = setting(0.0, "--trace-start", None,
                                 "seconds into a timed trace where the replay starts",
                                 parse=float)
    trace_loop: bool = setting(
        False, "--trace-loop", None,
        "a timed trace shorter than --num-requests replays back to back (with --time-scale "
        "0.1: ten copies at 10x the rate)", parse=bool)
    # --seed, or --workload-seed where a command takes the engine's own --seed
    workload_seed: int = setting(0, "--seed", "SEED",
                                 "seed for arrivals, sampled lengths and prompt text", parse=int)
    # The "arrivals" group (ARRIVAL_FIELDS) starts here.
    arrival: str = setting(
        "poisson", "--arrival", None,
        "arrival process; 'trace' replays a timed trace's timestamps", choices=ARRIVALS)
    rate: float = setting(2.0, "--rate", None,
                          "mean requests per second (ignored by --arrival trace)", parse=float)
    burstiness: float = setting(1.0, "--burstiness", None,
                                "gamma shape: 1 = Poisson, < 1 burstier, > 1 smoother",
                                parse=float)
    time_scale: float = setting(1.0, "--time-scale", None,
                                "multiply trace gaps by this (4 = four times slower)",
                                parse=float)
    surge: tuple[Surge, ...] = setting(
        [], "--surge", "FACTORx@START+DURATION",
        "multiply the rate over a window of seconds, e.g. 3x@20+30 (repeatable)",
        parse=arg_type(Surge.parse), nargs="append")
    ramp: tuple[Ramp, ...] = setting(
        [], "--ramp", "FROMx-TOx@START+DURATION",
        "move the rate multiplier linearly over a window, e.g. 1x-3x@10+20 (repeatable; "
        "multiplies with surges)", parse=arg_type(Ramp.parse), nargs="append")

    def __post_init__(self) -> None:
        # The repeatable flags collect lists (argparse appends to its default);
        # the spec keeps tuples, so that it stays immutable and comparable.
        object.__setattr__(self, "surge", tuple(self.surge))
        object.__setattr__(self, "ramp", tuple(self.ramp))


# The fields of the "arrivals" help group; the others are the "workload" group's.
ARRIVAL_FIELDS = ("arrival", "rate", "burstiness", "time_scale", "surge", "ramp")


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


def plan_workload(spec: WorkloadSpec) -> list[TraceRequest]:
    """Final lengths and send offsets (``arrival``, seconds from the run
    start) of every request, without prompt text."""
    _validate(spec)
    requests = _source_requests(spec)
    if spec.arrival == "trace":
        offsets = [r.arrival * spec.time_scale for r in requests]
    else:
        offsets = arrival_offsets(len(requests), spec.rate, spec.workload_seed, spec.burstiness,
                                  spec.surge, ramps=spec.ramp, process=spec.arrival)
    return [TraceRequest(offset, r.input_len, r.output_len, r.hash_ids)
            for offset, r in zip(offsets, requests)]


def build_workload(spec: WorkloadSpec, tokenizer: TokenizerLike) -> list[BenchItem]:
    """The requests to send, prompts of exact lengths for ``tokenizer``.

    Trace requests with hash ids (Mooncake) get prompts whose blocks of
    ``mooncake_block_tokens(spec.token_scale)`` tokens repeat wherever the
    trace's hash ids do, so prefix sharing survives the scaling.
    """
    plan = plan_workload(spec)
    factory = PromptFactory(tokenizer, seed=spec.workload_seed)
    block = mooncake_block_tokens(spec.token_scale)
    items = []
    for index, request in enumerate(plan):
        if request.hash_ids:
            prompt = factory.prefixed_text(request.hash_ids, block, request.input_len, key=index)
        else:
            prompt = factory.text(request.input_len, key=index)
        items.append(BenchItem(index, request.arrival, prompt, request.input_len,
                               request.output_len, request.hash_ids))
    return items


def describe_workload(spec: WorkloadSpec, items: Sequence[BenchItem] | None = None,
                      plan: Sequence[TraceRequest] | None = None) -> dict:
    """JSON-able description for results and reports: the source and its
    attribution, both scales, the arrival process and its parameters, the
    seed, and the offered rate of the actual schedule (``items`` or its
    ``plan``, else planned again from ``spec``)."""
    if items is None:
        plan = plan_workload(spec) if plan is None else plan
        offsets = [r.arrival for r in plan]
        lengths = [(r.input_len, r.output_len) for r in plan]
    else:
        offsets = [item.offset for item in items]
        lengths = [(item.input_tokens, item.output_tokens) for item in items]
    synthetic = spec.workload == SYNTHETIC
    path = None if synthetic or spec.workload in SHAPES else resolve_trace(spec.workload)
    span = max(offsets, default=0.0) - min(offsets, default=0.0)
    generated = spec.arrival != "trace"
    return {
        "name": spec.workload, "path": str(path) if path else None,
        "format": trace_format(path) if path else (
            "shape" if spec.workload in SHAPES else SYNTHETIC),
        "attribution": trace_attribution(path) if path else None,
        "num_requests": len(offsets),
        "input_len": spec.input_len if synthetic else None,
        "output_len": spec.output_len if synthetic else None,
        "mean_input_tokens": _mean(i for i, _ in lengths),
        "mean_output_tokens": _mean(o for _, o in lengths),
        "token_scale": spec.token_scale, "time_scale": spec.time_scale,
        "max_input_len": spec.max_input_len, "max_output_len": spec.max_output_len,
        "trace_start": None if synthetic else spec.trace_start,
        "trace_loop": bool(spec.trace_loop),
        "mooncake_block_tokens": mooncake_block_tokens(spec.token_scale),
        "arrival": spec.arrival,
        "process": describe_process(spec.arrival, spec.burstiness) if generated else "trace",
        "rate": spec.rate if generated else None,
        "burstiness": spec.burstiness if spec.arrival == "gamma" else None,
        "surges": [s.to_dict() for s in spec.surge], "ramps": [r.to_dict() for r in spec.ramp],
        "seed": spec.workload_seed,
        "duration_s": span,
        "offered_rate": (len(offsets) - 1) / span if span > 0 else None,
        # Only when the file is the excerpt packaged with carpool, not the whole trace.
        **({"excerpt": note} if (note := path and excerpt_note(path)) else {}),
    }


def mooncake_block_tokens(token_scale: float) -> int:
    """Tokens per Mooncake hash block after scaling token counts (at least 1)."""
    return max(1, round(MOONCAKE_BLOCK_TOKENS * token_scale))


def _source_requests(spec: WorkloadSpec) -> list[TraceRequest]:
    """``num_requests`` lengths (scaled, capped), with trace arrivals
    re-based to ``--trace-start`` when the trace has them."""
    count = spec.num_requests
    if spec.workload == SYNTHETIC:
        return [TraceRequest(None, spec.input_len, spec.output_len)] * count
    if spec.workload in SHAPES:
        shaped = SHAPES[spec.workload](count, random.Random(f"{spec.workload_seed}/shape"))
        _warn_capped(shaped, spec)
        return scale_tokens(shaped, spec.token_scale, spec.max_input_len, spec.max_output_len)
    trace = load_trace(spec.workload)
    if not has_arrivals(trace):
        rng = random.Random(f"{spec.workload_seed}/lengths")
        chosen = [trace[rng.randrange(len(trace))] for _ in range(count)]
        return scale_tokens(chosen, spec.token_scale, spec.max_input_len, spec.max_output_len)
    chosen = select_window(trace, start_s=spec.trace_start, max_requests=count)
    # Scaled before looping (the same either way): the window is the smaller list.
    chosen = scale_tokens(chosen, spec.token_scale, spec.max_input_len, spec.max_output_len)
    if len(chosen) < count and spec.trace_loop:
        chosen = loop_window(chosen, count)
    if len(chosen) < count:
        note = excerpt_note(resolve_trace(spec.workload))
        raise ValueError(f"trace {spec.workload!r} has only {len(chosen)} requests after "
                         f"--trace-start {spec.trace_start:g}; lower --num-requests or "
                         f"--trace-start, or add --trace-loop" + (f" ({note})" if note else ""))
    return chosen


def _warn_capped(requests: Sequence[TraceRequest], spec: WorkloadSpec) -> None:
    """A generated shape cut by the caps is no longer the shape (its shared
    prefixes may be all that is left): say so, with the flags to raise."""
    cut = sum(1 for r in requests
              if round(r.input_len * spec.token_scale) > spec.max_input_len
              or round(r.output_len * spec.token_scale) > spec.max_output_len)
    if cut:
        logging.getLogger(__name__).warning(
            "%s: %d of %d requests cut to --max-input-len %d / --max-output-len %d; raise "
            "them for the shape as published", spec.workload, cut, len(requests),
            spec.max_input_len, spec.max_output_len)


def _validate(spec: WorkloadSpec) -> None:
    positive = {"--num-requests": spec.num_requests, "--rate": spec.rate,
                "--burstiness": spec.burstiness, "--token-scale": spec.token_scale,
                "--time-scale": spec.time_scale, "--max-input-len": spec.max_input_len,
                "--max-output-len": spec.max_output_len}
    if spec.workload == SYNTHETIC:
        positive.update({"--input-len": spec.input_len, "--output-len": spec.output_len})
    for flag, value in positive.items():
        if value <= 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if spec.trace_start < 0:
        raise ValueError(f"--trace-start must be >= 0, got {spec.trace_start}")
    if spec.burstiness != 1 and spec.arrival != "gamma":
        raise ValueError(f"--burstiness {spec.burstiness:g} shapes gamma arrivals: add "
                         f"--arrival gamma (--arrival {spec.arrival} ignores it)")
    if spec.arrival != "trace":
        return
    if spec.surge or spec.ramp:
        raise ValueError("--surge and --ramp shape generated arrivals; they do not apply to "
                         "--arrival trace (use --time-scale to slow a trace down)")
    if spec.workload == SYNTHETIC or not _timed(spec.workload):
        raise ValueError(f"--arrival trace needs a trace with timestamps (azure-conv, "
                         f"azure-code, mooncake-conv, mooncake-synthetic); {spec.workload!r} "
                         f"has lengths only; choose --arrival constant, poisson or gamma")


def _timed(workload: str) -> bool:
    if workload in SHAPES:
        return False
    return trace_format(resolve_trace(workload)) in ("azure", "mooncake")


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None
