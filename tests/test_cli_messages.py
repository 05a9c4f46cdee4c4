"""The first five minutes: what the command line says back.

A flag is spelled in full (``--max-num-seq`` is an error naming it, not
``--max-num-seqs``); an option ``carpool`` does not take is named as such;
``carpool generate`` defaults to a mild repetition penalty (serve's requests
do not); status lines go through ``logging`` (a library does not print);
the serving line counts the engine replicas.
"""
from __future__ import annotations

import argparse
import logging

import pytest

from carpool.cli import build_parser, sampling_from_args
from carpool.model.kernel_switch import SwitchingCpuOps
from carpool.sampling_params import SamplingParams
from carpool.server.launcher import replicas_text


def _parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def _parsers(parser: argparse.ArgumentParser):
    """``parser`` and every sub-command's parser under it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_an_abbreviated_flag_is_an_error_naming_it(capsys):
    err = _parse_error(["serve", "--max-num-seq", "4", "--port", "0"], capsys)
    assert "unrecognized arguments: --max-num-seq" in err, err
    assert build_parser().parse_args(["serve", "--max-num-seqs", "4"]).engine_max_num_seqs == 4
    assert "--temp" in _parse_error(["generate", "hi", "--temp", "0.5"], capsys)
    assert "--hel" in _parse_error(["bench", "serve", "--hel"], capsys)


def test_no_parser_takes_abbreviations():
    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 20  # every command and sub-command
    assert [p.prog for p in parsers if p.allow_abbrev] == []


def test_an_unknown_option_before_the_command_is_named(capsys):
    for argv in (["--bogus"], ["--bogus", "serve"], ["-x", "generate", "hi"], ["--vers"]):
        err = _parse_error(argv, capsys)
        assert f"unrecognized arguments: {argv[0]}" in err and "COMMAND" not in err, err
    assert "required: COMMAND" in _parse_error([], capsys)  # no command at all: as before
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--version"])
    assert exited.value.code == 0


def test_generate_defaults_to_a_mild_repetition_penalty():
    params = sampling_from_args(build_parser().parse_args(["generate", "Write a haiku."]))
    assert params.temperature == 0.0 and params.repetition_penalty == pytest.approx(1.1)
    off = build_parser().parse_args(["chat", "--repetition-penalty", "1"])
    assert sampling_from_args(off).repetition_penalty == 1.0
    assert SamplingParams().repetition_penalty == 1.0  # an API request's default: off


class _BuiltKernels:
    """A background build that has ended with ``module``."""

    started = 0.0

    def __init__(self, module) -> None:
        self.module = module

    def done(self) -> bool:
        return True


def test_kernels_ready_is_a_log_line_not_a_print(caplog, capsys):
    with caplog.at_level(logging.INFO, logger="carpool"):
        assert SwitchingCpuOps(_BuiltKernels(object())).latch()
    assert [r.name for r in caplog.records] == ["carpool.model.kernel_switch"]
    assert "CPU kernels ready" in caplog.records[0].getMessage()
    assert capsys.readouterr() == ("", "")


def test_the_serving_line_counts_the_replicas():
    def pool(n: int) -> dict:
        return {"policy": "predicted-ttft", "replicas": [{"replica": f"r{i}"} for i in range(n)]}

    assert replicas_text({}) == ""  # one engine alone: the line as it was
    assert replicas_text({"routing": pool(1)}) == "1 replica"
    assert replicas_text({"routing": pool(2)}) == "2 replicas"
    assert (replicas_text({"pd": {"mode": "always", "prefill": pool(1), "decode": pool(2)}})
            == "1 prefill + 2 decode replicas")
