"""A measured cost model knows the machine it was measured on, and the
simulator says so loudly when it runs elsewhere."""
from __future__ import annotations

import json
import sys

import pytest

from carpool.machine import (
    BUSY_OTHER_CORES,
    BUSY_STEAL_SHARE,
    MachineLoad,
    identity_mismatch,
    load_verdict,
    machine_identity,
)
from carpool.sim.analytic import analytic_from_names
from carpool.sim.costs import load_cost_model, machine_warning, save_cost_model
from carpool.sim.fitted import FittedCostModel


def test_identity_of_this_machine_matches_itself():
    here = machine_identity()
    assert here["cpus"] >= 1 and here["device"] == "cpu" and isinstance(here["isa"], list)
    assert identity_mismatch(here) == []
    assert json.loads(json.dumps(here)) == here  # what a cost model file keeps


def test_each_difference_is_named():
    here = machine_identity()
    there = {**here, "cpu_model": "Other CPU", "cpus": here["cpus"] + 6,
             "isa": [f for f in here["isa"] if f != "avx512_bf16"] + ["amx_tile"]}
    if "avx512_bf16" not in here["isa"]:
        there["isa"].append("avx512_bf16")
    text = "; ".join(identity_mismatch(there, here))
    assert "CPU Other CPU there" in text and f"CPUs {here['cpus'] + 6} there" in text
    assert "instruction sets differ" in text and "avx512_bf16" in text
    assert identity_mismatch(None) == [
        "it records no machine identity (measured before carpool kept one)"]


def _measured(machine: dict | None) -> FittedCostModel:
    meta = {"note": "measured on the test bench", "created_at": "2026-12-02T00:00:00Z",
            "kv_bytes_per_token": 23040}
    if machine is not None:
        meta["machine"] = machine
    return FittedCostModel((0.01, 1e-4, 1e-4, 1e-7, 1e-8), meta)


def test_warning_only_for_a_measured_model_from_elsewhere(tmp_path):
    assert machine_warning(analytic_from_names("l4", "llama-3-8b")) is None
    here = _measured(machine_identity())
    assert machine_warning(load_cost_model(save_cost_model(here, tmp_path / "a.json"))) is None
    other = _measured({**machine_identity(), "cpu_model": "Other CPU"})
    warning = machine_warning(load_cost_model(save_cost_model(other, tmp_path / "b.json")))
    assert "CPU Other CPU there" in warning and "carpool measure" in warning
    assert "measured on the test bench" in machine_warning(_measured(None))


def test_simulate_warns_on_stderr_and_in_its_result(tmp_path, capsys):
    from carpool.cli import main

    path = save_cost_model(_measured({**machine_identity(), "cpus": 512}), tmp_path / "cm.json")
    out = tmp_path / "run.json"
    assert main(["simulate", "--cost-model", str(path), "--num-requests", "20", "--rate", "5",
                 "--json", str(out)]) == 0
    assert "WARNING: this cost model may not describe this machine: CPUs 512 there" in (
        capsys.readouterr().err)
    assert "CPUs 512 there" in json.loads(out.read_text())["simulation"]["cost_model_warning"]
    mine = save_cost_model(_measured(machine_identity()), tmp_path / "mine.json")
    assert main(["simulate", "--cost-model", str(mine), "--num-requests", "20", "--rate", "5",
                 "--json", str(out)]) == 0
    assert "WARNING" not in capsys.readouterr().err
    assert json.loads(out.read_text())["simulation"]["cost_model_warning"] is None


def test_load_verdict_names_what_made_the_machine_busy():
    quiet = load_verdict(BUSY_OTHER_CORES / 2, BUSY_STEAL_SHARE / 2)
    assert not quiet["busy"] and quiet["why"] == ""
    busy = load_verdict(1.5, 0.2)
    assert busy["busy"] and "1.50 cores" in busy["why"] and "stole 20.0%" in busy["why"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_machine_load_reads_the_interval():
    ticks = iter([0.0, 2.0])
    load = MachineLoad(clock=lambda: next(ticks))
    report = load.report()
    if report is None:
        pytest.skip("this /proc/stat counts more CPUs than this process may use (a container)")
    assert set(report) == {"other_cores", "steal_share", "busy", "why"}
    assert report["other_cores"] >= 0 and 0 <= report["steal_share"] <= 1
