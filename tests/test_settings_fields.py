"""Settings are declared once: every engine and server flag comes from its
config field's metadata (``carpool.settings_fields``), one flag per field,
with its help, and parses what its field holds."""
from __future__ import annotations

import dataclasses

from carpool.cli_flags import ENGINE_FLAGS, SERVER_FLAGS, SERVER_LIST_FLAGS
from carpool.config import CacheConfig, ControllerConfig, SchedulerConfig
from carpool.model_settings import ModelSettings
from carpool.server.config import ServerConfig
from carpool.settings_fields import FLAG, flag_fields

CLASSES = (ModelSettings, CacheConfig, SchedulerConfig, ControllerConfig, ServerConfig)


def test_every_flag_is_a_fields_own_and_each_field_has_at_most_one():
    declared = {(spec.flag, name) for cls in CLASSES for name, spec in flag_fields(cls)}
    tables = {(flag.flag, flag.key) for flag in ENGINE_FLAGS + SERVER_FLAGS + SERVER_LIST_FLAGS}
    # One documented alias besides: vLLM's older spelling of the step budget.
    assert tables - declared == {("--max-batch-tokens", "max_batch_tokens")}
    assert declared <= tables
    spellings = [flag.flag for flag in ENGINE_FLAGS + SERVER_FLAGS + SERVER_LIST_FLAGS]
    assert len(spellings) == len(set(spellings))
    for cls in CLASSES:
        for name, spec in flag_fields(cls):
            assert spec.flag.startswith("--") and spec.help.strip(), (cls.__name__, name)


def test_each_flagged_default_is_what_its_flag_would_parse():
    """A field's default survives its own flag's parser (shown as text)."""
    for cls in CLASSES:
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if FLAG in f.metadata}
        for name, spec in flag_fields(cls):
            default = defaults[name]
            if default is None or spec.parse in (bool, str):
                continue
            text = ("true" if default else "false") if isinstance(default, bool) else str(default)
            parsed = spec.parse(text)
            assert parsed == default or str(parsed) == str(default), (cls.__name__, name)


def test_the_routing_flag_names_the_policies_there_are():
    from carpool.cluster.policies import POLICIES

    (spec,) = [spec for name, spec in flag_fields(ServerConfig) if name == "routing"]
    named = {word.strip() for word in spec.help.split(":", 1)[1].split("|")}
    assert named == set(POLICIES)


def _parsers(parser, name="carpool"):
    """(command name, parser) of every command, nested ones too."""
    import argparse

    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _parsers(child, f"{name} {sub}")


def hand_written_flags() -> list[str]:
    """Every command's flags that no dataclass field declares."""
    from carpool.cli import build_parser

    rows = []
    for name, parser in _parsers(build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.dest in ("help", "version"):
                continue
            if getattr(action, "flag_spec", None) is None:
                rows.append(f"{name} {action.option_strings[0]}")
    return rows


def test_every_commands_flags_come_from_dataclass_fields():
    """serve, simulate, evaluate, bench, measure, tune, ...: each flag is a
    field's (``settings_fields.register_flag`` marks the actions it makes)."""
    assert hand_written_flags() == []


def test_the_fleets_shared_flags_differ_from_serve_only_where_help_says_so():
    from carpool.cli import build_parser
    from carpool.cluster.fleet_config import FleetConfig

    fleet = {f.name: f.default for f in dataclasses.fields(FleetConfig)}
    specs = {id(spec) for _, spec in flag_fields(FleetConfig)}
    parsers = dict(_parsers(build_parser()))
    checked = 0
    for command in ("carpool simulate", "carpool evaluate routing", "carpool evaluate pd",
                    "carpool evaluate autoscale", "carpool plan"):
        for action in parsers[command]._actions:
            if id(getattr(action, "flag_spec", None)) not in specs:
                continue  # not the fleet's setting (evaluate's --replicas: fleet sizes)
            checked += 1
            if action.default != fleet[action.dest]:
                assert "carpool serve" in action.help, (command, action.dest)
    assert checked >= 15
