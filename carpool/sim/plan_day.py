"""The day-long mode of ``carpool plan``, and the plan's text report.

A day is 24 hourly multipliers of the peak rate (``--daily-curve``; by
default ``DIURNAL_CURVE``, an assumed typical shape of interactive traffic:
a night trough near a fifth of the peak, a morning ramp, a midday plateau;
not measured data).

Replica schedule: hour h runs max(1, ceil(m_h x peak replicas)), i.e. the
per-replica sustainable rate is taken to be peak rate / the peak search's
answer, and at least one replica always stays up. Scaling happens at the
hour boundary with no start-up delay; a replica scaled in gets no new
requests and finishes the ones it has (``SimSettings.replica_schedule``).

Arrivals: the same stream the peak search simulates (at the peak rate),
cut into consecutive chunks of round(peak x m_h x hour seconds) requests,
each re-timed to fill its hour at exactly peak x m_h req/s on average
(piecewise constant per hour) with its own pattern of gaps kept. The whole
day is ONE continuous simulation: queues carry over hour boundaries.

Costs: one replica-hour per replica per hour of the curve, whatever
``--hour-seconds`` is; a compressed day (hours of fewer simulated seconds at
the same rates) has its output tokens scaled by 3600 / hour seconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from carpool.config import EngineConfig
from carpool.settings_fields import add_setting_args, setting
from carpool.sim.simulate import simulate
from carpool.workload.arrivals import rescale_offsets
from carpool.workload.flag_types import arg_type
from carpool.workload.stats import distribution, meets_slo
from carpool.workload.traces import TraceRequest

HOURS = 24
DIURNAL_CURVE = (0.30, 0.24, 0.20, 0.18, 0.18, 0.22, 0.32, 0.48, 0.66, 0.82, 0.92, 0.97,
                 1.00, 0.98, 0.96, 0.95, 0.93, 0.90, 0.85, 0.78, 0.70, 0.60, 0.50, 0.40)
DEFAULT_CURVE_NOTE = "assumed typical diurnal shape (not data)"


def parse_curve(text: str) -> tuple[float, ...]:
    """``M0,...,M23``: 24 hourly multipliers of the peak, each in [0, 1], the
    largest exactly 1 (the peak hour)."""
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--daily-curve takes numbers, got {text!r}") from None
    if len(values) != HOURS:
        raise ValueError(f"--daily-curve needs {HOURS} comma-separated hourly multipliers, "
                         f"got {len(values)}")
    if any(not 0 <= v <= 1 for v in values):
        raise ValueError(f"--daily-curve multipliers must be in [0, 1], got {text!r}")
    if abs(max(values) - 1) > 1e-9:
        raise ValueError(f"--daily-curve's largest multiplier must be 1 (the peak hour), "
                         f"got {max(values):g}")
    return values


@dataclass(frozen=True)
class DayFlags:
    """``carpool plan``'s day-long mode (group "day")."""

    day: bool = setting(False, "--day", None,
                        "also simulate a 24-hour load curve with a replica schedule", parse=bool)
    # None: DIURNAL_CURVE; given without --day it is an error (validate_day_args)
    daily_curve: tuple[float, ...] | None = setting(
        None, "--daily-curve", "M0,...,M23",
        "24 hourly multipliers of the peak in [0, 1], largest 1 (default: an assumed typical "
        "diurnal shape, not data)", parse=arg_type(parse_curve))
    hour_seconds: float | None = setting(
        None, "--hour-seconds", None,
        "simulated seconds per hour of the curve (default 3600; less compresses the day at "
        "the same rates)", parse=float)


def add_day_args(parser: argparse.ArgumentParser) -> None:
    """Group "day": `DayFlags`."""
    add_setting_args(parser.add_argument_group("day"), DayFlags)


def validate_day_args(args: argparse.Namespace) -> None:
    """ValueError for day flags out of range or given without --day."""
    if not args.day and (args.daily_curve is not None or args.hour_seconds is not None):
        raise ValueError("--daily-curve and --hour-seconds shape the day-long mode: add --day")
    if args.hour_seconds is not None and not args.hour_seconds > 0:
        raise ValueError(f"--hour-seconds must be > 0, got {args.hour_seconds}")


def hourly_replicas(curve: tuple[float, ...], peak_replicas: int) -> list[int]:
    """Replicas per hour: max(1, ceil(multiplier x peak_replicas))."""
    return [max(1, math.ceil(m * peak_replicas - 1e-9)) for m in curve]


def hourly_counts(peak_rate: float, curve: tuple[float, ...], hour_s: float) -> list[int]:
    """Requests arriving in each hour: round(peak_rate x multiplier x hour_s)."""
    return [round(peak_rate * m * hour_s) for m in curve]


def spread_over_curve(stream: list[TraceRequest], peak_rate: float, curve: tuple[float, ...],
                      hour_s: float) -> list[TraceRequest]:
    """The day's arrivals: consecutive chunks of ``stream`` (the peak
    workload, in arrival order), one per hour, each re-timed to fill its
    hour at exactly ``peak_rate x multiplier`` req/s on average while
    keeping its own gaps' pattern (a trace's bursts, Poisson variation).
    Rescaling per hour keeps a timed trace's slower and busier stretches
    from drifting into the wrong hours of the curve."""
    counts = hourly_counts(peak_rate, curve, hour_s)
    if len(stream) < sum(counts):
        raise ValueError(f"the day needs {sum(counts)} requests, the stream has {len(stream)}")
    out, taken = [], 0
    for hour, count in enumerate(counts):
        chunk = stream[taken:taken + count]
        taken += count
        if not chunk:
            continue
        offsets = rescale_offsets([r.arrival for r in chunk], peak_rate * curve[hour])
        out += [dataclasses.replace(r, arrival=hour * hour_s + t)
                for r, t in zip(chunk, offsets)]
    return out


def plan_day(problem, config: EngineConfig, peak_replicas: int, curve: tuple[float, ...] | None,
             hour_s: float, price_per_hour: float,
             make_stream: Callable[[int], list[TraceRequest]]) -> dict:
    """Simulate the day on the hourly schedule (``problem``: the peak
    search's ``PeakProblem``; ``curve`` None: ``DIURNAL_CURVE``)."""
    source = DEFAULT_CURVE_NOTE if curve is None else "--daily-curve"
    curve = DIURNAL_CURVE if curve is None else curve
    schedule = hourly_replicas(curve, peak_replicas)
    total = sum(hourly_counts(problem.peak_rate, curve, hour_s))
    if total == 0:
        raise ValueError("the day has no requests at this --peak-rate and --hour-seconds")
    stream = make_stream(total)
    arrivals = spread_over_curve(stream, problem.peak_rate, curve, hour_s)
    settings = dataclasses.replace(
        problem.settings, replicas=max(schedule),
        replica_schedule=tuple((h * hour_s, n) for h, n in enumerate(schedule)))
    run = simulate(arrivals, config, problem.cost, problem.num_blocks, settings)
    records = run.records
    good = sum(meets_slo(r, problem.slo) for r in records)
    tokens = sum(r.output_tokens for r in records if r.ok) * 3600.0 / hour_s
    dollars = sum(schedule) * price_per_hour
    return {"curve": list(curve), "curve_source": source, "hour_seconds": hour_s,
            "compression": 3600.0 / hour_s, "peak_replicas": peak_replicas,
            "per_replica_rate": problem.peak_rate / peak_replicas,
            "hours": _hour_rows(records, curve, schedule, problem, hour_s),
            "requests": len(records), "attainment": good / len(records) if records else None,
            "replica_hours": sum(schedule), "dollars": dollars,
            "static_replica_hours": HOURS * peak_replicas,
            "static_dollars": HOURS * peak_replicas * price_per_hour,
            "output_tokens_per_day": tokens,
            "dollars_per_million_output_tokens": dollars / (tokens / 1e6) if tokens else None,
            "simulated_s": run.duration, "wall_s": run.wall_seconds}


def _hour_rows(records, curve, schedule, problem, hour_s: float) -> list[dict]:
    """Per hour of arrival: offered rate, replicas, requests and how they fared."""
    buckets: list[list] = [[] for _ in range(HOURS)]
    for record in records:
        buckets[min(HOURS - 1, int(record.scheduled // hour_s))].append(record)
    rows = []
    for hour, bucket in enumerate(buckets):
        good = sum(meets_slo(r, problem.slo) for r in bucket)
        rows.append({"hour": hour, "multiplier": curve[hour],
                     "rate": problem.peak_rate * curve[hour], "replicas": schedule[hour],
                     "requests": len(bucket), "completed": sum(r.ok for r in bucket),
                     "attainment": good / len(bucket) if bucket else None,
                     "p99_ttft": distribution([r.ttft for r in bucket if r.ok])["p99"]})
    return rows


def format_day(day: dict) -> str:
    """The day's part of the report: per-hour rows and the totals."""
    compressed = ("" if day["hour_seconds"] == 3600 else
                  f"; COMPRESSED: 1 h of the curve = {day['hour_seconds']:g} s simulated, "
                  f"at the same rates; tokens scaled x{day['compression']:g} to a real day")
    lines = [f"day (24 h, curve: {day['curve_source']}{compressed})",
             f"replicas per hour = max(1, ceil(multiplier x {day['peak_replicas']})) (per-replica "
             f"rate taken as peak / {day['peak_replicas']} = {day['per_replica_rate']:.3g} req/s)",
             f"  {'hour':>4}{'x peak':>8}{'req/s':>9}{'replicas':>10}{'requests':>10}"
             f"{'attainment':>12}{'p99 TTFT ms':>13}"]
    for row in day["hours"]:
        attainment = "-" if row["attainment"] is None else f"{row['attainment']:.1%}"
        ttft = "-" if row["p99_ttft"] is None else f"{row['p99_ttft'] * 1000:.1f}"
        lines.append(f"  {row['hour']:>4}{row['multiplier']:>8.2f}{row['rate']:>9.3g}"
                     f"{row['replicas']:>10}{row['requests']:>10}{attainment:>12}{ttft:>13}")
    attainment = "-" if day["attainment"] is None else f"{day['attainment']:.1%}"
    per_million = day["dollars_per_million_output_tokens"]
    lines.append(
        f"day total: {day['requests']} requests, attainment {attainment} | "
        f"{day['replica_hours']} replica-hours -> ${day['dollars']:.2f}/day (static peak "
        f"provisioning: {day['static_replica_hours']} replica-hours, "
        f"${day['static_dollars']:.2f}) | {day['output_tokens_per_day'] / 1e6:.2f}M output "
        f"tokens/day -> " + (f"${per_million:.3f} per 1M" if per_million is not None else "-")
        + f" | simulated {day['simulated_s']:.0f} s in {day['wall_s']:.1f} s wall")
    return "\n".join(lines)


def format_plan(doc: dict) -> str:
    """The whole plan (``carpool plan``'s document) as a readable report."""
    inputs, workload = doc["inputs"], doc["workload"]
    slo = ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in inputs["slo"].items())
    lines = [f"== capacity plan: {doc['cost_model_label']} ==",
             f"cost model: {doc['cost_model_kind']} | pool {inputs['num_blocks']} blocks x "
             f"{inputs['block_size']} tokens per replica | routing {inputs['routing']}",
             f"workload: {workload['name']}, {workload['process']} arrivals at "
             f"{inputs['peak_rate']:g} req/s (peak) | {inputs['requests_per_probe']} requests "
             f"over {inputs['window_s']:g} s per probe | mean {workload['mean_input_tokens']:.0f} "
             f"in / {workload['mean_output_tokens']:.0f} out tokens",
             f"target: {slo} for >= {inputs['attainment']:.1%} of requests", "",
             *_search_lines(doc["candidates"]), "", *_answer_lines(doc)]
    lines += [f"note: {note}" for note in doc["notes"]]
    if "day" in doc:
        lines += ["", format_day(doc["day"])]
    lines.append(f"planned in {doc['wall_s']:.1f} s wall")
    return "\n".join(lines)


def _search_lines(candidates: list[dict]) -> list[str]:
    """Each candidate's first estimate, then every probe of the search."""
    lines = ["first estimate: replicas = ceil(peak QPS x mean processing time / (per-replica "
             "capacity x utilization))"]
    for row in candidates:
        e = row["estimate"]
        processing = "-" if e["mean_processing_s"] is None else f"{e['mean_processing_s']:.3f} s"
        lines.append(f"  {row['batching']}: ceil({e['peak_rate']:g} x {processing} / "
                     f"({e['capacity']} x {e['utilization']:.2f})) = {e['replicas']} | capacity "
                     f"= min(max_num_seqs {e['max_num_seqs']}, {e['kv_tokens']} KV tokens // "
                     f"{e['mean_tokens_per_request']:.0f} tokens/request) = {e['capacity']} | "
                     f"low-load attainment {e['low_load_attainment']:.1%}")
    lines += ["", "search (doubling, then bisection; assumes attainment does not fall as "
                  "replicas are added):",
              f"  {'batching':<12}{'replicas':>9}{'attainment':>12}{'meets':>7}"
              f"{'goodput/s':>11}{'p99 TTFT ms':>13}{'p99 TPOT ms':>13}"]
    for row in candidates:
        for p in row["probes"]:
            lines.append(f"  {row['batching']:<12}{p['replicas']:>9}{p['attainment']:>12.1%}"
                         f"{'yes' if p['meets'] else 'no':>7}{p['goodput']:>11.2f}"
                         f"{_ms(p['p99_ttft']):>13}{_ms(p['p99_tpot']):>13}")
        if row.get("unreachable"):
            lines.append(f"  {row['unreachable']}")
    return lines


def _answer_lines(doc: dict) -> list[str]:
    """The answer, its confirmation against one replica less, and the cost line."""
    answer, cost = doc["answer"], doc["cost"]
    below = answer["below"]
    per_million = cost["dollars_per_million_output_tokens"]
    assumed = " (an assumed placeholder: pass --price-per-hour)" if (
        doc["inputs"]["price_is_assumption"]) else ""
    return [f"answer: {_replicas(answer['replicas'])} with {answer['batching']} "
            f"(attainment {answer['confirm']['attainment']:.1%})"
            + (f"; {_replicas(below['replicas'])}: {below['attainment']:.1%} "
               f"({'meets' if below['meets'] else 'misses'})" if below else "")
            + (" -> confirmed" if answer["confirmed"] else " -> NOT confirmed: the confirming "
               "runs disagree with the search (attainment not monotone in replicas?)"),
            f"cost: {cost['replicas']} x ${cost['price_per_replica_hour']:g} per replica-hour"
            f"{assumed} = ${cost['dollars_per_hour']:.2f}/hour | "
            f"{cost['output_tokens_per_hour'] / 1e6:.2f}M output tokens/hour at the peak -> "
            + (f"${per_million:.3f} per 1M output tokens" if per_million is not None
               else "no output tokens")]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _replicas(count: int) -> str:
    return f"{count} replica" + ("" if count == 1 else "s")
