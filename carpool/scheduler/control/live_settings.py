"""Scheduler settings that may change while requests run (time-of-day
profile schedules apply them at window boundaries).

Pure Python. Only knobs that every component reads live are allowed: the
others are copied at start-up (queue lanes, the batch gate's buckets) and
changing them mid-flight would leave the scheduler inconsistent.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from carpool.scheduler.control.controller import LiveKnobs

LIVE_SETTINGS = frozenset({
    "max_num_seqs", "max_num_batched_tokens", "preferred_batch_size", "max_batch_size",
    "max_wait", "max_queue_requests", "max_queue_tokens", "queue_timeout",
    "long_prefill_share", "session_ttl", "predictive_shedding", "batching",
})
_KNOBS = {f.name for f in dataclasses.fields(LiveKnobs)}


def check_live(names) -> None:
    """``ValueError`` naming any setting that cannot change while running."""
    fixed = sorted(set(names) - LIVE_SETTINGS)
    if fixed:
        raise ValueError(f"{', '.join(fixed)} cannot change while the server runs; "
                         f"a schedule window may set: {', '.join(sorted(LIVE_SETTINGS))}")


def apply_live_settings(scheduler, values: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Set ``values`` on a running scheduler; return {name: (old, new)} of what changed.

    The new settings are validated as a whole first, so a bad value changes
    nothing. Without a controller the live knobs take the new values at
    once; with one, they become its caps (the knobs are clamped to them now
    and retuned at its next tick).
    """
    check_live(values)
    config = scheduler.config
    dataclasses.replace(config, **values).validate()
    changed = {k: (getattr(config, k), v) for k, v in values.items() if getattr(config, k) != v}
    for name, (_, new) in changed.items():
        setattr(config, name, new)  # the same object admission and the controller read
    scheduler.sessions.ttl = config.session_ttl
    if "batching" in changed:
        scheduler.set_batching(config.batching)
    knobs = scheduler.knobs
    if scheduler.controller is None:
        for name in _KNOBS & set(changed):
            setattr(knobs, name, getattr(config, name))
    else:
        knobs.max_num_seqs = min(knobs.max_num_seqs, config.max_num_seqs)
        knobs.max_num_batched_tokens = min(knobs.max_num_batched_tokens,
                                           config.max_num_batched_tokens)
        knobs.max_batch_size = min(knobs.max_batch_size, config.max_batch_size)
        knobs.preferred_batch_size = min(knobs.preferred_batch_size, knobs.max_batch_size)
    return changed
