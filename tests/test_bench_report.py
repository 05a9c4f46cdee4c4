"""The bench report (HTML + PNGs for serve and sweep results), find_knee, and
``carpool bench compare``, on synthetic result documents."""
from __future__ import annotations

import argparse
import json
import random
import re

import numpy as np
import pytest

from carpool.bench.compare import (
    add_compare_args,
    format_summary_table,
    load_result,
    run_compare,
)
from carpool.report.html import write_report
from carpool.report.run import format_ms, timeseries_figure
from carpool.report.sweep import find_knee

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _stats(values: list[float]) -> dict:
    if not values:
        return dict.fromkeys(("mean", "p50", "p90", "p95", "p99", "max"))
    arr = np.asarray(values)
    return {"mean": float(arr.mean()), "max": float(arr.max()),
            **{f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 95, 99)}}


def _request(index: int, sent: float, rng: random.Random, load: float) -> dict:
    if index % 13 == 5:
        reason = "http_429" if index % 2 else "http_503"
        return {"index": index, "scheduled": sent, "sent": sent, "status": "rejected",
                "reason": reason, "ttft": None, "e2e": None, "tpot": None, "itl": [],
                "input_tokens": 100, "output_tokens": 0}
    ttft = load * rng.uniform(0.05, 0.3)
    itl = [load * rng.uniform(0.01, 0.04) for _ in range(rng.randint(4, 20))]
    return {"index": index, "scheduled": sent, "sent": sent + 0.001, "status": "ok",
            "reason": None, "ttft": ttft, "e2e": ttft + sum(itl), "tpot": sum(itl) / len(itl),
            "itl": itl, "input_tokens": rng.randint(50, 200), "output_tokens": len(itl) + 1}


def make_serve(seed: int = 0, n: int = 60, label: str = "carpool continuous",
               load: float = 1.0, token_scale: float = 0.125, time_scale: float = 4.0,
               slo: dict | None = None) -> dict:
    """A realistic bench-serve result: Poisson sends, a 3x surge from 10 s to
    18 s that slows the requests in it, some 429/503 rejections."""
    rng = random.Random(seed)
    sent, requests = 0.0, []
    for i in range(n):
        sent += rng.expovariate(2.0)
        requests.append(_request(i, sent, rng, load * (3.0 if 10 <= sent < 18 else 1.0)))
    done = [r for r in requests if r["status"] == "ok"]
    duration = requests[-1]["sent"] + 2.0
    summary = {m: _stats([r[m] for r in done]) for m in ("ttft", "tpot", "e2e")}
    summary["itl"] = _stats([g for r in done for g in r["itl"]])
    reasons: dict[str, int] = {}
    for r in requests:
        if r["reason"]:
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    slo = {"ttft": 0.5, "tpot": 0.1} if slo is None else slo
    summary.update(
        requests=n, completed=len(done), rejected=n - len(done), failed=0, unsent=0,
        rejected_by_reason=reasons, failed_by_reason={}, rejected_share=(n - len(done)) / n,
        request_throughput=len(done) / duration,
        output_throughput=sum(r["output_tokens"] for r in done) / duration,
        total_token_throughput=sum(r["input_tokens"] + r["output_tokens"] for r in done) / duration,
        input_tokens=sum(r["input_tokens"] for r in requests),
        output_tokens=sum(r["output_tokens"] for r in done), slo=slo,
        goodput=0.8 if slo else None, slo_attainment=0.77 if slo else None, peak_concurrency=17)
    t = [i * 0.5 for i in range(int(duration / 0.5))]
    workload = {"name": "azure-conv", "token_scale": token_scale, "time_scale": time_scale,
                "arrival": "trace", "rate": 2.0, "burstiness": 1.0, "seed": seed,
                "surges": [{"factor": 3.0, "start": 10.0, "duration": 8.0}],
                "ramps": [{"start_factor": 1.0, "end_factor": 2.0, "start": 20.0, "duration": 5.0}],
                "num_requests": n, "offered_rate": 2.0}
    return {"kind": "bench-serve", "version": 1, "label": label,
            "started_at": "2026-12-01T05:00:00Z", "duration_s": duration,
            "config": {"base_url": "http://127.0.0.1:8000", "workload": workload},
            "summary": summary, "requests": requests,
            "timeseries": {"interval": 0.5, "t": t, "in_flight": [rng.randint(0, 9) for _ in t],
                           "server_waiting": [None] + [rng.randint(0, 4) for _ in t[1:]],
                           "server_running": None,
                           "output_tok_s": [rng.uniform(50, 150) for _ in t]}}


def make_sweep() -> dict:
    rates = (0.5, 1.0, 2.0)
    runs = [{"mode": "rate", "rate": rate,
             "result": make_serve(seed=i, n=25, load=rate ** 2, label=f"rate {rate}",
                                  token_scale=0.5, time_scale=1.0)}
            for i, rate in enumerate(rates)]
    for run, attained in zip(runs, (1.0, 0.95, 0.4)):
        run["result"]["summary"]["slo_attainment"] = attained
    runs[0]["meets_slo"] = False  # the sweep's own verdict wins over attainment >= target
    return {"kind": "bench-sweep", "version": 1, "label": "sweep <A>",
            "started_at": "2026-12-01T06:00:00Z", "config": {"workload": {"token_scale": 0.5}},
            "slo": {"ttft": 2.0, "tpot": 0.4}, "attainment_target": 0.9, "runs": runs,
            "capacity_rps": 1.0, "knee_rps": 1.0}


def _assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5000, f"{path} is suspiciously small ({len(data)} bytes)"


def test_serve_report_writes_html_and_valid_pngs(tmp_path):
    result = make_serve(label="carpool <continuous> & co")
    path = write_report(result, tmp_path / "out")
    assert path == tmp_path / "out" / "report.html"
    page = path.read_text()
    images = re.findall(r'<img src="([^"]+)"', page)
    assert sorted(images) == ["latency_cdf.png", "timeseries.png"]
    for name in images:
        _assert_png(tmp_path / "out" / name)
    assert "carpool &lt;continuous&gt; &amp; co" in page and "<continuous>" not in page
    assert "token counts x0.125, time x4" in page
    assert "surge x3 at 10-18 s" in page and "ramp x1-&gt;x2 at 20-25 s" in page
    summary = result["summary"]
    for metric in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("p50", "p99"):
            assert f"<td>{format_ms(summary[metric][stat])}</td>" in page
    assert "http_429" in page and "http_503" in page
    assert "<td>peak concurrency</td><td>17</td>" in page and "<td>unsent</td><td>0</td>" in page
    rejected = summary["rejected"]
    assert f"<td>rejected</td><td>{rejected} ({rejected / 60 * 100:.1f}%)</td>" in page
    assert "goodput 0.80 req/s" in page and "77.0%" in page and "TTFT &lt;= 500 ms" in page
    assert "<details>" in page and "127.0.0.1:8000" in page
    assert "<script" not in page and "http://cdn" not in page


def test_timeseries_marks_surges_and_ramps_on_every_panel():
    fig = timeseries_figure(make_serve())
    assert len(fig.axes) == 3
    assert sorted(t.get_text() for t in fig.axes[0].texts) == ["ramp x1->x2", "surge x3"]
    for ax in fig.axes:
        spans = sorted((p.get_x(), p.get_x() + p.get_width()) for p in ax.patches)
        assert spans == [(10.0, 18.0), (20.0, 25.0)]


def test_serve_report_without_completions_or_timeseries(tmp_path):
    result = make_serve(n=4, slo={})
    result["summary"]["failed_by_reason"] = {"timeout <30 s>": 4}
    for request in result["requests"]:
        request.update(status="failed", reason="timeout", ttft=None, e2e=None, tpot=None, itl=[])
    for metric in ("ttft", "tpot", "itl", "e2e"):
        result["summary"][metric] = dict.fromkeys(result["summary"]["ttft"])
    del result["timeseries"]
    page = write_report(result, tmp_path).read_text()
    assert "No SLO given" in page and "<td>-</td>" in page
    assert "<td>timeout &lt;30 s&gt;</td><td>4</td>" in page
    assert len(timeseries_figure(result).axes) == 1
    _assert_png(tmp_path / "timeseries.png")


def test_sweep_report_plots_table_and_run_reports(tmp_path):
    sweep = make_sweep()
    page = write_report(sweep, tmp_path).read_text()
    for name in ("latency_vs_rate.png", "throughput_vs_rate.png"):
        assert f'src="{name}"' in page
        _assert_png(tmp_path / name)
    assert "sweep &lt;A&gt;" in page and "token counts x0.5, time x1" in page
    rows = re.findall(r"<tr><td>rate</td>(.*?)</tr>", page)
    assert len(rows) == 3
    assert [re.findall(r"<td>(yes|no)</td>", row) for row in rows] == [["no"], ["yes"], ["no"]]
    assert "<td>0.50</td>" in rows[0] and "<td>2.00</td>" in rows[2]
    assert "Capacity 1.00 req/s, knee 1.00 req/s (SLO attainment target 90.0%)" in page
    for i in range(3):
        assert f'href="run-{i:02d}/report.html"' in page
        assert (tmp_path / f"run-{i:02d}" / "report.html").is_file()


def test_write_report_rejects_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match="bench-serve"):
        write_report({"kind": "bench-throughput"}, tmp_path)


def test_find_knee_hockey_stick_returns_the_bend():
    rates = [1, 2, 3, 4, 5, 6]
    latency = [1.0, 1.0, 1.05, 1.1, 3.0, 8.0]
    assert find_knee(rates, latency) == 4.0
    shuffled = [5, 2, 6, 1, 4, 3]
    assert find_knee(shuffled, [latency[r - 1] for r in shuffled]) == 4.0
    # a point without a latency (nothing finished) is left out, not fatal
    assert find_knee(rates + [7], latency + [None]) == 4.0


@pytest.mark.parametrize("rates, latency", [
    ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]),            # straight line
    ([1, 2, 3, 4, 5], [2, 2, 2, 2, 2]),            # flat
    ([1, 2, 3, 4, 5], [1.0, 1.01, 1.0, 1.02, 1.03]),  # flat within noise
    ([1, 2, 3, 4, 5], [1, 4, 5, 5.5, 6]),          # concave: saturates, no upward bend
    ([1, 2, 3, 4, 5], [8, 3, 1.1, 1.05, 1]),       # falling
    ([1, 2], [1, 9]),                              # too few points
    ([3, 3, 3], [1, 2, 9]),                        # no rate span
])
def test_find_knee_none_without_a_bend(rates, latency):
    assert find_knee(rates, latency) is None


def _write(tmp_path, name: str, doc: dict):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def _compare_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_compare_args(parser)
    return parser.parse_args(argv)


def _row(text: str, name: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(name + "  "))
    return line[len(name):].split()


def test_compare_prints_hand_computed_ratios(tmp_path, capsys):
    a, b = make_serve(seed=1, label="baseline"), make_serve(seed=2, label="candidate")
    a["summary"].update(output_throughput=100.0, request_throughput=2.0, rejected_share=0.0)
    b["summary"].update(output_throughput=150.0, request_throughput=1.5, rejected_share=0.1)
    a["summary"]["ttft"]["p99"], b["summary"]["ttft"]["p99"] = 0.2, 0.5
    a["summary"]["tpot"]["p50"], b["summary"]["tpot"]["p50"] = 0.04, 0.03
    b["summary"]["goodput"] = None
    paths = [_write(tmp_path, "a.json", a), _write(tmp_path, "b.json", b)]
    assert run_compare(_compare_args(*map(str, paths))) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split() == ["metric", "A", "B", "B/A"]
    assert _row(out, "output tok/s") == ["100.00", "150.00", "1.50x"]
    assert _row(out, "req/s") == ["2.00", "1.50", "0.75x"]
    assert _row(out, "TTFT p99 ms") == ["200.0", "500.0", "2.50x"]
    assert _row(out, "TPOT p50 ms") == ["40.0", "30.0", "0.75x"]
    assert _row(out, "rejected %") == ["0.0", "10.0", "-"]   # no ratio to a zero baseline
    assert _row(out, "goodput req/s") == ["0.80", "-", "-"]
    assert "A: baseline (token counts x0.125, time x4)" in out and str(paths[1]) in out
    assert err == ""


def test_compare_markdown_and_scale_warning(tmp_path, capsys):
    a, b = make_serve(seed=1), make_serve(seed=2, token_scale=1.0, time_scale=1.0)
    paths = [_write(tmp_path, "a.json", a), _write(tmp_path, "b.json", b)]
    run_compare(_compare_args("--markdown", *map(str, paths)))
    out, err = capsys.readouterr()
    assert out.startswith("| metric | A | B | B/A |\n|:--|--:|--:|--:|\n")
    assert "not comparable" in err and "A x0.125/x4" in err and "B x1/x1" in err


def test_compare_html_and_sweep_input(tmp_path, capsys):
    paths = [_write(tmp_path, "a.json", make_serve(label="serve <run>")),
             _write(tmp_path, "s.json", make_sweep())]
    run_compare(_compare_args("--html", str(tmp_path / "html"), *map(str, paths)))
    out = capsys.readouterr().out
    assert "sweep <A> @ 2 req/s" in out
    assert "capacity 1 req/s, knee 1 req/s" in out and "highest-rate run (rate, 2 req/s)" in out
    page = (tmp_path / "html" / "compare.html").read_text()
    assert "serve &lt;run&gt;" in page and "<th>B/A</th>" in page and "not comparable" in page
    assert 'src="compare_cdf.png"' in page
    _assert_png(tmp_path / "html" / "compare_cdf.png")


def test_format_summary_table_against_another_baseline():
    a, b = make_serve(seed=1), make_serve(seed=2)
    a["summary"]["output_throughput"], b["summary"]["output_throughput"] = 100.0, 50.0
    text = format_summary_table([a, b], baseline_index=1)
    assert text.splitlines()[0].split() == ["metric", "A", "A/B", "B"]
    assert _row(text, "output tok/s") == ["100.00", "2.00x", "50.00"]


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("{not json", "not a JSON result"),
    ('[1, 2]', "a JSON list is not a bench result"),
    ('{"kind": "bench-throughput", "version": 1}', "kind 'bench-throughput' is not a bench"),
    ('{"version": 1}', "kind None is not a bench result"),
    ('{"kind": "bench-serve", "version": 2, "summary": {}}', "version 2 is not supported"),
    ('{"kind": "bench-serve", "version": 1}', "has no summary"),
    ('{"kind": "bench-sweep", "version": 1, "runs": []}', "has no runs"),
])
def test_load_result_names_the_file_and_the_problem(tmp_path, content, message):
    path = tmp_path / "result.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        load_result(path)
    assert str(path) in str(info.value)


def _phases(ttft_p99: float, rejected: float, goodput: float) -> list[dict]:
    def phase(name: str, offered: float, share: float) -> dict:
        return {"phase": name, "offered_rate": offered, "rejected_share": share,
                "ttft": {"p99": ttft_p99}, "tpot": {"p99": 0.05}, "completed_rate": 1.0,
                "goodput": goodput}
    return [phase("calm 1", 2.0, 0.0), phase("surge 1 x3", 6.0, rejected),
            phase("calm 2", 2.0, 0.0)]


def test_compare_puts_the_phases_of_surge_runs_side_by_side(tmp_path, capsys):
    a, b = make_serve(seed=1, label="plain"), make_serve(seed=2, label="adaptive")
    a["phases"], b["phases"] = _phases(0.6, 0.0, 1.0), _phases(0.3, 0.4, 1.5)
    paths = [_write(tmp_path, "a.json", a), _write(tmp_path, "b.json", b)]
    run_compare(_compare_args(*map(str, paths)))
    out = capsys.readouterr().out
    assert "phase: metric" in out
    assert _row(out, "surge 1 x3: TTFT p99 ms") == ["600.0", "300.0", "0.50x"]
    assert _row(out, "surge 1 x3: goodput req/s") == ["1.00", "1.50", "1.50x"]
    assert _row(out, "calm 2: rejected %") == ["0.0", "0.0", "-"]
    b["phases"] = b["phases"][:2]  # different phases: no phase table
    assert "phase: metric" not in format_summary_table([a, b])
