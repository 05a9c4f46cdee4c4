"""``carpool bench regimes``: one workload replayed in real time against the
engine under each batching regime, side by side, with ratios to the first.

The workload is the one ``carpool bench serve`` sends (a shared trace with
its own timestamps, trace lengths under a seeded arrival process, or
synthetic; see carpool/workload/spec.py), tokenized once; every regime
replays the same requests at the same times with ``ignore_eos``, so all do
the same work. Latency counts from the intended arrival time, so a regime
that falls behind pays for it in TTFT. All regimes share one loaded model.

Static and dynamic batches run padded (``padding: right`` unless the
settings say otherwise), so they pay the padding a real request-level
batcher pays; continuous batching never pads. Fill rate = real tokens /
computed token slots; padding waste = 1 - fill; effective tok/s counts real
tokens only. With ``--slo`` and ``--rates``, each regime is also replayed
at each of those offered rates (the schedule's gaps rescaled) and the
highest rate at which ``--attainment`` of requests meet the SLO is its
peak rate under the SLO.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from carpool.bench.regimes_report import excess_share, print_row, print_table
from carpool.bench.throughput import BenchRequest
from carpool.config import EngineConfig
from carpool.sampling_params import SamplingParams
from carpool.scheduler import RejectedError
from carpool.settings_fields import add_setting_args, setting
from carpool.slo import parse_slo
from carpool.workload.arrivals import rescale_offsets
from carpool.workload.command import add_workload_args, arg_type, workload_spec
from carpool.workload.spec import build_workload, describe_workload
from carpool.workload.stats import OK, REJECTED, RequestRecord, summarize

# Regimes: the three batching modes, and continuous batching under the adaptive controller.
REGIMES = ("static", "dynamic", "continuous", "adaptive")


@dataclass
class RegimesOptions:
    """The flags of ``carpool bench regimes`` besides the workload's and the engine's."""

    regimes: str = setting(
        ",".join(REGIMES), "--regimes", "REGIMES",
        f"comma-separated, from {', '.join(REGIMES)} (adaptive = continuous under the "
        f"adaptive controller)")
    slo: dict[str, float] = setting(
        {}, "--slo", "SLO", "per-request limits, e.g. ttft=2s,tpot=400ms (ttft, tpot, e2e)",
        parse=arg_type(parse_slo))
    rates: str = setting(
        "", "--rates", "RATES",
        "offered rates (req/s) at which to look for each regime's peak rate under --slo, "
        "e.g. 1,2,3")
    attainment: float = setting(
        0.9, "--attainment", "ATTAINMENT", "share of requests that must meet the SLO at a rate",
        parse=float)
    json: str | None = setting(None, "--json", "JSON", "write the results here as JSON")


def add_regimes_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, seed_flag="--workload-seed")
    add_setting_args(parser, RegimesOptions)


@dataclass
class RegimeResult:
    regime: str
    padding: str
    seconds: float  # first arrival to last finish
    computed_tokens: int
    slot_tokens: int
    busy_seconds: float
    batches: int
    records: list[RequestRecord]

    def row(self, slo: dict[str, float] | None = None) -> dict:
        """The regime's line: throughput, busy share, fill, latency mean/p50/p99."""
        summary = summarize(self.records, self.seconds, slo)
        fill = self.computed_tokens / max(1, self.slot_tokens)
        row = {
            "regime": self.regime, "padding": self.padding, "requests": summary["requests"],
            "output_tokens": summary["output_tokens"], "seconds": self.seconds,
            "output_tok_s": summary["output_throughput"],
            "effective_tok_s": self.computed_tokens / self.seconds,
            "fill_rate": fill, "padding_waste": 1.0 - fill,
            "slot_tokens": self.slot_tokens, "computed_tokens": self.computed_tokens,
            "busy": self.busy_seconds / self.seconds, "batches": self.batches,
            "rejected_share": summary["rejected_share"],
            "slo_attainment": summary["slo_attainment"]}
        for metric in ("ttft", "tpot", "e2e"):
            for stat in ("mean", "p50", "p99", "max"):
                row[f"{metric}_{stat}"] = _nan(summary[metric][stat])
        return row


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def replay(engine, workload: list[BenchRequest], offsets: list[float]) -> RegimeResult:
    """Add each request at its arrival time, step whenever there is work."""
    start = time.monotonic()
    counters_before = engine.counters.copy()
    pending = list(zip(offsets, workload))
    pending.reverse()
    records: dict[str, RequestRecord] = {}
    turned_away = []
    while pending or engine.has_unfinished:
        now = time.monotonic() - start
        while pending and pending[-1][0] <= now:
            offset, request = pending.pop()
            record = RequestRecord(len(records) + len(turned_away), offset,
                                   len(request.prompt_token_ids), request.output_len, sent=offset)
            try:
                request_id = engine.add_request(request.prompt_token_ids, SamplingParams(
                    max_tokens=request.output_len, temperature=0, ignore_eos=True),
                    arrival_time=start + offset)
                records[request_id] = record
            except RejectedError:  # admission control said no at arrival (HTTP 429)
                record.status, record.reason, record.finished = REJECTED, "admission", offset
                turned_away.append(record)
        if engine.has_unfinished:
            for output in engine.step():
                if output.finished:
                    _finish(records[output.request_id], output, start)
        elif pending:
            time.sleep(max(0.0, pending[-1][0] - now))  # idle until the next arrival
    everything = sorted([*records.values(), *turned_away], key=lambda r: r.index)
    return _result(engine, everything, counters_before, time.monotonic() - start)


def _finish(record: RequestRecord, output, start: float) -> None:
    """In-process records carry the first and the last token's times only
    (TTFT, TPOT and E2E are exact; there is no per-chunk ITL)."""
    record.finished = output.finish_time - start
    if output.finish_reason == "rejected":  # shed while queued
        record.status, record.reason = REJECTED, "shed"
        return
    record.status = OK
    record.chunk_times = [output.first_token_time - start]
    record.output_tokens = output.num_output_tokens
    record.cached_tokens = output.num_cached_tokens


def _result(engine, records: list[RequestRecord], before, seconds: float) -> RegimeResult:
    after = engine.counters
    gate = engine.scheduler.gate
    adaptive = engine.scheduler.controller is not None
    return RegimeResult(
        regime="adaptive" if adaptive else engine.config.scheduler.batching,
        padding=engine.config.scheduler.padding_mode, seconds=seconds,
        computed_tokens=after.computed_tokens - before.computed_tokens,
        slot_tokens=after.slot_tokens - before.slot_tokens,
        busy_seconds=after.busy_seconds - before.busy_seconds,
        batches=gate.stats.batches if gate else 0, records=records)


def encode_workload(args: argparse.Namespace, tokenizer) -> tuple[list[BenchRequest], list[float]]:
    """The shared workload as token ids (exact: prompts are built with this
    tokenizer) and its send offsets."""
    items = build_workload(workload_spec(args), tokenizer)
    return ([BenchRequest(tokenizer.encode(item.prompt), item.output_tokens) for item in items],
            [item.offset for item in items])


def parse_rates(text: str) -> list[float]:
    rates = sorted({float(r) for r in text.split(",") if r.strip()})
    if any(r <= 0 for r in rates):
        raise ValueError(f"--rates must be positive, got {text!r}")
    return rates


def surge_summary(base, config: EngineConfig, workload: list[BenchRequest],
                  offsets: list[float]) -> dict:
    """Capacity (requests/s, every request at once, continuous batching) and
    the excess load of this schedule against the TTFT target."""
    from carpool.engine.llm_engine import LLMEngine

    engine = LLMEngine(regime_config(config, "continuous"), base.tokenizer, base.model_config,
                       base.executor, base.max_model_len)
    offline = replay(engine, workload, [0.0] * len(workload))
    capacity = len(workload) / offline.seconds
    target = config.controller.concrete().ttft_target or 0.0  # auto: the fallback
    excess = excess_share(offsets, capacity, target)
    print(f"capacity {capacity:.2f} requests/s (all {len(workload)} at once); offered "
          f"{len(offsets) / max(offsets[-1], 1e-9):.2f}/s on average; excess load over "
          f"capacity at TTFT target {target:g} s: {excess:.1%}", flush=True)
    return {"capacity_rps": capacity, "excess_share": excess, "ttft_target": target}


def run_regimes(config: EngineConfig, args: argparse.Namespace) -> int:
    from carpool.engine.llm_engine import LLMEngine

    base = LLMEngine.from_config(config)
    workload, offsets = encode_workload(args, base.tokenizer)
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    unknown = set(regimes) - set(REGIMES)
    if unknown:
        raise ValueError(f"unknown regimes {sorted(unknown)}; choose from {', '.join(REGIMES)}")
    rates = parse_rates(args.rates)
    if rates and not args.slo:
        raise ValueError("--rates looks for the peak rate under an SLO: give --slo too")
    warm_up(base, workload[0])
    if "adaptive" in regimes:
        print(f"adaptive: {adaptive_targets(base, args.slo).describe()}", flush=True)
    summary = surge_summary(base, config, workload, offsets) if args.surge else {}

    def engine_for(regime: str):
        return LLMEngine(regime_config(config, regime), base.tokenizer, base.model_config,
                         base.executor, base.max_model_len)

    rows = []
    for regime in regimes:
        row = replay(engine_for(regime), workload, offsets).row(args.slo)
        row["rates"] = {}
        for rate in rates:
            at_rate = replay(engine_for(regime), workload, rescale_offsets(offsets, rate)).row(args.slo)
            row["rates"][rate] = at_rate
        met = [rate for rate, r in row["rates"].items() if r["slo_attainment"] >= args.attainment]
        row["peak_rate_under_slo"] = max(met) if met else None
        rows.append(row)
        print_row(row, rows[0], bool(rates))
    print_table(rows, args, describe_workload(workload_spec(args)))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"config": {k: v for k, v in vars(args).items() if k != "func"},
             "workload": describe_workload(workload_spec(args)), "scheduler": vars(config.scheduler),
             "controller": vars(config.controller), **summary, "results": rows},
            indent=2, default=str))
    return 0


def adaptive_targets(engine, slo: dict[str, float]):
    """The adaptive regime's targets, set on ``engine.config.controller``:
    those the settings give, else ``--slo``'s TTFT / TPOT (the SLO the run is
    judged by), else measured as ``carpool serve`` does (a ``ServingSLO``)."""
    from carpool.engine.calibrate import resolve_targets

    controller, sources = engine.config.controller, {}
    for metric in controller.auto_targets:
        if metric in slo:
            setattr(controller, f"{metric}_target", slo[metric])
            sources[metric] = "--slo"
    return resolve_targets(engine, sources)


def regime_config(config: EngineConfig, regime: str) -> EngineConfig:
    """``config`` under one regime. Continuous never pads; static and dynamic
    keep the settings' padding (None: right); only ``adaptive`` runs the controller."""
    batching = "continuous" if regime == "adaptive" else regime
    padding = "none" if batching == "continuous" else config.scheduler.padding
    out = EngineConfig.from_dict({})
    out.update({"model": vars(config.model), "cache": vars(config.cache),
                "scheduler": {**vars(config.scheduler), "batching": batching,
                              "padding": padding},
                "controller": {**vars(config.controller), "adaptive": regime == "adaptive"}})
    return out.validate()


def warm_up(engine, request: BenchRequest) -> None:
    """One short request through the engine, so first-step costs are paid before timing."""
    engine.add_request(request.prompt_token_ids[:16], SamplingParams(max_tokens=4))
    while engine.has_unfinished:
        engine.step()
