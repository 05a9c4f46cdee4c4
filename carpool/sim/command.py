"""The ``carpool simulate`` command: workload and cost model from flags,
the simulation (carpool/sim/simulate.py), a bench-serve result out."""
from __future__ import annotations

import argparse
import dataclasses

from carpool.cluster.fleet_config import FleetConfig
from carpool.config import EngineConfig
from carpool.machine import available_cpus
from carpool.settings_fields import add_setting_args
from carpool.sim.cost_flags import (
    add_cost_model_args,
    cost_model_from_args,
    parallel_from_args,
    pool_blocks,
)
from carpool.sim.costs import CostModel, machine_warning
from carpool.sim.failures import FailureSettings
from carpool.sim.flags import (  # noqa: F401  (parse_pd_links: its home before)
    FailureFlags,
    KVTierFlags,
    ResultFlags,
    SimPoolFlags,
    SimScaleFlags,
    parse_pd_links,
)
from carpool.sim.scale_flags import add_reactive_args, reactive_knobs
from carpool.sim.simulate import (
    SimRun,
    SimSettings,
    cyclic_gc_paused,
    simulate,
)
from carpool.workload.command import add_workload_args, workload_spec
from carpool.workload.spec import describe_workload, mooncake_block_tokens, plan_workload

# `carpool simulate` studies policies where `carpool serve` picks the best
# one for a live fleet: its defaults are the baselines, and say so.
SIM_FLEET_DEFAULTS = {
    "routing": ("round-robin", "the fleet router's policy (default: round-robin, the "
                "baseline the other policies are measured against; `carpool serve` defaults "
                "to predicted-ttft)"),
    "max_replicas": (None, "--autoscale: most replicas (default: 4x --replicas; `carpool "
                     "serve`'s is --replicas, one machine's cores bound it)"),
}


def _link_defaults() -> dict:
    """The P/D flags' defaults where the simulator models a datacenter link
    and `carpool serve` prices its local TCP store."""
    from carpool.cluster.pd import Link

    return {
        "pd_mode": ("conditional", "conditional: prefill remotely only where it pays (default: "
                    "the planner under study); always: every request (`carpool serve`'s "
                    "default, the mode every backend has)"),
        "pd_bandwidth": (Link.bandwidth / 1e9, f"GB/s of the link between the pools (default "
                         f"{Link.bandwidth / 1e9:g}: 400 Gb/s RDMA; `carpool serve`'s prices "
                         f"its local KV store)"),
        "pd_latency": (Link.latency, f"seconds per transfer besides the bytes (default "
                       f"{Link.latency:g}; `carpool serve`'s: its local KV store's)"),
    }


# ParallelShape's fields: a run's config names them only for a sliced replica
PARALLEL_KEYS = ("tensor_parallel_size", "expert_parallel_size", "micro_batches")

SIM_OPTIONS = ("fleet_ttft_target", "front_seconds", "fast_forward", "workers")



def add_simulation_args(parser: argparse.ArgumentParser, *, fleet: bool = True) -> None:
    """Group "simulation": routing and the simulator's options; with
    ``fleet`` also the replica count, per-token times, autoscaling and
    failures (``carpool plan`` chooses the replicas itself)."""
    group = parser.add_argument_group("simulation")
    add_setting_args(group, FleetConfig, only=("replicas", "routing") if fleet else ("routing",),
                     defaults={"routing": SIM_FLEET_DEFAULTS["routing"]})
    add_setting_args(group, SimSettings, only=SIM_OPTIONS + (("token_times",) if fleet else ()),
                     defaults={"workers": (None, "processes for round-robin replicas, which "
                                           "are simulated independently (default: the CPUs "
                                           "available; same result)")})
    if not fleet:
        return
    scale = parser.add_argument_group("autoscaling (--replicas is then the start)")
    add_setting_args(scale, FleetConfig, only=("autoscale", "forecaster", "min_replicas",
                                               "max_replicas", "scale_tick"),
                     defaults={"max_replicas": SIM_FLEET_DEFAULTS["max_replicas"]})
    add_setting_args(scale, SimScaleFlags)
    add_reactive_args(scale)
    add_setting_args(parser.add_argument_group("failure injection"), FailureFlags)


def add_kv_tier_args(parser: argparse.ArgumentParser) -> None:
    """Group "shared KV tier": a fleet-wide external KV store (fleet.KVTierSettings)."""
    add_setting_args(parser.add_argument_group("shared KV tier"), KVTierFlags)


def kv_tier_from_args(args: argparse.Namespace):
    """The ``KVTierSettings`` the flags ask for, or None without ``--kv-tier``."""
    from carpool.sim.fleet import KVTierSettings

    if not getattr(args, "kv_tier", False):
        return None
    return KVTierSettings(args.kv_tier_memory, args.kv_tier_bandwidth * 1e9,
                          args.kv_tier_latency, args.kv_tier_ttl).validate()


def add_pd_args(parser: argparse.ArgumentParser, *, pools: bool = True) -> None:
    """Group "prefill/decode": pools and the planner (pd.PDSettings); without
    ``pools`` only the link and the planner's threshold (evaluate pd sets the rest)."""
    group = parser.add_argument_group("prefill/decode (analytic cost model)")
    link = _link_defaults()
    if pools:
        add_setting_args(group, SimPoolFlags, only=("prefill_replicas",))
        add_setting_args(group, FleetConfig, only=("pd_mode",),
                         defaults={"pd_mode": link["pd_mode"]})
    add_setting_args(group, FleetConfig, only=("pd_bandwidth", "pd_latency"),
                     defaults={k: link[k] for k in ("pd_bandwidth", "pd_latency")})
    add_setting_args(group, SimPoolFlags, only=("pd_link",))
    add_setting_args(group, FleetConfig, only=("pd_min_remote_tokens", "pd_stall_weight"))


def pd_from_args(args: argparse.Namespace, prefill_replicas: int | None = None,
                 mode: str | None = None):
    """The ``PDSettings`` the flags ask for, or None for a colocated fleet."""
    from carpool.sim.pd import PDSettings

    prefill = getattr(args, "prefill_replicas", 0) if prefill_replicas is None else prefill_replicas
    if not prefill:
        return None
    return PDSettings(prefill, mode or args.pd_mode, args.pd_bandwidth * 1e9, args.pd_latency,
                      args.pd_min_remote_tokens, getattr(args, "pd_link", ()),
                      args.pd_stall_weight)


def add_simulate_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, seed_flag="--workload-seed")
    add_cost_model_args(parser)
    add_simulation_args(parser)
    add_kv_tier_args(parser)
    add_pd_args(parser)
    add_setting_args(parser.add_argument_group("results"), ResultFlags)


def settings_from_args(config: EngineConfig, cost: CostModel,
                       args: argparse.Namespace) -> SimSettings:
    from carpool.cluster.autoscaler import AutoscaleConfig

    max_len = config.model.max_model_len or getattr(cost, "meta", {}).get("max_model_len")
    autoscale = getattr(args, "autoscale", None)
    scale_config = None
    if autoscale is not None:
        scale_config = AutoscaleConfig(
            min_replicas=args.min_replicas, max_replicas=args.max_replicas or 4 * args.replicas,
            tick_s=args.scale_tick, startup_s=args.startup_s,
            replica_concurrency=args.replica_concurrency, **reactive_knobs(args)).validate()
    return SimSettings(args.replicas, args.routing, args.fast_forward, args.token_times,
                       max_len, mooncake_block_tokens(args.token_scale),
                       args.workers or available_cpus(), autoscale=autoscale,
                       autoscale_config=scale_config,
                       autoscale_schedule=getattr(args, "scale_schedule", ()),
                       forecaster=getattr(args, "forecaster", "holt"),
                       kv_tier=kv_tier_from_args(args), pd=pd_from_args(args),
                       failures=failures_from_args(args),
                       lost_block_events=getattr(args, "lost_block_events", 0.0),
                       fleet_ttft_target=getattr(args, "fleet_ttft_target", None),
                       front_seconds=getattr(args, "front_seconds", 0.0)).validate()


def failures_from_args(args: argparse.Namespace) -> FailureSettings | None:
    if not getattr(args, "fail", None):
        return None
    return FailureSettings(args.fail, args.failure_restart_s)


def run_simulate(config: EngineConfig, args: argparse.Namespace) -> int:
    from carpool.report.html import write_outputs
    from carpool.workload.results import format_result

    cost = cost_model_from_args(args)
    num_blocks = pool_blocks(config, cost, memory_set=args.engine_kv_cache_memory is not None)
    settings = settings_from_args(config, cost, args)
    with cyclic_gc_paused():  # the result's passes over the records too
        plan = plan_workload(workload_spec(args))
        run = simulate(plan, config, cost, num_blocks, settings)
        label = args.label or f"simulated: {settings.replicas} x {cost_label(cost)}"
        result = simulation_result(label, args, config, cost, num_blocks, settings, plan, run)
    print(format_result(result))
    print(format_speed(result["simulation"]))
    print(format_cost(result["simulation"]["cost"]))
    write_outputs(result, args.json, args.html)
    return 0


def cost_label(cost: CostModel) -> str:
    """Which cost model priced a run, in a few words (reports name the kind)."""
    data = cost.describe()
    if cost.kind == "analytic":
        return f"{data['model']['name']} on {data['hardware']['name']} (analytic)"
    return f"{data.get('model', 'model')}, {data.get('dtype', '?')} (measured)"


def simulation_result(label: str, args: argparse.Namespace, config: EngineConfig,
                      cost: CostModel, num_blocks: int, settings: SimSettings,
                      plan, run: SimRun) -> dict:
    """The bench-serve document of a simulated run, plus its ``simulation`` section."""
    from carpool.workload.results import LoadRun, make_result

    run_config = {k: v for k, v in vars(args).items()
                  if k not in ("func", "slo") and not k.startswith("engine_")}
    if parallel_from_args(args).trivial:  # one GPU a replica: the config says what it did
        for key in PARALLEL_KEYS:
            run_config.pop(key, None)
    run_config.update({"model": cost_label(cost),
                       "workload": describe_workload(workload_spec(args), plan=plan),
                       "engine": dataclasses.asdict(config)})
    written = bool(getattr(args, "json", None) or getattr(args, "html", None))
    result = make_result(label, run_config, LoadRun(run.records, run.duration,
                                                    run.server_samples), args.slo,
                         per_request=written)
    result["simulation"] = {
        "cost_model_kind": cost.kind, "cost_model": cost.describe(),
        "cost_model_warning": machine_warning(cost),
        "num_blocks": num_blocks, "settings": dataclasses.asdict(settings),
        "speed": run.speed(), "replicas": run.per_replica, "scaling": run.scaling,
        "kv_tier": run.kv_tier, "pd": run.pd, "failures": run.failures,
        "cost": fleet_cost(run, getattr(args, "price_per_hour", None)),
        "timeline": run.timeline}
    return result


def fleet_cost(run: SimRun, price_per_hour: float | None) -> dict:
    """Replica-hours and their price (``ASSUMED_PRICE`` when none is given)."""
    from carpool.sim.plan import ASSUMED_PRICE

    hours = run.replica_seconds() / 3600
    price = ASSUMED_PRICE if price_per_hour is None else price_per_hour
    return {"replica_hours": hours, "price_per_hour": price, "dollars": hours * price,
            "price_assumed": price_per_hour is None}


def format_cost(cost: dict) -> str:
    note = " (assumed price: --price-per-hour sets it)" if cost["price_assumed"] else ""
    return (f"fleet cost: {cost['replica_hours']:.3f} replica-hours x ${cost['price_per_hour']:g}"
            f" = ${cost['dollars']:.2f}{note}")


def format_speed(simulation: dict) -> str:
    speed = simulation["speed"]
    return (f"simulated {speed['requests']} requests, {speed['steps']} scheduler steps "
            f"({speed['fast_forwarded_steps']} fast-forwarded) in {speed['wall_s']:.2f} s wall: "
            f"{speed['requests_per_wall_s']:.0f} requests/s, {speed['steps_per_wall_s']:.0f} "
            f"steps/s, {speed['simulated_s_per_wall_s']:.0f}x real time | cost model: "
            f"{simulation['cost_model_kind']} | pool {simulation['num_blocks']} blocks")
