"""Latency targets (SLOs): parsing, the calibration rule, and what a server
promises each priority class.

Pure Python, no dependencies: the config layer, the scheduler and the
benchmarks import it alike.

The rule (``carpool serve`` without an explicit ``--slo``): at start-up the
engine runs ``CALIBRATION_RUNS`` unloaded requests of a
``CALIBRATION_PROMPT_TOKENS``-token prompt and ``CALIBRATION_DECODE_TOKENS``
output tokens (after one discarded warm-up run of the same shape) and takes
the median TTFT and TPOT; the targets are

    ttft_target = max(TTFT_MULTIPLE x TTFT_unloaded, MIN_TTFT_TARGET)
    tpot_target = max(TPOT_MULTIPLE x TPOT_unloaded, MIN_TPOT_TARGET)

Why these multiples (from this project's 2-core CPU and SmolLM2-135M: a
step costs about the same per token whether it prefills or decodes, so a
128-token prompt's unloaded TTFT is several decode steps; at 0.6x capacity
over HTTP the p99 TTFT was ~0.25 s and TPOT 30-45 ms):

- TTFT x5: under load a first token waits for the step in flight, then
  rides a prefill step widened by the running decodes and often by another
  arrival's prompt, then the HTTP hop; at 0.6x capacity that is 2-2.5x the
  unloaded TTFT at p99 (0.30 s vs 0.13 s in ``carpool simulate`` with this
  machine's cost model). Five times leaves twice that for the learned
  prediction margin and the normal class's 85% share (below): replaying
  0.6x load with 3x surges of 20-60 s through the simulator, x4 still
  turned away 2-5% of the calm phase after a surge, x5 nothing, while the
  surge's admitted p99 TTFT stayed at ~0.85 of the target.
- TPOT x5: the step grows with the batch (here ~0.03 s + 2 ms per
  sequence) and, in steady state, with the prefill each decoded token
  brings along (prompt tokens per output token); at 0.6x capacity TPOT was
  ~2.5-3x unloaded. The batch limit keeps the mean step at 80% of the
  target (the balanced mode), so x5 is 4x unloaded for the mean step: room
  for the calm phase's batch with 1.5x to spare, while the batch a surge
  would build (TPOT ~0.2 s on a plain server) is refused. On a GPU the
  step is nearly flat in the batch, so x5 still allows large batches.
- Floors: a tiny or very fast model measures a TTFT of a few milliseconds,
  whose multiples would promise what no network hop keeps; targets never go
  below ``MIN_TTFT_TARGET`` (a quarter second, below which users cannot tell
  the difference) and ``MIN_TPOT_TARGET`` (25 ms, 40 tokens/s, faster than
  anyone reads). An explicit SLO is taken as given, floors do not apply.

Without a measurement (``calibrate: false``, offline use, the simulator)
"auto" targets are ``FALLBACK_TTFT`` / ``FALLBACK_TPOT``, the fixed defaults
earlier versions used.
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field

AUTO = "auto"  # a target to measure at serve start-up (else the fallback)
TTFT_MULTIPLE = 5.0
TPOT_MULTIPLE = 5.0
MIN_TTFT_TARGET = 0.25  # seconds
MIN_TPOT_TARGET = 0.025  # seconds
FALLBACK_TTFT = 2.0  # seconds
FALLBACK_TPOT = 0.2  # seconds
CALIBRATION_PROMPT_TOKENS = 128
CALIBRATION_DECODE_TOKENS = 16
CALIBRATION_RUNS = 3

# The metrics an SLO may limit (per request; a limit holds for its p99).
SLO_METRICS = ("ttft", "tpot", "e2e")
# The metrics that are also the adaptive controller's targets (``--slo``).
TARGET_METRICS = ("ttft", "tpot", "e2e")
# Those a server measures at start-up when "auto" (an E2E target depends on
# the output lengths clients ask for: only an operator can set one).
CALIBRATED_METRICS = ("ttft", "tpot")
_UNITS = {"ms": 1e-3, "s": 1.0}

# Admission: the share of the TTFT target a class may be predicted to use.
# Lower priority values are more important (high -1, normal 0, low 1). As
# load grows, predicted first tokens grow, so low arrivals are turned away
# first (at 60% of the target), then normal ones (85%), and high ones only
# when even they would miss; the headroom normal and low leave is what keeps
# high arrivals within the target when they come on top.
CLASS_SHARES = {"high": 1.0, "normal": 0.85, "low": 0.6}


def class_share(priority: int) -> float:
    """The share of the TTFT target admission allows a request of ``priority``."""
    if priority < 0:
        return CLASS_SHARES["high"]
    return CLASS_SHARES["normal"] if priority == 0 else CLASS_SHARES["low"]


def parse_duration(text: str, bare_seconds: bool = False) -> float:
    """``200ms`` or ``2s`` (or ``0.2`` when ``bare_seconds``) as seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s)?\s*", text)
    if not match:
        raise ValueError(f"cannot parse duration {text!r} (examples: 200ms, 2s)")
    if match.group(2) is None and not bare_seconds:
        raise ValueError(f"duration {text!r} needs a unit: {text.strip()}ms or {text.strip()}s")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def parse_slo(text: str, metrics: tuple[str, ...] = SLO_METRICS) -> dict[str, float]:
    """``ttft=2s,tpot=200ms`` -> ``{"ttft": 2.0, "tpot": 0.2}``: the p99 of each
    named metric must be at most the value. '' means no SLO."""
    slo: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep:
            raise ValueError(f"SLO term {part!r} is not METRIC=DURATION (e.g. tpot=200ms)")
        if name not in metrics:
            raise ValueError(f"unknown SLO metric {name!r}; use {', '.join(metrics)}")
        if name in slo:
            raise ValueError(f"SLO metric {name!r} given twice")
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            raise ValueError(f"SLO {name}: {exc}") from None
        if seconds <= 0:
            raise ValueError(f"SLO {name} must be > 0, got {value.strip()!r}")
        slo[name] = seconds
    return slo


def parse_targets(text: str) -> dict[str, float]:
    """A server's SLO, ``ttft=500ms,tpot=100ms`` (either or both): the
    controller's targets, as ``{"ttft_target": 0.5, "tpot_target": 0.1}``."""
    return {f"{name}_target": value for name, value in parse_slo(text, TARGET_METRICS).items()}


def parse_target(text: str) -> float | str:
    """One target flag: ``auto``, seconds (``0.5``) or a duration (``500ms``)."""
    if text.strip().lower() == AUTO:
        return AUTO
    return parse_duration(text, bare_seconds=True)


def slo_arg(text: str) -> str:
    """``carpool serve --slo``'s argparse type: checked now, kept as text (the
    config layer parses it as the ``slo`` key)."""
    try:
        parse_targets(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def slo_sources(args: argparse.Namespace) -> dict[str, str]:
    """Which latency targets the command line set (``{"ttft": "flag"}``);
    the rest come from a settings file or profile, or are measured."""
    given = set()
    if getattr(args, "engine_slo", None):
        given |= {key[:-len("_target")] for key in parse_targets(args.engine_slo)}
    for metric in TARGET_METRICS:
        if getattr(args, f"engine_{metric}_target", None) is not None:
            given.add(metric)
    return {metric: "flag" for metric in sorted(given)}


def calibrated_targets(ttft_unloaded: float, tpot_unloaded: float) -> tuple[float, float]:
    """The rule: (ttft_target, tpot_target) from the unloaded TTFT and TPOT."""
    return (max(TTFT_MULTIPLE * ttft_unloaded, MIN_TTFT_TARGET),
            max(TPOT_MULTIPLE * tpot_unloaded, MIN_TPOT_TARGET))


@dataclass(frozen=True)
class ServingSLO:
    """The targets a server runs with, where each came from, and the
    measurement behind calibrated ones.

    ``sources`` maps ``ttft`` / ``tpot`` to ``flag`` (``--slo`` or a target
    flag), ``config`` (``--config`` or a profile), ``calibrated`` (measured at
    start-up) or ``fallback`` (auto without a measurement).
    """

    ttft: float | None  # None: no target (set so explicitly)
    tpot: float | None
    sources: dict[str, str] = field(default_factory=dict)
    ttft_unloaded: float | None = None  # seconds, measured at start-up
    tpot_unloaded: float | None = None
    calibration_seconds: float | None = None  # what the measurement took
    # Admission's regime (``ControllerConfig.regime``): ``slo`` sheds
    # predicted TTFT misses, ``queue`` only enforces the queue bounds; and why.
    regime: str = "queue"
    regime_reason: str = ""
    e2e: float | None = None  # the operator's E2E target, if any (never measured)

    def rule(self) -> str:
        """How calibrated targets follow from the measurement (one line)."""
        return (f"target = max({TTFT_MULTIPLE:g} x unloaded TTFT, {MIN_TTFT_TARGET:g} s) and "
                f"max({TPOT_MULTIPLE:g} x unloaded TPOT, {MIN_TPOT_TARGET * 1000:g} ms), "
                f"unloaded = median of {CALIBRATION_RUNS} requests of "
                f"{CALIBRATION_PROMPT_TOKENS} prompt + {CALIBRATION_DECODE_TOKENS} output tokens")

    def describe(self) -> str:
        """The start-up line's text, e.g. ``SLO ttft 0.65 s, tpot 0.100 s (ttft
        5x the unloaded 0.130 s, tpot 5x the unloaded 0.020 s measured at
        start-up in 1.4 s)``."""
        def fmt(value: float | None, digits: int) -> str:
            return "none" if value is None else f"{value:.{digits}f} s"

        head = f"SLO ttft {fmt(self.ttft, 2)}, tpot {fmt(self.tpot, 3)}"
        if self.e2e is not None:
            head += f", e2e {fmt(self.e2e, 2)}"
        notes = []
        measured = [m for m in CALIBRATED_METRICS if self.sources.get(m) == "calibrated"]
        if measured:
            multiples = {"ttft": (TTFT_MULTIPLE, self.ttft_unloaded, MIN_TTFT_TARGET),
                         "tpot": (TPOT_MULTIPLE, self.tpot_unloaded, MIN_TPOT_TARGET)}
            parts = []
            for metric in measured:
                multiple, unloaded, floor = multiples[metric]
                if math.isclose(getattr(self, metric) or 0.0, floor):
                    parts.append(f"{metric} the floor, over {multiple:g}x the unloaded "
                                 f"{unloaded:.3f} s")
                else:
                    parts.append(f"{metric} {multiple:g}x the unloaded {unloaded:.3f} s")
            took = (f" in {self.calibration_seconds:.1f} s"
                    if self.calibration_seconds is not None else "")
            notes.append(", ".join(parts) + f" measured at start-up{took}")
        others = [f"{m} from {self.sources[m]}" for m in TARGET_METRICS
                  if self.sources.get(m) not in (None, "calibrated")]
        notes += others
        text = head + (f" ({'; '.join(notes)})" if notes else "")
        return text + (f"; admission: {self.regime} ({self.regime_reason})"
                       if self.regime_reason else "")

    def as_dict(self) -> dict:
        """JSON for ``GET /carpool/policy``."""
        return {"ttft_target": self.ttft, "tpot_target": self.tpot, "e2e_target": self.e2e,
                "sources": dict(self.sources),
                "ttft_unloaded": self.ttft_unloaded, "tpot_unloaded": self.tpot_unloaded,
                "calibration_seconds": self.calibration_seconds, "rule": self.rule(),
                "regime": self.regime, "regime_reason": self.regime_reason,
                "class_shares": dict(CLASS_SHARES)}
