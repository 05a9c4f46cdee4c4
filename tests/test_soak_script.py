"""The chaos soak (scripts/soak.py, issue 47 item 4), briefly: a 2-replica
fleet under a looped trace for 40 s with a worker SIGKILLed every 12 s, its
KV store restarted every 13 s, a client leaving mid-stream every 5 s and a
3x burst; nothing accepted is
lost or hung, no process of the fleet outlives it, and the report and its
plot are written. (The leak verdict needs a long run: scripts/soak.py's
default is two hours.)"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_short_soak_loses_nothing_and_leaves_no_process(tiny_model_dir, tmp_path):
    out = tmp_path / "soak"
    run = subprocess.run(
        [sys.executable, "scripts/soak.py", "--model", str(tiny_model_dir), "--out", str(out),
         "--duration", "40", "--rate", "3", "--kill-every", "12", "--disconnect-every", "5",
         "--burst-every", "15", "--burst-s", "5", "--sample-s", "1", "--hang-s", "120",
         "--store-restart-every", "13",
         "--serve-args", "--attention-backend torch --dtype float32 --adaptive false"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    report = json.loads((out / "soak.json").read_text())
    verdict = report["verdict"]
    assert verdict["requests"] > 60, run.stdout + run.stderr
    assert verdict["lost"] == 0 and verdict["hung"] == 0, verdict
    assert verdict["orphans"] == []
    assert verdict["faults"]["kill"] == 3 and verdict["faults"]["disconnect"] >= 6
    assert verdict["faults"]["burst_start"] == 2 and verdict["faults"]["store_restart"] >= 2
    assert verdict["ok"] + verdict["refused"] == verdict["requests"]
    assert len(report["samples"]) >= 30 and (out / "soak.png").stat().st_size > 10_000
