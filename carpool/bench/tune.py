"""``carpool tune``: sweep batch size x max_wait on one workload (the same seeded
requests and arrivals for every point, replayed by
``carpool.bench.regimes.replay`` on one loaded model), mark the Pareto front of
output tok/s vs p99 latency, recommend the most throughput that meets an SLO.

The default latency metric is E2E: max_wait moves TTFT (batch formation),
batch size moves TPOT (step cost) and TTFT (queueing); E2E p99 holds both.
Continuous batching (iteration-level) has no batching wait: only the batch
size (``max_num_seqs``) is swept. Only ``run_tune``/``_measure`` need a model.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from carpool.config import EngineConfig, SchedulerConfig
from carpool.settings_fields import add_setting_args, setting
from carpool.slo import SLO_METRICS as LATENCY_METRICS
from carpool.slo import parse_duration, parse_slo
from carpool.workload.command import add_workload_args, arg_type


@dataclass(frozen=True)
class Setting:
    """One grid point: a batching regime with a batch size and a batching wait."""

    batching: str
    batch_size: int
    max_wait: float | None  # seconds; None under continuous batching (no batching wait)

    def label(self) -> str:
        """``static B=8 max_wait=50ms``, or ``continuous B=8``."""
        wait = "" if self.max_wait is None else f" max_wait={format_duration(self.max_wait)}"
        return f"{self.batching} B={self.batch_size}{wait}"

    def scheduler_knobs(self, base: SchedulerConfig) -> dict:
        """The scheduler settings this point sets on top of ``base``."""
        if self.batching == "continuous":
            return {"batching": "continuous", "max_num_seqs": self.batch_size}
        max_batch = max(self.batch_size, base.max_batch_size)
        return {"batching": self.batching, "preferred_batch_size": self.batch_size,
                "max_batch_size": max_batch, "max_wait": self.max_wait,
                "max_num_seqs": max(base.max_num_seqs, max_batch)}


@dataclass
class TunePoint:
    """What one grid point measured (latencies are p99 seconds; NaN: none finished)."""

    setting: Setting
    output_tok_s: float
    ttft_p99: float
    tpot_p99: float
    e2e_p99: float
    rejected_share: float
    requests: int = 0

    def latency(self, metric: str) -> float:
        """p99 of ``metric`` in seconds; a missing value (NaN) counts as infinite."""
        value = getattr(self, f"{metric}_p99")
        return math.inf if math.isnan(value) else value

    def to_dict(self) -> dict:
        """JSON-safe (a NaN p99 becomes null)."""
        p99 = {f"{m}_p99": None if math.isnan(v := getattr(self, f"{m}_p99")) else v
               for m in LATENCY_METRICS}
        return {"batching": self.setting.batching, "batch_size": self.setting.batch_size,
                "max_wait": self.setting.max_wait, "requests": self.requests,
                "output_tok_s": self.output_tok_s, **p99, "rejected_share": self.rejected_share}


@dataclass
class Recommendation:
    """The recommended point, whether it meets the SLO, and why it was chosen."""

    point: TunePoint
    meets_slo: bool
    message: str


def format_duration(seconds: float) -> str:
    """``0.05`` -> ``50ms``, ``2.0`` -> ``2s``."""
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


def parse_batch_sizes(text: str) -> list[int]:
    """``4,8,16,32`` -> sorted distinct positive ints."""
    try:
        sizes = {int(p) for p in text.split(",") if p.strip()}
    except ValueError:
        raise ValueError(f"batch sizes must be integers, e.g. 4,8,16,32; got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch sizes must be integers >= 1, e.g. 4,8,16,32; got {text!r}")
    return sorted(sizes)


def parse_max_waits(text: str) -> list[float]:
    """``0.05,0.1`` (seconds) or ``50ms,100ms`` -> sorted distinct seconds >= 0."""
    waits = {parse_duration(p, bare_seconds=True) for p in text.split(",") if p.strip()}
    if not waits:
        raise ValueError(f"give at least one max wait, e.g. 0.05,0.1; got {text!r}")
    return sorted(waits)


def parse_share(text: str) -> float:
    """A fraction in [0, 1] such as ``0.01``."""
    if not re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", text) or float(text) > 1:
        raise ValueError(f"expected a fraction between 0 and 1, e.g. 0.01; got {text!r}")
    return float(text)


def make_grid(batching: str, batch_sizes: list[int], max_waits: list[float]) -> list[Setting]:
    """Batch size x max_wait for static/dynamic; batch size only for continuous."""
    waits: list[float | None] = [None] if batching == "continuous" else list(max_waits)
    return [Setting(batching, b, w) for b in batch_sizes for w in waits]


def pareto_front(points: list[TunePoint], metric: str = "e2e") -> list[TunePoint]:
    """Points no other point beats on both throughput (max) and p99 ``metric``
    (min); points that tie on both stay. Input order is kept."""
    def dominates(a: TunePoint, b: TunePoint) -> bool:
        ta, tb, la, lb = a.output_tok_s, b.output_tok_s, a.latency(metric), b.latency(metric)
        return ta >= tb and la <= lb and (ta > tb or la < lb)
    return [p for p in points if not any(dominates(q, p) for q in points if q is not p)]


def point_meets_slo(point: TunePoint, slo: dict[str, float], max_rejected: float = 0.0) -> bool:
    """A whole run's verdict: every SLO metric's p99 within its limit (the
    SLO's meaning, ``carpool.slo.parse_slo``), and no more rejected than
    allowed. One request's verdict (goodput) is ``workload.stats.meets_slo``."""
    return (point.rejected_share <= max_rejected
            and all(point.latency(m) <= limit for m, limit in slo.items()))


def describe_slo(slo: dict[str, float], max_rejected: float = 0.0) -> str:
    """``ttft p99 <= 2s, rejected <= 0%``: the SLO in words."""
    terms = [f"{m} p99 <= {format_duration(v)}" for m, v in slo.items()]
    return ", ".join(terms + [f"rejected <= {max_rejected:.0%}"])


def recommend(points: list[TunePoint], slo: dict[str, float], metric: str = "e2e",
              max_rejected: float = 0.0, tolerance: float = 0.0) -> Recommendation:
    """The highest-throughput point meeting the SLO; throughputs within
    ``tolerance`` (a share) of the best count as tied, and ties go to the lower
    p99 ``metric``, then the earlier grid point. If none meets it, the point
    that rejects the fewest requests beyond ``max_rejected`` and then has the
    lowest latency relative to the SLO (worst p99 / limit; p99 ``metric``
    without an SLO)."""
    if not points:
        raise ValueError("no measured points to recommend from")
    feasible = [p for p in points if point_meets_slo(p, slo, max_rejected)]
    target = describe_slo(slo, max_rejected)
    if feasible:
        top = max(p.output_tok_s for p in feasible) * (1.0 - tolerance)
        best = min((p for p in feasible if p.output_tok_s >= top),
                   key=lambda p: (p.latency(metric), -p.output_tok_s))
        within = f" (within {tolerance:.0%}, then lowest {metric.upper()} p99)" if tolerance else ""
        return Recommendation(best, True, f"recommended: {best.setting.label()} - the most "
                              f"throughput{within} of the {len(feasible)}/{len(points)} "
                              f"settings meeting the SLO ({target})")

    def excess(p: TunePoint) -> float:  # the worst p99 / limit
        return max(p.latency(m) / v for m, v in slo.items()) if slo else p.latency(metric)
    best = min(points, key=lambda p: (max(0.0, p.rejected_share - max_rejected), excess(p),
                                      -p.output_tok_s))
    return Recommendation(best, False, (
        f"NO setting meets the SLO ({target}). Closest (lowest latency relative to the "
        f"SLO): {best.setting.label()}. Loosen the SLO, lower --rate or widen the grid."))


def format_table(points: list[TunePoint], metric: str, slo: dict[str, float],
                 max_rejected: float = 0.0) -> list[str]:
    """All points as text rows; ``*`` marks the Pareto front."""
    front = {id(p) for p in pareto_front(points, metric)}
    lines = [(f"  {'batch':>5} {'max_wait':>8} {'out tok/s':>9} {'TTFT p99':>9} "
              f"{'TPOT p99':>9} {'E2E p99':>9} {'rej':>5}  SLO")]
    for p in points:
        wait = "-" if p.setting.max_wait is None else format_duration(p.setting.max_wait)
        lines.append(
            f"{'*' if id(p) in front else ' '} {p.setting.batch_size:>5} {wait:>8} "
            f"{p.output_tok_s:>9.1f} {p.ttft_p99:>8.3f}s {p.tpot_p99:>8.3f}s "
            f"{p.e2e_p99:>8.3f}s {p.rejected_share:>5.0%}  "
            f"{'ok' if point_meets_slo(p, slo, max_rejected) else 'miss'}")
    lines.append(f"* = Pareto front: output tok/s vs {metric.upper()} p99")
    return lines


def profile_knobs(setting: Setting, base: SchedulerConfig | None = None) -> dict:
    """Scheduler settings for a profile: the tuned knobs over whatever the sweep
    ran with that differs from the defaults (the numbers were measured so)."""
    base = base or SchedulerConfig()
    tuned = setting.scheduler_knobs(base)
    defaults = vars(SchedulerConfig())
    return tuned | {k: v for k, v in vars(base).items() if k not in tuned and v != defaults[k]}


def profile_yaml(recommendation: Recommendation, header: list[str],
                 base: SchedulerConfig | None = None) -> str:
    """A profile (the layout of ``carpool/profiles/*.yaml``) for ``--profile``."""
    import yaml

    comment = "".join(f"# {line}\n" if line else "#\n" for line in header)
    return comment + yaml.safe_dump({"scheduler": profile_knobs(recommendation.point.setting,
                                                                base)}, sort_keys=False)


def profile_header(rec: Recommendation, workload: str, slo: dict[str, float],
                   max_rejected: float, command: str) -> list[str]:
    """The leading comment of a written profile: what, on what, measured how."""
    p = rec.point
    return [f"Written by `carpool tune`: {p.setting.label()}.", "",
            f"Workload: {workload}",
            f"SLO: {describe_slo(slo, max_rejected)} ({'met' if rec.meets_slo else 'NOT met'})",
            (f"Measured: {p.output_tok_s:.1f} out tok/s, p99 TTFT {p.ttft_p99:.3f}s, "
             f"TPOT {p.tpot_p99:.3f}s, E2E {p.e2e_p99:.3f}s, {p.rejected_share:.0%} rejected"),
            f"Command: {command}"]


@dataclass
class TuneSweep:
    """The grid ``carpool tune`` sweeps and how it judges the points."""

    batch_sizes: list[int] = setting(
        [4, 8, 16, 32], "--batch-sizes", "BATCH_SIZES",
        "batch sizes: preferred_batch_size (static/dynamic) or max_num_seqs (continuous) "
        "(default 4,8,16,32)", parse=arg_type(parse_batch_sizes))
    max_waits: list[float] = setting(
        [0.05, 0.1, 0.2, 0.3], "--max-waits", "MAX_WAITS",
        "batching waits, seconds or with ms/s (default 0.05,0.1,0.2,0.3); not used by "
        "continuous batching", parse=arg_type(parse_max_waits))
    latency_metric: str = setting(
        "e2e", "--latency-metric", None, "latency side of the Pareto front (p99; default e2e)",
        choices=LATENCY_METRICS)
    slo: dict[str, float] = setting(
        {}, "--slo", "SLO", "p99 limits, e.g. ttft=2s,tpot=200ms (units ms or s)",
        parse=arg_type(parse_slo))
    max_rejected: float = setting(
        0.0, "--max-rejected", "MAX_REJECTED",
        "share of requests a setting may reject and still meet the SLO",
        parse=arg_type(parse_share))
    tolerance: float = setting(
        0.02, "--tolerance", "TOLERANCE",
        "throughputs within this share of the best count as tied; the lower latency wins "
        "(default 0.02: measurement noise)", parse=arg_type(parse_share))


@dataclass
class TuneOutputs:
    """Where ``carpool tune`` writes its points and its recommendation."""

    json: str | None = setting(None, "--json", "JSON", "write all points here as JSON")
    write_profile: str | None = setting(
        None, "--write-profile", "PATH.yaml",
        "write the recommended setting as a profile (carpool serve --profile PATH.yaml)")


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    """Workload, replay and sweep flags (the engine flags come separately;
    the engine flag ``--batching`` picks the regime to tune)."""
    add_workload_args(parser, seed_flag="--workload-seed")
    add_setting_args(parser.add_argument_group("sweep"), TuneSweep)
    add_setting_args(parser, TuneOutputs)


def add_tune_parser(commands, add_engine_flags) -> argparse.ArgumentParser:
    """``carpool tune`` on the CLI's subparsers; dispatch to ``run_tune(config, args)``."""
    tune = commands.add_parser(
        "tune", help="sweep batch size x max_wait on a workload; print the throughput/p99 "
                     "Pareto table and recommend a setting for an SLO")
    add_tune_args(tune)
    add_engine_flags(tune)
    return tune


def _measure(base, config: EngineConfig, setting: Setting, workload, offsets) -> TunePoint:
    from carpool.bench.regimes import replay
    from carpool.engine.llm_engine import LLMEngine

    point_config = EngineConfig()
    # A fixed setting per point: the adaptive controller would move the knobs being swept.
    point_config.update({"model": vars(config.model), "cache": vars(config.cache), "scheduler": {
        **vars(config.scheduler), **setting.scheduler_knobs(config.scheduler)},
        "controller": {**vars(config.controller), "adaptive": False}})
    point_config.validate()
    engine = LLMEngine(point_config, base.tokenizer, base.model_config, base.executor,
                       base.max_model_len)
    result = replay(engine, workload, offsets)
    row = result.row()
    return TunePoint(setting, row["output_tok_s"], row["ttft_p99"], row["tpot_p99"],
                     row["e2e_p99"], row["rejected_share"], row["requests"])


def describe_workload(args: argparse.Namespace, model: str | None) -> str:
    """One line naming the workload, arrivals and model, for the output and profile."""
    from carpool.workload.command import workload_spec
    from carpool.workload.spec import describe_workload as describe

    w = describe(workload_spec(args))
    lengths = (f"synthetic {args.input_len} in / {args.output_len} out" if w["format"] ==
               "synthetic" else f"lengths from {w['name']} x{w['token_scale']:g}")
    arrivals = (f"trace timestamps x{w['time_scale']:g}" if w["arrival"] == "trace"
                else f"{w['process']} {w['rate']:g}/s")
    surges = "".join(f", surge {x.factor:g}x at {x.start:g}+{x.duration:g} s"
                     for x in args.surge)
    return (f"{w['num_requests']} requests, {arrivals}{surges}, {lengths}, seed "
            f"{w['seed']}, model {model or 'default'}")


def run_tune(config: EngineConfig, args: argparse.Namespace) -> int:
    """Run the sweep, print the table and recommendation, write JSON/profile."""
    from tqdm import tqdm

    from carpool.bench.regimes import encode_workload, warm_up
    from carpool.engine.llm_engine import LLMEngine

    batching = config.scheduler.batching
    grid = make_grid(batching, args.batch_sizes, args.max_waits)
    workload_text = describe_workload(args, config.model.model)
    print(f"tuning {batching} batching over {len(grid)} settings; workload: {workload_text}")
    if batching == "continuous":
        print("continuous batching is iteration-level and has no batching wait: sweeping "
              "batch size (max_num_seqs) only; --max-waits does not apply")
    base = LLMEngine.from_config(config)
    workload, offsets = encode_workload(args, base.tokenizer)
    warm_up(base, workload[0])
    span = offsets[-1] - offsets[0]
    offered = (len(offsets) - 1) / span * sum(r.output_len for r in workload) / len(workload) \
        if span > 0 else float("inf")
    points = []
    with tqdm(grid, desc="tune", unit="setting", file=sys.stderr) as bar:
        for setting in bar:
            bar.set_postfix_str(setting.label())
            points.append(_measure(base, config, setting, workload, offsets))
    _report(points, config, args, workload_text, offered)
    return 0


def _report(points: list[TunePoint], config: EngineConfig, args: argparse.Namespace,
            workload_text: str, offered: float) -> None:
    metric, slo = args.latency_metric, args.slo
    print("\n".join(format_table(points, metric, slo, args.max_rejected)))
    if all(p.output_tok_s >= 0.9 * offered for p in points):
        print(f"note: every setting kept up with the offered load (~{offered:.0f} out tok/s), "
              f"so throughput mostly reflects --rate; raise --rate to find each one's capacity")
    rec = recommend(points, slo, metric, args.max_rejected, args.tolerance)
    print(rec.message if slo else f"{rec.message} (no --slo given)")
    command = shlex.join(["carpool", *sys.argv[1:]])
    if args.write_profile:
        header = profile_header(rec, workload_text, slo, args.max_rejected, command)
        header.append(f"Use it: carpool serve --profile {args.write_profile}")
        Path(args.write_profile).write_text(profile_yaml(rec, header, config.scheduler))
        missed = "" if rec.meets_slo else " (NOT meeting the SLO)"
        print(f"wrote profile {args.write_profile}{missed}")
    if args.json:
        front = {id(p) for p in pareto_front(points, metric)}
        Path(args.json).write_text(json.dumps({
            "workload": workload_text, "command": command, "latency_metric": metric,
            "slo": slo, "max_rejected": args.max_rejected, "scheduler": vars(config.scheduler),
            "points": [p.to_dict() | {"pareto": id(p) in front,
                                      "meets_slo": point_meets_slo(p, slo, args.max_rejected)}
                       for p in points],
            "recommendation": rec.point.to_dict() | {"meets_slo": rec.meets_slo,
                                                     "message": rec.message}},
            indent=2, default=str))
