"""Settings declared once: a config dataclass field carries its own flag.

``setting(default, "--flag", "METAVAR", "help")`` is a ``dataclasses.field``
whose metadata holds the flag's spelling, metavar, help, value parser and
aliases (``FlagSpec``); ``flag_fields`` lists a dataclass's flagged
fields in declaration order, and ``carpool.cli_flags`` builds every
command's engine and server flags from them. Plain Python, no argparse
objects kept: the value parsers are functions (``flag_bool`` and
``flag_bool_or_auto`` for booleans that also take a value).

``add_setting_args`` registers a dataclass's flags on an argparse group
with the fields' own defaults (the commands that are not layered over a
settings file: simulate, evaluate, bench, measure, tune, ...) and
``values_from_args`` reads them back into the dataclass.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FLAG = "carpool.flag"  # the metadata key


def flag_bool(value: str) -> bool:
    """A true/false flag value (1/0, yes/no, on/off too); anything else is an error."""
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def flag_bool_or_auto(value: str) -> bool | str:
    """``auto`` or a true/false flag value (``flag_bool``)."""
    return "auto" if value.strip().lower() == "auto" else flag_bool(value)


@dataclass(frozen=True)
class FlagSpec:
    """A field's flag. ``parse`` is ``bool`` for a switch (``--x`` /
    ``--no-x``, no value: it cannot swallow the positional after it) and
    ``flag_bool`` for a boolean that also takes a value (``--x``, ``--x
    false``, ``--no-x``). ``aliases``: other spellings (each gets its
    ``--no-`` form too)."""

    flag: str
    metavar: str | None
    help: str
    parse: Callable[[str], Any] = str
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    nargs: str | None = None  # "*" or "+": a list of values; "append": repeatable
    required: bool = False  # the command cannot run without it (the default: until parsed)


def setting(default: Any, flag: str, metavar: str | None, help_text: str, *,
            parse: Callable[[str], Any] = str, aliases: tuple[str, ...] = (),
            choices: tuple[str, ...] | None = None, nargs: str | None = None,
            required: bool = False) -> Any:
    """A dataclass field with ``default`` and its flag (module docstring). A
    list or dict default is copied for each instance (a default factory)."""
    spec = FlagSpec(flag, metavar, help_text, parse, aliases, choices, nargs, required)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default),
                                 metadata={FLAG: spec})
    return dataclasses.field(default=default, metadata={FLAG: spec})


def flag_fields(cls: type) -> list[tuple[str, FlagSpec]]:
    """(field name, its flag) of ``cls``'s flagged fields, in declaration order."""
    return [(f.name, f.metadata[FLAG]) for f in dataclasses.fields(cls) if FLAG in f.metadata]


def field_default(field: dataclasses.Field) -> Any:
    """A field's default (its factory's value for a list or dict)."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def register_flag(group: Any, spec: FlagSpec, dest: str, default: Any, help_text: str) -> None:
    """One flag on an argparse parser or group: a switch (``parse`` is bool)
    gets ``--no-x``; a ``flag_bool`` takes an optional value and ``--no-x``."""
    names = (spec.flag, *spec.aliases)
    if spec.parse is bool:  # --x / --no-x for each name
        action = group.add_argument(*names, dest=dest, action=argparse.BooleanOptionalAction,
                                    default=default, help=help_text)
        action.flag_spec = spec
        return
    if spec.parse is flag_bool:  # --x [BOOL]; --no-x (shown on the same help line)
        action = group.add_argument(*names, dest=dest, type=flag_bool, nargs="?", const=True,
                                    default=default, metavar=spec.metavar, help=help_text)
        negatives = tuple("--no-" + name[2:] for name in names)
        negative = group.add_argument(*negatives, dest=dest, action="store_const",
                                      const=False, default=default, help=argparse.SUPPRESS)
        action.negative_flags = negatives
        action.flag_spec = negative.flag_spec = spec
        return
    extra: dict[str, Any] = {"metavar": spec.metavar}
    if spec.choices:  # argparse lists them where the metavar would be
        extra = {"choices": spec.choices}
    if spec.required:
        extra["required"] = True
    if spec.nargs == "append":
        extra["action"] = "append"
    elif spec.nargs:
        extra["nargs"] = spec.nargs
    action = group.add_argument(*names, dest=dest, type=spec.parse, default=default,
                                help=help_text, **extra)
    action.flag_spec = spec  # which declaration made it (tests/test_settings_fields.py)


def add_setting_args(group: Any, cls: type, *, skip: tuple[str, ...] = (),
                     only: tuple[str, ...] | None = None,
                     defaults: dict[str, tuple[Any, str]] | None = None) -> None:
    """Register ``cls``'s flagged fields on ``group`` (dest: the field's name,
    default: the field's). ``skip``: fields this command does not take;
    ``only``: just these (a help group of a larger dataclass).
    ``defaults``: field -> (default, help) where this command deliberately
    differs from the field's default; its help must say so."""
    defaults = defaults or {}
    unknown = (set(defaults) | set(skip) | set(only or ())) - {
        name for name, _ in flag_fields(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__} has no flagged field {sorted(unknown)}")
    for field in dataclasses.fields(cls):
        spec = field.metadata.get(FLAG)
        if spec is None or field.name in skip or (only is not None and field.name not in only):
            continue
        default, help_text = defaults.get(field.name, (field_default(field), spec.help))
        register_flag(group, spec, field.name, default, help_text.replace("%", "%%"))


def values_from_args(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    """``cls`` from the flags ``add_setting_args`` registered (fields a
    command skipped keep their defaults), plus ``extra`` fields."""
    given = {name: getattr(args, name) for name, _ in flag_fields(cls) if hasattr(args, name)}
    return cls(**given, **extra)
