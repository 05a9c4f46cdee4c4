"""Latency targets in the configuration: the rule and its floors, ``--slo``
and the target flags, YAML and profiles, and ``adaptive: null`` resolved
once (on for serve, off elsewhere)."""
from __future__ import annotations

import pytest

from carpool.cli import build_parser, engine_config_from_args, slo_sources
from carpool.config import ControllerConfig, EngineConfig
from carpool.scheduler import Scheduler
from carpool.slo import (
    AUTO,
    MIN_TPOT_TARGET,
    MIN_TTFT_TARGET,
    ServingSLO,
    calibrated_targets,
    class_share,
    parse_target,
    parse_targets,
)
from tests.test_scheduler_properties import FakeClock


def test_the_rule_multiplies_the_unloaded_values_with_floors():
    assert calibrated_targets(0.13, 0.02) == (pytest.approx(0.65), pytest.approx(0.1))
    assert calibrated_targets(0.002, 0.001) == (MIN_TTFT_TARGET, MIN_TPOT_TARGET)
    assert class_share(-1) > class_share(0) > class_share(1) == class_share(3)


def test_server_slo_and_target_flags_parse_with_units():
    assert parse_targets("ttft=500ms,tpot=100ms") == {"ttft_target": 0.5,
                                                      "tpot_target": pytest.approx(0.1)}
    assert parse_targets("tpot=0.1s") == {"tpot_target": 0.1}
    assert parse_targets("e2e=1.5s") == {"e2e_target": 1.5}  # issue 42: a live E2E target
    with pytest.raises(ValueError, match="unknown SLO metric 'itl'; use ttft, tpot, e2e"):
        parse_targets("itl=2s")
    assert parse_target("auto") == AUTO and parse_target("250ms") == 0.25
    assert parse_target("0.3") == 0.3


def test_config_defaults_mean_measured_targets_and_adaptive_undecided():
    config = ControllerConfig()
    assert config.adaptive is None and config.auto_targets == ("ttft", "tpot")
    concrete = config.concrete()  # what a scheduler outside serve runs
    assert concrete.adaptive is False and (concrete.ttft_target, concrete.tpot_target) == (
        2.0, 0.2)
    config.resolve_adaptive(serving=True)
    assert config.adaptive is True
    off = ControllerConfig(adaptive=False)
    off.resolve_adaptive(serving=True)
    assert off.adaptive is False  # an explicit false stays
    for bad in ({"ttft_target": "fast"}, {"tpot_target": 0.0}, {"adaptive": "yes"},
                {"controller_fast_window": 0.0}):
        with pytest.raises(ValueError):
            ControllerConfig(**bad).validate()


def test_yaml_profiles_and_flags_set_the_slo(tmp_path):
    nested = EngineConfig.from_dict({"controller": {"slo": "ttft=600ms,tpot=120ms"}})
    assert (nested.controller.ttft_target, nested.controller.tpot_target) == (
        pytest.approx(0.6), pytest.approx(0.12))
    mapping = EngineConfig.from_dict({"slo": {"ttft": 0.8, "tpot": "90ms"}}).validate()
    assert mapping.controller.ttft_target == 0.8
    assert mapping.controller.tpot_target == pytest.approx(0.09)
    assert EngineConfig.from_dict({"controller": {"ttft_target": 1.0}}).controller.auto_targets \
        == ("tpot",)
    settings = tmp_path / "slo.yaml"
    settings.write_text("controller: {ttft_target: 0.9}\n")
    args = build_parser().parse_args(["serve", "--config", str(settings),
                                      "--slo", "ttft=500ms,tpot=100ms", "--tpot-target", "80ms"])
    config = engine_config_from_args(args)
    # flags beat the file; a target flag beats --slo
    assert (config.controller.ttft_target, config.controller.tpot_target) == (
        0.5, pytest.approx(0.08))
    assert slo_sources(args) == {"ttft": "flag", "tpot": "flag"}
    only_file = build_parser().parse_args(["serve", "--config", str(settings)])
    assert slo_sources(only_file) == {}  # the file's target counts as "config"
    assert engine_config_from_args(only_file).controller.adaptive is None
    plain = build_parser().parse_args(["serve", "--adaptive", "false", "--calibrate", "false"])
    plain_config = engine_config_from_args(plain)
    assert plain_config.controller.adaptive is False and not plain_config.controller.calibrate
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--slo", "ttft=soon"])


def test_a_scheduler_built_from_the_defaults_has_no_controller():
    from carpool.config import CacheConfig, SchedulerConfig

    scheduler = Scheduler(SchedulerConfig(), CacheConfig(), 64, FakeClock(), ControllerConfig())
    assert scheduler.controller is None and scheduler.admission.ttft_target is None


def test_the_start_up_line_says_where_each_target_came_from():
    slo = ServingSLO(0.65, 0.1, {"ttft": "calibrated", "tpot": "calibrated"}, 0.13, 0.02, 1.4)
    assert slo.describe() == ("SLO ttft 0.65 s, tpot 0.100 s (ttft 5x the unloaded 0.130 s, "
                              "tpot 5x the unloaded 0.020 s measured at start-up in 1.4 s)")
    mixed = ServingSLO(0.25, 0.2, {"ttft": "calibrated", "tpot": "flag"}, 0.01, None, 0.2)
    assert mixed.describe() == ("SLO ttft 0.25 s, tpot 0.200 s (ttft the floor, over 5x the "
                                "unloaded 0.010 s measured at start-up in 0.2 s; tpot from flag)")
    policy = mixed.as_dict()
    assert policy["sources"] == {"ttft": "calibrated", "tpot": "flag"}
    assert policy["class_shares"] == {"high": 1.0, "normal": 0.85, "low": 0.6}
