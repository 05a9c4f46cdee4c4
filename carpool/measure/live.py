"""``carpool measure --from URL``: fit the simulator's cost model on the
steps a live carpool server really ran.

The server logs the shape and wall time of its recent steps
(``carpool.engine.step_log``, ``GET /carpool/steps``, operator keys only).
Fitting on them prices the shapes real traffic produces, on the machine
serving it, as it runs now; a grid measured earlier misses both (issue 16:
the machine's speed drifted by 25-70% within 90 minutes). The fit is the
same as the grid's (``carpool.sim.fitted.fit``); its error is printed by
step kind and batch region, and a kind the log lacks is named, since the
fit then extrapolates to it.
"""
from __future__ import annotations

import platform
from datetime import datetime, timezone

from carpool.executor.shapes import StepSample, StepShape
from carpool.measure.steps import errors_by_region, format_errors_by_region, step_kind
from carpool.sim.fitted import FittedCostModel, fit

MIN_LIVE_STEPS = 64  # fewer steps than this say too little about a machine
KINDS = ("decode", "mixed", "prefill")
_SHAPE_FIELDS = ("prefill_tokens", "decode_seqs", "context_tokens", "seqs", "attention_pairs")


def server_root(url: str) -> str:
    """``http://host:port`` from a server URL, with or without ``/v1``."""
    root = url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def fetch_steps(url: str, api_key: str | None, limit: int | None = None,
                timeout: float = 30.0) -> dict:
    """The server's step log document; ``ValueError`` saying why not."""
    import httpx

    params = {"limit": str(limit)} if limit else {}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    where = server_root(url) + "/carpool/steps"
    try:
        response = httpx.get(where, params=params, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {where}: {exc}") from None
    if response.status_code != 200:
        try:
            detail = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            detail = response.text[:200]
        raise ValueError(f"{where} answered {response.status_code}: {detail}")
    return response.json()


def samples_of(document: dict) -> list[StepSample]:
    """The timed steps of a step log document; each one's idle gap is the
    time from the end of the step its replica logged before it to its own
    start (0 for a replica's first, or where the log has no start times:
    a fleet's log interleaves its replicas' steps, each row tagged with
    ``replica``); ``new_shape`` as the server logged it (false where it
    did not)."""
    out = []
    last_end: dict[str | None, float | None] = {}  # replica -> end of its last step
    for index, row in enumerate(document.get("steps", [])):
        try:
            shape = StepShape(**{name: int(row[name]) for name in _SHAPE_FIELDS})
            seconds = float(row["seconds"])
            started = row.get("started")
            started = None if started is None else float(started)
            new_shape = bool(row.get("new_shape", False))
            replica = row.get("replica")
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"step {index} of the log is malformed: {row!r}") from None
        before = last_end.get(replica)
        idle = 0.0 if started is None or before is None else max(0.0, started - before)
        last_end[replica] = None if started is None else started + seconds
        if seconds > 0:
            out.append(StepSample(shape, seconds, idle, new_shape))
    return out


def fit_live(document: dict, url: str) -> tuple[FittedCostModel, list[str]]:
    """The cost model fitted on a step log document, and notes (kinds the
    log lacks). ``ValueError`` when the log holds too few steps."""
    samples = samples_of(document)
    if len(samples) < MIN_LIVE_STEPS:
        raise ValueError(f"the server logged {len(samples)} steps; a fit needs at least "
                         f"{MIN_LIVE_STEPS}: send it some traffic first (or run "
                         "`carpool measure` without --from on this machine)")
    counts = {kind: 0 for kind in KINDS}
    for sample in samples:
        counts[step_kind(sample.shape)] += 1
    notes = [f"the log holds no {kind} steps: the fit extrapolates to them"
             for kind, count in counts.items() if not count]
    model = fit(samples, _meta(document, url, samples, counts))
    model.meta["errors_by_region"] = errors_by_region(samples, model)
    return model, notes


def _meta(document: dict, url: str, samples, counts: dict[str, int]) -> dict:
    machine = document.get("machine") or {}
    starts = [row.get("started") for row in document.get("steps", [])
              if isinstance(row.get("started"), (int, float))]
    return {
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": {"machine": machine.get("arch", platform.machine()),
                     "processor": machine.get("cpu_model"), "cpus": machine.get("cpus"),
                     "torch": machine.get("torch"), "device": machine.get("device")},
        "machine": machine or None,
        **{key: document.get(key) for key in ("model", "dtype", "kv_bytes_per_token",
                                              "max_model_len", "max_num_batched_tokens",
                                              "max_num_seqs")},
        # Steps logged before servers padded rows ran exact rows.
        "row_bucket": document.get("row_bucket", 1),
        "grid": "live server",
        "source": {"server": server_root(url), "steps": len(samples), "by_kind": counts,
                   "span_s": (max(starts) - min(starts)) if starts else None,
                   "total_steps_logged": document.get("total_steps")}}


def format_live_fit(model: FittedCostModel, notes: list[str]) -> str:
    source = model.meta["source"]
    kinds = ", ".join(f"{kind} {count}" for kind, count in source["by_kind"].items())
    span = source["span_s"]
    lines = [f"fitted on {source['steps']} steps of {source['server']} ({kinds}"
             + (f"; over {span:.0f} s)" if span is not None else ")")]
    lines.append(format_errors_by_region(model.meta["errors_by_region"]))
    lines += [f"note: {note}" for note in notes]
    return "\n".join(lines)
