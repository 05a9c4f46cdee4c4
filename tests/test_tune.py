"""``carpool tune``: SLO parsing, grid, Pareto front, recommendation, profiles
(pure, no model) and one small sweep on the tiny random-weight model."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from carpool.bench.tune import (
    Setting,
    TunePoint,
    add_tune_parser,
    format_table,
    make_grid,
    pareto_front,
    parse_batch_sizes,
    parse_max_waits,
    profile_header,
    profile_yaml,
    recommend,
    run_tune,
)
from carpool.cli import add_engine_flags, build_parser, engine_config_from_args
from carpool.config import EngineConfig, SchedulerConfig
from carpool.profiles import load_profile
from carpool.slo import parse_duration, parse_slo


def _pt(b: int, tput: float, e2e: float, ttft: float = 0.1, tpot: float = 0.01,
        rej: float = 0.0, wait: float | None = 0.05, batching: str = "static") -> TunePoint:
    return TunePoint(Setting(batching, b, wait), tput, ttft, tpot, e2e, rej, requests=10)


def _tune_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="carpool")
    add_tune_parser(parser.add_subparsers(dest="command", required=True), add_engine_flags)
    return parser


# -- parsing ---------------------------------------------------------------------------

def test_slo_parses_ms_and_s_for_each_metric():
    assert parse_slo("ttft=2s,tpot=200ms") == {"ttft": 2.0, "tpot": pytest.approx(0.2)}
    assert parse_slo(" E2E = 1.5s , ttft=250ms ,") == {"e2e": 1.5, "ttft": pytest.approx(0.25)}
    assert parse_slo("") == {}
    assert parse_duration("0.3", bare_seconds=True) == 0.3
    assert parse_duration("1e2ms") == pytest.approx(0.1)


@pytest.mark.parametrize("text, message", [
    ("tpot=200", r"SLO tpot: duration '200' needs a unit: 200ms or 200s"),
    ("itl=20ms", r"unknown SLO metric 'itl'; use ttft, tpot, e2e"),
    ("ttft", r"SLO term 'ttft' is not METRIC=DURATION"),
    ("ttft=1s,ttft=2s", r"SLO metric 'ttft' given twice"),
    ("ttft=0ms", r"SLO ttft must be > 0"),
    ("ttft=fast", r"SLO ttft: cannot parse duration 'fast'"),
    ("ttft=2min", r"cannot parse duration '2min'"),
    ("ttft=-1s", r"cannot parse duration"),
])
def test_bad_slo_is_rejected_with_a_clear_message(text, message):
    with pytest.raises(ValueError, match=message):
        parse_slo(text)


def test_grid_flags_parse_and_reject_bad_values(capsys):
    assert parse_batch_sizes("16,4, 8,4") == [4, 8, 16]
    assert parse_max_waits("0.1,50ms,0.3s") == [0.05, 0.1, 0.3]
    with pytest.raises(ValueError, match="integers >= 1"):
        parse_batch_sizes("0,4")
    with pytest.raises(ValueError, match="must be integers"):
        parse_batch_sizes("4,eight")
    with pytest.raises(ValueError, match="at least one max wait"):
        parse_max_waits(" , ")
    with pytest.raises(SystemExit):
        _tune_parser().parse_args(["tune", "--slo", "tpot=200"])
    assert "argument --slo: SLO tpot: duration '200' needs a unit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _tune_parser().parse_args(["tune", "--max-rejected", "5"])
    assert "between 0 and 1" in capsys.readouterr().err


def test_grid_is_batch_x_wait_except_under_continuous_batching():
    assert make_grid("dynamic", [4, 8], [0.05, 0.1]) == [
        Setting("dynamic", 4, 0.05), Setting("dynamic", 4, 0.1),
        Setting("dynamic", 8, 0.05), Setting("dynamic", 8, 0.1)]
    assert make_grid("continuous", [4, 8], [0.05, 0.1]) == [
        Setting("continuous", 4, None), Setting("continuous", 8, None)]


def test_each_setting_makes_a_valid_engine_config():
    base = SchedulerConfig(max_num_seqs=16, max_batch_size=8)
    knobs = Setting("dynamic", 32, 0.2).scheduler_knobs(base)
    assert knobs == {"batching": "dynamic", "preferred_batch_size": 32, "max_batch_size": 32,
                     "max_wait": 0.2, "max_num_seqs": 32}
    assert Setting("static", 4, 0.05).scheduler_knobs(base)["max_batch_size"] == 8
    assert Setting("continuous", 4, None).scheduler_knobs(base) == {
        "batching": "continuous", "max_num_seqs": 4}
    for setting in make_grid("static", [4, 32], [0.0, 0.3]):
        EngineConfig.from_dict({"scheduler": setting.scheduler_knobs(base)}).validate()


# -- Pareto front and recommendation ---------------------------------------------------

def test_pareto_front_drops_dominated_points_and_keeps_ties():
    a, b, c = _pt(4, 100, 1.0), _pt(8, 200, 2.0), _pt(16, 300, 3.0)  # a trade-off curve
    worse = _pt(32, 150, 2.5)  # b has more throughput and less latency
    twin = _pt(64, 200, 2.0)  # ties b on both: neither dominates
    same_tput = _pt(128, 300, 3.5)  # c: same throughput, less latency
    nothing = _pt(2, 0.0, math.nan)  # nothing finished: infinite latency
    points = [a, worse, b, twin, c, same_tput, nothing]
    assert pareto_front(points, "e2e") == [a, b, twin, c]
    assert pareto_front([nothing], "e2e") == [nothing]
    # on another metric the front changes: b's TTFT is worse than c's
    b.ttft_p99, c.ttft_p99 = 0.9, 0.5
    assert b not in pareto_front([a, b, c], "ttft")


def test_recommend_takes_the_most_throughput_that_meets_the_slo():
    points = [_pt(4, 100, 1.0, tpot=0.05), _pt(8, 200, 2.0, tpot=0.1),
              _pt(16, 300, 3.0, tpot=0.3), _pt(32, 400, 1.5, tpot=0.1, rej=0.2)]
    rec = recommend(points, parse_slo("e2e=2s,tpot=200ms"))
    assert rec.meets_slo and rec.point is points[1]  # 32 rejects a fifth: not eligible
    assert "recommended: static B=8 max_wait=50ms" in rec.message and "2/4 settings" in rec.message
    assert recommend(points, parse_slo("e2e=2s"), max_rejected=0.25).point is points[3]
    assert recommend(points, {}).point is points[2]  # no SLO: most throughput, nothing rejected


def test_recommend_without_a_feasible_point_says_so_and_picks_the_lowest_latency():
    points = [_pt(4, 100, 1.0, ttft=0.8), _pt(8, 200, 2.0, ttft=0.6), _pt(16, 300, 3.0, ttft=0.9)]
    rec = recommend(points, parse_slo("e2e=500ms"))
    assert not rec.meets_slo and rec.point is points[0]
    assert rec.message.startswith("NO setting meets the SLO (e2e p99 <= 500ms, rejected <= 0%)")
    # relative to the SLO: worst p99 / limit (8: max(2/1.5, 0.6/0.5) = 1.33 < 4's 0.8/0.5)
    assert recommend(points, parse_slo("e2e=1500ms,ttft=500ms")).point is points[1]
    lossy = [_pt(4, 100, 0.1, rej=0.5), _pt(8, 90, 5.0, rej=0.1)]
    assert recommend(lossy, parse_slo("e2e=50ms")).point is lossy[1]  # drops fewer first


def test_throughputs_within_the_tolerance_tie_and_the_lower_latency_wins():
    points = [_pt(4, 100.0, 1.0), _pt(8, 101.5, 2.0), _pt(16, 90.0, 0.5)]
    assert recommend(points, {}).point is points[1]  # exact: the most throughput
    rec = recommend(points, {}, tolerance=0.02)
    assert rec.point is points[0] and "(within 2%, then lowest E2E p99)" in rec.message
    assert recommend(points, {}, tolerance=0.2).point is points[2]


def test_table_marks_the_pareto_points_and_the_slo():
    points = [_pt(4, 100, 1.0, wait=0.05), _pt(8, 50, 2.0, wait=0.1),
              _pt(4, 80, 0.5, wait=None, batching="continuous")]
    lines = format_table(points, "e2e", parse_slo("e2e=800ms"))
    assert lines[0].split() == ["batch", "max_wait", "out", "tok/s", "TTFT", "p99", "TPOT",
                                "p99", "E2E", "p99", "rej", "SLO"]
    assert lines[1].startswith("*") and lines[1].split()[1:3] == ["4", "50ms"]
    assert lines[1].endswith("miss") and lines[3].endswith("ok")
    assert lines[2].startswith(" ") and lines[3].split()[2] == "-"
    assert "Pareto front" in lines[-1] and "E2E p99" in lines[-1]


# -- profiles --------------------------------------------------------------------------

def test_profile_round_trips_through_load_profile_and_serve(tmp_path):
    base = SchedulerConfig(max_num_batched_tokens=256, batching="dynamic")
    rec = recommend([_pt(16, 300, 1.0, wait=0.2, batching="dynamic")], parse_slo("e2e=2s"))
    header = profile_header(rec, "8 requests, Poisson 2/s", parse_slo("e2e=2s"), 0.0,
                            "carpool tune --batching dynamic")
    text = profile_yaml(rec, header, base)
    # the first line alone is the profile's description (a blank comment line ends it)
    assert text.startswith("# Written by `carpool tune`: dynamic B=16 max_wait=200ms.\n#\n")
    assert "# SLO: e2e p99 <= 2s, rejected <= 0% (met)\n" in text
    assert "# Measured: 300.0 out tok/s" in text and "# Command: carpool tune" in text
    path = tmp_path / "tuned.yaml"
    path.write_text(text)
    config = EngineConfig()
    config.update(load_profile(str(path)))
    config.validate()
    s = config.scheduler
    assert (s.batching, s.preferred_batch_size, s.max_wait) == ("dynamic", 16, 0.2)
    assert s.max_num_batched_tokens == 256  # what the sweep ran with comes along
    served = engine_config_from_args(build_parser().parse_args(
        ["serve", "--profile", str(path), "--max-num-seqs", "64"]))
    assert served.scheduler.preferred_batch_size == 16 and served.scheduler.max_num_seqs == 64


# -- a real sweep on the tiny model ----------------------------------------------------

def _run(tiny_model_dir, capsys, *flags: str) -> tuple[int, str]:
    args = _tune_parser().parse_args([
        "tune", "--model", str(tiny_model_dir), "--attention-backend", "torch",
        "--num-blocks", "64", "--num-requests", "6", "--input-len", "12", "--output-len", "4",
        "--rate", "50", *flags])
    code = run_tune(engine_config_from_args(args), args)
    return code, capsys.readouterr().out


def test_tune_sweeps_static_batching_and_writes_a_profile(tiny_model_dir, tmp_path, capsys):
    out_json, profile = tmp_path / "tune.json", tmp_path / "tuned.yaml"
    code, out = _run(tiny_model_dir, capsys, "--batching", "static", "--batch-sizes", "2,4",
                     "--max-waits", "20ms", "--slo", "e2e=60s", "--json", str(out_json),
                     "--write-profile", str(profile))
    assert code == 0
    data = json.loads(out_json.read_text())
    assert [(p["batch_size"], p["max_wait"]) for p in data["points"]] == [(2, 0.02), (4, 0.02)]
    for point in data["points"]:
        assert point["requests"] == 6 and point["rejected_share"] == 0
        assert point["output_tok_s"] > 0 and point["ttft_p99"] <= point["e2e_p99"]
        assert point["meets_slo"]
    assert any(p["pareto"] for p in data["points"]) and data["recommendation"]["meets_slo"]
    assert "recommended: static B=" in out and "Pareto front" in out
    config = EngineConfig()
    config.update(load_profile(str(profile)))
    assert config.validate().scheduler.batching == "static"
    assert config.scheduler.max_wait == 0.02
    assert config.scheduler.preferred_batch_size == data["recommendation"]["batch_size"]


def test_tune_continuous_sweeps_batch_size_only_and_reports_a_missed_slo(tiny_model_dir,
                                                                          capsys):
    code, out = _run(tiny_model_dir, capsys, "--batch-sizes", "2,4", "--slo", "ttft=0.001ms",
                     "--latency-metric", "ttft")
    assert code == 0
    assert "has no batching wait: sweeping batch size (max_num_seqs) only" in out
    assert "NO setting meets the SLO (ttft p99 <= 0.001ms" in out
    assert len([line for line in out.splitlines() if line.endswith("miss")]) == 2


def test_requests_turned_away_at_arrival_count_as_rejected(tiny_model_dir, capsys):
    # a queue of one and a 200 ms batching wait: the five requests arriving within
    # 10 ms of the first find it full, and replay goes on instead of failing
    code, out = _run(tiny_model_dir, capsys, "--batching", "static", "--batch-sizes", "4",
                     "--max-waits", "200ms", "--max-queue-requests", "1", "--rate", "500",
                     "--slo", "e2e=60s")
    assert code == 0
    row = next(line for line in out.splitlines() if line.endswith("miss"))
    assert row.split()[1:3] == ["4", "200ms"] and row.split()[-2] == "83%"
    assert "NO setting meets the SLO (e2e p99 <= 60s, rejected <= 0%)" in out
