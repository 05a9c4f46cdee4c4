"""Real step timings as data: record them, read them back, and say how well
a cost model prices them by step kind and batch region.

``carpool fidelity`` prints both summaries of its real steps
(``step_error_line``, ``errors_by_region``) and with ``--steps-out FILE``
writes them (gzipped JSON lines: the ``StepShape`` fields, ``seconds`` and
``idle_s``, the idle gap before the step, and ``new_shape``; files without
them read as 0 and false),
so that tests can judge a cost model's form on the shapes real traffic
produces, with no live timing (tests/test_measure_steps.py).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import statistics
from pathlib import Path

from carpool.executor.shapes import StepSample, StepShape, as_samples

# Batch regions (sequences in the step) the error is reported by.
SEQ_REGIONS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, None))


def step_kind(shape: StepShape) -> str:
    """``decode`` (no prompt tokens), ``prefill`` (no decodes) or ``mixed``."""
    if not shape.prefill_tokens:
        return "decode"
    return "mixed" if shape.decode_seqs else "prefill"


def seq_region(shape: StepShape) -> str:
    for low, high in SEQ_REGIONS:
        if shape.seqs >= low and (high is None or shape.seqs <= high):
            return (f"{low}" if low == high else f"{low}+" if high is None
                    else f"{low}-{high}") + " seqs"
    return "0 seqs"


def predicted_seconds(cost, sample: StepSample) -> float:
    """What ``cost`` charges for a timed step: its shape after its idle gap."""
    return cost.step_seconds(sample.shape) + cost.extra_seconds(
        sample.shape.tokens, sample.idle_s, sample.new_shape)


def save_steps(samples: list[StepSample], path: str | Path) -> Path:
    """Write timed steps as gzipped JSON lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for shape, seconds, idle_s, new_shape in as_samples(samples):
            f.write(json.dumps({**dataclasses.asdict(shape), "seconds": seconds,
                                "idle_s": idle_s, "new_shape": new_shape}) + "\n")
    return path


def load_steps(path: str | Path) -> list[StepSample]:
    """Samples written by ``save_steps``."""
    names = [f.name for f in dataclasses.fields(StepShape)]
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            out.append(StepSample(StepShape(**{name: int(row[name]) for name in names}),
                                  float(row["seconds"]), float(row.get("idle_s", 0.0)),
                                  bool(row.get("new_shape", False))))
    return out


def errors_by_region(samples: list[StepSample], cost) -> dict[str, dict]:
    """{"<kind>, <region>": {"steps", "median", "p90_abs"}} of the relative
    error predicted / measured - 1, over the kind and batch regions present."""
    groups: dict[str, list[float]] = {}
    for sample in as_samples(samples):
        key = f"{step_kind(sample.shape)}, {seq_region(sample.shape)}"
        groups.setdefault(key, []).append(predicted_seconds(cost, sample) / sample.seconds - 1)
    out = {}
    for key in sorted(groups):
        errors = sorted(groups[key])
        absolute = sorted(abs(e) for e in errors)
        out[key] = {"steps": len(errors), "median": statistics.median(errors),
                    "p90_abs": absolute[min(len(absolute) - 1, int(len(absolute) * 0.9))]}
    return out


def format_errors_by_region(table: dict[str, dict]) -> str:
    lines = [f"{'step kind, batch':<26}{'steps':>7}{'median':>9}{'p90 |err|':>11}"]
    lines += [f"{key:<26}{row['steps']:>7}{row['median']:>+9.1%}{row['p90_abs']:>11.1%}"
              for key, row in table.items()]
    return "\n".join(lines)


def step_error_line(samples: list[StepSample], cost) -> str:
    """How well ``cost`` priced the steps: median and p90 of |predicted /
    measured - 1|, the median error by kind, and the total of each (the busy
    time)."""
    if not samples:
        return "no steps ran"
    samples = as_samples(samples)
    predicted = [predicted_seconds(cost, sample) for sample in samples]
    errors = [p / sample.seconds - 1 for p, sample in zip(predicted, samples)]
    absolute = sorted(abs(e) for e in errors)
    by_kind: dict[str, list[float]] = {}
    for sample, error in zip(samples, errors):
        by_kind.setdefault(step_kind(sample.shape), []).append(error)
    kinds = ", ".join(f"{kind} {statistics.median(errs):+.1%} ({len(errs)})"
                      for kind, errs in sorted(by_kind.items()))
    return (f"cost model on the {len(samples)} real steps: |error| median "
            f"{absolute[len(absolute) // 2]:.1%}, p90 {absolute[int(len(absolute) * 0.9)]:.1%}; "
            f"median error by kind: {kinds}; busy time measured "
            f"{sum(sample.seconds for sample in samples):.1f} s, predicted {sum(predicted):.1f} s")
