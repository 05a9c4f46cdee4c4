"""``carpool bench serve``: replay a workload against any OpenAI-compatible
server and measure it from the client (see carpool/workload/stats.py for the
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
import os

import httpx

from carpool.bench.client import Target
from carpool.bench.loadgen import LoadLimits, run_load
from carpool.report.html import write_outputs
from carpool.slo import parse_slo
from carpool.workload.command import add_workload_args, arg_type, workload_spec
from carpool.workload.results import format_result, make_result
from carpool.workload.spec import build_workload, describe_workload


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
                        help="the target model's tokenizer (HF dir, tokenizer.json, .gguf or "
                             "HF repo id) for exact prompt lengths (default: carpool's default "
                             "model)")
    target.add_argument("--prompt-format", choices=("text", "token-ids"), default="text",
                        help="completions: send prompts as text or as token ids (encoded "
                             "with --tokenizer)")
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
    .gguf file, a Hugging Face repo id, or (None) carpool's default model.
    ValueError (one line) when it cannot be loaded."""
    from carpool.model.loader import ModelLoadError, load_tokenizer

    try:
        return load_tokenizer(spec)
    except ModelLoadError as exc:
        raise ValueError(f"--tokenizer: {exc}") from exc


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


def target_from_args(args: argparse.Namespace, tokenizer=None) -> Target:
    """Where to send; ``tokenizer`` encodes prompts under ``--prompt-format token-ids``."""
    token_ids = getattr(args, "prompt_format", "text") == "token-ids"
    if token_ids and args.endpoint != "completions":
        raise ValueError("--prompt-format token-ids needs --endpoint completions "
                         "(chat messages are text)")
    model = args.model or discover_model(args.base_url, args.api_key)
    encode = (lambda text: list(tokenizer.encode(text))) if token_ids else None
    return Target(args.base_url, model, args.endpoint, args.api_key, args.temperature,
                  args.ignore_eos, encode=encode)


def run_config(args: argparse.Namespace, target: Target) -> dict:
    """Every argument (the api key masked) plus the workload's description."""
    skip = {"func", "api_key", "slo"}
    config = {k: v for k, v in vars(args).items() if k not in skip}
    config.update({"model": target.model, "api_key_set": bool(args.api_key),
                   "workload": describe_workload(workload_spec(args))})
    return config


def run_bench_serve(args: argparse.Namespace) -> int:
    tokenizer = load_bench_tokenizer(args.tokenizer)
    target = target_from_args(args, tokenizer)
    plan = build_workload(workload_spec(args), tokenizer)
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
