"""The design's configuration template loads as written, with the same
meaning (issue 42): through ``--config`` and ``EngineConfig.from_yaml``."""
from __future__ import annotations

import pytest

from carpool.cli import build_parser, engine_config_from_args
from carpool.config import EngineConfig

TEMPLATE = """\
dynamic_batching:
  max_tokens: 4096
  preferred_batch_size: 8
  max_wait_time: 0.15
  emergency_switch: true
"""


def _check(config: EngineConfig) -> None:
    scheduler = config.scheduler
    assert scheduler.max_num_batched_tokens == 4096  # a step's (a batch's) token budget
    assert scheduler.preferred_batch_size == 8
    assert scheduler.max_wait == 0.15  # seconds a request waits for a batch to fill
    assert scheduler.emergency_switch is True
    assert scheduler.batching == EngineConfig().scheduler.batching  # picks no regime


def test_the_template_loads_through_config_and_from_yaml(tmp_path):
    path = tmp_path / "carpool.yaml"
    path.write_text(TEMPLATE)
    args = build_parser().parse_args(["serve", "some/model", "--config", str(path)])
    args.engine_model = args.model_path
    _check(engine_config_from_args(args))
    _check(EngineConfig.from_yaml(path).validate())
    # Flags still win over the file.
    args = build_parser().parse_args(["serve", "some/model", "--config", str(path),
                                      "--max-num-batched-tokens", "512"])
    args.engine_model = args.model_path
    assert engine_config_from_args(args).scheduler.max_num_batched_tokens == 512


def test_a_misspelt_template_key_is_one_clear_error(tmp_path):
    path = tmp_path / "carpool.yaml"
    path.write_text(TEMPLATE.replace("max_wait_time", "max_wait_tme"))
    args = build_parser().parse_args(["serve", "some/model", "--config", str(path)])
    args.engine_model = args.model_path
    with pytest.raises(ValueError, match="unknown config key dynamic_batching.max_wait_tme"):
        engine_config_from_args(args)
    with pytest.raises(ValueError, match="dynamic_batching must be a mapping"):
        EngineConfig.from_dict({"dynamic_batching": 3})
