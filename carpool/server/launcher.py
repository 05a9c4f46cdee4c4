"""``carpool serve``: load the engine, run uvicorn, drain on SIGTERM.

Exit codes: 0 after a signal-initiated drain, 1 when the engine loop
failed (so a supervisor restarts the process).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import math
import signal
import socket
import sys
import time

import prometheus_client
import uvicorn

from carpool.config import EngineConfig
from carpool.engine.async_engine import AsyncEngine
from carpool.engine.client import EngineClient, EngineLaunchError
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.worker import build_serving_engine
from carpool.fleet.local import FleetEngine
from carpool.server.app import build_app
from carpool.server.config import LOG_DATE_FORMAT, ServerConfig
from carpool.server.http import with_head_timeout
from carpool.server.metrics import Metrics
from carpool.server.serving import ServerContext

log = logging.getLogger("carpool.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# After an engine failure the server stays up this long, so in-flight
# responses flush their error events and health checks see 503.
FAILURE_GRACE_S = 2.0
# The event loop competes for the GIL with the engine thread and the request
# preparation threads; at Python's default 5 ms switch interval a flood of
# maximal bodies kept /health waiting ~0.2-0.4 s, at 1 ms under 0.1 s.
GIL_SWITCH_INTERVAL_S = 0.001


def model_name(engine_config: EngineConfig, server_config: ServerConfig) -> str:
    """The name the API serves: ``--served-model-name``, else the model
    argument exactly as given (as vLLM reports it: the same file is one name
    however it was loaded), else the default model's name."""
    if server_config.served_model_name:
        return server_config.served_model_name
    return engine_config.model.model or DEFAULT_MODEL_NAME


def setup_logging(config: ServerConfig) -> None:
    """The server's log lines on stderr in ``config.log_format`` (by default
    ``2026-12-04 19:30:01 carpool: ...``); a process whose logging is set up
    already (an embedding application, pytest) keeps its own."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(config.log_format, LOG_DATE_FORMAT))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


def _engine_log(message: str) -> None:
    """``prepare_serving``'s progress lines, as the server's log lines."""
    log.info(message.removeprefix("carpool: "))


class _Server(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains instead of exiting."""

    def __init__(self, config: uvicorn.Config, runner: "_Runner") -> None:
        super().__init__(config)
        self.runner = runner

    def handle_exit(self, sig: int, frame) -> None:
        if self.runner.draining_since is None:
            self.runner.loop.call_soon_threadsafe(self.runner.start_drain, sig)
        else:  # a second signal: stop now
            super().handle_exit(sig, frame)
            self.force_exit = True


class _Runner:
    def __init__(self, ctx: ServerContext, config: ServerConfig) -> None:
        self.ctx = ctx
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.exit_code = 0
        self.draining_since: float | None = None
        uv_config = uvicorn.Config(
            build_app(ctx), host=config.host, port=config.port,
            log_level=config.uvicorn_log_level,
            access_log=False, lifespan="off", timeout_graceful_shutdown=5,
            http=with_head_timeout(config.header_timeout, config.max_connections,
                                   config.max_connections_per_client),
            timeout_keep_alive=config.keep_alive_timeout,
            h11_max_incomplete_event_size=config.max_header_bytes + 4096)
        self.server = _Server(uv_config, self)
        ctx.engine.on_failure = lambda exc: self.loop.call_soon_threadsafe(self.fail, exc)

    def start_drain(self, sig: int) -> None:
        self.draining_since = time.monotonic()
        self.ctx.draining = True
        log.warning("received %s: draining %d in-flight requests (up to %.0f s)",
                    signal.Signals(sig).name, self.ctx.engine.num_in_flight,
                    self.config.shutdown_timeout)
        asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        deadline = self.draining_since + self.config.shutdown_timeout
        while self.ctx.engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.ctx.engine.num_in_flight:
            log.warning("shutdown timeout: aborting %d requests", self.ctx.engine.num_in_flight)
        self.ctx.engine.shutdown()  # anything left ends with an error event
        self.server.should_exit = True

    def fail(self, exc: BaseException) -> None:
        log.error("engine loop failed (%r); exiting with status 1", exc)
        self.exit_code = 1
        self.loop.call_later(FAILURE_GRACE_S, setattr, self.server, "should_exit", True)

    async def run(self) -> int:
        await self.ctx.prep.start()
        serve = asyncio.ensure_future(self.server.serve())
        while not self.server.started and not serve.done():
            await asyncio.sleep(0.02)
        if self.server.started:
            self._announce()
            status = asyncio.ensure_future(self._status_lines())
            await serve
            status.cancel()
        else:
            await serve  # failed to bind: uvicorn has said why
            return 1
        return self.exit_code

    def _announce(self) -> None:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        ctx = self.ctx
        stats = ctx.engine.stats
        per_token = ctx.engine.info.cache_info.get("kv_bytes_per_token", "?")
        replicas = replicas_text(ctx.engine.routing())
        log.info("serving %r on http://%s:%s (%scontext %d tokens, KV cache %d blocks, %s bytes "
                 "per token)", ctx.model_name, host, port, f"{replicas}, " if replicas else "",
                 ctx.max_model_len, stats.kv_num_blocks, per_token)
        if not replicas:  # one engine: its serving line keeps the form scripts match
            log.info("1 engine replica serves (--replicas N for more)")
        slo_text = ctx.engine.info.slo_text
        if slo_text is not None:
            log.info("%s (--adaptive false for plain batching)", slo_text)
        else:
            log.info("adaptive controller off: plain batching at the configured knobs, "
                     "no latency targets")

    async def _status_lines(self) -> None:
        # The window's base from the start: a burst served within the first
        # interval is reported at its end.
        self.ctx.metrics.snapshot()
        while True:
            await asyncio.sleep(self.config.status_interval)
            stats, rates = self.ctx.metrics.snapshot()
            gen = rates["generation_tokens_per_second"]
            if stats.num_running or stats.num_waiting or (gen == gen and gen > 0):
                log.info("%s", status_line(stats, rates))


def replicas_text(routing: dict) -> str:
    """How many engine replicas serve, from a front engine's ``routing()``:
    ``2 replicas``, ``1 prefill + 2 decode replicas`` (P/D); empty for one
    engine alone (no routing), whose serving line stays as it was."""
    pd = routing.get("pd")
    if pd is not None:
        prefill, decode = (len(pd.get(pool, {}).get("replicas", ())) for pool in
                           ("prefill", "decode"))
        return f"{prefill} prefill + {decode} decode replicas"
    if "routing" not in routing:
        return ""
    count = len(routing["routing"].get("replicas", ()))
    return f"{count} replica{'' if count == 1 else 's'}"


def status_line(stats, rates: dict[str, float]) -> str:
    def rate(name: str) -> float:
        value = rates[name]
        return 0.0 if math.isnan(value) else value

    return (f"running {stats.num_running} | waiting {stats.num_waiting} | "
            f"KV {stats.kv_usage:.1%} | gen {rate('generation_tokens_per_second'):.1f} tok/s | "
            f"all {rate('effective_tokens_per_second'):.1f} tok/s | "
            f"busy {rate('engine_busy_fraction'):.0%} | prefix hit {stats.prefix_hit_rate:.1%} | "
            f"mode {stats.mode}")


def address_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on ``host:port`` (one line), or None.
    Binds and closes a socket as uvicorn will (SO_REUSEADDR: a port in
    TIME_WAIT is free, one another server listens on is not)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"unknown host ({exc.strerror})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            hint = " (another server is listening there: pick another --port)" \
                if exc.errno == errno.EADDRINUSE else ""
            return f"{exc.strerror or exc}{hint}"
    return None


def run_server(engine_config: EngineConfig, server_config: ServerConfig,
               schedule=None, slo_sources: dict[str, str] | None = None) -> int:
    """Load the model and serve until a signal drains the server or the engine fails.

    ``schedule`` (a ``ProfileSchedule``): time-of-day windows applied live.
    The adaptive controller is on unless ``adaptive: false``; its latency
    targets are resolved (measured at start-up when ``auto``) before the
    server listens; ``slo_sources`` says which the command line set."""
    server_config.validate()
    setup_logging(server_config)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    prometheus_client.disable_created_metrics()  # as vLLM: no *_created series
    problem = address_problem(server_config.host, server_config.port)
    if problem:  # found now, not after the model has loaded
        print(f"carpool: cannot listen on {server_config.host}:{server_config.port}: {problem}",
              file=sys.stderr, flush=True)
        return 2
    server_config.resolve_api_key()
    if server_config.api_keys:  # a bad keys file fails now, before the model loads
        from carpool.server.auth import read_keys_file

        read_keys_file(server_config.api_keys)
    # Named before loading: the model argument as the user gave it.
    name = model_name(engine_config, server_config)
    log.info("loading the model...")
    if server_config.engine_process:
        return asyncio.run(_serve_with_worker(engine_config, server_config, name, schedule,
                                              slo_sources))
    return _serve_in_process(engine_config, server_config, name, schedule, slo_sources)


async def _serve_with_worker(engine_config: EngineConfig, server_config: ServerConfig,
                             name: str, schedule, slo_sources) -> int:
    """Serve with the engine in a worker process (``EngineClient``), or
    ``--replicas`` of them behind the router (``FleetEngine``)."""
    launch = {"slo_sources": slo_sources,
              "profile": schedule.source if schedule is not None else None,
              "pinned": sorted(schedule.pinned) if schedule is not None else (),
              "log_format": server_config.log_format, "log_datefmt": LOG_DATE_FORMAT}
    try:
        if server_config.prefill:
            from carpool.fleet.pd import PDFleet

            client = await PDFleet.start(engine_config, server_config.prefill,
                                         server_config.decode, server_config.routing,
                                         server_config.pd_mode, server_config.pd_link(),
                                         server_config.pd_min_remote_tokens,
                                         server_config.pd_stall_weight, **launch)
        elif server_config.replicas > 1 or server_config.autoscale:
            autoscale = server_config.autoscale_config() if server_config.autoscale else None
            client = await FleetEngine.start(
                engine_config, server_config.replicas, server_config.routing, autoscale,
                server_config.autoscale or "reactive",
                start_delay_s=server_config.replica_start_delay,
                concurrency_from_replicas=server_config.replica_concurrency is None,
                forecaster=server_config.forecaster, **launch)
        else:
            client = await EngineClient.start(engine_config, **launch)
    except EngineLaunchError as exc:
        if exc.usage:  # the settings or the model: one line, as the CLI says them
            print(f"carpool: error: {exc}", file=sys.stderr, flush=True)
            return 2
        log.error("the engine could not be built: %s", exc)
        return 1
    try:
        ctx = ServerContext(client, client.tokenizer, name, client.info.max_model_len,
                            server_config, Metrics(name, lambda: client.stats))
        return await _Runner(ctx, server_config).run()
    finally:
        await client.wait_closed()


def _serve_in_process(engine_config: EngineConfig, server_config: ServerConfig, name: str,
                      schedule, slo_sources) -> int:
    """Serve with the engine on a thread of this process (``AsyncEngine``)."""

    def build() -> LLMEngine:
        return build_serving_engine(engine_config, slo_sources, schedule, _engine_log)

    # Built on the engine thread: one thread runs every torch op (async_engine.py).
    async_engine = AsyncEngine(build)

    async def main() -> int:
        # The engine thread runs from here on: stop it however serving ends,
        # while the loop its streams answer on is still running.
        try:
            ctx = ServerContext(async_engine, async_engine.tokenizer, name,
                                async_engine.info.max_model_len, server_config,
                                Metrics(name, lambda: async_engine.stats))
            return await _Runner(ctx, server_config).run()
        finally:
            async_engine.shutdown()

    return asyncio.run(main())
