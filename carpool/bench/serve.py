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
from dataclasses import dataclass

import httpx

from carpool.bench.client import Target
from carpool.bench.loadgen import LoadLimits, run_load
from carpool.report.html import write_outputs
from carpool.settings_fields import add_setting_args, setting
from carpool.slo import parse_slo
from carpool.workload.command import add_workload_args, arg_type, workload_spec
from carpool.workload.results import format_result, make_result
from carpool.workload.spec import build_workload, describe_workload

API_KEY_HELP = "bearer token (default: $OPENAI_API_KEY)"


@dataclass
class ServerTarget:
    """``bench serve`` / ``sweep``: the server to measure and how requests look."""

    base_url: str = setting(
        "http://127.0.0.1:8000/v1", "--base-url", "BASE_URL",
        "the server's OpenAI API root")
    model: str | None = setting(
        None, "--model", "MODEL",
        "model name to request (default: the server's first /v1/models)")
    endpoint: str = setting(
        "completions", "--endpoint", None,
        "completions sends the prompt as is (exact token counts); chat wraps it in one user "
        "message (the chat template adds tokens)", choices=("completions", "chat"))
    # The command's default is $OPENAI_API_KEY, read when the parser is built.
    api_key: str | None = setting(None, "--api-key", "API_KEY", API_KEY_HELP)
    tokenizer: str | None = setting(
        None, "--tokenizer", "TOKENIZER",
        "the target model's tokenizer (HF dir, tokenizer.json, .gguf or HF repo id) for exact "
        "prompt lengths (default: carpool's default model)")
    prompt_format: str = setting(
        "text", "--prompt-format", None,
        "completions: send prompts as text or as token ids (encoded with --tokenizer)",
        choices=("text", "token-ids"))
    temperature: float = setting(
        0.0, "--temperature", "TEMPERATURE", "sampling temperature of every request",
        parse=float)
    ignore_eos: bool = setting(
        True, "--ignore-eos", None,
        "send ignore_eos (the default), so every request generates its workload length; "
        "--no-ignore-eos lets the model stop early", parse=bool)


@dataclass
class RunLimits:
    """When a run stops sending and gives up (the fields of ``LoadLimits``)."""

    max_concurrency: int | None = setting(
        None, "--max-concurrency", "MAX_CONCURRENCY",
        "cap on requests in flight (default: none, open loop)", parse=int)
    max_duration: float | None = setting(
        None, "--max-duration", "MAX_DURATION",
        "send no request after this many seconds", parse=float)
    request_timeout: float = setting(
        600.0, "--request-timeout", "REQUEST_TIMEOUT",
        "seconds before a request is given up (failed: timeout)", parse=float)


@dataclass
class RunOutputs:
    """What a run is judged by, what it is called, where it is written."""

    slo: dict[str, float] = setting(
        {}, "--slo", "SLO",
        "per-request limits for goodput, e.g. ttft=500ms,tpot=100ms (metrics: ttft, tpot, e2e)",
        parse=arg_type(parse_slo))
    label: str | None = setting(None, "--label", "LABEL", "name of this run in reports")
    json: str | None = setting(None, "--json", "JSON", "write the result here")
    html: str | None = setting(
        None, "--html", "HTML", "write an HTML report with plots here (dir)")
    progress: bool = setting(
        True, "--progress", None, "a progress bar while the requests run (default: on)", parse=bool)
    metrics_interval: float = setting(
        0.5, "--metrics-interval", "METRICS_INTERVAL",
        "seconds between polls of the server's /metrics queue gauges", parse=float)


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """The server to measure, and the run's limits and outputs (shared with ``sweep``)."""
    api_key = os.environ.get("OPENAI_API_KEY")
    add_setting_args(parser.add_argument_group("server"), ServerTarget,
                     defaults={"api_key": (api_key, API_KEY_HELP)})
    add_setting_args(parser.add_argument_group("limits"), RunLimits)
    add_setting_args(parser.add_argument_group("results"), RunOutputs)


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
