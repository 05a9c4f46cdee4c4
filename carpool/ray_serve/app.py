"""The Ray Serve application: ``serve run carpool.ray_serve.app:build_app model=...``.

Two deployments:

- ``CarpoolIngress``: carpool's FastAPI app (the same endpoints, keys,
  limits, errors and metrics as ``carpool serve``) over a ``RayEngine``;
- ``CarpoolEngine``: ``EngineReplica``s, one in-process ``AsyncEngine``
  each, routed by carpool's router (``CarpoolRequestRouter``) and, with
  ``autoscale``, sized by carpool's autoscaler (``CarpoolAutoscalingPolicy``).

P/D serving (``prefill`` and ``decode`` counts, as ``carpool serve
--prefill P --decode D``): two engine deployments instead, ``CarpoolPrefill``
and ``CarpoolDecode`` (``EngineReplica``s with that role, each pool routed
by carpool's router), sharing the block-hash secret and a ``RayObjectStore``
(KV blocks in Ray's object store, listed by the application's ``KVIndex``
actor, which the ingress creates so that it lives as long as the
application). The ingress serves through ``PDFleet`` over one ``RayEngine``
per pool: the first token from a prefill replica, the rest from a decode
replica that loads the prompt's blocks from the store.

``build_app``'s arguments are carpool's settings by their flag names (as
in a ``--config`` file: ``model``, ``replicas``, ``routing``,
``max-num-seqs``, ``autoscale``, ...) plus ``config`` (a carpool settings
file on every node), ``replica_cpus`` and ``ingress_cpus`` (Ray CPUs per
engine replica and for the ingress). Both deployments get their settings
as msgspec bytes (``AppSettings``), never a pickled carpool object.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import secrets
import time
import warnings
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from carpool.cli_flags import file_settings
from carpool.config import EngineConfig, read_yaml
from carpool.fleet.pd import PDFleet
from carpool.ray_serve.autoscaling import POLICY_PATH, policy_kwargs
from carpool.ray_serve.engine import RayEngine
from carpool.ray_serve.kv_store import store_for, uses_ray_store
from carpool.ray_serve.replica import EngineReplica, app_name
from carpool.ray_serve.router import CarpoolRequestRouter
from carpool.ray_serve.tp_followers import rank_bundles
from carpool.ray_serve.wire import AppSettings
from carpool.server.app import build_app as build_fastapi_app
from carpool.server.config import ServerConfig
from carpool.server.metrics import Metrics
from carpool.server.serving import ServerContext

log = logging.getLogger("carpool.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
RAY_KEYS = ("config", "replica_cpus", "ingress_cpus")  # builder arguments that are not carpool's
ROUTING_STATS_PERIOD_S = 0.5  # how often replicas report their views (and prefix caches)
INGRESS_MAX_ONGOING = 4096  # concurrent HTTP requests per ingress replica: carpool's limits apply
# No line per call (the stats polls would log four a second): carpool logs its own.
QUIET = {"enable_access_log": False}
REPLICAS_HEARD_S = 120.0  # for the ingress to hear from every engine replica at its start


@serve.ingress()
class CarpoolIngress:
    """carpool's FastAPI app, built once the engine deployment answered
    (P/D: both, ``engine_handle`` the prefill one)."""

    async def __init__(self, settings: bytes, engine_handle, decode_handle=None) -> None:
        app = AppSettings.decode(settings)
        if decode_handle is None:
            self.engine = await RayEngine.connect(engine_handle, app.engine, app.server.routing)
        else:
            # The KV index is created here first (when the replicas use Ray's
            # store), so that this ingress owns it: it lives, and is deleted,
            # with the application. Its handle is kept: a named actor whose
            # handles all went out of scope is collected.
            self.kv_index = None
            if uses_ray_store(app.engine.cache):
                store = store_for(app.engine.cache, app_name())
                self.kv_index = await asyncio.to_thread(store.index)
            self.engine = await _pd_engine(app, engine_handle, decode_handle)
        await _hear_from_every_replica(self.engine, app.server)
        self.ctx = ServerContext(self.engine, self.engine.tokenizer, app.model_name,
                                 self.engine.info.max_model_len, app.server,
                                 Metrics(app.model_name, lambda: self.engine.stats))
        await self.ctx.prep.start()

    def __serve_build_asgi_app__(self):
        return build_fastapi_app(self.ctx)

    async def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.wait_closed()


async def _pd_engine(app: AppSettings, prefill_handle, decode_handle) -> PDFleet:
    """A ``PDFleet`` over the two pools' ``RayEngine``s."""
    prefill, decode = await asyncio.gather(
        RayEngine.connect(prefill_handle, app.engine, app.server.routing),
        RayEngine.connect(decode_handle, app.engine, app.server.routing))
    return PDFleet(prefill, decode)


async def _hear_from_every_replica(engine: RayEngine | PDFleet, server: ServerConfig) -> None:
    """Return once this ingress's stats polls have reached every engine
    replica the application starts with (each pool's, in P/D), so that the
    application is RUNNING (``serve.run`` returns, ``carpool serve`` says it
    serves) only when /carpool/policy lists them all. Ray counts a replica
    running when its constructor returns, but this ingress's handle learns
    of it later and its polls (round robin, one per ``STATS_POLL_S``) reach
    it later still: a request sent at once could see one replica of two.
    Bounded: a replica not heard from in time is logged, and joins the
    views at its first poll."""
    pools = engine.pools if isinstance(engine, PDFleet) else (engine,)
    counts = (server.prefill, server.decode) if server.prefill else (_initial_replicas(server),)
    deadline = time.monotonic() + REPLICAS_HEARD_S
    for pool, count in zip(pools, counts, strict=True):
        while len(pool.views()) < count:
            if time.monotonic() > deadline:
                log.warning("the ingress heard from %d of %d engine replicas in %.0f s; the "
                            "others join /carpool/policy at their first stats poll",
                            len(pool.views()), count, REPLICAS_HEARD_S)
                break
            await asyncio.sleep(0.05)


def settings_from_args(args: dict[str, Any]) -> AppSettings:
    """``AppSettings`` from builder arguments (see the module docstring);
    values may be text (``serve run key=value``) or YAML's types."""
    args = {str(k).replace("-", "_"): v for k, v in (args or {}).items()}
    ray_args = {k: args.pop(k) for k in RAY_KEYS if k in args}
    layers = []
    if ray_args.get("config"):
        layers.append(file_settings(read_yaml(ray_args["config"]), ray_args["config"]))
    layers.append(file_settings(args, "the application's arguments"))
    engine = EngineConfig()
    server = ServerConfig()
    for layer in layers:
        engine.update({k: v for k, v in layer.items() if k != "server"})
        for key, value in (layer.get("server") or {}).items():
            if not hasattr(server, key):
                raise ValueError(f"unknown setting {key!r}")
            setattr(server, key, value)
    name = server.served_model_name or engine.model.model or DEFAULT_MODEL_NAME
    return settings_for(engine.validate(), server.validate(), name,
                        replica_cpus=float(ray_args.get("replica_cpus", 1.0)),
                        ingress_cpus=float(ray_args.get("ingress_cpus", 0.0)))


def settings_for(engine: EngineConfig, server: ServerConfig, model_name: str,
                 slo_sources: dict[str, str] | None = None, replica_cpus: float = 1.0,
                 ingress_cpus: float = 0.0) -> AppSettings:
    """The deployments' settings, with the fleet's block-hash secret (the
    configured one, else one made here: every replica and router of the
    application must share it)."""
    engine = copy.deepcopy(engine)
    if engine.cache.block_hash_key is None:
        engine.cache.block_hash_key = engine.cache.block_hash_secret().hex()
    if replica_cpus < 0 or ingress_cpus < 0:
        raise ValueError("replica_cpus and ingress_cpus must be >= 0")
    if server.prefill and not engine.cache.enable_prefix_caching:
        raise ValueError("P/D serving moves KV by block keys: it needs prefix caching")
    return AppSettings(engine, server, model_name, dict(slo_sources or {}), replica_cpus,
                       ingress_cpus)


def _initial_replicas(server: ServerConfig) -> int:
    """How many engine replicas the (colocated) deployment starts with."""
    if not server.autoscale:
        return server.replicas
    scaling = server.autoscale_config()
    return min(scaling.max_replicas, max(scaling.min_replicas, server.replicas))


def _autoscaling_config(server: ServerConfig) -> AutoscalingConfig:
    """Ray's autoscaling settings that hand the decision to carpool's policy."""
    scaling = server.autoscale_config()
    with warnings.catch_warnings():
        # ``metrics_interval_s`` is marked deprecated in favour of environment
        # variables, but Ray 2.60's replicas still push their metrics (the
        # backlog carpool's policy reads) at this interval: left at its 10 s
        # default, the policy acts on a backlog up to 10 s old (measured:
        # a 7 s burst on one slot never reached it). Pushed every half tick,
        # each tick sees a fresh one; the look-back window stays longer
        # than the push interval, as Ray requires.
        warnings.simplefilter("ignore", DeprecationWarning)
        return AutoscalingConfig(
            min_replicas=scaling.min_replicas, max_replicas=scaling.max_replicas,
            initial_replicas=_initial_replicas(server),
            # carpool's scaler holds its own cooldown and scale-in window
            upscale_delay_s=0.0, downscale_delay_s=0.0, look_back_period_s=scaling.tick_s,
            metrics_interval_s=scaling.tick_s / 2,
            policy=AutoscalingPolicy(policy_function=POLICY_PATH, policy_kwargs=policy_kwargs(
                server.autoscale, server.replicas, scaling)))


def _engine_options(settings: AppSettings, name: str) -> dict[str, Any]:
    """An engine deployment's options, carpool's router routing it."""
    server, scheduler = settings.server, settings.engine.scheduler
    ranks = settings.engine.model.tensor_parallel_size
    # A sliced replica: one actor per rank, in one placement group on one node.
    sliced = {"placement_group_bundles": rank_bundles(ranks, settings.replica_cpus),
              "placement_group_strategy": "STRICT_PACK"} if ranks > 1 else {}
    return {
        "name": name,
        "ray_actor_options": {"num_cpus": settings.replica_cpus / ranks},
        **sliced,
        # carpool's admission bounds the queue; Ray's cap only guards against a runaway
        "max_ongoing_requests": scheduler.max_num_seqs + scheduler.max_queue_requests,
        "graceful_shutdown_timeout_s": server.shutdown_timeout,
        "logging_config": QUIET,
        "request_router_config": RequestRouterConfig(
            request_router_class=CarpoolRequestRouter,
            request_router_kwargs={"policy": server.routing},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=5.0),
    }


def application(settings: AppSettings):
    """The Ray Serve ``Application`` of these settings (``serve.run`` it)."""
    server = settings.server
    ingress = serve.deployment(CarpoolIngress, name="CarpoolIngress",
                               ray_actor_options={"num_cpus": settings.ingress_cpus},
                               max_ongoing_requests=INGRESS_MAX_ONGOING,
                               graceful_shutdown_timeout_s=server.shutdown_timeout,
                               logging_config=QUIET)
    data = settings.encode()
    if server.prefill or server.decode:  # P/D: a pool each, fixed sizes (ServerConfig.validate)
        prefill = serve.deployment(EngineReplica, num_replicas=server.prefill,
                                   **_engine_options(settings, "CarpoolPrefill"))
        decode = serve.deployment(EngineReplica, num_replicas=server.decode,
                                  **_engine_options(settings, "CarpoolDecode"))
        return ingress.bind(data, prefill.bind(data, "prefill"), decode.bind(data, "decode"))
    engine_options = _engine_options(settings, "CarpoolEngine")
    if server.autoscale:
        engine_options["autoscaling_config"] = _autoscaling_config(server)
    else:
        engine_options["num_replicas"] = server.replicas
    engine = serve.deployment(EngineReplica, **engine_options)
    return ingress.bind(data, engine.bind(data))


def build_app(args: dict[str, Any]):
    """The application builder ``serve run`` and a RayService name."""
    return application(settings_from_args(args))


def fresh_secret() -> str:
    """A new block-hash secret (hex), for a deployment file that pins one."""
    return secrets.token_hex(32)
