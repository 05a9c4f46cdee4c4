"""Time-of-day schedules in a profile: windows that change scheduler knobs.

A profile may carry a ``schedule:`` list next to its sections::

    schedule:
      - name: peak
        from: "09:00"       # inclusive
        to: "11:00"         # exclusive
        scheduler: {max_num_seqs: 32}

Semantics:

- A window is active at wall-clock time ``t`` when ``from <= t < to``; one
  with ``from > to`` wraps midnight (``22:00``-``06:00`` is active from
  22:00 until just before 06:00). ``to: "24:00"`` means midnight.
- Times are strings ``"HH:MM"`` or ``"HH:MM:SS"``. Quote them: YAML reads
  an unquoted ``11:00`` as the number 660, which is rejected.
- Windows may not overlap (touching is fine: ``09:00-11:00`` and
  ``11:00-13:00``), so at most one is active; ``from == to`` is rejected.
- Only ``scheduler:`` knobs can change by time of day: they are the ones a
  running engine can re-apply at a boundary (``next_change``). Outside
  every window the profile's base settings hold.
- Precedence for one knob: flags > ``--config`` > the active window >
  the profile's base > defaults.

Pure Python (no torch), no global state: every function takes the time of
day from its caller.
"""
from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, time
from typing import Any

from carpool.config import SchedulerConfig
from carpool.scheduler.control.live_settings import check_live

DAY = 24 * 3600
_TIME = re.compile(r"([01]?[0-9]|2[0-4]):([0-5][0-9])(?::([0-5][0-9]))?")
_WINDOW_KEYS = {"name", "from", "to", "scheduler"}
_SCHEDULER_KNOBS = {f.name for f in dataclasses.fields(SchedulerConfig)}


def parse_clock(value: Any, label: str = "time") -> int:
    """Seconds since midnight of ``"HH:MM"`` / ``"HH:MM:SS"``; ``"24:00"`` is 86400."""
    match = _TIME.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        hint = (" (quote it: YAML reads an unquoted 11:00 as the number 660)"
                if isinstance(value, int) and not isinstance(value, bool) else "")
        raise ValueError(f"{label}: cannot read {value!r} as a time of day "
                         f"(a string 'HH:MM' or 'HH:MM:SS', 00:00 to 24:00){hint}")
    hours, minutes, seconds = int(match[1]), int(match[2]), int(match[3] or 0)
    if hours == 24 and (minutes or seconds):
        raise ValueError(f"{label}: {value!r} is past 24:00")
    return hours * 3600 + minutes * 60 + seconds


def clock_of(t: time | datetime) -> int:
    """Whole seconds since midnight of a wall-clock time (a datetime's own time)."""
    if isinstance(t, datetime):
        t = t.time()
    return t.hour * 3600 + t.minute * 60 + t.second


def _hhmm(seconds: int) -> str:
    h, rest = divmod(seconds % DAY, 3600)
    m, s = divmod(rest, 60)
    return f"{h:02d}:{m:02d}" + (f":{s:02d}" if s else "")


@dataclass(frozen=True)
class Window:
    """One schedule entry: ``[start, end)`` in seconds since midnight
    (``start > end`` wraps midnight) and the scheduler knobs it sets."""

    name: str
    start: int
    end: int
    scheduler: dict[str, Any] = field(default_factory=dict)

    def contains(self, t: time | datetime) -> bool:
        """Whether the window is active at ``t`` (start inclusive, end exclusive)."""
        s = clock_of(t)
        if self.start < self.end:
            return self.start <= s < self.end
        return s >= self.start or s < self.end

    def spans(self) -> list[tuple[int, int]]:
        """The window as one or two non-wrapping ``[a, b)`` ranges within a day."""
        if self.start < self.end:
            return [(self.start, self.end)]
        return [(self.start, DAY), (0, self.end)] if self.end else [(self.start, DAY)]

    def describe(self) -> str:
        """``"09:00-11:00"``."""
        return f"{_hhmm(self.start)}-{_hhmm(self.end)}"


def _require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok`` (the CLI reports ValueError as one line)."""
    if not ok:
        raise ValueError(message)


def _parse_window(entry: Any, index: int) -> Window:
    _require(isinstance(entry, Mapping),
             f"schedule[{index}] must be a mapping with name, from, to, scheduler")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"schedule[{index}] needs a non-empty 'name'")
    label = f"schedule window {name!r}"
    unknown = sorted(set(entry) - _WINDOW_KEYS)
    if unknown:
        raise ValueError(f"{label}: unknown key(s) {', '.join(map(str, unknown))}; a window has "
                         f"name, from, to and a 'scheduler' section (only scheduler knobs can "
                         f"change by time of day)")
    for key in ("from", "to"):
        if key not in entry:
            raise ValueError(f"{label} needs '{key}' (a time 'HH:MM')")
    start = parse_clock(entry["from"], f"{label} 'from'")
    end = parse_clock(entry["to"], f"{label} 'to'")
    if start == DAY:
        raise ValueError(f"{label}: 'from' cannot be 24:00 (use 00:00)")
    end %= DAY
    if start == end:
        raise ValueError(f"{label}: 'from' and 'to' are both {_hhmm(start)}; a window must "
                         f"cover part of the day (the base settings cover the rest)")
    knobs = entry.get("scheduler") or {}
    _require(isinstance(knobs, Mapping), f"{label}: 'scheduler' must be a mapping of knobs")
    bad = sorted(k for k in knobs if k not in _SCHEDULER_KNOBS)
    if bad:
        raise ValueError(f"{label}: unknown scheduler knob(s) {', '.join(map(str, bad))}")
    try:
        check_live(knobs)  # a window opens while the server runs
    except ValueError as exc:
        raise ValueError(f"{label}: {exc}") from None
    return Window(name, start, end, dict(knobs))


def parse_schedule(entries: Any) -> list[Window]:
    """Validate a profile's ``schedule:`` list into windows sorted by start.

    Raises ``ValueError`` for a malformed entry, a bad time, an unknown key
    or knob, a duplicate name or two windows that overlap.
    """
    if entries is None:
        return []
    _require(isinstance(entries, list),
             "'schedule' must be a list of windows (name, from, to, scheduler)")
    windows = [_parse_window(entry, i) for i, entry in enumerate(entries)]
    names = [w.name for w in windows]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ValueError(f"schedule: two windows are named {duplicate!r}")
    for i, first in enumerate(windows):
        for second in windows[i + 1:]:
            if any(a1 < b2 and a2 < b1 for a1, b1 in first.spans() for a2, b2 in second.spans()):
                raise ValueError(f"schedule windows {first.name!r} ({first.describe()}) and "
                                 f"{second.name!r} ({second.describe()}) overlap")
    return sorted(windows, key=lambda w: w.start)


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else in ``over`` wins."""
    merged = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


class ProfileSchedule:
    """A profile's base settings and its parsed windows.

    For the live controller: ``overrides_at(when)`` gives the scheduler
    knobs the active window sets (minus ``pinned`` knobs, which flags or
    ``--config`` fixed); ``baseline`` holds what those knobs are outside
    every window, to restore when a window ends; ``next_change(t)`` says
    when to look again.
    """

    def __init__(self, base: Mapping[str, Any], windows: Sequence[Window],
                 pinned: Iterable[str] = ()) -> None:
        self.base = {k: v for k, v in base.items() if k != "schedule"}
        self.windows = list(windows)
        self.pinned = frozenset(pinned)
        self.baseline = self._baseline()
        self.source: dict[str, Any] | None = None

    @classmethod
    def from_profile(cls, profile: Mapping[str, Any],
                     pinned: Iterable[str] = ()) -> ProfileSchedule:
        """Parse and check a profile: every window's knobs, applied to the
        base, must make a valid ``SchedulerConfig`` (checked now, not when
        the window opens)."""
        schedule = cls(profile, parse_schedule(profile.get("schedule")), pinned)
        schedule.source = dict(profile)  # what rebuilds it in an engine worker process
        for window in schedule.windows:
            try:
                schedule._scheduler_config(window).validate()
            except ValueError as exc:
                raise ValueError(f"schedule window {window.name!r}: {exc}") from None
        return schedule

    def _scheduler_config(self, window: Window | None) -> SchedulerConfig:
        config = SchedulerConfig()
        section = self.base.get("scheduler") or {}
        section = section if isinstance(section, Mapping) else {}
        flat = {k: v for k, v in self.base.items() if k in _SCHEDULER_KNOBS}
        for key, value in {**flat, **section, **(window.scheduler if window else {})}.items():
            if key in _SCHEDULER_KNOBS:
                setattr(config, key, value)
        return config

    def _baseline(self) -> dict[str, Any]:
        base = self._scheduler_config(None)
        return {knob: getattr(base, knob) for knob in self.knobs()}

    def knobs(self) -> list[str]:
        """Scheduler knobs some window sets and nothing pins, sorted."""
        return sorted({k for w in self.windows for k in w.scheduler} - self.pinned)

    def active(self, t: time | datetime) -> Window | None:
        """The window active at ``t``, or None."""
        return next((w for w in self.windows if w.contains(t)), None)

    def next_change(self, t: time | datetime) -> time | None:
        """The first window boundary strictly after ``t`` (tomorrow's if none
        is left today); None without windows."""
        if not self.windows:
            return None
        now = clock_of(t)
        bounds = {b for w in self.windows for b in (w.start, w.end)}
        seconds = min(bounds, key=lambda b: (b - now - 1) % DAY)
        return time(seconds // 3600, seconds // 60 % 60, seconds % 60)

    def settings_at(self, t: time | datetime) -> dict[str, Any]:
        """The base settings with the active window's knobs merged in (no
        ``schedule`` key): a layer for ``EngineConfig.update``."""
        window = self.active(t)
        if window is None:
            return copy.deepcopy(self.base)
        # A flat top-level knob in the base would otherwise compete with the section.
        base = {k: v for k, v in self.base.items() if k not in window.scheduler}
        return _merge(base, {"scheduler": window.scheduler})

    def overrides_at(self, when: datetime) -> dict[str, Any]:
        """Flat scheduler knobs the window active at ``when`` (its wall-clock
        time as given; a naive datetime is local time) sets, minus pinned
        ones; empty outside every window (then ``baseline`` applies)."""
        window = self.active(when)
        if window is None:
            return {}
        return {k: v for k, v in window.scheduler.items() if k not in self.pinned}

    def knobs_at(self, when: datetime) -> dict[str, Any]:
        """Every scheduled knob's value at ``when``: ``baseline`` with the
        active window's overrides on top (apply it whole at each change)."""
        return {**self.baseline, **self.overrides_at(when)}


def settings_at(profile: Mapping[str, Any], t: time | datetime) -> dict[str, Any]:
    """A profile's settings at wall-clock time ``t``: its base with the
    active window's overrides merged deeply, ``schedule`` removed."""
    return ProfileSchedule.from_profile(profile).settings_at(t)


def active_window(profile: Mapping[str, Any], t: time | datetime) -> Window | None:
    """The profile's window active at ``t``, or None."""
    return ProfileSchedule.from_profile(profile).active(t)


def next_change(profile: Mapping[str, Any], t: time | datetime) -> time | None:
    """When the profile's active window next changes after ``t``; None without windows."""
    return ProfileSchedule.from_profile(profile).next_change(t)
