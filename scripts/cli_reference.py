"""The CLI reference page, generated from carpool's argparse parsers.

``python scripts/cli_reference.py [OUT.md]`` writes Markdown (stdout without
an argument): every command and sub-command of ``carpool.cli.build_parser()``
with a table of its flags (flag, default, choices, help). The docs site
builds its page with it on every build (``docs/hooks/cli_reference.py``), so
the page is never committed and never stale.

Only argparse is read: where a flag's argparse default is None and its help
ends in ``(default: X)`` (carpool's engine and server flags take their
defaults from the config dataclasses), X is the default shown. A group of
flags that several commands share whole (the engine flags, the workload
flags, ...) is listed once, and each command links to it.
"""
from __future__ import annotations

import argparse
import re
import sys
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# Run from a checkout without installing: the repository root on the path.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHARED_MIN_USES = 3  # a group used whole by this many commands is listed once
_DEFAULT_TAIL = re.compile(r"\s*\(default:\s*(?P<value>.*)\)\s*$", re.S)


@dataclass
class Row:
    flag: str
    default: str
    choices: str
    help: str
    literal: bool = True  # the default is a value (shown as code), not words from the help


@dataclass
class Group:
    title: str
    rows: list[Row]

    def key(self) -> tuple:
        return (self.title, tuple((r.flag, r.default, r.choices, r.help, r.literal)
                                  for r in self.rows))


@dataclass
class Command:
    name: str                  # "bench serve"
    summary: str
    description: str
    usage: str
    groups: list[Group] = field(default_factory=list)
    subcommands: list[str] = field(default_factory=list)


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse._SubParsersAction]:
    # argparse keeps sub-commands only on its private action class.
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def _help_text(action: argparse.Action, prog: str) -> str:
    """The action's help as ``--help`` prints it, %-expansions done."""
    text = action.help or ""
    if "%" in text:
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        params["prog"] = prog
        for name in ("choices",):
            if params.get(name) is not None:
                params[name] = ", ".join(map(str, params[name]))
        try:
            text = text % params
        except (KeyError, TypeError, ValueError):
            pass
    return " ".join(text.split())


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return str(value)


def _default(action: argparse.Action, help_text: str) -> tuple[str, str, bool]:
    """(default shown, help without a trailing ``(default: X)``, whether the
    default is a literal value rather than words)."""
    default = action.default
    match = _DEFAULT_TAIL.search(help_text)
    if match:
        help_text = help_text[:match.start()].rstrip()
    if action.nargs == 0:  # a switch: given or not
        return "", help_text, True
    if default is not None and default is not argparse.SUPPRESS and default != []:
        return _shown(default), help_text, True
    if match:
        value = match.group("value")
        literal = bool(re.fullmatch(r"[\w.:/+-]+", value)) and not value.startswith("the")
        return value, help_text, literal
    return "", help_text, True


def _flag(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    """How the flag is typed: every spelling, with its metavar."""
    if not action.option_strings:
        return action.metavar or action.dest
    names = list(action.option_strings)
    names += getattr(action, "negative_flags", ())  # carpool's --no-x spellings
    if action.nargs == 0:
        return ", ".join(names)
    metavar = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    if action.choices and action.metavar is None:  # the choices have their own column
        metavar = action.dest.upper()
    first, *others = names
    return ", ".join([f"{first} {metavar}", *others])


def _rows(actions, formatter, prog: str) -> list[Row]:
    rows = []
    for action in actions:
        if action.help is argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        if isinstance(action, argparse._HelpAction):
            continue
        help_text = _help_text(action, prog)
        default, help_text, literal = _default(action, help_text)
        choices = ", ".join(map(str, action.choices)) if action.choices else ""
        rows.append(Row(_flag(action, formatter), default, choices, help_text, literal))
    return rows


def collect(parser: argparse.ArgumentParser, name: str = "carpool",
            summary: str = "") -> list[Command]:
    """Every command under ``parser``, depth first, in the order they were added."""
    formatter = parser._get_formatter()
    usage = " ".join(parser.format_usage().split())
    usage = usage[len("usage: "):] if usage.startswith("usage: ") else usage
    command = Command(name, summary, parser.description or "", usage)
    for group in parser._action_groups:
        rows = _rows(group._group_actions, formatter, parser.prog)
        if rows:
            command.groups.append(Group(group.title or "options", rows))
    commands = [command]
    for sub in _subparsers(parser):
        helps = {choice.dest: choice.help or "" for choice in sub._choices_actions}
        for sub_name, sub_parser in sub.choices.items():
            command.subcommands.append(f"{name} {sub_name}")
            commands += collect(sub_parser, f"{name} {sub_name}", helps.get(sub_name, ""))
    return commands


# -- Markdown -------------------------------------------------------------------------

def _cell(text: str) -> str:
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([*_\[\]`])", r"\\\1", text)


def _code(text: str) -> str:
    if not text:
        return ""
    # Python-Markdown's tables leave pipes inside code spans alone.
    return f"`{text}`" if "`" not in text else f"`` {text} ``"


def _anchor(text: str) -> str:
    """A heading's id as the docs site's Markdown makes it (``toc``'s slugify)."""
    value = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def _table(rows: list[Row]) -> list[str]:
    lines = ["| flag | default | choices | help |", "|---|---|---|---|"]
    for row in rows:
        default = _code(row.default) if row.literal else _cell(row.default)
        lines.append(f"| {_code(row.flag)} | {default} | {_cell(row.choices)} "
                     f"| {_cell(row.help)} |")
    return lines


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole page, as Markdown."""
    if parser is None:
        from carpool.cli import build_parser

        parser = build_parser()
    commands = collect(parser)
    uses = Counter(group.key() for c in commands for group in c.groups)
    shared: dict[tuple, str] = {}
    for c in commands:
        for group in c.groups:
            if uses[group.key()] < SHARED_MIN_USES or group.key() in shared:
                continue
            name = f"{group.title} flags"
            if group.title == "options":  # argparse's default group: name it by its users
                users = [u.name.split() for u in commands
                         for g in u.groups if g.key() == group.key()]
                common = [w for w, *rest in zip(*users) if all(r == w for r in rest)]
                name = " ".join(common) + " options"
            if name in shared.values():
                name += f" ({sum(v.startswith(name) for v in shared.values()) + 1})"
            shared[group.key()] = name

    out = ["# CLI reference", "",
           "Generated from the command line's own parsers (`carpool.cli.build_parser`) by",
           "`scripts/cli_reference.py` each time this site is built, so it is what",
           "`carpool COMMAND --help` prints. Engine and server settings have the",
           "precedence flags > `--config FILE` > `--profile` > defaults; every",
           "boolean also has a `--no-` form.", ""]
    out += ["| command | what it does |", "|---|---|"]
    for c in commands[1:]:
        out.append(f"| [`{c.name}`](#{_anchor(c.name)}) | {_cell(c.summary)} |")
    out.append("")
    for c in commands[1:]:
        out += [f"## {c.name}", ""]
        if c.summary:
            out += [_cell(c.summary[0].upper() + c.summary[1:]) + ".", ""]
        out += ["```", c.usage, "```", ""]
        if c.subcommands:
            out += ["Sub-commands: " + ", ".join(f"[`{s}`](#{_anchor(s)})"
                                                for s in c.subcommands) + ".", ""]
        for group in c.groups:
            name = shared.get(group.key())
            if name:
                out += [f"**{group.title}**: the [{name}](#{_anchor(name)}) below "
                        f"({len(group.rows)} flags).", ""]
                continue
            out += [f"**{group.title}**", "", *_table(group.rows), ""]
    if shared:
        out += ["## Shared flag groups", "",
                "Groups of flags that several commands take alike.", ""]
        for key, name in shared.items():
            users = [c.name for c in commands for g in c.groups if g.key() == key]
            rows = next(g.rows for c in commands for g in c.groups if g.key() == key)
            out += [f"### {name}", "",
                    "Taken by " + ", ".join(f"`{u}`" for u in users) + ".", "",
                    *_table(rows), ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if argv:
        Path(argv[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
