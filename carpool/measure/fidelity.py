"""``carpool fidelity``: one workload window on the real engine and in the
simulator, and how far apart they are.

The procedure: measure this machine (``carpool measure --out
cost-model.json``), then replay a trace window here twice with the same
engine settings: in real time through the loaded model (the in-process
replay of ``carpool bench regimes``: requests are added at their arrival
times, latency counts from the arrival), and in the simulator with the
measured cost model pricing every step and the same KV pool size. The report gives
each side's TTFT, TPOT and E2E p50/p99 and output throughput, and the
relative error of the simulation (simulated / real - 1). With ``--json
DIR`` both runs are written as bench-serve results (``real.json``,
``simulated.json``) for ``carpool bench compare`` and the HTML report.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from carpool.config import EngineConfig
from carpool.workload.command import add_workload_args, workload_spec
from carpool.workload.spec import describe_workload, mooncake_block_tokens, plan_workload
from carpool.workload.traces import TraceRequest

# (metric, statistic) pairs the report compares; throughput is added apart.
COMPARED = (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("tpot", "p99"),
            ("e2e", "p50"), ("e2e", "p99"))
GOAL = {"p50": 0.10, "p99": 0.15, "throughput": 0.10}  # the goal, as |error|


@dataclass
class FidelityRow:
    name: str
    real: float | None
    simulated: float | None
    goal: float

    @property
    def error(self) -> float | None:
        if not self.real or self.simulated is None:
            return None
        return self.simulated / self.real - 1

    @property
    def within_goal(self) -> bool:
        return self.error is not None and abs(self.error) <= self.goal


def add_fidelity_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, seed_flag="--workload-seed")
    parser.add_argument("--cost-model", required=True,
                        help="this machine's measured cost model (carpool measure --out)")
    parser.add_argument("--json", default=None,
                        help="write real.json and simulated.json (bench-serve results) here")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless every error is within the goal (p50 10%%, p99 "
                             "15%%, throughput 10%%)")


def compare(real: dict, simulated: dict) -> list[FidelityRow]:
    """Rows of (real, simulated) from two bench-serve summaries."""
    rows = [FidelityRow(f"{metric.upper()} {stat}", real[metric][stat], simulated[metric][stat],
                        GOAL[stat]) for metric, stat in COMPARED]
    rows.append(FidelityRow("output tok/s", real["output_throughput"],
                            simulated["output_throughput"], GOAL["throughput"]))
    return rows


def format_rows(rows: list[FidelityRow]) -> str:
    lines = [f"{'':<14}{'real':>10}{'simulated':>11}{'error':>9}{'goal':>7}"]
    for row in rows:
        scale = 1 if row.name.startswith("output") else 1000  # latencies in ms
        cells = [f"{v * scale:>10.1f}" if v is not None else f"{'-':>10}"
                 for v in (row.real, row.simulated)]
        error = f"{row.error:>+9.1%}" if row.error is not None else f"{'-':>9}"
        mark = "" if row.within_goal else "  <- over"
        lines.append(f"{row.name:<14}{cells[0]}{cells[1]:>11}{error}{row.goal:>7.0%}{mark}")
    return "\n".join(lines)


def run_fidelity(config: EngineConfig, args: argparse.Namespace) -> int:
    from carpool.engine.llm_engine import LLMEngine
    from carpool.report.html import write_outputs
    from carpool.sim.costs import load_cost_model

    cost = load_cost_model(args.cost_model)
    result = fidelity(LLMEngine.from_config(config), config, cost, args)
    print(format_rows(result.rows))
    print(result.notes)
    if args.json:
        out = Path(args.json)
        write_outputs(result.real, str(out / "real.json"), None)
        write_outputs(result.simulated, str(out / "simulated.json"), None)
    return 1 if args.check and not all(row.within_goal for row in result.rows) else 0


@dataclass
class FidelityResult:
    rows: list[FidelityRow]
    real: dict  # bench-serve result documents
    simulated: dict
    notes: str  # the cost model's error on the real steps, run lengths


def fidelity(engine, config: EngineConfig, cost, args: argparse.Namespace) -> FidelityResult:
    """Replay the workload of ``args`` on ``engine`` in real time, then in
    the simulator with ``cost`` and the engine's pool size; compare."""
    from carpool.bench.regimes import encode_workload, replay, warm_up
    from carpool.sim.command import cost_label
    from carpool.sim.simulate import SimSettings, simulate
    from carpool.workload.results import LoadRun, make_result

    workload, offsets = encode_workload(args, engine.tokenizer)
    warm_up(engine, workload[0])
    print(f"replaying {len(workload)} requests on the real engine "
          f"({offsets[-1]:.0f} s of arrivals)...")
    steps = _time_steps(engine)
    try:
        real = replay(engine, workload, offsets)
    finally:
        del engine.step  # the instance attribute goes; the method is back
        engine.executor = engine.executor._inner
    plan = [TraceRequest(offset, len(request.prompt_token_ids), request.output_len,
                         planned.hash_ids)
            for offset, request, planned in zip(offsets, workload, plan_workload(workload_spec(args)))]
    settings = SimSettings(max_model_len=engine.max_model_len,
                           hash_block=mooncake_block_tokens(args.token_scale))
    sim = simulate(plan, config, cost, engine.executor.num_blocks, settings)
    run_config = {**{k: v for k, v in vars(args).items()
                     if not k.startswith("engine_") and k != "func"},
                  "workload": describe_workload(workload_spec(args))}
    real_doc = make_result("real engine (in-process replay)", run_config,
                           LoadRun(real.records, real.seconds), {})
    sim_doc = make_result(f"simulated: {cost_label(cost)}", run_config,
                          LoadRun(sim.records, sim.duration, sim.server_samples), {})
    sim_doc["simulation"] = {"cost_model_kind": cost.kind, "cost_model": cost.describe(),
                             "speed": sim.speed()}
    notes = (f"{step_error_line(steps, cost)}\nreal run {real.seconds:.1f} s, {len(steps)} "
             f"steps; simulated in {sim.wall_seconds:.2f} s, {sim.steps} steps (cost model: "
             f"{cost.kind})")
    return FidelityResult(compare(real_doc["summary"], sim_doc["summary"]), real_doc, sim_doc,
                          notes)


def _time_steps(engine) -> list:
    """Wrap ``engine.step`` to keep (shape, seconds) of every step that ran
    a batch: the cost model's own error on the replayed steps."""
    from carpool.measure.costs import ShapeRecorder

    recorder = ShapeRecorder(engine.executor)
    engine.executor = recorder
    samples: list = []
    step = engine.step

    def timed_step():
        recorder.last = None
        started = time.perf_counter()
        outputs = step()
        if recorder.last is not None:
            samples.append((recorder.last, time.perf_counter() - started))
        return outputs

    engine.step = timed_step
    return samples


def step_error_line(samples: list, cost) -> str:
    """How well the cost model priced the real steps: median and p90 of
    |predicted / measured - 1|, and the total of each (the busy time)."""
    if not samples:
        return "no steps ran"
    errors = sorted(abs(cost.step_seconds(shape) / seconds - 1) for shape, seconds in samples)
    measured = sum(seconds for _, seconds in samples)
    predicted = sum(cost.step_seconds(shape) for shape, _ in samples)
    by_kind = {}
    for shape, seconds in samples:
        kind = ("decode" if not shape.prefill_tokens
                else "mixed" if shape.decode_seqs else "prefill")
        by_kind.setdefault(kind, []).append(cost.step_seconds(shape) / seconds - 1)
    kinds = ", ".join(f"{kind} {statistics.median(errs):+.1%} ({len(errs)})"
                      for kind, errs in sorted(by_kind.items()))
    return (f"cost model on the {len(samples)} real steps: |error| median "
            f"{errors[len(errors) // 2]:.1%}, p90 {errors[int(len(errors) * 0.9)]:.1%}; median "
            f"error by kind: {kinds}; busy time measured {measured:.1f} s, predicted "
            f"{predicted:.1f} s")
