"""``carpool serve --backend ray``: the application on a local (or attached) Ray.

Starts Ray on 127.0.0.1 (no dashboard; or attaches to ``$RAY_ADDRESS``),
runs Ray Serve's HTTP proxy on ``--host``/``--port``, deploys the
application (``carpool.ray_serve.app``) and serves until SIGTERM or
Ctrl-C, then deletes the application (each replica gets
``--shutdown-timeout`` to finish its requests) and stops what it started.
Ray is imported here only: without it the command says how to install it.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading

from carpool.config import EngineConfig
from carpool.server.config import ServerConfig
from carpool.server.launcher import address_problem, model_name, setup_logging

log = logging.getLogger("carpool.server")

APP_NAME = "carpool"
INSTALL_HINT = "--backend ray needs Ray Serve: pip install -e '.[ray]'"


def free_port(host: str) -> int:
    """A port free on ``host`` now (``--port 0``)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _most_replicas(server_config: ServerConfig) -> int:
    """How many engine replicas may run at once (the CPUs are split between them)."""
    if server_config.prefill:
        return server_config.prefill + server_config.decode
    return max(1, server_config.max_replicas or server_config.replicas)


def _replicas_text(server_config: ServerConfig) -> str:
    if server_config.prefill:
        return (f"{server_config.prefill} prefill and {server_config.decode} decode engine "
                f"replica(s) (P/D, KV through Ray's object store)")
    return f"{server_config.replicas} engine replica(s)"


def _running_text(app) -> str:
    """How many engine replicas Ray Serve runs for the application (its
    ``ApplicationStatusOverview``): ``2 replicas``, or P/D's two pools."""
    def running(name: str) -> int:
        deployment = app.deployments.get(name)
        return deployment.replica_states.get("RUNNING", 0) if deployment else 0

    if "CarpoolPrefill" in app.deployments:
        return (f"{running('CarpoolPrefill')} prefill + {running('CarpoolDecode')} decode "
                f"replicas")
    count = running("CarpoolEngine")
    return f"{count} replica{'' if count == 1 else 's'}"


def run_ray_server(engine_config: EngineConfig, server_config: ServerConfig,
                   slo_sources: dict[str, str] | None = None, schedule=None) -> int:
    """Serve through Ray Serve until a signal; the exit status (0, or 1 when
    the application could not be deployed, 2 for a usage error)."""
    try:
        import ray
        from ray import serve
    except ImportError:
        print(f"carpool: error: {INSTALL_HINT}", file=sys.stderr, flush=True)
        return 2
    if schedule is not None:
        raise ValueError("--profile time-of-day windows are not applied with --backend ray; "
                         "give the settings as flags or --config")
    server_config.validate()
    setup_logging(server_config)
    problem = address_problem(server_config.host, server_config.port)
    if problem:
        print(f"carpool: cannot listen on {server_config.host}:{server_config.port}: {problem}",
              file=sys.stderr, flush=True)
        return 2
    server_config.resolve_api_key()
    if server_config.api_keys:
        from carpool.server.auth import read_keys_file

        read_keys_file(server_config.api_keys)
    from carpool.ray_serve.app import application, settings_for

    cpus = os.cpu_count() or 1
    settings = settings_for(engine_config, server_config, model_name(engine_config, server_config),
                            slo_sources, replica_cpus=cpus / _most_replicas(server_config))
    if server_config.port == 0:  # any free port (Ray's proxy cannot say which it took)
        server_config.port = free_port(server_config.host)
    attached = _start_ray(ray, cpus)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        log.info("deploying %s on Ray Serve...", _replicas_text(server_config))
        serve.run(application(settings), name=APP_NAME, route_prefix="/")
        log.info("serving %r on http://%s:%d through Ray Serve (%s, routing %s%s)",
                 settings.model_name, server_config.host, server_config.port,
                 _running_text(serve.status().applications[APP_NAME]), server_config.routing,
                 f", autoscale {server_config.autoscale}" if server_config.autoscale else "")
        while not stop.wait(1.0):
            pass
        log.warning("draining: deleting the application (up to %.0f s per replica)",
                    server_config.shutdown_timeout)
        return 0
    except RuntimeError as exc:  # the application failed to deploy (Ray says why)
        log.error("the Ray Serve application could not be deployed: %s", exc)
        return 1
    finally:
        _leave_ray(ray, serve, attached)


def _start_ray(ray, cpus: int) -> bool:  # noqa: ANN001
    """Attach to ``$RAY_ADDRESS``'s cluster, else start one here on
    127.0.0.1 with ``cpus``; whether it attached."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    attached = bool(os.environ.get("RAY_ADDRESS"))
    if attached:
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=cpus)
    return attached


def _leave_ray(ray, serve, attached: bool) -> None:  # noqa: ANN001
    """Delete the application and stop Serve; stop Ray too where it was ours."""
    from carpool.ray_serve.driver import stop_driver_router

    try:
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        stop_driver_router()
        if not attached:
            ray.shutdown()
