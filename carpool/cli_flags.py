"""The engine and server flags of the ``carpool`` command line, their help
(defaults read from the config dataclasses, real metavars), the boolean
spellings vLLM users type, and settings files written with flag names.

Every flag's argparse default is None: a flag given on the command line is
one that is not None, which is what lets flags win over ``--config`` and a
profile (see ``carpool.cli.engine_config_from_args``).
"""
from __future__ import annotations

import argparse
import dataclasses
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from carpool.cluster.fleet_config import FleetConfig
from carpool.config import (
    DESIGN_SECTION,
    CacheConfig,
    ControllerConfig,
    EngineConfig,
    SchedulerConfig,
    design_section,
)
from carpool.model_settings import ModelSettings
from carpool.server.config import ServerConfig
from carpool.settings_fields import (  # noqa: F401
    FlagSpec,
    flag_bool,
    flag_bool_or_auto,
    flag_fields,
    register_flag,
    setting,
)
from carpool.slo import slo_arg


@dataclass(frozen=True)
class Flag:
    """One flag: its spelling, the config field it sets, how its value parses.

    ``kind`` is ``bool`` for a switch (``--x`` / ``--no-x``, no value: it
    cannot swallow the positional after it) and ``flag_bool`` for a boolean
    that also takes a value (``--x``, ``--x false``, ``--no-x``).
    ``aliases``: other spellings (each gets its ``--no-`` form too).
    """

    flag: str
    key: str
    kind: Callable[[str], Any]
    metavar: str | None
    help: str
    aliases: tuple[str, ...] = ()
    nargs: str | None = None


def _flags_of(*classes: type) -> list[Flag]:
    """The flags the config dataclasses' fields declare (``settings_fields``)."""
    return [Flag(spec.flag, name, spec.parse, spec.metavar, spec.help, spec.aliases, spec.nargs)
            for cls in classes for name, spec in flag_fields(cls)]


@dataclass
class SettingsSources:
    """What the command line adds besides the config dataclasses' fields:
    the settings files under the flags, and the latency targets' shorthand
    (``slo:`` in a settings file, the controller's targets)."""

    config: str | None = setting(
        None, "--config", "FILE",
        "YAML settings file: carpool's sections or vLLM's flat flag names (max-num-seqs: 64); "
        "flags given override it")
    profile: str | None = setting(
        None, "--profile", "NAME|FILE",
        "settings profile: a built-in name or a YAML file (flags override it)")
    slo: str | None = setting(
        None, "--slo", "ttft=500ms,tpot=100ms,e2e=2s",
        "latency targets for admitted requests (p99): the controller keeps them and sheds what "
        "would miss the TTFT one (429); default: measured at start-up, steering the batching "
        "without shedding, see docs/server/scheduling.md#adaptive-controller", parse=slo_arg)


def sources_flag(name: str) -> FlagSpec:
    """``SettingsSources``' flag of field ``name``."""
    return dict(flag_fields(SettingsSources))[name]


# Engine and server flags: declared once, on their config fields.
ENGINE_FLAGS: list[Flag] = [
    *_flags_of(ModelSettings, CacheConfig, SchedulerConfig, ControllerConfig),
    Flag("--max-batch-tokens", "max_batch_tokens", int, "N", "same as --max-num-batched-tokens"),
]
# ServerConfig inherits the fleet's (FleetConfig: shared with `carpool simulate`).
# The list-valued ones (--cors-origins A B ...) apart: the tables' flags take one value.
SERVER_FLAGS: list[Flag] = [f for f in _flags_of(ServerConfig) if f.nargs is None]
SERVER_LIST_FLAGS: list[Flag] = [f for f in _flags_of(ServerConfig) if f.nargs is not None]
FLEET_FLAGS: list[Flag] = _flags_of(FleetConfig)


def engine_defaults() -> dict[str, Any]:
    """Every engine knob's default, by field name, from the dataclasses."""
    config = EngineConfig()
    return {f.name: getattr(section, f.name)
            for section in (config.model, config.cache, config.scheduler, config.controller)
            for f in dataclasses.fields(section)}


def server_defaults() -> dict[str, Any]:
    """Every server setting's default, by field name, from ``ServerConfig``."""
    config = ServerConfig()
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _help(flag: Flag, defaults: dict[str, Any]) -> str:
    """The flag's help with ``(default: X)`` from the dataclass, unless the
    default is None (the help says what unset means) or the help gives one."""
    default = defaults.get("max_num_batched_tokens" if flag.key == "max_batch_tokens"
                           else flag.key)
    text = flag.help
    if default is not None and default != [] and "(default" not in text:
        text += f" (default: {_shown(default)})"
    return text.replace("%", "%%")  # argparse %-formats help strings


def add_flags(group, flags: Iterable[Flag], prefix: str, defaults: dict[str, Any]) -> None:
    """Register ``flags`` on ``group``, each with ``dest=prefix + key`` and
    default None; every boolean also gets its ``--no-`` spelling."""
    for flag in flags:
        spec = FlagSpec(flag.flag, flag.metavar, flag.help, flag.kind, flag.aliases,
                        nargs=flag.nargs)
        register_flag(group, spec, prefix + flag.key, None, _help(flag, defaults))


class HelpFormatter(argparse.HelpFormatter):
    """Defaults shown, a boolean's ``--no-x`` on its ``--x`` line, and a
    short usage line (``prog [options] POSITIONALS``) where the flags are many."""

    def _get_help_string(self, action: argparse.Action) -> str:
        """Flags outside these tables with an argparse default show it too."""
        text = action.help or ""
        default = action.default
        shown = not (default is None or default is False or default is argparse.SUPPRESS
                     or (isinstance(default, (str, list, tuple, dict)) and not default))
        if shown and action.option_strings and "default" not in text.lower():
            text += " (default: %(default)s)"
        return text

    def _format_action_invocation(self, action: argparse.Action) -> str:
        text = super()._format_action_invocation(action)
        return ", ".join([text, *getattr(action, "negative_flags", ())])

    def add_usage(self, usage, actions, groups, prefix=None) -> None:  # noqa: ANN001
        actions = list(actions)
        if usage is None and sum(1 for a in actions if a.option_strings) > 6:
            positionals = [self._format_args(a, self._get_default_metavar_for_positional(a))
                           for a in actions if not a.option_strings]
            usage = " ".join(["%(prog)s [options]", *positionals])
        super().add_usage(usage, actions, groups, prefix)


class TopHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """``carpool --help``: the description's command list is laid out already."""


def _summary(help_text: str | None) -> str:
    """A sub-command's help cut to one line: up to its first ``;`` or ``(``."""
    text = " ".join((help_text or "").split())
    for mark in ("; ", " ("):
        text = text.split(mark)[0]
    return text


def command_summaries(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, str]]:
    """(``name``, one-line summary) of every sub-command, nested ones as
    ``bench serve``, in the order they were added."""
    rows = []
    # argparse keeps the sub-commands and their help only on its private
    # sub-parsers action; nothing public lists them.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                rows.append((prefix + choice.dest, _summary(choice.help)))
                rows += command_summaries(action.choices[choice.dest], f"{prefix}{choice.dest} ")
    return rows


def describe_commands(parser: argparse.ArgumentParser, about: str) -> str:
    """``about``, then every sub-command with its one-line summary (plain text)."""
    rows = command_summaries(parser)
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"  {name:<{width}}{summary}" for name, summary in rows]
    return "\n".join([*textwrap.wrap(about, 79), "", "commands:", *lines])


# -- settings files written with flag names (vLLM's flat YAML) -----------------------

_SECTIONS = {f.name for f in dataclasses.fields(EngineConfig)}


def _file_keys() -> dict[str, tuple[str, str, Callable[[str], Any]]]:
    """Flat file key (underscores) -> (``engine`` | ``server``, field, parser)."""
    keys: dict[str, tuple[str, str, Callable[[str], Any]]] = {}
    for side, names in (("engine", engine_defaults()), ("server", server_defaults())):
        keys.update({name: (side, name, str) for name in names})
    keys["slo"] = ("engine", "slo", str)
    for side, flags in (("engine", ENGINE_FLAGS), ("server", SERVER_FLAGS)):
        for flag in flags:
            kind = flag_bool if flag.kind is bool else flag.kind
            for name in (flag.flag, *flag.aliases):
                keys[name[2:].replace("-", "_")] = (side, flag.key, kind)
    return keys


def _file_value(value: Any, parse: Callable[[str], Any], label: str) -> Any:
    """A text value parsed as its flag would be (``"64"``, ``"false"``, ``"500ms"``)."""
    if not isinstance(value, str) or parse is str:
        return value
    try:
        return parse(value)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{label}: {exc}") from None


def file_settings(data: dict[str, Any], source: str) -> dict[str, Any]:
    """A ``--config`` file's mapping in carpool's layered form: engine keys
    (flat, or in the ``model``/``cache``/``scheduler``/``controller``
    sections) and a ``server`` section.

    Keys may be written as vLLM writes its config files, the flag names
    without ``--`` (``max-num-seqs: 64``, ``served-model-name: x``), with
    dashes or underscores; flat server keys join the ``server`` section.
    An unknown key is an error naming it.
    """
    known = _file_keys()
    engine: dict[str, Any] = {}
    server: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key in _SECTIONS | {"server"} and isinstance(value, dict):
            section = {str(k).replace("-", "_"): v for k, v in value.items()}
            if key == "server":
                server.update(section)
            else:
                engine.setdefault(key, {}).update(section)
            continue
        if key == DESIGN_SECTION:  # the design's template, as written
            try:
                engine.update(design_section(value))
            except ValueError as exc:
                raise ValueError(f"{source}: {exc}") from None
            continue
        if key == "server":
            raise ValueError(f"{source}: the 'server' section must be a mapping")
        if key not in known:
            raise ValueError(f"{source}: unknown config key {raw_key!r}")
        side, name, parse = known[key]
        value = _file_value(value, parse, f"{source}: {raw_key}")
        (engine if side == "engine" else server)[name] = value
    return {**engine, "server": server} if server else engine
