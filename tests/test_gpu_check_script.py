"""scripts/gpu_check.sh proven on the CPU before a GPU is spent on it:
every section runs in --dry-run (tiny model, Triton's interpreter, eager
"graphs") and writes its results."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_runs_every_section(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), TRITON_INTERPRET="1")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(results) == {"environment", "kernels", "greedy", "sampler", "throughput"}
    assert results["kernels"]["ok"] and results["greedy"]["ok"] and results["sampler"]["ok"]
    assert results["greedy"]["float32"]["sequences_equal"] == "4/4"
    rows = results["throughput"]["tiny"]["rows"]
    assert {(r["batch"], r["mode"]) for r in rows} == {(b, m) for b in (1, 4)
                                                       for m in ("eager", "graphs")}
    assert all(r["output_tok_per_s"] > 0 and r["decode_step_ms"] > 0 for r in rows)


def test_gpu_check_parallel_section_runs_two_ranks_on_the_cpu(tmp_path):
    """--only parallel in the dry run: tensor parallel size 2 over gloo, the
    same greedy tokens as one process, with and without micro-batches."""
    env = dict(os.environ, OUT=str(tmp_path), TRITON_INTERPRET="1")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--only",
                           "parallel"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parallel = json.loads((tmp_path / "gpu_check.json").read_text())["parallel"]
    assert parallel["ok"] and parallel["tokens_equal"]
    assert set(parallel["timings_ms"]) == {"TP 1", "TP 2, one batch", "TP 2, two micro-batches"}
