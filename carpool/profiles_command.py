"""``carpool profiles``: list the built-in profiles, or show one resolved.

``carpool profiles`` prints each built-in profile with its description (the
file's first comment line), the knobs it sets and its schedule windows;
``carpool profiles NAME`` prints the settings NAME resolves to now (or
``--at HH:MM``) as YAML, with the window active then.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from datetime import datetime, time
from typing import Any, TextIO

from carpool.profiles import describe, list_profiles, load_profile
from carpool.profiles.schedule import ProfileSchedule, Window, parse_clock
from carpool.settings_fields import add_setting_args, setting


def _clock(value: str) -> time:
    try:
        seconds = parse_clock(value, "time") % (24 * 3600)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return time(seconds // 3600, seconds // 60 % 60, seconds % 60)


@dataclass
class ProfilesOptions:
    at: time | None = setting(None, "--at", "HH:MM",
                              "resolve at this local time of day instead of now", parse=_clock)


def add_profiles_args(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``carpool profiles``."""
    parser.add_argument("name", nargs="?", default=None,
                        help="show this profile (built-in name or YAML file) resolved as YAML")
    add_setting_args(parser, ProfilesOptions)


def _knobs(mapping: dict[str, Any]) -> str:
    return " ".join(f"{k}={_scalar(v)}" for k, v in mapping.items())


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _window_line(window: Window) -> str:
    return f"{window.name} {window.describe()}: {_knobs(window.scheduler)}"


def _list(out: TextIO) -> None:
    names = list_profiles()
    width = max(len(n) for n in names)
    for name in names:
        profile = load_profile(name)
        schedule = ProfileSchedule.from_profile(profile)
        print(f"{name:<{width}}  {describe(name)}", file=out)
        for section, values in schedule.base.items():
            if isinstance(values, dict):
                print(f"{'':<{width}}    {section}: {_knobs(values)}", file=out)
            else:
                print(f"{'':<{width}}    {section}={_scalar(values)}", file=out)
        for window in schedule.windows:
            print(f"{'':<{width}}    schedule {_window_line(window)}", file=out)


def _check(settings: dict[str, Any]) -> None:
    """The settings must build a valid EngineConfig and ServerConfig."""
    from carpool.config import EngineConfig
    from carpool.server.config import ServerConfig

    EngineConfig.from_dict({k: v for k, v in settings.items() if k != "server"}).validate()
    server = ServerConfig()
    for key, value in (settings.get("server") or {}).items():
        if not hasattr(server, key):
            raise ValueError(f"unknown config key 'server.{key}'")
        setattr(server, key, value)
    server.validate()


def _show(name: str, at: time, out: TextIO) -> None:
    import yaml

    schedule = ProfileSchedule.from_profile(load_profile(name))
    settings = schedule.settings_at(at)
    _check(settings)
    print(f"# profile {name}: {describe(name)}", file=out)
    for window in schedule.windows:
        print(f"# schedule {_window_line(window)}", file=out)
    clock = at.strftime("%H:%M")
    active = schedule.active(at)
    change = schedule.next_change(at)
    if active is not None:
        print(f"# at {clock}: window {active.name!r} is active "
              f"(until {change.strftime('%H:%M')})", file=out)
    elif change is not None:
        print(f"# at {clock}: no window is active (next change at {change.strftime('%H:%M')})",
              file=out)
    print(yaml.safe_dump(settings, sort_keys=False, default_flow_style=False), end="", file=out)


def run_profiles(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``carpool profiles [NAME] [--at HH:MM]``; raises ``ValueError`` for a bad profile."""
    out = out or sys.stdout
    if args.name is None:
        _list(out)
    else:
        _show(args.name, args.at or datetime.now().time(), out)
    return 0
