"""The ``carpool`` command line (``carpool --help`` lists every command).

Every engine knob is a flag (the tables are in ``carpool.cli_flags``);
``--config x.yaml`` loads a file first and flags given on the command line
win (flags > file > profile > defaults).
"""
from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from collections.abc import Sequence

from carpool import __version__
from carpool.cli_flags import (
    ENGINE_FLAGS,
    FLEET_FLAGS,
    SERVER_FLAGS,
    SERVER_LIST_FLAGS,
    HelpFormatter,
    TopHelpFormatter,
    add_flags,
    describe_commands,
    engine_defaults,
    file_settings,
    register_flag,
    server_defaults,
    sources_flag,
)
from carpool.cli_options import GenerateOptions, add_sampling_flags, sampling_from_args
from carpool.config import EngineConfig, read_yaml
from carpool.settings_fields import add_setting_args
from carpool.slo import slo_sources


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (``carpool.cli_flags.ENGINE_FLAGS``) and ``--config``."""
    group = parser.add_argument_group("engine")
    spec = sources_flag("config")
    register_flag(group, spec, "config", None, spec.help)
    add_flags(group, ENGINE_FLAGS, "engine_", engine_defaults())


def _config_layers(args: argparse.Namespace) -> list[dict]:
    """Settings files in increasing precedence: the profile, then --config
    (in carpool's form: see ``cli_flags.file_settings``).

    A profile's ``schedule`` resolves to the window active at the local time
    now (``args.profile_time``, a ``datetime.time``, if set); every window is
    validated either way.
    """
    from datetime import datetime

    from carpool.profiles import load_profile
    from carpool.profiles.schedule import ProfileSchedule

    layers = []
    if getattr(args, "profile", None):
        schedule = ProfileSchedule.from_profile(load_profile(args.profile))
        at = getattr(args, "profile_time", None) or datetime.now().time()
        layers.append(schedule.settings_at(at))
    if args.config:
        layers.append(file_settings(read_yaml(args.config), args.config))
    return layers


def _layer_keys(layer: dict) -> set[str]:
    """The flat knob names a settings layer sets (section keys included)."""
    return {k for key, value in layer.items()
            for k in (value if isinstance(value, dict) else {key: value})}


# Two ways to size the KV pool: one layer (a file, or the flags) may give one
# of them; a higher layer's choice replaces a lower one's (a --kv-cache-memory
# flag beats a file's gpu_memory_utilization, and the other way round).
# --num-blocks overrides both.
_POOL_SIZES = ("gpu_memory_utilization", "kv_cache_memory")


def _apply_layer(config: EngineConfig, layer: dict, where: str) -> None:
    keys = _layer_keys(layer)
    if set(_POOL_SIZES) <= keys:
        raise ValueError(f"--gpu-memory-utilization and --kv-cache-memory both size the KV "
                         f"cache: give one of them ({where})")
    config.update(layer)
    if "kv_cache_memory" in keys:
        config.cache.gpu_memory_utilization = None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """defaults < --profile < --config file < flags (a file's ``server:``
    section is for ``carpool serve``)."""
    config = EngineConfig()
    for layer in _config_layers(args):
        _apply_layer(config, {k: v for k, v in layer.items() if k != "server"}, "settings file")
    overrides = {name[len("engine_"):]: value for name, value in vars(args).items()
                 if name.startswith("engine_") and value is not None}
    if "slo" in overrides:  # serve's --slo first: --ttft-target / --tpot-target win over it
        config.update({"slo": overrides.pop("slo")})
    _apply_layer(config, overrides, "flags")
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
        layer = file_settings(read_yaml(args.config), args.config)
        pinned |= set(layer) | set(layer.get("scheduler") or {})
    schedule = ProfileSchedule.from_profile(load_profile(args.profile), pinned)
    return schedule if schedule.knobs() else None


def server_config_from_args(args: argparse.Namespace):
    """defaults < --profile < --config (its ``server`` section and flat
    server keys) < flags."""
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
    for flag in SERVER_FLAGS + SERVER_LIST_FLAGS:
        value = getattr(args, f"server_{flag.key}")
        if value is not None:
            setattr(config, flag.key, value)
    return config.validate()


def add_serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (vLLM's flags)")
    serve.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                       help="HF model directory, .gguf file or Hugging Face repo id, served "
                            "under this name as given (default: SmolLM2-135M-Instruct)")
    spec = sources_flag("profile")
    register_flag(serve, spec, "profile", None, spec.help)
    group = serve.add_argument_group("server")
    add_flags(group, [f for f in SERVER_FLAGS + SERVER_LIST_FLAGS if f not in FLEET_FLAGS],
              "server_", server_defaults())
    add_flags(serve.add_argument_group("fleet (shared with `carpool simulate`)"), FLEET_FLAGS,
              "server_", server_defaults())
    add_engine_flags(serve)
    spec = sources_flag("slo")
    register_flag(serve, spec, "engine_slo", None, spec.help)


class _Parser(argparse.ArgumentParser):
    """A bad flag or value is one line (which flag, what was wrong, where
    help is), not the whole usage; help shows defaults and real metavars
    (``cli_flags.HelpFormatter``); a flag is spelled in full (no
    abbreviations: ``--max-num-seq`` is an error, not ``--max-num-seqs``).
    Sub-commands, and theirs, are made of this class too (argparse's
    ``add_subparsers`` default), so they inherit all three."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _TopParser(_Parser):
    """``carpool`` itself: an option before the command that it does not
    take (``carpool --bogus``) is named as unrecognized, rather than argparse
    reporting the missing COMMAND. Its own options take no value, so every
    word before the command is one of them."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201
        args = list(sys.argv[1:] if args is None else args)
        for arg in args:
            if not arg.startswith("-") or arg in ("-", "--"):
                break
            if arg not in self._option_string_actions:
                self.error(f"unrecognized arguments: {arg}")
        return super().parse_known_args(args, namespace)


_ABOUT = ("carpool: an LLM inference server with an OpenAI-compatible API; its scheduler "
          "carpools requests (continuous batching on a paged KV cache with prefix reuse).")
_EPILOG = ("'carpool COMMAND --help' lists a command's flags and their defaults. Engine "
           "settings come from flags > --config FILE (carpool's sections or vLLM's flat "
           "flag names) > --profile > defaults.")


def build_parser() -> argparse.ArgumentParser:
    parser = _TopParser(prog="carpool", usage="%(prog)s [-h] [--version] COMMAND ...",
                        formatter_class=TopHelpFormatter, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"carpool {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     prog="carpool", help=argparse.SUPPRESS, parser_class=_Parser)
    generate = commands.add_parser("generate", help="complete one prompt, streaming to stdout")
    generate.add_argument("prompt", help="the prompt text")
    add_setting_args(generate, GenerateOptions, only=("raw",))
    add_sampling_flags(generate)
    add_engine_flags(generate)

    chat = commands.add_parser("chat", help="interactive chat with the model's chat template")
    add_setting_args(chat, GenerateOptions, only=("system",))
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
        "regimes", help="one Poisson workload under static, dynamic, continuous and adaptive "
                        "batching; side by side")
    add_regimes_args(regimes)
    add_engine_flags(regimes)
    from carpool.bench.engine import add_engine_bench_args

    engine_bench = bench_commands.add_parser(
        "engine", help="the engine's own cost per step: a fake executor (no model), N "
                       "sequences decoding, step time and its phases")
    add_engine_bench_args(engine_bench)
    add_engine_flags(engine_bench)
    _add_client_benches(bench_commands)
    from carpool.bench.tune import add_tune_parser

    add_tune_parser(commands, add_engine_flags)
    from carpool.profiles_command import add_profiles_args

    add_profiles_args(commands.add_parser(
        "profiles", help="list the built-in settings profiles, or show one resolved"))
    from carpool.workload.command import add_traces_args

    add_traces_args(commands.add_parser(
        "traces", help="the public request traces: where each is found, or download them"))
    from carpool.kv_transfer.command import add_kv_store_args

    add_kv_store_args(commands.add_parser(
        "kv-store", help="a shared KV store server for replicas' prompt blocks "
                         "(--kv-store tcp://HOST:PORT)"))
    for name, help_text, module, add_args in _SIM_COMMANDS:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        # A command with sub-commands returns them: the engine flags go on each.
        for leaf in getattr(importlib.import_module(module), add_args)(sub) or [sub]:
            add_engine_flags(leaf)
    parser.description = describe_commands(parser, _ABOUT)
    parser.epilog = "\n".join(textwrap.wrap(_EPILOG, 79))
    return parser


def _add_client_benches(bench_commands) -> None:
    """Benchmarks that drive a server over HTTP: no engine flags."""
    from carpool.bench.serve import add_bench_serve_args
    from carpool.bench.sweep import add_sweep_args

    add_bench_serve_args(bench_commands.add_parser(
        "serve", help="replay a workload against any OpenAI-compatible server; real traces "
                      "or synthetic, latency, goodput, JSON + HTML report"))
    add_sweep_args(bench_commands.add_parser(
        "sweep", help="find a server's capacity under an SLO; synchronous and max-throughput "
                      "probes, then rates in between"))
    from carpool.bench.compare import add_compare_args

    add_compare_args(bench_commands.add_parser(
        "compare", help="results of bench serve side by side, with ratios to the first"))


# The simulator's commands: (name, help, module, the function adding its flags).
_SIM_COMMANDS = (
    ("measure", "measure this machine's step times and fit the simulator's cost model",
     "carpool.measure.costs", "add_measure_args"),
    ("simulate", "replay a workload through simulated replicas on a virtual clock; "
                 "carpool's scheduler with a cost model, bench-serve report",
     "carpool.sim.command", "add_simulate_args"),
    ("fidelity", "the simulator's error against the real engine; one workload replayed "
                 "on both (with this machine's profile)",
     "carpool.measure.fidelity", "add_fidelity_args"),
    ("plan", "capacity planning: the fewest simulated replicas that meet an SLO; at a "
             "peak load, their cost, optionally a day on a replica schedule",
     "carpool.sim.plan_command", "add_plan_args"),
    ("evaluate", "fleet policies side by side in the simulator at full trace size "
                 "(routing: every policy on the same arrivals; pd: colocated against "
                 "disaggregated fleets)",
     "carpool.sim.evaluations", "add_evaluate_args"),
)

# Commands run as function(args), with no engine config, imported only when chosen.
_ARGS_COMMANDS = {
    "profiles": ("carpool.profiles_command", "run_profiles"),
    "traces": ("carpool.workload.command", "run_traces"),
    "kv-store": ("carpool.kv_transfer.command", "run_kv_store"),
    "bench serve": ("carpool.bench.serve", "run_bench_serve"),
    "bench sweep": ("carpool.bench.sweep", "run_sweep"),
    "bench compare": ("carpool.bench.compare", "run_compare"),
}

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
    "bench engine": ("carpool.bench.engine", "run_engine_bench"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = args.command if args.command != "bench" else f"bench {args.bench_command}"
    try:
        if name in _ARGS_COMMANDS:
            module, function = _ARGS_COMMANDS[name]
            return getattr(importlib.import_module(module), function)(args)
        if args.command == "serve" and args.model_path:
            args.engine_model = args.model_path
        config = engine_config_from_args(args)
        if args.command == "serve":
            server_config = server_config_from_args(args)
            if server_config.backend == "ray":
                from carpool.ray_serve.launch import run_ray_server

                return run_ray_server(config, server_config, slo_sources(args),
                                      profile_schedule(args))
            from carpool.server.launcher import run_server

            return run_server(config, server_config, profile_schedule(args),
                              slo_sources=slo_sources(args))
        if args.command == "generate":
            from carpool.repl import run_generate

            return run_generate(config, args.prompt, sampling_from_args(args), raw=args.raw)
        if args.command == "chat":
            from carpool.repl import run_chat

            return run_chat(config, sampling_from_args(args), system=args.system)
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
