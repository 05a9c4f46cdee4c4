"""``carpool bench serve``: replay a workload against any OpenAI-compatible
server and measure it from the client (see carpool/bench/stats.py for the
definitions). Writes a JSON result (with the full config) and, with
``--html``, a report with plots.

The workload comes from ../shared/traces (Azure 2023 conv/code, Mooncake,
ShareGPT/arXiv lengths) or is synthetic; token counts may be scaled down
and time stretched for a small model on a CPU, and every report states
both factors.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from datetime import datetime, timezone
from pathlib import Path

import httpx

from carpool.bench.client import Target
from carpool.bench.loadgen import LoadLimits, LoadRun, run_load
from carpool.bench.stats import (
    LATENCY_METRICS,
    PERCENTILES,
    phase_summaries,
    summarize,
    timeseries,
)
from carpool.bench.tune import parse_slo
from carpool.bench.workload import (
    add_workload_args,
    arg_type,
    build_workload,
    describe_workload,
)

RESULT_KIND, RESULT_VERSION = "bench-serve", 1


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """The server to measure, and the run's limits and outputs (shared with ``sweep``)."""
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="the server's OpenAI API root")
    target.add_argument("--model", default=None,
                        help="model name to request (default: the server's first /v1/models)")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="completions sends the prompt as is (exact token counts); chat "
                             "wraps it in one user message (the chat template adds tokens)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    target.add_argument("--tokenizer", default=None,
                        help="the target model's tokenizer (HF dir, tokenizer.json or .gguf) "
                             "for exact prompt lengths (default: carpool's default model)")
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let the model stop early (default: ignore_eos, so every "
                             "request generates its workload length)")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--max-concurrency", type=int, default=None,
                        help="cap on requests in flight (default: none, open loop)")
    limits.add_argument("--max-duration", type=float, default=None,
                        help="send no request after this many seconds")
    limits.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds before a request is given up (failed: timeout)")
    out = parser.add_argument_group("results")
    out.add_argument("--slo", type=arg_type(parse_slo), default={},
                     help="per-request limits for goodput, e.g. ttft=500ms,tpot=100ms "
                          "(metrics: ttft, tpot, e2e)")
    out.add_argument("--label", default=None, help="name of this run in reports")
    out.add_argument("--json", default=None, help="write the result here")
    out.add_argument("--html", default=None, help="write an HTML report with plots here (dir)")
    out.add_argument("--no-progress", dest="progress", action="store_false")
    out.add_argument("--metrics-interval", type=float, default=0.5,
                     help="seconds between polls of the server's /metrics queue gauges")


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    add_target_args(parser)
    add_workload_args(parser)


def load_bench_tokenizer(spec: str | None):
    """The tokenizer prompts are built with: a HF dir, a tokenizer.json, a
    .gguf file, or (None) carpool's default model."""
    from carpool.model.tokenizer import Tokenizer

    if spec and Path(spec).is_dir():
        return Tokenizer.from_dir(spec)
    if spec and Path(spec).name == "tokenizer.json":
        return Tokenizer.from_dir(Path(spec).parent)
    from carpool.model.hub import fetch_default_model
    from carpool.model.loader import ensure_converted
    from carpool.paths import default_cache_dir

    cache = default_cache_dir()
    if spec is None:
        return Tokenizer.from_dir(ensure_converted(fetch_default_model(cache), cache))
    if Path(spec).suffix.lower() == ".gguf" and Path(spec).is_file():
        return Tokenizer.from_dir(ensure_converted(Path(spec), cache))
    raise ValueError(f"--tokenizer {spec!r}: expected a model dir, a tokenizer.json or a "
                     f".gguf file")


def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists; a clear error when it cannot be reached."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base_url.rstrip('/')}/models"
    try:
        response = httpx.get(url, headers=headers, timeout=10.0)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"cannot list models at {url} ({exc}); is the server up? "
                         f"Pass --model to skip this") from None


def target_from_args(args: argparse.Namespace) -> Target:
    model = args.model or discover_model(args.base_url, args.api_key)
    return Target(args.base_url, model, args.endpoint, args.api_key, args.temperature,
                  args.ignore_eos)


def make_result(label: str, config: dict, run: LoadRun, slo: dict[str, float],
                per_request: bool = True) -> dict:
    """The bench-serve JSON document (also what ``carpool simulate`` writes);
    without ``per_request`` its ``requests`` list is left empty (a result
    that is only printed)."""
    return {
        "kind": RESULT_KIND, "version": RESULT_VERSION, "label": label,
        "started_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": config, "duration_s": run.duration,
        "summary": summarize(run.records, run.duration, slo),
        "phases": phase_summaries(run.records, (config.get("workload") or {}).get("surges")
                                  or [], slo),
        "timeseries": timeseries(run.records, run.duration, run.server_samples),
        "requests": [r.to_dict() for r in run.records] if per_request else [],
    }


def run_config(args: argparse.Namespace, target: Target) -> dict:
    """Every argument (the api key masked) plus the workload's description."""
    skip = {"func", "api_key", "slo"}
    config = {k: v for k, v in vars(args).items() if k not in skip}
    config.update({"model": target.model, "api_key_set": bool(args.api_key),
                   "workload": describe_workload(args)})
    return config


def run_bench_serve(args: argparse.Namespace) -> int:
    tokenizer = load_bench_tokenizer(args.tokenizer)
    target = target_from_args(args)
    plan = build_workload(args, tokenizer)
    limits = LoadLimits(args.max_concurrency, args.max_duration, args.request_timeout)
    run = asyncio.run(run_load(plan, target, limits, token_counter(tokenizer), args.progress,
                               args.metrics_interval, "bench serve"))
    label = args.label or f"{target.model} @ {target.base_url}"
    result = make_result(label, run_config(args, target), run, args.slo)
    print(format_result(result))
    write_outputs(result, args.json, args.html)
    return 0


def token_counter(tokenizer):
    return lambda text: len(tokenizer.encode(text))


def write_outputs(result: dict, json_path: str | None, html_dir: str | None) -> None:
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {json_path}")
    if html_dir:
        from carpool.bench.html_report import write_report

        print(f"wrote {write_report(result, Path(html_dir))}")


def format_result(result: dict) -> str:
    """The summary as text: counts, throughput, goodput, latency percentiles (ms)."""
    s, workload = result["summary"], result["config"].get("workload", {})
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(s["rejected_by_reason"].items()))
    failed = ", ".join(f"{k} {v}" for k, v in sorted(s["failed_by_reason"].items()))
    lines = [
        f"== {result['label']} ==",
        f"workload: {workload.get('name')} | token counts x{workload.get('token_scale', 1):g}, "
        f"time x{workload.get('time_scale', 1):g} | arrivals {workload.get('arrival')}"
        + (f"\nnote: {workload['excerpt']}" if workload.get("excerpt") else ""),
        f"requests {s['requests']}: completed {s['completed']}, rejected {s['rejected']}"
        f"{f' ({rejected})' if rejected else ''}, failed {s['failed']}"
        f"{f' ({failed})' if failed else ''}" + (f", unsent {s['unsent']}" if s["unsent"] else ""),
        f"duration {result['duration_s']:.1f} s | {s['request_throughput']:.2f} req/s | "
        f"output {s['output_throughput']:.1f} tok/s | total {s['total_token_throughput']:.1f} "
        f"tok/s | peak concurrency {s['peak_concurrency']}",
    ]
    if s["slo"]:
        limits = ", ".join(f"{k}<={v * 1000:g}ms" for k, v in s["slo"].items())
        lines.append(f"goodput {s['goodput']:.2f} req/s, {s['slo_attainment']:.1%} of "
                     f"requests meet {limits}")
    if s["token_count_mismatches"]:
        lines.append(f"note: {s['token_count_mismatches']} responses' usage differs from our "
                     f"tokenizer's count of their text")
    lines += format_phases(result.get("phases") or [])
    header = f"{'ms':<6}" + "".join(f"{c:>9}" for c in ["mean", *[f"p{q}" for q in PERCENTILES]])
    lines.append(header)
    for metric in LATENCY_METRICS:
        values = s[metric]
        cells = [values["mean"], *[values[f"p{q}"] for q in PERCENTILES]]
        lines.append(f"{metric.upper():<6}" + "".join(
            f"{'-':>9}" if v is None else f"{v * 1000:>9.1f}" for v in cells))
    return "\n".join(lines)


def format_phases(phases: list[dict]) -> list[str]:
    """One line per phase of a surge schedule (nothing for a single phase)."""
    if len(phases) < 2:
        return []

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = [f"{'phase':<14}{'offered/s':>10}{'sent':>6}{'rejected':>10}{'TTFT p99':>10}"
             f"{'TPOT p99':>10}{'goodput/s':>11}"]
    for p in phases:
        goodput = "-" if p["goodput"] is None else f"{p['goodput']:.2f}"
        lines.append(f"{p['phase']:<14}{p['offered_rate']:>10.2f}{p['requests']:>6}"
                     f"{p['rejected_share']:>9.1%} {ms(p['ttft']['p99']):>9}"
                     f"{ms(p['tpot']['p99']):>10}{goodput:>11}")
    return lines
