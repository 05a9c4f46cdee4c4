"""``carpool fidelity``: one workload window on the real engine and in the
simulator, and how far apart they are.

The procedure: measure this machine (``carpool measure --out
cost-model.json``), then replay a trace window here twice with the same
engine settings: in real time through the loaded model (the in-process
replay of ``carpool bench regimes``: requests are added at their arrival
times, latency counts from the arrival), and in the simulator with the
measured cost model pricing every step and the same KV pool size. The report gives
each side's TTFT, TPOT and E2E p50/p99 and output throughput, and the
relative error of the simulation (simulated / real - 1) next to the real
side's own spread: the real replay runs ``--real-runs`` times (default 2,
each on a fresh scheduler) and this machine's speed drifts between them.
A real run during which other processes kept the machine busy (or the
hypervisor stole CPU time: ``carpool.machine.MachineLoad``) is not judged
against the goals. With ``--json DIR`` the runs are written as bench-serve
results (``real.json``, ``real-2.json``, ..., ``simulated.json``) for
``carpool bench compare`` and the HTML report.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from carpool.config import EngineConfig
from carpool.measure.steps import (
    errors_by_region,
    format_errors_by_region,
    save_steps,
    step_error_line,
)
from carpool.settings_fields import add_setting_args, setting
from carpool.workload.command import add_workload_args, workload_spec
from carpool.workload.spec import describe_workload, mooncake_block_tokens, plan_workload
from carpool.workload.traces import TraceRequest

# (metric, statistic) pairs the report compares; throughput is added apart.
COMPARED = (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("tpot", "p99"),
            ("e2e", "p50"), ("e2e", "p99"))
GOAL = {"p50": 0.10, "p99": 0.15, "throughput": 0.10}  # the goal, as |error|


@dataclass
class FidelityRow:
    """One compared statistic: ``real`` is the mean over the real runs and
    ``spread`` their own (max - min) / mean (None with one run): the error
    of the simulation is only meaningful next to it."""

    name: str
    real: float | None
    simulated: float | None
    goal: float
    spread: float | None = None

    @property
    def error(self) -> float | None:
        if not self.real or self.simulated is None:
            return None
        return self.simulated / self.real - 1

    @property
    def within_goal(self) -> bool:
        return self.error is not None and abs(self.error) <= self.goal


@dataclass(frozen=True)
class FidelityFlags:
    """``carpool fidelity``'s own flags (besides the workload's and the engine's)."""

    # required: the simulator's error is judged against this machine's own model
    cost_model: str | None = setting(
        None, "--cost-model", None, "this machine's measured cost model (carpool measure --out)",
        required=True)
    json: str | None = setting(
        None, "--json", None, "write real.json and simulated.json (bench-serve results) here")
    real_runs: int = setting(
        2, "--real-runs", None,
        "real replays (each on a fresh scheduler): the real side's own run-to-run spread is "
        "printed beside the errors (default 2)", parse=int)
    steps_out: str | None = setting(
        None, "--steps-out", "FILE",
        "write the real runs' steps (shape and seconds, gzipped JSON lines) here, for judging "
        "a cost model offline")
    check: bool = setting(
        False, "--check", None,
        "exit 1 unless every error is within the goal (p50 10%, p99 15%, throughput 10%) and "
        "the machine was quiet", parse=bool)


def add_fidelity_args(parser: argparse.ArgumentParser) -> None:
    """The workload's flags (``--workload-seed``: the engine has ``--seed``) and `FidelityFlags`."""
    add_workload_args(parser, seed_flag="--workload-seed")
    add_setting_args(parser, FidelityFlags)


def compare(real: dict, simulated: dict, more_real: list[dict] = ()) -> list[FidelityRow]:
    """Rows of (real, simulated) from bench-serve summaries: ``real`` and
    ``more_real`` are the real runs (their mean and spread), ``simulated``
    the simulation."""
    reals = [real, *more_real]

    def row(name: str, pick, goal: float) -> FidelityRow:
        values = [pick(summary) for summary in reals]
        if any(v is None for v in values):
            return FidelityRow(name, None, pick(simulated), goal)
        mean = statistics.fmean(values)
        spread = (max(values) - min(values)) / mean if len(values) > 1 and mean else None
        return FidelityRow(name, mean, pick(simulated), goal, spread)

    rows = [row(f"{metric.upper()} {stat}", lambda s, m=metric, t=stat: s[m][t], GOAL[stat])
            for metric, stat in COMPARED]
    rows.append(row("output tok/s", lambda s: s["output_throughput"], GOAL["throughput"]))
    return rows


def format_rows(rows: list[FidelityRow], busy: str | None = None) -> str:
    """The table; with ``busy`` (why the machine was not quiet) nothing is
    marked over or within the goal, and the reason is said under it."""
    lines = [f"{'':<14}{'real':>10}{'simulated':>11}{'error':>9}{'real spread':>13}{'goal':>7}"]
    for row in rows:
        scale = 1 if row.name.startswith("output") else 1000  # latencies in ms
        cells = [f"{v * scale:>10.1f}" if v is not None else f"{'-':>10}"
                 for v in (row.real, row.simulated)]
        error = f"{row.error:>+9.1%}" if row.error is not None else f"{'-':>9}"
        spread = f"{row.spread:>13.1%}" if row.spread is not None else f"{'-':>13}"
        mark = "" if busy or row.within_goal else "  <- over"
        lines.append(f"{row.name:<14}{cells[0]}{cells[1]:>11}{error}{spread}{row.goal:>7.0%}"
                     f"{mark}")
    if busy:
        lines.append(f"not judged against the goals: the machine was busy ({busy}); run "
                     f"again alone")
    return "\n".join(lines)


def run_fidelity(config: EngineConfig, args: argparse.Namespace) -> int:
    from carpool.engine.llm_engine import LLMEngine
    from carpool.report.html import write_outputs
    from carpool.sim.costs import load_cost_model, warn_if_elsewhere

    cost = load_cost_model(args.cost_model)
    warn_if_elsewhere(cost)
    result = fidelity(LLMEngine.from_config(config), config, cost, args)
    print(format_rows(result.rows, result.busy))
    print(result.notes)
    warn_if_elsewhere(cost)  # again beside the numbers it puts in doubt
    if args.json:
        out = Path(args.json)
        write_outputs(result.real, str(out / "real.json"), None)
        for run, doc in enumerate(result.more_real, start=2):
            write_outputs(doc, str(out / f"real-{run}.json"), None)
        write_outputs(result.simulated, str(out / "simulated.json"), None)
    judged = result.busy is None and all(row.within_goal for row in result.rows)
    return 1 if args.check and not judged else 0


@dataclass
class FidelityResult:
    rows: list[FidelityRow]
    real: dict  # bench-serve result documents: the first real run,
    simulated: dict  # the simulation
    notes: str  # the cost model's error on the real steps, run lengths, machine load
    more_real: list[dict] = field(default_factory=list)  # the other real runs
    busy: str | None = None  # why the machine was not quiet (then nothing is judged)


def fidelity(engine, config: EngineConfig, cost, args: argparse.Namespace) -> FidelityResult:
    """Replay the workload of ``args`` on ``engine`` in real time
    (``args.real_runs`` times, each on a fresh scheduler, for the real
    side's own spread), then in the simulator with ``cost`` and the
    engine's pool size; compare."""
    from carpool.bench.regimes import encode_workload, warm_up
    from carpool.measure.costs import StepTimer
    from carpool.sim.command import cost_label
    from carpool.sim.costs import machine_warning
    from carpool.sim.simulate import SimSettings, simulate
    from carpool.workload.results import LoadRun, make_result

    workload, offsets = encode_workload(args, engine.tokenizer)
    warm_up(engine, workload[0])
    spec = workload_spec(args)
    run_config = {**{k: v for k, v in vars(args).items()
                     if not k.startswith("engine_") and k != "func"},
                  "workload": describe_workload(spec)}
    runs = max(1, getattr(args, "real_runs", 1))
    timer = StepTimer(engine.config.model.row_bucket)
    for tokens in (min(16, len(workload[0].prompt_token_ids)), 1):
        timer.shapes.see(tokens)  # the warm-up's prefill and decodes ran these
    real_docs, steps, loads = [], [], []
    for run in range(runs):
        print(f"replaying {len(workload)} requests on the real engine "
              f"({offsets[-1]:.0f} s of arrivals; real run {run + 1} of {runs})...")
        replayed, run_steps, load = _real_run(engine if run == 0 else engine.renewed(),
                                              workload, offsets, timer)
        doc = make_result(f"real engine (in-process replay {run + 1})", run_config,
                          LoadRun(replayed.records, replayed.seconds), {})
        doc["machine_load"] = load
        real_docs.append(doc)
        steps += run_steps
        loads.append(load)
    plan = [TraceRequest(offset, len(request.prompt_token_ids), request.output_len,
                         planned.hash_ids)
            for offset, request, planned in zip(offsets, workload, plan_workload(spec))]
    settings = SimSettings(max_model_len=engine.max_model_len,
                           hash_block=mooncake_block_tokens(args.token_scale))
    sim = simulate(plan, config, cost, engine.executor.num_blocks, settings)
    sim_doc = make_result(f"simulated: {cost_label(cost)}", run_config,
                          LoadRun(sim.records, sim.duration, sim.server_samples), {})
    sim_doc["simulation"] = {"cost_model_kind": cost.kind, "cost_model": cost.describe(),
                             "cost_model_warning": machine_warning(cost), "speed": sim.speed()}
    busy = "; ".join(f"real run {i + 1}: {load['why']}" for i, load in enumerate(loads)
                     if load is not None and load["busy"])
    lengths = ", ".join(f"{doc['duration_s']:.1f}" for doc in real_docs)
    if getattr(args, "steps_out", None):
        save_steps(steps, args.steps_out)
    by_region = format_errors_by_region(errors_by_region(steps, cost))
    notes = (f"{step_error_line(steps, cost)}\n{by_region}\n"
             f"real runs {lengths} s, {len(steps)} steps; "
             f"simulated in {sim.wall_seconds:.2f} s, {sim.steps} steps (cost model: "
             f"{cost.kind}); {_load_line(loads)}")
    rows = compare(real_docs[0]["summary"], sim_doc["summary"],
                   [d["summary"] for d in real_docs[1:]])
    return FidelityResult(rows, real_docs[0], sim_doc, notes, real_docs[1:], busy or None)


def _real_run(engine, workload, offsets, timer):
    """One timed replay on ``engine``: (its result, its timed steps, what
    else the machine ran meanwhile)."""
    from carpool.bench.regimes import replay
    from carpool.machine import MachineLoad

    steps = _time_steps(engine, timer)
    load = MachineLoad()
    try:
        replayed = replay(engine, workload, offsets)
    finally:
        del engine.step  # the instance attribute goes; the method is back
        engine.executor = engine.executor._inner
    return replayed, steps, load.report()


def _load_line(loads: list) -> str:
    known = [load for load in loads if load is not None]
    if not known:
        return "machine load unknown (no /proc/stat)"
    return ("machine during the real runs: other processes "
            + ", ".join(f"{load['other_cores']:.2f}" for load in known) + " cores, stolen "
            + ", ".join(f"{load['steal_share']:.1%}" for load in known))


def _time_steps(engine, timer) -> list:
    """Wrap ``engine.step`` to keep the timed steps (shape, seconds, idle
    gap before, new token count) of every step that ran a batch: the cost
    model's own error on the replayed steps. One timer for every real run:
    they share the process, so a token count one run met is not new to the
    next."""
    from carpool.measure.costs import ShapeRecorder

    recorder = ShapeRecorder(engine.executor)
    engine.executor = recorder
    samples: list = []
    step = engine.step

    def timed_step():
        outputs, sample = timer.run(step, recorder)
        if sample is not None:
            samples.append(sample)
        return outputs

    engine.step = timed_step
    return samples
