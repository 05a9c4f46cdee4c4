"""``carpool`` command line: serve, generate, chat, bench, tune, profiles, profile.

Every engine knob is a flag; ``--config x.yaml`` loads a file first and
flags given on the command line win (CLI > file > defaults).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from carpool import __version__
from carpool.config import EngineConfig, read_yaml
from carpool.sampling_params import SamplingParams
from carpool.slo import parse_target, slo_arg, slo_sources


# (flag, config key, type, help). The key is an EngineConfig field name.
def _flag_bool(value: str) -> bool:
    """A true/false flag value (1/0, yes/no, on/off too); anything else is an error."""
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


ENGINE_FLAGS: list[tuple[str, str, type, str]] = [
    ("--model", "model", str, "HF model directory or .gguf file (default: SmolLM2-135M-Instruct)"),
    ("--tokenizer", "tokenizer", str,
     "tokenizer directory or .gguf when not the model's own (default: the model's)"),
    ("--chat-template", "chat_template", str,
     "chat template: a Jinja file or the template text (default: the model's own)"),
    ("--dtype", "dtype", str, "auto | float32 (float) | bfloat16 | float16 (half) (auto: bf16 "
                              "on GPU and on CPUs with native bf16, else fp32)"),
    ("--device", "device", str, "auto | cpu | cuda[:N]"),
    ("--max-model-len", "max_model_len", int, "context limit (default: the model's)"),
    ("--attention-backend", "attention_backend", str,
     "auto | torch | sdpa | cpu (our C++ decode kernel) | triton (our GPU kernels; auto on CUDA)"),
    ("--cuda-graph-sizes", "cuda_graph_sizes", str,
     "decode batch sizes captured as CUDA graphs: auto or a comma list, e.g. 1,2,4,8,16,32"),
    ("--cache-dir", "cache_dir", str, "where models are fetched and converted "
                                      "(default: $CARPOOL_CACHE or ~/.cache/carpool)"),
    ("--threads", "threads", int, "torch CPU threads (default: torch's choice)"),
    ("--seed", "seed", int, "seeds the per-request seeds of requests that give none"),
    ("--row-bucket", "row_bucket", int, "pad each step's token rows to a multiple of this "
                                        "before the linear layers (1: exact rows)"),
    ("--block-size", "block_size", int, "tokens per KV block"),
    ("--kv-cache-memory", "kv_cache_memory", str, "KV pool budget, e.g. 512MiB, 2GiB"),
    ("--num-blocks", "num_blocks", int, "KV pool size in blocks (overrides --kv-cache-memory)"),
    ("--watermark", "watermark", float, "fraction of blocks kept free when admitting"),
    ("--max-num-seqs", "max_num_seqs", int, "most requests running at once"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget of one step"),
    ("--scheduling-policy", "policy", str, "fcfs | priority"),
    ("--max-queue-requests", "max_queue_requests", int,
     "waiting requests beyond which new ones are rejected (HTTP 429)"),
    ("--max-queue-tokens", "max_queue_tokens", int,
     "waiting prompt tokens beyond which new requests are rejected"),
    ("--queue-timeout", "queue_timeout", float,
     "seconds a request may wait to start before it is rejected"),
    ("--session-ttl", "session_ttl", float,
     "seconds a session's prefix stays preferred in the KV cache"),
    ("--max-session-requests", "max_session_requests", int,
     "unfinished requests one session may hold (more get 429 session_full)"),
    ("--aging-interval", "aging_interval", float,
     "policy priority: seconds of waiting that raise a request one priority class "
     "(null in a config file: no aging)"),
    ("--long-prompt-threshold", "long_prompt_threshold", int,
     "prompts longer than this many tokens share the long-prefill allowance"),
    ("--long-prefill-share", "long_prefill_share", float,
     "fraction of the step token budget long prompts get for prefill while short "
     "requests wait (1 = no cap)"),
    ("--batching", "batching", str, "continuous | static | dynamic (request-level baselines)"),
    ("--preferred-batch-size", "preferred_batch_size", int,
     "static: the batch size; dynamic: dispatch when a length bucket holds this many"),
    ("--max-batch-size", "max_batch_size", int, "dynamic: most requests in one batch"),
    ("--max-wait", "max_wait", float,
     "static/dynamic: seconds the oldest request waits before a partial batch goes"),
    ("--padding", "padding", str,
     "static/dynamic: pad each step to a rectangle: none | left | right | center (default right)"),
    ("--bucket-tolerance", "bucket_tolerance", float,
     "dynamic: a length bucket holds prompts within this fraction of its length"),
    ("--predictive-shedding", "predictive_shedding", _flag_bool,
     "reject at arrival a request predicted to miss its deadline or TTFT target "
     "(default true)"),
    ("--emergency-switch", "emergency_switch", _flag_bool,
     "true: under sustained overload shed the lowest priorities first"),
    ("--max-batch-tokens", "max_batch_tokens", int, "same as --max-num-batched-tokens"),
    ("--adaptive", "adaptive", _flag_bool,
     "the adaptive controller and SLO admission (default: on for serve, off elsewhere); "
     "false: plain batching at the configured knobs"),
    ("--controller-interval", "controller_interval", float,
     "adaptive: seconds between regular controller decisions (>= 0.1; events tick sooner)"),
    ("--controller-window", "controller_window", float,
     "adaptive: seconds of live metrics the slow signals read"),
    ("--controller-fast-window", "controller_fast_window", float,
     "adaptive: seconds of live metrics the fast signals (step times, arrivals) read"),
    ("--controller-mode", "controller_mode", str,
     "adaptive: auto | latency | balanced | throughput (a fixed mode)"),
    ("--ttft-target", "ttft_target", parse_target,
     "adaptive: p99 time-to-first-token target (0.5, 500ms or auto: measured at serve "
     "start-up); admission sheds predicted misses"),
    ("--tpot-target", "tpot_target", parse_target,
     "adaptive: p99 time-per-output-token target (0.1, 100ms or auto)"),
    ("--calibrate", "calibrate", _flag_bool,
     "serve: measure the unloaded TTFT/TPOT at start-up for auto targets (default true; "
     "false: auto targets are 2 s / 200 ms)"),
    ("--memory-headroom", "memory_headroom", float,
     "adaptive: share of the KV pool the batch limit keeps free"),
    ("--transition-steps", "transition_steps", int,
     "adaptive: scheduler steps a knob change is spread over (1..3)"),
    ("--hysteresis-ticks", "hysteresis_ticks", int,
     "adaptive: ticks in a row asking for a change before mode, alpha or correction move"),
    ("--shed-on-ttft-target", "shed_on_ttft_target", _flag_bool,
     "adaptive: reject at arrival what is predicted to miss the TTFT target (default true)"),
]

# (flag, ServerConfig field, type, help)
SERVER_FLAGS: list[tuple[str, str, type, str]] = [
    ("--host", "host", str, "address to listen on (default 127.0.0.1; 0.0.0.0 for all)"),
    ("--port", "port", int, "port to listen on (default 8000; 0 = any free port)"),
    ("--served-model-name", "served_model_name", str, "model name in the API"),
    ("--api-key", "api_key", str, "require 'Authorization: Bearer KEY' (visible in ps: "
                                  "prefer $CARPOOL_API_KEY or --api-key-file; none = open)"),
    ("--api-key-file", "api_key_file", str, "read the API key from this file's first line"),
    ("--api-keys", "api_keys", str, "YAML/JSON file of API keys, each with its tenant and "
                                    "privileges (max_priority, share_prefix_cache)"),
    ("--header-timeout", "header_timeout", float,
     "seconds a connection may take to send a request head (default 10)"),
    ("--keep-alive-timeout", "keep_alive_timeout", float,
     "seconds an idle keep-alive connection stays open (default 5)"),
    ("--special-tokens-in-content", "special_tokens_in_content",
     _flag_bool,
     "true: parse special-token text (<|im_start|>...) inside chat message content "
     "(default false: it is plain text)"),
    ("--shutdown-timeout", "shutdown_timeout", float,
     "seconds in-flight requests get to finish after SIGTERM"),
    ("--status-interval", "status_interval", float, "seconds between status lines while busy"),
    ("--max-body-bytes", "max_body_bytes", int, "largest request body accepted"),
    ("--max-n", "max_n", int, "largest n accepted"),
    ("--max-tokens-cap", "max_tokens_cap", int, "largest max_tokens accepted"),
    ("--max-prompt-chars", "max_prompt_chars", int,
     "most characters of prompt text (or chat messages) in one request (HTTP 400 beyond)"),
    ("--max-header-bytes", "max_header_bytes", int, "largest request head accepted (HTTP 431)"),
    ("--max-prompts", "max_prompts", int, "most prompts in one /v1/completions call"),
    ("--max-messages", "max_messages", int, "most chat messages in one call"),
    ("--max-logprobs", "max_logprobs", int, "largest logprobs / top_logprobs accepted (0..20)"),
    ("--max-stop", "max_stop", int, "most stop strings in one request"),
    ("--prep-workers", "prep_workers", int,
     "threads that parse, template and tokenize requests off the event loop"),
    ("--stall-timeout", "stall_timeout", float,
     "seconds busy without a step before /health answers 503"),
    ("--uvicorn-log-level", "uvicorn_log_level", str,
     "uvicorn's own log level: critical | error | warning (default) | info | debug | trace"),
    ("--metrics-prefix", "metrics_prefix", str,
     "Prometheus series names: carpool (default) | vllm (vLLM's dashboards unchanged) | both"),
]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--config", help="YAML file of engine settings (flags override it)")
    for flag, key, kind, help_text in ENGINE_FLAGS:
        group.add_argument(flag, dest=f"engine_{key}", type=kind, default=None, help=help_text)
    group.add_argument("--enforce-eager", dest="engine_enforce_eager", action="store_true",
                       default=None, help="CUDA: run every step eagerly (no CUDA graphs)")
    group.add_argument("--enable-prefix-caching", dest="engine_enable_prefix_caching",
                       action="store_true", default=None,
                       help="reuse cached KV blocks of shared prefixes (the default)")
    group.add_argument("--no-enable-prefix-caching", "--no-prefix-caching",
                       dest="engine_enable_prefix_caching", action="store_false", default=None,
                       help="disable prefix caching")


def _config_layers(args: argparse.Namespace) -> list[dict]:
    """Settings files in increasing precedence: the profile, then --config.

    A profile's ``schedule`` resolves to the window active at the local time
    now (``args.profile_time``, a ``datetime.time``, if set); every window is
    validated either way.
    """
    from datetime import datetime

    from carpool.profiles import load_profile, read_yaml
    from carpool.profiles.schedule import ProfileSchedule

    layers = []
    if getattr(args, "profile", None):
        schedule = ProfileSchedule.from_profile(load_profile(args.profile))
        at = getattr(args, "profile_time", None) or datetime.now().time()
        layers.append(schedule.settings_at(at))
    if args.config:
        layers.append(read_yaml(args.config))
    return layers


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """defaults < --profile < --config file < flags (a file's ``server:``
    section is for ``carpool serve``)."""
    config = EngineConfig()
    for layer in _config_layers(args):
        config.update({k: v for k, v in layer.items() if k != "server"})
    overrides = {name[len("engine_"):]: value for name, value in vars(args).items()
                 if name.startswith("engine_") and value is not None}
    if "slo" in overrides:  # serve's --slo first: --ttft-target / --tpot-target win over it
        config.update({"slo": overrides.pop("slo")})
    config.update(overrides)
    return config.validate()


def profile_schedule(args: argparse.Namespace):
    """The ``--profile``'s time-of-day windows to apply live (a
    ``ProfileSchedule``), or None; knobs that flags or ``--config`` set are
    pinned: a window never changes them."""
    if not getattr(args, "profile", None):
        return None
    from carpool.profiles import load_profile
    from carpool.profiles.schedule import ProfileSchedule

    pinned = {name[len("engine_"):] for name, value in vars(args).items()
              if name.startswith("engine_") and value is not None}
    if args.config:
        layer = read_yaml(args.config)
        pinned |= set(layer) | set(layer.get("scheduler") or {})
    schedule = ProfileSchedule.from_profile(load_profile(args.profile), pinned)
    return schedule if schedule.knobs() else None


def server_config_from_args(args: argparse.Namespace):
    from carpool.server.config import ServerConfig

    config = ServerConfig()
    for layer in _config_layers(args):
        section = layer.get("server") or {}
        if not isinstance(section, dict):
            raise ValueError("the 'server' section of a config file must be a mapping")
        for key, value in section.items():
            if not hasattr(config, key):
                raise ValueError(f"unknown config key 'server.{key}'")
            setattr(config, key, value)
    for _, key, _, _ in SERVER_FLAGS:
        value = getattr(args, f"server_{key}")
        if value is not None:
            setattr(config, key, value)
    if args.cors_origins:
        config.cors_origins = list(args.cors_origins)
    if args.allowed_hosts:
        config.allowed_hosts = list(args.allowed_hosts)
    return config.validate()


def add_serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_path", nargs="?", default=None,
                       help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--profile", default=None,
                       help="settings profile: a built-in name or a YAML file (flags override it)")
    group = serve.add_argument_group("server")
    for flag, key, kind, help_text in SERVER_FLAGS:
        group.add_argument(flag, dest=f"server_{key}", type=kind, default=None, help=help_text)
    group.add_argument("--cors-origins", nargs="*", default=None,
                       help="allowed CORS origins (CORS is off unless given)")
    group.add_argument("--allowed-hosts", nargs="*", default=None,
                       help="Host header names accepted (default: loopback names on a keyless "
                            "loopback server, else any)")
    add_engine_flags(serve)
    serve.add_argument("--slo", dest="engine_slo", type=slo_arg, default=None,
                       metavar="ttft=500ms,tpot=100ms",
                       help="latency targets for admitted requests (p99): the controller keeps "
                            "them and sheds what would miss them (429); default: measured at "
                            "start-up, see README 'Adaptive controller'")



def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.sample_seed,
                          stop=args.stop)


class _Parser(argparse.ArgumentParser):
    """A bad flag or value is one line (which flag, what was wrong, where
    help is), not the whole usage; sub-commands inherit it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="carpool", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"carpool {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete one prompt, streaming to stdout")
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument("--raw", action="store_true",
                          help="send the prompt as is instead of through the chat template")
    add_sampling_flags(generate)
    add_engine_flags(generate)

    chat = commands.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_flags(chat)
    add_engine_flags(chat)

    add_serve_parser(commands)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    from carpool.bench.throughput import add_throughput_args

    throughput = bench_commands.add_parser(
        "throughput", help="offline throughput: carpool vs HF transformers static batching")
    add_throughput_args(throughput)
    add_engine_flags(throughput)
    from carpool.bench.regimes import add_regimes_args

    regimes = bench_commands.add_parser(
        "regimes", help="one Poisson workload replayed under static, dynamic and continuous "
                        "batching, side by side")
    add_regimes_args(regimes)
    add_engine_flags(regimes)
    _add_client_benches(bench_commands)
    from carpool.bench.tune import add_tune_parser

    add_tune_parser(commands, add_engine_flags)
    from carpool.profiles.command import add_profiles_args

    add_profiles_args(commands.add_parser(
        "profiles", help="list the built-in settings profiles, or show one resolved"))
    from carpool.workload.command import add_traces_args

    add_traces_args(commands.add_parser(
        "traces", help="the public request traces: where each is found, or download them"))
    for name, help_text, module, add_args in _SIM_COMMANDS:
        sub = commands.add_parser(name, help=help_text)
        # A command with sub-commands returns them: the engine flags go on each.
        for leaf in getattr(importlib.import_module(module), add_args)(sub) or [sub]:
            add_engine_flags(leaf)
    return parser


def _add_client_benches(bench_commands) -> None:
    """Benchmarks that drive a server over HTTP: no engine flags."""
    from carpool.bench.serve import add_bench_serve_args
    from carpool.bench.sweep import add_sweep_args

    add_bench_serve_args(bench_commands.add_parser(
        "serve", help="replay a workload (real traces or synthetic) against any "
                      "OpenAI-compatible server; latency, goodput, JSON + HTML report"))
    add_sweep_args(bench_commands.add_parser(
        "sweep", help="find a server's capacity under an SLO: synchronous and max-throughput "
                      "probes, then rates in between"))
    from carpool.bench.compare import add_compare_args

    add_compare_args(bench_commands.add_parser(
        "compare", help="results of bench serve side by side, with ratios to the first"))


def _run_client_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        from carpool.bench.serve import run_bench_serve

        return run_bench_serve(args)
    if args.bench_command == "sweep":
        from carpool.bench.sweep import run_sweep

        return run_sweep(args)
    from carpool.bench.compare import run_compare

    return run_compare(args)


# The simulator's commands: (name, help, module, the function adding its flags).
_SIM_COMMANDS = (
    ("measure", "measure this machine's step times and fit the simulator's cost model",
     "carpool.measure.costs", "add_measure_args"),
    ("simulate", "replay a workload through simulated replicas running carpool's scheduler "
                 "with a cost model (virtual clock); bench-serve report",
     "carpool.sim.command", "add_simulate_args"),
    ("fidelity", "replay one workload on the real engine and in the simulator (with this "
                 "machine's profile) and report the simulation's error",
     "carpool.measure.fidelity", "add_fidelity_args"),
    ("plan", "capacity planning: the fewest simulated replicas that meet an SLO at a peak "
             "load, their cost, and optionally a day on a replica schedule",
     "carpool.sim.plan_command", "add_plan_args"),
    ("evaluate", "fleet policies side by side in the simulator at full trace size "
                 "(routing: every policy on the same arrivals; pd: colocated against "
                 "disaggregated fleets)",
     "carpool.sim.evaluations", "add_evaluate_args"),
)

# Commands run as function(engine config, args), imported only when chosen.
_CONFIG_COMMANDS = {
    "simulate": ("carpool.sim.command", "run_simulate"),
    "fidelity": ("carpool.measure.fidelity", "run_fidelity"),
    "plan": ("carpool.sim.plan_command", "run_plan"),
    "evaluate": ("carpool.sim.evaluations", "run_evaluate"),
    "measure": ("carpool.measure.costs", "run_measure"),
    "tune": ("carpool.bench.tune", "run_tune"),
    "bench regimes": ("carpool.bench.regimes", "run_regimes"),
    "bench throughput": ("carpool.bench.throughput", "run_throughput"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "profiles":
            from carpool.profiles.command import run_profiles

            return run_profiles(args)
        if args.command == "traces":
            from carpool.workload.command import run_traces

            return run_traces(args)
        if getattr(args, "bench_command", None) in ("serve", "sweep", "compare"):
            return _run_client_bench(args)
        if args.command == "serve" and args.model_path:
            args.engine_model = args.model_path
        config = engine_config_from_args(args)
        if args.command == "serve":
            from carpool.server.launcher import run_server

            return run_server(config, server_config_from_args(args), profile_schedule(args),
                              slo_sources=slo_sources(args))
        if args.command == "generate":
            from carpool.repl import run_generate

            return run_generate(config, args.prompt, sampling_from_args(args), raw=args.raw)
        if args.command == "chat":
            from carpool.repl import run_chat

            return run_chat(config, sampling_from_args(args), system=args.system)
        name = args.command if args.command != "bench" else f"bench {args.bench_command}"
        module, function = _CONFIG_COMMANDS[name]
        return getattr(importlib.import_module(module), function)(config, args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as exc:
        print(f"carpool: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from carpool.model.loader import ModelLoadError

        if isinstance(exc, ModelLoadError):  # one clear line, no traceback
            print(f"carpool: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
