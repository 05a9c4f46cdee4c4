"""scripts/surge_verdict.py checks issue 42's surge goals on any pair of
``carpool bench serve`` results: each goal can fail."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "surge_verdict.py"
spec = importlib.util.spec_from_file_location("surge_verdict", SCRIPT)
surge_verdict = importlib.util.module_from_spec(spec)
spec.loader.exec_module(surge_verdict)


def phase(name, start, end, ttft, rejected_share=0.0, failed=0, offered=3.0):
    return {"phase": name, "start": start, "end": end, "offered_rate": offered,
            "ttft": {"p99": ttft}, "tpot": {"p99": 0.1}, "rejected": round(rejected_share * 90),
            "rejected_share": rejected_share, "failed": failed, "goodput": 1.0,
            "backlog_until": start, "rejected_after_backlog": 0}


def runs(surge_ttft=0.5, rejected=0.5, failed=0):
    plain = {"summary": {"slo": {"ttft": 1.0, "tpot": 0.3}}, "requests": [],
             "phases": [phase("calm 1", 0, 30, 0.3), phase("surge", 30, 60, 3.0, offered=9.0),
                        phase("calm 2", 60, 90, 0.3)]}
    adaptive = {"summary": {"slo": {"ttft": 1.0, "tpot": 0.3}}, "requests": [],
                "phases": [phase("calm 1", 0, 30, 0.3),
                           phase("surge", 30, 60, surge_ttft, rejected, failed, offered=9.0),
                           phase("calm 2", 60, 90, 0.3)]}
    return plain, adaptive


def failures(plain, adaptive):
    capacity = {"slo_capacity_below": 4.5}  # offered 9/s: the excess is 50%
    return [text for text, ok in surge_verdict.verdict(plain, adaptive, capacity) if not ok]


def test_a_run_meeting_every_goal_passes():
    assert failures(*runs()) == []


def test_each_goal_can_fail():
    assert any("2x the calm" in f for f in failures(*runs(surge_ttft=0.7)))
    assert any("<= target" in f for f in failures(*runs(surge_ttft=1.2)))
    assert any("excess" in f for f in failures(*runs(rejected=0.53)))
    assert failures(*runs(rejected=0.519)) == []  # within 2 points of the excess
    assert any("nothing lost" in f for f in failures(*runs(failed=1)))
    plain, adaptive = runs()
    adaptive["phases"][2]["rejected_after_backlog"] = 1
    assert any("no rejections" in f for f in failures(plain, adaptive))


def test_a_run_on_a_machine_slower_than_its_probe_is_void():
    plain, _ = runs()

    def request(sent, finished, tpot):
        return {"status": "ok", "sent": sent, "finished": finished, "ttft": 0.2, "tpot": tpot}

    # Calm-1 requests that finished before the surge (at 30 s) within the SLO;
    # one sent at 29 s decodes through the surge, slowly: it does not count.
    plain["requests"] = [request(t, t + 5, 0.1) for t in range(0, 24, 2)]
    plain["requests"].append(request(29, 45, 0.9))
    assert surge_verdict.speed_kept(plain)[1]
    plain["requests"][3]["tpot"] = 0.8  # calm at 0.6x capacity, yet over the 0.3 s target
    text, kept = surge_verdict.speed_kept(plain)
    assert not kept and "TPOT p99 800 ms" in text and "12 calm-1 requests" in text
    plain["requests"] = []
    assert not surge_verdict.speed_kept(plain)[1]
