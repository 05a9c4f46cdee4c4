"""Server settings: listening address, auth, client-controlled size limits."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from carpool import limits
from carpool.server.reasoning_parsers import REASONING_PARSERS
from carpool.server.tools import TOOL_PARSERS

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
METRICS_PREFIXES = ("carpool", "vllm", "both")
BACKENDS = ("local", "ray")
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"  # %(asctime)s in log_format


@dataclass
class ServerConfig:
    """Everything about the HTTP front; the engine has its own ``EngineConfig``.

    Every size a client controls has a cap here, so one request can never
    hold the server hostage (body, headers, n, logprobs, stop strings, ...).
    """

    host: str = "127.0.0.1"  # loopback by default; 0.0.0.0 to serve the network
    port: int = 8000
    served_model_name: str | None = None  # defaults to the model's name
    # One key for every caller (also from $CARPOOL_API_KEY or --api-key-file,
    # which keep it out of `ps`); --api-keys FILE maps keys to tenants and privileges.
    api_key: str | None = None
    api_key_file: str | None = None  # a file whose first line is the key
    api_keys: str | None = None  # keys file (see carpool.server.auth)
    # Host names (no port) accepted in the Host header; empty = automatic:
    # on a keyless server bound to loopback only loopback names (against
    # DNS rebinding), otherwise any.
    allowed_hosts: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)  # CORS is off when empty
    # The largest valid request: 32 prompts of 8192 token ids (~1.8 MB of JSON).
    max_body_bytes: int = 2 * 2**20
    max_header_bytes: int = 16 * 2**10
    max_n: int = 16
    max_prompts: int = 32  # prompts in one /v1/completions batch
    max_messages: int = 256
    max_logprobs: int = int(limits.LOGPROBS.hi)  # may be lowered, never raised
    max_stop: int = limits.MAX_STOP_STRINGS
    max_tokens_cap: int | None = None  # None: the context length is the only cap
    # Characters of prompt text in one request (all text prompts, or all chat
    # messages' content); None = CHARS_PER_CONTEXT_TOKEN per token of the
    # context length (a longer text could not fit the context anyway).
    # Token-id prompts are capped at the context length each.
    max_prompt_chars: int | None = None
    # Chat: special-token text inside message content is tokenized as plain
    # text (content cannot forge <|im_start|> and the like) unless true.
    special_tokens_in_content: bool = False
    # Tool calling (vLLM's flags): the format the model writes calls in
    # (hermes | llama3_json | mistral), which tool_choice "auto" needs,
    # with enable_auto_tool_choice; required and named choices need neither.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # Splits <think>...</think> off into reasoning_content: qwen3 | deepseek_r1.
    reasoning_parser: str | None = None
    prep_workers: int = 1  # threads that parse, template and tokenize requests
    # The engine runs in a worker process of its own (carpool.engine.worker),
    # so HTTP, tokenizing and the SSE stream never wait on the model's GIL;
    # false: on a thread of the API process (one process, as before).
    engine_process: bool = True
    # Where the replicas run: local (this machine: worker processes, or a
    # thread with --no-engine-process) or ray (Ray Serve deployments on a
    # Ray cluster, carpool.ray_serve; pip install -e '.[ray]').
    backend: str = "local"
    # Engine worker processes behind the router (carpool.fleet.local); 1 =
    # one engine. Each takes its own KV pool and torch threads: on one
    # machine, at most about one per two cores pays.
    replicas: int = 1
    # P/D serving (carpool.fleet.pd): prefill and decode replica pools,
    # the KV of each prompt moving from one to the other through the KV
    # store (kv_store: local by default). 0 and 0: colocated (--replicas).
    prefill: int = 0
    decode: int = 0
    # Where each P/D request runs (carpool.cluster.pd.PDPlanner): always (every
    # request prefilled on the prefill pool) | conditional (only where the
    # predicted first token with the transfer beats a prefill on the decode
    # replica; local backend). The link the planner prices the KV transfer
    # with: GB/s and seconds per transfer (default: the local TCP store's
    # load rate on a 2-core machine, README); shortest uncached prompt sent.
    pd_mode: str = "always"
    pd_bandwidth: float = 0.5
    pd_latency: float = 0.0002
    pd_min_remote_tokens: int = 0
    # conditional: what a colocated prefill's stall of the decode replica's
    # running requests weighs against the request's own TTFT (PDPlanner).
    pd_stall_weight: float = 0.0
    # The fleet router's policy (carpool.cluster.policies.POLICIES).
    routing: str = "predicted-ttft"
    # Live replica counts (carpool.cluster.autoscaler): reactive | predictive,
    # None = the fixed --replicas. The count moves within [min, max]
    # (max: default --replicas); the rules' thresholds follow.
    autoscale: str | None = None
    min_replicas: int = 1
    max_replicas: int | None = None
    scale_tick: float = 10.0  # seconds between autoscaler ticks
    scale_out_backlog: int = 100  # scale out when more than this many wait ...
    scale_out_wait: float = 1.0  # ... longer than this at the recent rate (0: the count alone)
    scale_out_cooldown: float = 30.0
    scale_in_utilization: float = 0.5  # scale in when slots stay less used than this ...
    scale_in_after: float = 300.0  # ... for this many seconds
    scale_in_window: float = 300.0  # and the highest want of this window is lower
    header_timeout: float = 10.0  # seconds a connection may take to send its request head
    # A request body must arrive within body_timeout seconds of its head, at
    # body_min_rate bytes/s on average after its first second (0: no
    # minimum); otherwise the answer is 408 and the connection is closed.
    body_timeout: float = 60.0
    body_min_rate: float = 1024.0
    # Open connections in all (more are answered 503) and from one client
    # address (429); 0 = no cap. Behind a proxy, every client has the
    # proxy's address: raise or drop the per-client cap there.
    max_connections: int = 1024
    max_connections_per_client: int = 256
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    # The emergency switch's last step (--emergency-switch): identical
    # deterministic non-streamed requests of one tenant answered from a
    # cache of at most this many responses and bytes, each for ttl seconds.
    response_cache_entries: int = 1024
    response_cache_bytes: int = 64 * 2**20
    response_cache_ttl: float = 60.0
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    status_interval: float = 5.0  # seconds between status lines while busy
    stall_timeout: float = 120.0  # /health turns 503 if busy with no step for this long
    uvicorn_log_level: str = "warning"  # critical | error | warning | info | debug | trace
    # Prefix of the Prometheus series: carpool (default), vllm (an existing
    # vLLM dashboard and its alert rules work unchanged) or both.
    metrics_prefix: str = "carpool"
    # The server's log lines (listening, targets, status while busy, drain):
    # Python logging's %-style fields; asctime is local time to the second
    # (LOG_DATE_FORMAT), e.g. "2026-12-04 19:30:01 carpool: serving ...".
    log_format: str = "%(asctime)s carpool: %(message)s"

    def _validate_connections(self) -> None:
        if not 0 < self.body_timeout < float("inf") or not self.body_min_rate >= 0:
            raise ValueError(f"body_timeout must be > 0 seconds and body_min_rate >= 0 bytes/s, "
                             f"got {self.body_timeout} and {self.body_min_rate}")
        for name in ("max_connections", "max_connections_per_client"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no cap), got {getattr(self, name)}")
        for name in ("response_cache_entries", "response_cache_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no response cache), "
                                 f"got {getattr(self, name)}")
        if not self.response_cache_ttl > 0:
            raise ValueError(f"response_cache_ttl must be > 0 seconds, "
                             f"got {self.response_cache_ttl}")

    def _validate_pd(self) -> None:
        from carpool.cluster.pd import PD_MODES

        if self.pd_mode not in PD_MODES:
            raise ValueError(f"pd_mode must be one of {', '.join(PD_MODES)}, got "
                             f"{self.pd_mode!r}")
        if not self.pd_bandwidth > 0 or not self.pd_latency >= 0:  # also rejects NaN
            raise ValueError(f"P/D link needs pd_bandwidth > 0 GB/s and pd_latency >= 0 s, "
                             f"got {self.pd_bandwidth} and {self.pd_latency}")
        if not self.pd_stall_weight >= 0:
            raise ValueError(f"pd_stall_weight must be >= 0, got {self.pd_stall_weight}")
        if self.pd_min_remote_tokens < 0:
            raise ValueError(f"pd_min_remote_tokens must be >= 0, got "
                             f"{self.pd_min_remote_tokens}")
        if self.prefill and self.backend == "ray" and self.pd_mode != "always":
            raise ValueError("--backend ray: Ray Serve's request routers place each part, so "
                             "P/D there is --pd-mode always")

    def pd_link(self):
        """The planner's ``Link`` (``pd_bandwidth`` GB/s, ``pd_latency`` s)."""
        from carpool.cluster.pd import Link

        return Link(self.pd_bandwidth * 1e9, self.pd_latency)

    def validate(self) -> "ServerConfig":
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        for name in ("max_body_bytes", "max_header_bytes", "max_n", "max_prompts",
                     "max_messages", "max_stop"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1 or null (no cap), "
                             f"got {self.max_prompt_chars}")
        if not limits.LOGPROBS.contains(self.max_logprobs):
            raise ValueError(f"max_logprobs must be in {limits.LOGPROBS.describe()}, "
                             f"got {self.max_logprobs}")
        if self.shutdown_timeout < 0 or self.status_interval <= 0 or self.stall_timeout <= 0:
            raise ValueError("shutdown_timeout must be >= 0, status_interval and "
                             "stall_timeout > 0")
        if not self.header_timeout > 0 or not self.keep_alive_timeout > 0:
            raise ValueError("header_timeout and keep_alive_timeout must be > 0 seconds")
        self._validate_connections()
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if (self.replicas > 1 or self.autoscale) and not self.engine_process:
            raise ValueError("replicas > 1 and autoscale need engine processes (drop "
                             "--no-engine-process)")
        if (self.prefill > 0) != (self.decode > 0) or min(self.prefill, self.decode) < 0:
            raise ValueError(f"P/D serving needs both --prefill N and --decode N >= 1, got "
                             f"{self.prefill} and {self.decode}")
        if self.prefill and (self.replicas > 1 or self.autoscale or not self.engine_process):
            raise ValueError("--prefill/--decode run their own pools of engine replicas: drop "
                             "--replicas, --autoscale and --no-engine-process")
        self._validate_pd()
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got "
                             f"{self.backend!r}")
        if self.backend == "ray" and not self.engine_process:
            raise ValueError("--backend ray runs each engine in a Ray Serve replica (drop "
                             "--no-engine-process)")
        if self.autoscale is not None:
            self.autoscale_config()  # raises on bad bounds or thresholds
            if self.autoscale not in ("reactive", "predictive"):
                raise ValueError(f"autoscale must be reactive or predictive, got "
                                 f"{self.autoscale!r}")
        from carpool.cluster.policies import POLICIES

        if self.routing not in POLICIES:
            raise ValueError(f"unknown routing policy {self.routing!r}; one of "
                             f"{', '.join(POLICIES)}")
        if self.prep_workers < 1:
            raise ValueError(f"prep_workers must be >= 1, got {self.prep_workers}")
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics_prefix must be one of {', '.join(METRICS_PREFIXES)}, "
                             f"got {self.metrics_prefix!r}")
        _check_log_format(self.log_format)
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, "
                             f"got {self.uvicorn_log_level!r}")
        return self

    def autoscale_config(self):
        """The ``AutoscaleConfig`` these settings describe (``--autoscale``)."""
        from carpool.cluster.autoscaler import AutoscaleConfig

        return AutoscaleConfig(
            min_replicas=self.min_replicas, max_replicas=self.max_replicas or self.replicas,
            tick_s=self.scale_tick, scale_out_backlog=self.scale_out_backlog,
            scale_out_wait_s=self.scale_out_wait, scale_out_cooldown_s=self.scale_out_cooldown,
            scale_in_utilization=self.scale_in_utilization, scale_in_after_s=self.scale_in_after,
            scale_in_window_s=self.scale_in_window).validate()

    def prompt_chars_cap(self, max_model_len: int) -> int:
        """The character cap in force for a model of this context length."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return CHARS_PER_CONTEXT_TOKEN * max_model_len

    def resolve_api_key(self) -> None:
        """Fill ``api_key`` from ``api_key_file``, $CARPOOL_API_KEY or (as
        vLLM reads it) $VLLM_API_KEY when not given."""
        if self.api_key is None and self.api_key_file:
            with open(self.api_key_file, encoding="utf-8") as f:
                self.api_key = f.readline().strip() or None
            if self.api_key is None:
                raise ValueError(f"{self.api_key_file}: the first line holds no key")
        if self.api_key is None:
            self.api_key = (os.environ.get("CARPOOL_API_KEY")
                            or os.environ.get("VLLM_API_KEY") or None)

    def host_allow_list(self, keyed: bool) -> frozenset[str] | None:
        """Host names the Host header may carry, or None for any."""
        if self.allowed_hosts:
            return frozenset(h.lower() for h in self.allowed_hosts)
        if not keyed and is_loopback(self.host):
            return LOOPBACK_NAMES
        return None


def _check_log_format(text: str) -> None:
    """A log format that cannot format a line is an error now, not a
    traceback on every line later."""
    try:
        record = logging.makeLogRecord({"msg": "x", "levelname": "INFO", "name": "carpool"})
        logging.Formatter(text, LOG_DATE_FORMAT).format(record)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"log_format {text!r} cannot format a line ({exc}); use logging's "
                         f"%-style fields, e.g. '%(asctime)s carpool: %(message)s'") from None


# Generous: real text runs ~3-5 characters per token, code up to ~10.
CHARS_PER_CONTEXT_TOKEN = 16
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
