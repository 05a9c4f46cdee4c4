"""Settings declared once: a config dataclass field carries its own flag.

``setting(default, "--flag", "METAVAR", "help")`` is a ``dataclasses.field``
whose metadata holds the flag's spelling, metavar, help, value parser and
aliases (``FlagSpec``); ``flag_fields`` lists a dataclass's flagged
fields in declaration order, and ``carpool.cli_flags`` builds every
command's engine and server flags from them. Plain Python, no argparse
objects kept: the value parsers are functions (``flag_bool`` and
``flag_bool_or_auto`` for booleans that also take a value).
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


def setting(default: Any, flag: str, metavar: str | None, help_text: str, *,
            parse: Callable[[str], Any] = str, aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field with ``default`` and its flag (module docstring)."""
    return dataclasses.field(default=default, metadata={
        FLAG: FlagSpec(flag, metavar, help_text, parse, aliases)})


def flag_fields(cls: type) -> list[tuple[str, FlagSpec]]:
    """(field name, its flag) of ``cls``'s flagged fields, in declaration order."""
    return [(f.name, f.metadata[FLAG]) for f in dataclasses.fields(cls) if FLAG in f.metadata]
