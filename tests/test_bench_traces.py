"""Trace readers on every shared trace file, windows, scaling, bad input."""
from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from carpool.workload.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TRACE_FILES,
    TraceRequest,
    excerpt_note,
    load_trace,
    read_azure_csv,
    read_lengths_csv,
    read_mooncake_jsonl,
    resolve_trace,
    scale_tokens,
    select_window,
    trace_attribution,
    trace_format,
    traces_dir,
)

ROWS = {"azure-conv": 19_366, "azure-code": 8_819, "mooncake-conv": 12_031,
        "mooncake-synthetic": 3_993, "sharegpt": 30_731, "arxiv": 28_257}
TIMED = {"azure-conv", "azure-code", "mooncake-conv", "mooncake-synthetic"}


def _require_whole(*names: str) -> None:
    """These tests check facts of the whole traces (row counts, rates, the
    last arrival): they need them on disk. The packaged excerpts (all a bare
    clone has) are checked in tests/test_workload_sources.py."""
    for name in names:
        if excerpt_note(resolve_trace(name)):
            pytest.skip(f"needs the whole {name} trace (carpool traces download {name}, "
                        f"or ../shared/traces)")


@pytest.fixture(scope="module")
def traces() -> dict[str, list[TraceRequest]]:
    return {name: load_trace(name) for name in TRACE_FILES}


def test_registry_covers_every_shared_trace_file():
    _require_whole(*TRACE_FILES)
    on_disk = {p.relative_to(traces_dir()).as_posix()
               for p in traces_dir().rglob("*") if p.suffix in (".csv", ".jsonl")}
    assert on_disk == {relative for relative, _, _ in TRACE_FILES.values()}
    assert set(TRACE_FILES) == set(ROWS)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_trace_parses_with_its_row_count(traces, name):
    _require_whole(name)
    requests = traces[name]
    assert len(requests) == ROWS[name]
    assert all(r.input_len >= 1 and r.output_len >= 1 for r in requests)
    if name in TIMED:
        arrivals = [r.arrival for r in requests]
        assert arrivals[0] == 0.0
        assert all(a <= b for a, b in itertools.pairwise(arrivals))
        assert arrivals[-1] > 1000  # about an hour, except the synthetic Mooncake trace
    else:
        assert all(r.arrival is None for r in requests)
    assert trace_attribution(resolve_trace(name))


@pytest.mark.parametrize("name", sorted(ROWS))
def test_readers_are_fast(name):
    started = time.perf_counter()
    load_trace(name)
    assert time.perf_counter() - started < 1.0


def test_azure_rates_and_lengths_match_the_readme(traces):
    _require_whole("azure-conv", "azure-code")
    conv, code = traces["azure-conv"], traces["azure-code"]
    assert (len(conv) - 1) / conv[-1].arrival == pytest.approx(5.5, rel=0.02)
    assert (len(code) - 1) / code[-1].arrival == pytest.approx(2.6, rel=0.03)
    assert sum(r.input_len for r in conv) / len(conv) == pytest.approx(1155, abs=1)
    assert sum(r.output_len for r in conv) / len(conv) == pytest.approx(211, abs=1)
    assert conv[0] == TraceRequest(0.0, 374, 44)
    # 18:15:46.6805900 -> 18:15:50.9951690
    assert (conv[1].arrival, conv[1].input_len) == (pytest.approx(4.3145790), 396)


def test_mooncake_hash_ids_cover_the_prompt(traces):
    for name in ("mooncake-conv", "mooncake-synthetic"):
        for r in traces[name]:
            blocks = len(r.hash_ids)
            full = blocks * MOONCAKE_BLOCK_TOKENS
            assert full - MOONCAKE_BLOCK_TOKENS < r.input_len <= full
    first = traces["mooncake-conv"][0]
    assert first == TraceRequest(0.0, 6758, 500, tuple(range(14)))


def test_mooncake_timestamps_are_milliseconds(traces):
    _require_whole("mooncake-conv")
    # The trace's timestamps are in ms.
    assert traces["mooncake-conv"][-1].arrival == pytest.approx(3536.999)


def test_select_window_rebases_and_limits(traces):
    conv = traces["azure-conv"]
    window = select_window(conv, start_s=600.0, duration_s=60.0)
    expected = [r for r in conv if 600.0 <= r.arrival < 660.0]
    assert len(window) == len(expected) > 200
    assert [w.arrival for w in window] == pytest.approx([r.arrival - 600.0 for r in expected])
    assert [w.input_len for w in window] == [r.input_len for r in expected]
    assert all(0 <= w.arrival < 60.0 for w in window)
    assert select_window(conv, 600.0, 60.0, max_requests=10) == window[:10]
    assert select_window(conv) == conv
    lengths = traces["sharegpt"]
    assert select_window(lengths, max_requests=5) == lengths[:5]
    with pytest.raises(ValueError):
        select_window(conv, start_s=-1)


def test_scale_tokens_rounds_clamps_and_keeps_hash_ids(traces):
    mooncake = traces["mooncake-conv"][:50]
    scaled = scale_tokens(mooncake, 0.125, max_input_len=700, max_output_len=40)
    for before, after in zip(mooncake, scaled):
        assert after.hash_ids == before.hash_ids and after.arrival == before.arrival
        assert after.input_len == max(1, min(700, round(before.input_len * 0.125)))
        assert after.output_len == max(1, min(40, round(before.output_len * 0.125)))
    assert scale_tokens([TraceRequest(None, 3, 1)], 0.01) == [TraceRequest(None, 1, 1)]
    with pytest.raises(ValueError):
        scale_tokens(mooncake, 0.0)


@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), max_size=20),
       st.floats(0.001, 10.0), st.integers(1, 4096), st.integers(1, 4096))
def test_scaled_counts_stay_in_bounds(lengths, factor, max_in, max_out):
    requests = [TraceRequest(None, i, o) for i, o in lengths]
    for r in scale_tokens(requests, factor, max_in, max_out):
        assert 1 <= r.input_len <= max_in and 1 <= r.output_len <= max_out


def test_timestamps_parse_robustly(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 23:59:59.9999999,5,6\n"
                    "2023-11-17T00:00:01,7,8\n"
                    "2023-11-16 23:59:58.5,3,4\n")
    requests = read_azure_csv(path)
    # Sorted by time, measured from the earliest request, across midnight.
    assert [r.input_len for r in requests] == [3, 5, 7]
    assert [r.arrival for r in requests] == pytest.approx([0.0, 1.4999999, 2.5])


def test_paths_and_formats(tmp_path):
    lengths = tmp_path / "mine.csv"
    lengths.write_text("num_prefill_tokens,num_decode_tokens,extra\n10,2,x\n20,4,y\n")
    assert trace_format(lengths) == "lengths"
    assert load_trace(str(lengths)) == [TraceRequest(None, 10, 2), TraceRequest(None, 20, 4)]
    assert trace_attribution(lengths) is None
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text('{"timestamp": 2000, "input_length": 3, "output_length": 1, "hash_ids": [4]}\n'
                     '{"timestamp": 500, "input_length": 9, "output_length": 2}\n')
    assert read_mooncake_jsonl(jsonl) == [TraceRequest(0.0, 9, 2), TraceRequest(1.5, 3, 1, (4,))]
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(other)


@pytest.mark.parametrize("content,reader,line", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,1,2\nyesterday,1,2\n",
     read_azure_csv, 3),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,1,two\n", read_azure_csv, 2),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,1\n", read_azure_csv, 2),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:15:46.6,1,2\n", read_azure_csv, 2),
    ("TIMESTAMP,Context\n", read_azure_csv, 1),
    ("num_prefill_tokens,num_decode_tokens\n1,2\n3,-4\n", read_lengths_csv, 3),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1}\n{"timestamp": 0}\n',
     read_mooncake_jsonl, 2),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1}\n\n{not json\n',
     read_mooncake_jsonl, 3),
])
def test_malformed_rows_name_file_and_line(tmp_path, content, reader, line):
    path = tmp_path / "bad.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"bad\.txt:{line}:"):
        reader(path)


def test_missing_traces_say_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("CARPOOL_TRACES", str(tmp_path))
    assert traces_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match="CARPOOL_TRACES"):
        resolve_trace("azure-conv")
    with pytest.raises(FileNotFoundError, match="known name"):
        resolve_trace(str(tmp_path / "nowhere.csv"))
    (tmp_path / "lengths").mkdir()
    relative = TRACE_FILES["sharegpt"][0]
    (tmp_path / relative).write_text("num_prefill_tokens,num_decode_tokens\n5,6\n")
    assert resolve_trace("sharegpt") == tmp_path / relative
    assert load_trace("sharegpt") == [TraceRequest(None, 5, 6)]


def test_default_dir_is_found_from_the_repo_and_elsewhere(monkeypatch, tmp_path):
    monkeypatch.delenv("CARPOOL_TRACES", raising=False)
    repo_traces = Path(__file__).resolve().parents[2] / "shared" / "traces"
    monkeypatch.chdir(tmp_path)
    assert traces_dir().resolve() == repo_traces.resolve()


def test_loop_window_replays_back_to_back_with_fresh_prefix_ids():
    from carpool.workload.traces import loop_window

    window = [TraceRequest(0.0, 10, 1, (0, 1)), TraceRequest(2.0, 20, 2, (1,)),
              TraceRequest(4.0, 30, 3)]
    looped = loop_window(window, 7)
    # period = span 4 s + mean gap 2 s
    assert [r.arrival for r in looped] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    assert [r.input_len for r in looped] == [10, 20, 30, 10, 20, 30, 10]
    assert looped[3].hash_ids == (2, 3) and looped[6].hash_ids == (4, 5)
    assert looped[4].hash_ids == (3,)
