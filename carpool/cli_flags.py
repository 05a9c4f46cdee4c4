"""The engine and server flags of the ``carpool`` command line, their help
(defaults read from the config dataclasses, real metavars), the boolean
spellings vLLM users type, and settings files written with flag names.

Every flag's argparse default is None: a flag given on the command line is
one that is not None, which is what lets flags win over ``--config`` and a
profile (see ``carpool.cli.engine_config_from_args``).
"""
from __future__ import annotations

import argparse
import dataclasses
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from carpool.config import DESIGN_SECTION, EngineConfig, design_section
from carpool.slo import parse_target


def flag_bool(value: str) -> bool:
    """A true/false flag value (1/0, yes/no, on/off too); anything else is an error."""
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def flag_bool_or_auto(value: str) -> bool | str:
    """``auto`` or a true/false flag value (``flag_bool``)."""
    return "auto" if value.strip().lower() == "auto" else flag_bool(value)


@dataclass(frozen=True)
class Flag:
    """One flag: its spelling, the config field it sets, how its value parses.

    ``kind`` is ``bool`` for a switch (``--x`` / ``--no-x``, no value: it
    cannot swallow the positional after it) and ``flag_bool`` for a boolean
    that also takes a value (``--x``, ``--x false``, ``--no-x``).
    ``aliases``: other spellings (each gets its ``--no-`` form too).
    """

    flag: str
    key: str
    kind: Callable[[str], Any]
    metavar: str | None
    help: str
    aliases: tuple[str, ...] = ()


def _f(flag: str, key: str, kind: Callable[[str], Any], metavar: str | None, help_text: str,
       *aliases: str) -> Flag:
    return Flag(flag, key, kind, metavar, help_text, aliases)


ENGINE_FLAGS: list[Flag] = [
    _f("--model", "model", str, "MODEL",
       "HF model directory, .gguf file or Hugging Face repo id (default: SmolLM2-135M-Instruct)"),
    _f("--tokenizer", "tokenizer", str, "PATH",
       "tokenizer directory or .gguf when not the model's own (default: the model's)"),
    _f("--chat-template", "chat_template", str, "TEMPLATE",
       "chat template: a Jinja file or the template text (default: the model's own)"),
    _f("--dtype", "dtype", str, "DTYPE", "auto | float32 (float) | bfloat16 | float16 (half); "
       "auto: bf16 on GPU and on CPUs with native bf16, else fp32"),
    _f("--device", "device", str, "DEVICE", "auto | cpu | cuda[:N]"),
    _f("--max-model-len", "max_model_len", int, "N", "context limit (default: the model's)"),
    _f("--attention-backend", "attention_backend", str, "BACKEND",
       "auto | torch | sdpa | cpu (our C++ decode kernel) | triton (our GPU kernels; auto on "
       "CUDA)"),
    _f("--cuda-graph-sizes", "cuda_graph_sizes", str, "SIZES",
       "decode batch sizes captured as CUDA graphs: auto or a comma list, e.g. 1,2,4,8,16,32"),
    _f("--enforce-eager", "enforce_eager", bool, None,
       "CUDA: run every step eagerly (no CUDA graphs)"),
    _f("--cache-dir", "cache_dir", str, "DIR", "where models are fetched and converted "
       "(default: $CARPOOL_CACHE or ~/.cache/carpool)"),
    _f("--threads", "threads", int, "N", "torch CPU threads (default: torch's choice)"),
    _f("--seed", "seed", int, "N", "seeds the per-request seeds of requests that give none"),
    _f("--quantization", "quantization", str, "METHOD",
       "weight-only quantization for CPU decode steps of a few rows: int8 (+50% weight "
       "memory) or int4 (groups of 32, +25%) (default: none)"),
    _f("--packed-decode", "packed_decode", str, "MODE",
       "CPU bf16: decode steps of a few rows on a packed copy of the weights (our AVX512-BF16 "
       "kernel), and MoE experts on our fused kernel: auto (the copy where it fits in a quarter "
       "of the free memory; the experts where the CPU has AVX512-BF16 but no AMX) | on | off"),
    _f("--blocked-weights", "blocked_weights", str, "MODE",
       "CPU bf16: linear weights laid out once in oneDNN's blocked format (same results, "
       "faster matrix products): auto (where oneDNN has bf16 kernels) | on | off"),
    _f("--overlap", "overlap", str, "MODE",
       "make a step's outputs (detokenizing, stop strings) while the executor runs the next "
       "step: auto (on for CUDA, off on CPU) | on | off"),
    _f("--row-bucket", "row_bucket", int, "N", "pad each step's token rows to a multiple of "
       "this before the linear layers (1: exact rows)"),
    _f("--block-size", "block_size", int, "N", "tokens per KV block"),
    _f("--kv-cache-memory", "kv_cache_memory", str, "SIZE", "KV pool budget, e.g. 512MiB, "
       "2GiB (unless --gpu-memory-utilization or --num-blocks is given)"),
    _f("--gpu-memory-utilization", "gpu_memory_utilization", float, "FRACTION",
       "size the KV pool as this fraction (0 < f <= 1) of the memory free once the weights "
       "are loaded (CUDA: free device memory; CPU: MemAvailable); instead of "
       "--kv-cache-memory (default: unset)"),
    _f("--num-blocks", "num_blocks", int, "N", "KV pool size in blocks (overrides "
       "--kv-cache-memory and --gpu-memory-utilization)"),
    _f("--kv-store", "kv_store", str, "URL",
       "a shared KV store for prompt blocks: local (with --replicas or --prefill/--decode: a "
       "TCP store the API process serves its replicas) | shm (the same in shared memory) | "
       "memory | tcp://HOST:PORT | shm://HOST:PORT/ARENA | redis://HOST:PORT[/DB] "
       "(default: none)"),
    _f("--kv-store-ttl", "kv_store_ttl", float, "SECONDS",
       "seconds a stored block stays after its last use"),
    _f("--kv-store-capacity", "kv_store_capacity", str, "SIZE",
       "the memory KV store's capacity, e.g. 1GiB (Redis: set its maxmemory)"),
    _f("--kv-store-max-inflight", "kv_store_max_inflight", str, "SIZE",
       "KV blocks being written to the store at most; more are dropped"),
    _f("--enable-prefix-caching", "enable_prefix_caching", bool, None,
       "reuse cached KV blocks of shared prefixes", "--prefix-caching"),
    _f("--watermark", "watermark", float, "FRACTION",
       "fraction of blocks kept free when admitting"),
    _f("--pinned-prefix-share", "pinned_prefix_share", float, "FRACTION",
       "share of the KV pool all operator-pinned prefixes (POST /carpool/prefixes) may hold "
       "together (0: pinning off)"),
    _f("--max-pinned-prefixes", "max_pinned_prefixes", int, "N",
       "most prefixes pinned at once (each one a label of the pinned_prefix_* metrics)"),
    _f("--max-num-seqs", "max_num_seqs", int, "N", "most requests running at once"),
    _f("--max-num-batched-tokens", "max_num_batched_tokens", int, "N",
       "token budget of one step"),
    _f("--scheduling-policy", "policy", str, "POLICY", "fcfs | priority"),
    _f("--max-queue-requests", "max_queue_requests", int, "N",
       "waiting requests beyond which new ones are rejected (HTTP 429)"),
    _f("--max-queue-tokens", "max_queue_tokens", int, "N",
       "waiting prompt tokens beyond which new requests are rejected (default: unbounded)"),
    _f("--queue-timeout", "queue_timeout", float, "SECONDS",
       "seconds a request may wait to start before it is rejected (default: no limit)"),
    _f("--session-ttl", "session_ttl", float, "SECONDS",
       "seconds a session's prefix stays preferred in the KV cache"),
    _f("--max-session-requests", "max_session_requests", int, "N",
       "unfinished requests one session may hold (more get 429 session_full)"),
    _f("--aging-interval", "aging_interval", float, "SECONDS",
       "policy priority: seconds of waiting that raise a request one priority class "
       "(null in a config file: no aging)"),
    _f("--long-prompt-threshold", "long_prompt_threshold", int, "N",
       "prompts longer than this many tokens share the long-prefill allowance"),
    _f("--long-prefill-share", "long_prefill_share", float, "FRACTION",
       "fraction of the step token budget long prompts get for prefill while short "
       "requests wait (1 = no cap)"),
    _f("--batching", "batching", str, "MODE",
       "continuous | static | dynamic (request-level baselines)"),
    _f("--preferred-batch-size", "preferred_batch_size", int, "N",
       "static: the batch size; dynamic: dispatch when a length bucket holds this many"),
    _f("--max-batch-size", "max_batch_size", int, "N", "dynamic: most requests in one batch"),
    _f("--max-wait", "max_wait", float, "SECONDS",
       "static/dynamic: seconds the oldest request waits before a partial batch goes"),
    _f("--padding", "padding", str, "MODE", "static/dynamic: pad each step to a rectangle: "
       "none | left | right | center (default: right under static/dynamic, else none)"),
    _f("--long-batch-size", "long_batch_size", int, "N",
       "static/dynamic: prompts over --long-prompt-threshold form their own batches of at "
       "most this many (null in a config file: one queue for all)"),
    _f("--long-max-wait", "long_max_wait", float, "SECONDS",
       "static/dynamic: seconds the oldest long prompt waits before a partial long batch goes"),
    _f("--bucket-tolerance", "bucket_tolerance", float, "FRACTION",
       "dynamic: a length bucket holds prompts within this fraction of its length"),
    _f("--predictive-shedding", "predictive_shedding", flag_bool, "BOOL",
       "reject at arrival a request predicted to miss its deadline or TTFT target"),
    _f("--surge-ttft-factor", "surge_ttft_factor", float, "X",
       "under an operator's TTFT target, also hold first tokens within X times the live "
       "calm TTFT p99, so a surge's queue stays short (null in a settings file: the "
       "target alone)"),
    _f("--emergency-switch", "emergency_switch", flag_bool, "BOOL",
       "under sustained overload degrade in steps: shed the lowest priorities first, then "
       "static batching, then answer repeated deterministic requests from a cache"),
    _f("--emergency-queue-share", "emergency_queue_share", float, "FRACTION",
       "emergency switch: a queue at this share of --max-queue-requests is overload"),
    _f("--emergency-busy", "emergency_busy", float, "FRACTION",
       "emergency switch: the engine busier than this share of the time is overload"),
    _f("--emergency-host-cpu", "emergency_host_cpu", float, "FRACTION",
       "emergency switch: the host's CPUs busier than this is overload (null in a config "
       "file: no CPU breaker)"),
    _f("--emergency-sustain", "emergency_sustain", float, "SECONDS",
       "emergency switch: seconds of overload before degrading, and before each further "
       "step"),
    _f("--max-batch-tokens", "max_batch_tokens", int, "N", "same as --max-num-batched-tokens"),
    _f("--adaptive", "adaptive", flag_bool, "BOOL",
       "the adaptive controller and SLO admission (default: on for serve, off elsewhere); "
       "false: plain batching at the configured knobs"),
    _f("--controller-interval", "controller_interval", float, "SECONDS",
       "adaptive: seconds between regular controller decisions (>= 0.1; events tick sooner)"),
    _f("--controller-window", "controller_window", float, "SECONDS",
       "adaptive: seconds of live metrics the slow signals read"),
    _f("--controller-fast-window", "controller_fast_window", float, "SECONDS",
       "adaptive: seconds of live metrics the fast signals (step times, arrivals) read"),
    _f("--controller-mode", "controller_mode", str, "MODE",
       "adaptive: auto | latency | balanced | throughput (a fixed mode)"),
    _f("--ttft-target", "ttft_target", parse_target, "TIME",
       "adaptive: p99 time-to-first-token target (0.5, 500ms or auto: measured at serve "
       "start-up); admission sheds predicted misses"),
    _f("--tpot-target", "tpot_target", parse_target, "TIME",
       "adaptive: p99 time-per-output-token target (0.1, 100ms or auto)"),
    _f("--e2e-target", "e2e_target", parse_target, "TIME",
       "adaptive: p99 end-to-end target (1.5, 1500ms); caps the batch so the long outputs of "
       "recent requests finish within it (default: none)"),
    _f("--calibrate", "calibrate", flag_bool, "BOOL",
       "serve: measure the unloaded TTFT/TPOT at start-up for auto targets (false: auto "
       "targets are 2 s / 200 ms)"),
    _f("--memory-headroom", "memory_headroom", float, "FRACTION",
       "adaptive: share of the KV pool the batch limit keeps free"),
    _f("--alpha-policy", "alpha_policy", str, "POLICY",
       "adaptive, static/dynamic batching: how alpha (the batch limit's headroom over peak "
       "demand) moves: rule (x1.25 / x0.8 by which target is missed) | bandit (learned online "
       "from the goodput each move earned)"),
    _f("--transition-steps", "transition_steps", int, "N",
       "adaptive: scheduler steps a knob change is spread over (1..3)"),
    _f("--hysteresis-ticks", "hysteresis_ticks", int, "N",
       "adaptive: ticks in a row asking for a change before mode, alpha or correction move"),
    _f("--shed-on-ttft-target", "shed_on_ttft_target", flag_bool_or_auto, "BOOL|auto",
       "adaptive: reject at arrival what is predicted to miss the TTFT target; auto: only "
       "when the operator set that target (--slo, --ttft-target, a settings file), never "
       "for a measured one"),
    _f("--batch-limit-by-tpot", "batch_limit_by_tpot", flag_bool_or_auto, "BOOL|auto",
       "adaptive: cap the batch at the largest whose steps keep the TPOT target; auto: only "
       "when the operator set that target"),
]

SERVER_FLAGS: list[Flag] = [
    _f("--host", "host", str, "HOST", "address to listen on (0.0.0.0 for all)"),
    _f("--port", "port", int, "PORT", "port to listen on (0 = any free port)"),
    _f("--served-model-name", "served_model_name", str, "NAME",
       "model name in the API (default: the model argument as given)"),
    _f("--api-key", "api_key", str, "KEY", "require 'Authorization: Bearer KEY' (visible in "
       "ps: prefer $CARPOOL_API_KEY / $VLLM_API_KEY or --api-key-file; none = open)"),
    _f("--api-key-file", "api_key_file", str, "FILE",
       "read the API key from this file's first line"),
    _f("--api-keys", "api_keys", str, "FILE", "YAML/JSON file of API keys, each with its "
       "tenant and privileges (max_priority, share_prefix_cache)"),
    _f("--header-timeout", "header_timeout", float, "SECONDS",
       "seconds a connection may take to send a request head"),
    _f("--keep-alive-timeout", "keep_alive_timeout", float, "SECONDS",
       "seconds an idle keep-alive connection stays open"),
    _f("--response-cache-entries", "response_cache_entries", int, "N",
       "--emergency-switch's last step: responses kept to answer identical deterministic "
       "requests of a tenant (0: none)"),
    _f("--response-cache-bytes", "response_cache_bytes", int, "BYTES",
       "the response cache's size bound (JSON bytes)"),
    _f("--response-cache-ttl", "response_cache_ttl", float, "SECONDS",
       "seconds a cached response may be served"),
    _f("--body-timeout", "body_timeout", float, "SECONDS",
       "seconds a request body may take to arrive after its head (HTTP 408)"),
    _f("--body-min-rate", "body_min_rate", float, "BYTES_PER_S",
       "slowest average rate a request body may arrive at after its first second, HTTP 408 "
       "(0: no minimum)"),
    _f("--max-connections", "max_connections", int, "N",
       "open connections in all; more are answered 503 (0: no cap)"),
    _f("--max-connections-per-client", "max_connections_per_client", int, "N",
       "open connections from one client address; more are answered 429 (0: no cap; behind "
       "a proxy every client has the proxy's address)"),
    _f("--special-tokens-in-content", "special_tokens_in_content", flag_bool, "BOOL",
       "parse special-token text (<|im_start|>...) inside chat message content (false: it "
       "is plain text)"),
    _f("--tool-call-parser", "tool_call_parser", str, "NAME",
       "the format the model writes tool calls in: hermes | llama3_json | mistral (needed "
       "by tool_choice auto)"),
    _f("--enable-auto-tool-choice", "enable_auto_tool_choice", bool, None,
       "let the model decide when to call tools (tool_choice auto; with --tool-call-parser)"),
    _f("--reasoning-parser", "reasoning_parser", str, "NAME",
       "split <think>...</think> off into reasoning_content: qwen3 | deepseek_r1"),
    _f("--shutdown-timeout", "shutdown_timeout", float, "SECONDS",
       "seconds in-flight requests get to finish after SIGTERM"),
    _f("--status-interval", "status_interval", float, "SECONDS",
       "seconds between status lines while busy"),
    _f("--log-format", "log_format", str, "FORMAT", "format of the server's log lines "
       "(Python logging: %(asctime)s, %(levelname)s, %(message)s, ...)"),
    _f("--max-body-bytes", "max_body_bytes", int, "BYTES", "largest request body accepted"),
    _f("--max-n", "max_n", int, "N", "largest n accepted"),
    _f("--max-tokens-cap", "max_tokens_cap", int, "N",
       "largest max_tokens accepted (default: the context length)"),
    _f("--max-prompt-chars", "max_prompt_chars", int, "N", "most characters of prompt text "
       "(or chat messages) in one request, HTTP 400 beyond (default: 16 per context token)"),
    _f("--max-header-bytes", "max_header_bytes", int, "BYTES",
       "largest request head accepted (HTTP 431)"),
    _f("--max-prompts", "max_prompts", int, "N", "most prompts in one /v1/completions call"),
    _f("--max-messages", "max_messages", int, "N", "most chat messages in one call"),
    _f("--max-logprobs", "max_logprobs", int, "N",
       "largest logprobs / top_logprobs accepted (0..20)"),
    _f("--max-stop", "max_stop", int, "N", "most stop strings in one request"),
    _f("--prep-workers", "prep_workers", int, "N",
       "threads that parse, template and tokenize requests off the event loop"),
    _f("--engine-process", "engine_process", flag_bool, "BOOL",
       "run the engine in a worker process of its own, HTTP and tokenizing in this one "
       "(false: both in one process)"),
    _f("--backend", "backend", str, "BACKEND",
       "where the replicas run: local (worker processes on this machine) | ray (Ray Serve "
       "deployments on a local or attached Ray cluster; pip install -e '.[ray]')"),
    _f("--replicas", "replicas", int, "N",
       "engine worker processes behind carpool's router (each its own KV pool and threads)"),
    _f("--prefill", "prefill", int, "N",
       "P/D serving: N prefill replicas (with --decode), each prompt's KV sent to a decode "
       "replica through the KV store"),
    _f("--decode", "decode", int, "N", "P/D serving: N decode replicas (with --prefill)"),
    _f("--pd-mode", "pd_mode", str, "MODE", "P/D: always (every prompt on the prefill pool) | "
       "conditional (where the predicted TTFT says it pays; local backend)"),
    _f("--pd-bandwidth", "pd_bandwidth", float, "GBPS",
       "P/D: GB/s the planner prices a KV transfer at"),
    _f("--pd-latency", "pd_latency", float, "SECONDS", "P/D: seconds per KV transfer besides "
       "the bytes"),
    _f("--pd-stall-weight", "pd_stall_weight", float, "W", "P/D conditional: weight of the "
       "decodes a colocated prefill stalls against the request's own TTFT (1: alike)"),
    _f("--pd-min-remote-tokens", "pd_min_remote_tokens", int, "N",
       "P/D conditional: shortest uncached prompt prefilled remotely (0: the predictions decide)"),
    _f("--routing", "routing", str, "POLICY",
       "the router's policy with --replicas > 1: predicted-ttft | cache-aware | "
       "session-affinity | least-outstanding | round-robin | ..."),
    _f("--autoscale", "autoscale", str, "POLICY",
       "change the replica count live: reactive | predictive (default: fixed --replicas)"),
    _f("--min-replicas", "min_replicas", int, "N", "--autoscale: fewest replicas"),
    _f("--max-replicas", "max_replicas", int, "N",
       "--autoscale: most replicas (default: --replicas; one machine: its cores bound it)"),
    _f("--scale-tick", "scale_tick", float, "SECONDS", "--autoscale: seconds between ticks"),
    _f("--scale-out-backlog", "scale_out_backlog", int, "N",
       "--autoscale: scale out when more than N requests wait ..."),
    _f("--scale-out-wait", "scale_out_wait", float, "SECONDS",
       "... longer than this at the recent arrival rate (0: the count alone)"),
    _f("--scale-out-cooldown", "scale_out_cooldown", float, "SECONDS",
       "--autoscale: seconds between two scale-outs (unless arrivals panic)"),
    _f("--scale-in-utilization", "scale_in_utilization", float, "FRACTION",
       "--autoscale: scale in when slot use stays under this ..."),
    _f("--scale-in-after", "scale_in_after", float, "SECONDS", "... for this long"),
    _f("--scale-in-window", "scale_in_window", float, "SECONDS",
       "--autoscale: scale in only to the highest want of this window"),
    _f("--stall-timeout", "stall_timeout", float, "SECONDS",
       "seconds busy without a step before /health answers 503"),
    _f("--uvicorn-log-level", "uvicorn_log_level", str, "LEVEL",
       "uvicorn's own log level: critical | error | warning | info | debug | trace"),
    _f("--metrics-prefix", "metrics_prefix", str, "PREFIX",
       "Prometheus series names: carpool | vllm (vLLM's dashboards unchanged) | both"),
]


def engine_defaults() -> dict[str, Any]:
    """Every engine knob's default, by field name, from the dataclasses."""
    config = EngineConfig()
    return {f.name: getattr(section, f.name)
            for section in (config.model, config.cache, config.scheduler, config.controller)
            for f in dataclasses.fields(section)}


def server_defaults() -> dict[str, Any]:
    """Every server setting's default, by field name, from ``ServerConfig``."""
    from carpool.server.config import ServerConfig

    config = ServerConfig()
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _help(flag: Flag, defaults: dict[str, Any]) -> str:
    """The flag's help with ``(default: X)`` from the dataclass, unless the
    default is None (the help says what unset means) or the help gives one."""
    default = defaults.get("max_num_batched_tokens" if flag.key == "max_batch_tokens"
                           else flag.key)
    text = flag.help
    if default is not None and default != [] and "(default" not in text:
        text += f" (default: {_shown(default)})"
    return text.replace("%", "%%")  # argparse %-formats help strings


def add_flags(group, flags: Iterable[Flag], prefix: str, defaults: dict[str, Any]) -> None:
    """Register ``flags`` on ``group``, each with ``dest=prefix + key`` and
    default None; every boolean also gets its ``--no-`` spelling."""
    for flag in flags:
        dest, text = prefix + flag.key, _help(flag, defaults)
        names = (flag.flag, *flag.aliases)
        if flag.kind is bool:  # --x / --no-x for each name
            group.add_argument(*names, dest=dest, action=argparse.BooleanOptionalAction,
                               default=None, help=text)
            continue
        if flag.kind is flag_bool:  # --x [BOOL]; --no-x (shown on the same help line)
            action = group.add_argument(*names, dest=dest, type=flag_bool, nargs="?",
                                        const=True, default=None, metavar=flag.metavar,
                                        help=text)
            negatives = tuple("--no-" + name[2:] for name in names)
            group.add_argument(*negatives, dest=dest, action="store_const", const=False,
                               default=None, help=argparse.SUPPRESS)
            action.negative_flags = negatives
            continue
        group.add_argument(*names, dest=dest, type=flag.kind, default=None,
                           metavar=flag.metavar, help=text)


class HelpFormatter(argparse.HelpFormatter):
    """Defaults shown, a boolean's ``--no-x`` on its ``--x`` line, and a
    short usage line (``prog [options] POSITIONALS``) where the flags are many."""

    def _get_help_string(self, action: argparse.Action) -> str:
        """Flags outside these tables with an argparse default show it too."""
        text = action.help or ""
        default = action.default
        shown = not (default is None or default is False or default is argparse.SUPPRESS
                     or (isinstance(default, (str, list, tuple, dict)) and not default))
        if shown and action.option_strings and "default" not in text.lower():
            text += " (default: %(default)s)"
        return text

    def _format_action_invocation(self, action: argparse.Action) -> str:
        text = super()._format_action_invocation(action)
        return ", ".join([text, *getattr(action, "negative_flags", ())])

    def add_usage(self, usage, actions, groups, prefix=None) -> None:  # noqa: ANN001
        actions = list(actions)
        if usage is None and sum(1 for a in actions if a.option_strings) > 6:
            positionals = [self._format_args(a, self._get_default_metavar_for_positional(a))
                           for a in actions if not a.option_strings]
            usage = " ".join(["%(prog)s [options]", *positionals])
        super().add_usage(usage, actions, groups, prefix)


class TopHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """``carpool --help``: the description's command list is laid out already."""


def _summary(help_text: str | None) -> str:
    """A sub-command's help cut to one line: up to its first ``;`` or ``(``."""
    text = " ".join((help_text or "").split())
    for mark in ("; ", " ("):
        text = text.split(mark)[0]
    return text


def command_summaries(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, str]]:
    """(``name``, one-line summary) of every sub-command, nested ones as
    ``bench serve``, in the order they were added."""
    rows = []
    # argparse keeps the sub-commands and their help only on its private
    # sub-parsers action; nothing public lists them.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                rows.append((prefix + choice.dest, _summary(choice.help)))
                rows += command_summaries(action.choices[choice.dest], f"{prefix}{choice.dest} ")
    return rows


def describe_commands(parser: argparse.ArgumentParser, about: str) -> str:
    """``about``, then every sub-command with its one-line summary (plain text)."""
    rows = command_summaries(parser)
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"  {name:<{width}}{summary}" for name, summary in rows]
    return "\n".join([*textwrap.wrap(about, 79), "", "commands:", *lines])


# -- settings files written with flag names (vLLM's flat YAML) -----------------------

_SECTIONS = {f.name for f in dataclasses.fields(EngineConfig)}


def _file_keys() -> dict[str, tuple[str, str, Callable[[str], Any]]]:
    """Flat file key (underscores) -> (``engine`` | ``server``, field, parser)."""
    keys: dict[str, tuple[str, str, Callable[[str], Any]]] = {}
    for side, names in (("engine", engine_defaults()), ("server", server_defaults())):
        keys.update({name: (side, name, str) for name in names})
    keys["slo"] = ("engine", "slo", str)
    for side, flags in (("engine", ENGINE_FLAGS), ("server", SERVER_FLAGS)):
        for flag in flags:
            kind = flag_bool if flag.kind is bool else flag.kind
            for name in (flag.flag, *flag.aliases):
                keys[name[2:].replace("-", "_")] = (side, flag.key, kind)
    return keys


def _file_value(value: Any, parse: Callable[[str], Any], label: str) -> Any:
    """A text value parsed as its flag would be (``"64"``, ``"false"``, ``"500ms"``)."""
    if not isinstance(value, str) or parse is str:
        return value
    try:
        return parse(value)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{label}: {exc}") from None


def file_settings(data: dict[str, Any], source: str) -> dict[str, Any]:
    """A ``--config`` file's mapping in carpool's layered form: engine keys
    (flat, or in the ``model``/``cache``/``scheduler``/``controller``
    sections) and a ``server`` section.

    Keys may be written as vLLM writes its config files, the flag names
    without ``--`` (``max-num-seqs: 64``, ``served-model-name: x``), with
    dashes or underscores; flat server keys join the ``server`` section.
    An unknown key is an error naming it.
    """
    known = _file_keys()
    engine: dict[str, Any] = {}
    server: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key in _SECTIONS | {"server"} and isinstance(value, dict):
            section = {str(k).replace("-", "_"): v for k, v in value.items()}
            if key == "server":
                server.update(section)
            else:
                engine.setdefault(key, {}).update(section)
            continue
        if key == DESIGN_SECTION:  # the design's template, as written
            try:
                engine.update(design_section(value))
            except ValueError as exc:
                raise ValueError(f"{source}: {exc}") from None
            continue
        if key == "server":
            raise ValueError(f"{source}: the 'server' section must be a mapping")
        if key not in known:
            raise ValueError(f"{source}: unknown config key {raw_key!r}")
        side, name, parse = known[key]
        value = _file_value(value, parse, f"{source}: {raw_key}")
        (engine if side == "engine" else server)[name] = value
    return {**engine, "server": server} if server else engine
