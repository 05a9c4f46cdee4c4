"""Server settings: listening address, auth, client-controlled size limits."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from carpool import limits
from carpool.cluster.fleet_config import FleetConfig
from carpool.cluster.policies import POLICIES
from carpool.server.reasoning_parsers import REASONING_PARSERS
from carpool.server.tools import TOOL_PARSERS
from carpool.settings_fields import flag_bool, setting

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
METRICS_PREFIXES = ("carpool", "vllm", "both")
BACKENDS = ("local", "ray")
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"  # %(asctime)s in log_format


@dataclass
class ServerConfig(FleetConfig):
    """Everything about the HTTP front; the engine has its own ``EngineConfig``.

    Every size a client controls has a cap here, so one request can never
    hold the server hostage (body, headers, n, logprobs, stop strings, ...).
    The fleet's settings (replicas, routing, P/D, autoscaling) are
    ``FleetConfig``'s, shared with ``carpool simulate``.
    """

    # loopback by default; 0.0.0.0 to serve the network
    host: str = setting(
        "127.0.0.1", "--host", "HOST",
        "address to listen on (0.0.0.0 for all)")
    port: int = setting(
        8000, "--port", "PORT",
        "port to listen on (0 = any free port)", parse=int)
    # defaults to the model's name
    served_model_name: str | None = setting(
        None, "--served-model-name", "NAME",
        "model name in the API (default: the model argument as given)")
    # One key for every caller (also from $CARPOOL_API_KEY or --api-key-file,
    # which keep it out of `ps`); --api-keys FILE maps keys to tenants and privileges.
    api_key: str | None = setting(
        None, "--api-key", "KEY",
        "require 'Authorization: Bearer KEY' (visible in ps: prefer $CARPOOL_API_KEY / "
        "$VLLM_API_KEY or --api-key-file; none = open)")
    # a file whose first line is the key
    api_key_file: str | None = setting(
        None, "--api-key-file", "FILE",
        "read the API key from this file's first line")
    # keys file (see carpool.server.auth)
    api_keys: str | None = setting(
        None, "--api-keys", "FILE",
        "YAML/JSON file of API keys, each with its tenant and privileges (max_priority, "
        "share_prefix_cache)")
    # Host names (no port) accepted in the Host header; empty = automatic:
    # on a keyless server bound to loopback only loopback names (against
    # DNS rebinding), otherwise any.
    allowed_hosts: list[str] = setting(
        [], "--allowed-hosts", "HOST",
        "Host header names accepted (default: loopback names on a keyless loopback server, "
        "else any)", nargs="*")
    cors_origins: list[str] = setting(  # CORS is off when empty
        [], "--cors-origins", "ORIGIN", "allowed CORS origins (CORS is off unless given)",
        nargs="*")
    # The largest valid request: 32 prompts of 8192 token ids (~1.8 MB of JSON).
    max_body_bytes: int = setting(
        2 * 2**20, "--max-body-bytes", "BYTES",
        "largest request body accepted", parse=int)
    max_header_bytes: int = setting(
        16 * 2**10, "--max-header-bytes", "BYTES",
        "largest request head accepted (HTTP 431)", parse=int)
    max_n: int = setting(
        16, "--max-n", "N",
        "largest n accepted", parse=int)
    # prompts in one /v1/completions batch
    max_prompts: int = setting(
        32, "--max-prompts", "N",
        "most prompts in one /v1/completions call", parse=int)
    max_messages: int = setting(
        256, "--max-messages", "N",
        "most chat messages in one call", parse=int)
    # may be lowered, never raised
    max_logprobs: int = setting(
        int(limits.LOGPROBS.hi), "--max-logprobs", "N",
        "largest logprobs / top_logprobs accepted (0..20)", parse=int)
    max_stop: int = setting(
        limits.MAX_STOP_STRINGS, "--max-stop", "N",
        "most stop strings in one request", parse=int)
    # None: the context length is the only cap
    max_tokens_cap: int | None = setting(
        None, "--max-tokens-cap", "N",
        "largest max_tokens accepted (default: the context length)", parse=int)
    # Characters of prompt text in one request (all text prompts, or all chat
    # messages' content); None = CHARS_PER_CONTEXT_TOKEN per token of the
    # context length (a longer text could not fit the context anyway).
    # Token-id prompts are capped at the context length each.
    max_prompt_chars: int | None = setting(
        None, "--max-prompt-chars", "N",
        "most characters of prompt text (or chat messages) in one request, HTTP 400 beyond "
        "(default: 16 per context token)", parse=int)
    # Chat: special-token text inside message content is tokenized as plain
    # text (content cannot forge <|im_start|> and the like) unless true.
    special_tokens_in_content: bool = setting(
        False, "--special-tokens-in-content", "BOOL",
        "parse special-token text (<|im_start|>...) inside chat message content (false: it is"
        " plain text)", parse=flag_bool)
    # Tool calling (vLLM's flags): the format the model writes calls in
    # (hermes | llama3_json | mistral), which tool_choice "auto" needs,
    # with enable_auto_tool_choice; required and named choices need neither.
    tool_call_parser: str | None = setting(
        None, "--tool-call-parser", "NAME",
        "the format the model writes tool calls in: hermes | llama3_json | mistral (needed by"
        " tool_choice auto)")
    enable_auto_tool_choice: bool = setting(
        False, "--enable-auto-tool-choice", None,
        "let the model decide when to call tools (tool_choice auto; with --tool-call-parser)",
        parse=bool)
    # Splits <think>...</think> off into reasoning_content: qwen3 | deepseek_r1.
    reasoning_parser: str | None = setting(
        None, "--reasoning-parser", "NAME",
        "split <think>...</think> off into reasoning_content: qwen3 | deepseek_r1")
    # threads that parse, template and tokenize requests
    prep_workers: int = setting(
        1, "--prep-workers", "N",
        "threads that parse, template and tokenize requests off the event loop", parse=int)
    # The engine runs in a worker process of its own (carpool.engine.worker),
    # so HTTP, tokenizing and the SSE stream never wait on the model's GIL;
    # false: on a thread of the API process (one process, as before).
    engine_process: bool = setting(
        True, "--engine-process", "BOOL",
        "run the engine in a worker process of its own, HTTP and tokenizing in this one "
        "(false: both in one process)", parse=flag_bool)
    # Where the replicas run: local (this machine: worker processes, or a
    # thread with --no-engine-process) or ray (Ray Serve deployments on a
    # Ray cluster, carpool.ray_serve; pip install -e '.[ray]').
    backend: str = setting(
        "local", "--backend", "BACKEND",
        "where the replicas run: local (worker processes on this machine) | ray (Ray Serve "
        "deployments on a local or attached Ray cluster; pip install -e '.[ray]')")
    # seconds a connection may take to send its request head
    header_timeout: float = setting(
        10.0, "--header-timeout", "SECONDS",
        "seconds a connection may take to send a request head", parse=float)
    # A request body must arrive within body_timeout seconds of its head, at
    # body_min_rate bytes/s on average after its first second (0: no
    # minimum); otherwise the answer is 408 and the connection is closed.
    body_timeout: float = setting(
        60.0, "--body-timeout", "SECONDS",
        "seconds a request body may take to arrive after its head (HTTP 408)", parse=float)
    body_min_rate: float = setting(
        1024.0, "--body-min-rate", "BYTES_PER_S",
        "slowest average rate a request body may arrive at after its first second, HTTP 408 "
        "(0: no minimum)", parse=float)
    # Open connections in all (more are answered 503) and from one client
    # address (429); 0 = no cap. Behind a proxy, every client has the
    # proxy's address: raise or drop the per-client cap there.
    max_connections: int = setting(
        1024, "--max-connections", "N",
        "open connections in all; more are answered 503 (0: no cap)", parse=int)
    max_connections_per_client: int = setting(
        256, "--max-connections-per-client", "N",
        "open connections from one client address; more are answered 429 (0: no cap; behind a"
        " proxy every client has the proxy's address)", parse=int)
    # seconds an idle keep-alive connection stays open
    keep_alive_timeout: float = setting(
        5.0, "--keep-alive-timeout", "SECONDS",
        "seconds an idle keep-alive connection stays open", parse=float)
    # The emergency switch's last step (--emergency-switch): identical
    # deterministic non-streamed requests of one tenant answered from a
    # cache of at most this many responses and bytes, each for ttl seconds.
    response_cache_entries: int = setting(
        1024, "--response-cache-entries", "N",
        "--emergency-switch's last step: responses kept to answer identical deterministic "
        "requests of a tenant (0: none)", parse=int)
    response_cache_bytes: int = setting(
        64 * 2**20, "--response-cache-bytes", "BYTES",
        "the response cache's size bound (JSON bytes)", parse=int)
    response_cache_ttl: float = setting(
        60.0, "--response-cache-ttl", "SECONDS",
        "seconds a cached response may be served", parse=float)
    # seconds in-flight requests get after SIGTERM
    shutdown_timeout: float = setting(
        30.0, "--shutdown-timeout", "SECONDS",
        "seconds in-flight requests get to finish after SIGTERM", parse=float)
    # seconds between status lines while busy
    status_interval: float = setting(
        5.0, "--status-interval", "SECONDS",
        "seconds between status lines while busy", parse=float)
    # /health turns 503 if busy with no step for this long
    stall_timeout: float = setting(
        120.0, "--stall-timeout", "SECONDS",
        "seconds busy without a step before /health answers 503", parse=float)
    # critical | error | warning | info | debug | trace
    uvicorn_log_level: str = setting(
        "warning", "--uvicorn-log-level", "LEVEL",
        "uvicorn's own log level: critical | error | warning | info | debug | trace")
    # Prefix of the Prometheus series: carpool (default), vllm (an existing
    # vLLM dashboard and its alert rules work unchanged) or both.
    metrics_prefix: str = setting(
        "carpool", "--metrics-prefix", "PREFIX",
        "Prometheus series names: carpool | vllm (vLLM's dashboards unchanged) | both")
    # The server's log lines (listening, targets, status while busy, drain):
    # Python logging's %-style fields; asctime is local time to the second
    # (LOG_DATE_FORMAT), e.g. "2026-12-04 19:30:01 carpool: serving ...".
    log_format: str = setting(
        "%(asctime)s carpool: %(message)s", "--log-format", "FORMAT",
        "format of the server's log lines (Python logging: %(asctime)s, %(levelname)s, "
        "%(message)s, ...)")

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
        self._validate_fleet()
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

    def _validate_fleet(self) -> None:
        """The fleet's settings (``FleetConfig``'s) in this server's terms:
        pools, engine processes and the backend that runs them."""
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
        self.validate_pd()
        if self.prefill and self.backend == "ray" and self.pd_mode != "always":
            raise ValueError("--backend ray: Ray Serve's request routers place each part, so "
                             "P/D there is --pd-mode always")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got "
                             f"{self.backend!r}")
        if self.backend == "ray" and not self.engine_process:
            raise ValueError("--backend ray runs each engine in a Ray Serve replica (drop "
                             "--no-engine-process)")
        if self.autoscale is not None:
            self.autoscale_config()  # raises on bad bounds or thresholds
            if self.min_replicas == 0 and self.backend == "ray":
                raise ValueError("--min-replicas 0 (scale to zero) runs on the local fleet; "
                                 "with --backend ray the fewest replicas is 1")
            if self.autoscale not in ("reactive", "predictive", "forecast"):
                raise ValueError(f"autoscale must be reactive, predictive or forecast, got "
                                 f"{self.autoscale!r}")
        if self.routing not in POLICIES:
            raise ValueError(f"unknown routing policy {self.routing!r}; one of "
                             f"{', '.join(POLICIES)}")

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
