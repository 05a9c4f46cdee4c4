"""Arrival schedules: rate, burstiness, surges and ramps, seeding."""
from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from carpool.workload.arrivals import (
    Ramp,
    RateShape,
    Surge,
    arrival_offsets,
    describe_process,
    rate_at,
)

GAPS = 20_000


def _gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(offsets)]


def _count(offsets: list[float], start: float, end: float) -> int:
    return sum(1 for t in offsets if start <= t < end)


@pytest.mark.parametrize("process,burstiness", [
    ("poisson", 1.0), ("gamma", 1.0), ("gamma", 0.25), ("gamma", 4.0)])
@pytest.mark.parametrize("rate", [0.5, 8.0])
def test_mean_gap_and_cv_match_rate_and_burstiness(process, burstiness, rate):
    gaps = _gaps(arrival_offsets(GAPS + 1, rate, seed=7, burstiness=burstiness, process=process))
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.03)
    cv = statistics.pstdev(gaps) / mean
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_poisson_ignores_burstiness():
    assert arrival_offsets(50, 3.0, 1, 0.25, process="poisson") == \
        arrival_offsets(50, 3.0, 1, 1.0, process="gamma")


def test_default_process_is_gamma_with_the_given_burstiness():
    assert arrival_offsets(100, 2.0, 5, 0.5) == arrival_offsets(100, 2.0, 5, 0.5, process="gamma")
    assert arrival_offsets(100, 2.0, 5) == arrival_offsets(100, 2.0, 5, process="poisson")


def test_constant_gaps_are_exactly_one_over_rate():
    offsets = arrival_offsets(1001, 4.0, seed=3, process="constant")
    gaps = _gaps(offsets)
    assert offsets[0] == 0.0
    assert all(g == pytest.approx(0.25, abs=1e-12) for g in gaps)
    assert statistics.pstdev(gaps) == pytest.approx(0.0, abs=1e-9)
    assert offsets == arrival_offsets(1001, 4.0, seed=99, process="constant")


def test_same_seed_same_schedule_other_seed_other_schedule():
    a = arrival_offsets(500, 2.0, seed=11, burstiness=0.5, surges=[Surge(2, 10, 10)],
                        ramps=[Ramp(1, 3, 0, 50)])
    b = arrival_offsets(500, 2.0, seed=11, burstiness=0.5, surges=[Surge(2, 10, 10)],
                        ramps=[Ramp(1, 3, 0, 50)])
    c = arrival_offsets(500, 2.0, seed=12, burstiness=0.5, surges=[Surge(2, 10, 10)],
                        ramps=[Ramp(1, 3, 0, 50)])
    assert a == b
    assert a != c
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))


@pytest.mark.parametrize("process", ["poisson", "constant", "gamma"])
def test_surge_multiplies_the_count_in_its_window(process):
    offsets = arrival_offsets(6000, 10.0, seed=2, burstiness=2.0, process=process,
                              surges=[Surge.parse("3x@100+100")])
    before = _count(offsets, 0, 100)
    during = _count(offsets, 100, 200)
    after = _count(offsets, 200, 300)
    assert before == pytest.approx(1000, rel=0.08)
    assert during == pytest.approx(3000, rel=0.08)
    assert after == pytest.approx(1000, rel=0.08)


@pytest.mark.parametrize("process", ["poisson", "constant"])
def test_ramp_moves_the_rate_linearly_over_its_window(process):
    offsets = arrival_offsets(8000, 10.0, seed=4, process=process,
                              ramps=[Ramp.parse("1x-3x@100+200")])
    # Integral of 10 * (1 + 2 * (t - 100) / 200) over each half of the window.
    assert _count(offsets, 0, 100) == pytest.approx(1000, rel=0.08)
    assert _count(offsets, 100, 200) == pytest.approx(1500, rel=0.08)
    assert _count(offsets, 200, 300) == pytest.approx(2500, rel=0.08)
    assert _count(offsets, 300, 400) == pytest.approx(1000, rel=0.08)


def test_surges_and_ramps_multiply():
    surge, ramp = Surge(2.0, 10, 10), Ramp(1.0, 3.0, 0, 40)
    shape = RateShape((surge,), (ramp,))
    assert shape.factor_at(5) == pytest.approx(1.25)
    assert shape.factor_at(15) == pytest.approx(2.0 * 1.75)
    assert shape.factor_at(40) == 1.0  # the window is half-open
    assert rate_at(4.0, [surge], 15, [ramp]) == pytest.approx(4.0 * 3.5)
    assert rate_at(4.0, [surge], 15) == pytest.approx(8.0)  # the old call still works
    offsets = arrival_offsets(4000, 5.0, seed=1, process="constant",
                              surges=[Surge(2.0, 100, 100)], ramps=[Ramp(2.0, 2.0, 150, 100)])
    # 100-150: x2; 150-200: x4; 200-250: x2.
    assert _count(offsets, 100, 150) == pytest.approx(500, abs=2)
    assert _count(offsets, 150, 200) == pytest.approx(1000, abs=2)
    assert _count(offsets, 200, 250) == pytest.approx(500, abs=2)


def test_parse_and_describe():
    ramp = Ramp.parse(" 0.5x-2x@10+20.5 ")
    assert ramp == Ramp(0.5, 2.0, 10.0, 20.5)
    assert ramp.factor_at(9.99) == 1.0
    assert ramp.factor_at(10) == 0.5
    assert ramp.factor_at(20.25) == pytest.approx(1.25)
    assert Ramp.parse(str(ramp)) == ramp
    surge = Surge.parse("3x@20+30")
    assert Surge.parse(str(surge)) == surge
    described = json.loads(json.dumps(RateShape((surge,), (ramp,)).to_dict()))
    assert described["surges"][0] == {"kind": "surge", "factor": 3.0, "start": 20.0,
                                      "duration": 30.0, "text": "3x@20+30"}
    assert described["ramps"][0]["start_factor"] == 0.5
    assert described["ramps"][0]["end_factor"] == 2.0
    assert describe_process("gamma", 1.0) == "Poisson"
    assert describe_process("gamma", 0.5) == "gamma (burstiness 0.5)"
    assert describe_process("constant", 0.5) == "constant"


@pytest.mark.parametrize("text", ["3x", "x@1+2", "1x-@1+2", "0x@1+2", "2x@1+0", "1x-0x@0+5",
                                  "1x-2x@0+0", "-1x@0+5", "ax@0+5"])
def test_bad_specs_are_rejected(text):
    with pytest.raises(ValueError):
        (Ramp if "-" in text.split("@")[0] else Surge).parse(text)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="process"):
        arrival_offsets(10, 1.0, 0, process="uniform")
    with pytest.raises(ValueError):
        arrival_offsets(10, 0.0, 0)
    with pytest.raises(ValueError):
        arrival_offsets(10, 1.0, 0, burstiness=0.0)


@given(start_factor=st.integers(1, 50), end_factor=st.integers(1, 50),
       start=st.integers(0, 1000), duration=st.integers(1, 1000), t=st.floats(-10, 3000))
def test_ramp_factor_stays_between_its_ends(start_factor, end_factor, start, duration, t):
    ramp = Ramp.parse(f"{start_factor}x-{end_factor}x@{start}+{duration}")
    factor = ramp.factor_at(t)
    if ramp.covers(t):
        low, high = sorted((start_factor, end_factor))
        assert low - 1e-9 <= factor <= high + 1e-9
    else:
        assert factor == 1.0
