"""The ``carpool simulate`` command: workload and cost model from flags,
the simulation (carpool/sim/simulate.py), a bench-serve result out."""
from __future__ import annotations

import argparse
import dataclasses

from carpool.config import EngineConfig, parse_size
from carpool.machine import available_cpus
from carpool.sim.cost_flags import add_cost_model_args, cost_model_from_args, pool_blocks
from carpool.sim.costs import CostModel, machine_warning
from carpool.sim.failures import FailureSettings, parse_failures
from carpool.sim.scale_flags import add_reactive_args, parse_scale_schedule, reactive_knobs
from carpool.sim.simulate import (
    ROUTING,
    SimRun,
    SimSettings,
    cyclic_gc_paused,
    simulate,
)
from carpool.workload.command import add_workload_args, arg_type, workload_spec
from carpool.workload.spec import describe_workload, mooncake_block_tokens, plan_workload


def add_simulation_args(parser: argparse.ArgumentParser, *, fleet: bool = True) -> None:
    """Group "simulation": routing and the simulator's options; with
    ``fleet`` also the replica count and per-token times (``carpool plan``
    chooses the replicas itself)."""
    group = parser.add_argument_group("simulation")
    if fleet:
        group.add_argument("--replicas", type=int, default=1)
    group.add_argument("--routing", choices=ROUTING, default="round-robin",
                       help="the fleet router's policy (default: round-robin, the baseline "
                            "the other policies are measured against; `carpool serve` "
                            "defaults to predicted-ttft)")
    group.add_argument("--fleet-ttft-target", type=float, default=None, metavar="SECONDS",
                       help="fleet admission: turn a request away at the front (429) when no "
                            "replica's predicted TTFT is within this (predicted-ttft routing)")
    group.add_argument("--front-seconds", type=float, default=0.0, metavar="SECONDS",
                       help="the front's serial work per request (HTTP, tokenizing, routing, "
                            "the hop to a worker): a burst reaches the replicas one request "
                            "after another (default 0: at once)")
    group.add_argument("--no-fast-forward", dest="fast_forward", action="store_false",
                       help="step through every decode step (same result, slower)")
    group.add_argument("--workers", type=int, default=None,
                       help="processes for round-robin replicas, which are simulated "
                            "independently (default: the CPUs available; same result)")
    if fleet:
        group.add_argument("--token-times", action="store_true",
                           help="keep every token's time, for inter-token latency (memory "
                                "grows with output tokens)")
        scale = parser.add_argument_group("autoscaling (--replicas is then the start)")
        scale.add_argument("--autoscale", choices=("reactive", "predictive", "schedule", "oracle"),
                           default=None, help="scale the fleet with this policy")
        scale.add_argument("--scale-schedule", type=arg_type(parse_scale_schedule), default=(),
                           metavar="SECONDS:REPLICAS,...",
                           help="--autoscale schedule: the replicas from each time on")
        scale.add_argument("--min-replicas", type=int, default=1)
        scale.add_argument("--max-replicas", type=int, default=None,
                           help="default: 4x --replicas")
        scale.add_argument("--startup-s", type=float, default=60.0,
                           help="seconds a new replica takes before it serves")
        scale.add_argument("--replica-concurrency", type=float, default=32.0,
                           help="requests one replica holds within the SLO (sizing)")
        scale.add_argument("--scale-tick", type=float, default=10.0,
                           help="seconds between autoscaler decisions")
        add_reactive_args(scale)
        faults = parser.add_argument_group("failure injection")
        faults.add_argument("--fail", type=arg_type(parse_failures), default=None,
                            metavar="SECONDS:REPLICA,...",
                            help="kill replica REPLICA (its index) SECONDS into the run; its "
                                 "streaming requests fail, the others are routed again")
        faults.add_argument("--failure-restart-s", type=float, default=60.0,
                            help="seconds until a fresh replica replaces a failed one "
                                 "(without --autoscale; default 60)")


def add_kv_tier_args(parser: argparse.ArgumentParser) -> None:
    """Group "shared KV tier": a fleet-wide external KV store (fleet.KVTierSettings)."""
    from carpool.sim.fleet import TIER_BANDWIDTH, TIER_LATENCY_S, TIER_MEMORY_PER_REPLICA

    group = parser.add_argument_group("shared KV tier")
    group.add_argument("--kv-tier", action="store_true",
                       help="give the fleet a shared KV tier replicas write through to and "
                            "load prefixes from on a local miss")
    group.add_argument("--kv-tier-memory", type=arg_type(parse_size), default=None,
                       help=f"its capacity, e.g. 4TiB (default: "
                            f"{TIER_MEMORY_PER_REPLICA >> 30} GiB per replica)")
    group.add_argument("--kv-tier-bandwidth", type=float, default=TIER_BANDWIDTH / 1e9,
                       help=f"GB/s a replica loads at (default {TIER_BANDWIDTH / 1e9:g})")
    group.add_argument("--kv-tier-latency", type=float, default=TIER_LATENCY_S,
                       help=f"seconds per load besides the bytes (default {TIER_LATENCY_S:g})")
    group.add_argument("--kv-tier-ttl", type=float, default=1800.0,
                       help="seconds a block is kept after its last use (default 1800)")


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
    from carpool.cluster.pd import Link

    group = parser.add_argument_group("prefill/decode (analytic cost model)")
    if pools:
        group.add_argument("--prefill-replicas", type=int, default=0,
                           help="replicas of the prefill pool (the rest decode); 0: all "
                                "replicas mixed (colocated)")
        group.add_argument("--pd-mode", choices=("conditional", "always"), default="conditional",
                           help="conditional: prefill remotely only where it pays (default: "
                                "the planner under study); always: every request (`carpool "
                                "serve`'s default, the mode every backend has)")
    group.add_argument("--pd-bandwidth", type=float, default=Link.bandwidth / 1e9,
                       help=f"GB/s of the link between the pools (default "
                            f"{Link.bandwidth / 1e9:g}: 400 Gb/s RDMA)")
    group.add_argument("--pd-latency", type=float, default=Link.latency,
                       help=f"seconds per transfer besides the bytes (default {Link.latency:g})")
    group.add_argument("--pd-link", type=arg_type(parse_pd_links), default=(),
                       metavar="P:D:GBPS[:LATENCY],...",
                       help="links that differ from --pd-bandwidth/--pd-latency, between "
                            "prefill replica P and decode replica D (indices)")
    group.add_argument("--pd-min-remote-tokens", type=int, default=0,
                       help="shortest uncached prompt the planner prefills remotely (default 0: "
                            "the predicted first tokens decide)")
    group.add_argument("--pd-stall-weight", type=float, default=0.0,
                       help="conditional: what a colocated prefill's stall of the decode "
                            "replica's running requests weighs against the request's own "
                            "TTFT (default 0: its own TTFT only; 1: request-seconds alike)")


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


def parse_pd_links(text: str) -> tuple[tuple[int, int, float, float], ...]:
    """``P:D:GBPS[:LATENCY_S],...`` as (prefill, decode, bytes/s, seconds)."""
    from carpool.cluster.pd import Link

    links = []
    for part in text.split(","):
        fields = part.split(":")
        try:
            if len(fields) not in (3, 4):
                raise ValueError
            latency = float(fields[3]) if len(fields) == 4 else Link.latency
            links.append((int(fields[0]), int(fields[1]), float(fields[2]) * 1e9, latency))
        except ValueError:
            raise ValueError(f"a link is P:D:GBPS[:LATENCY_S], got {part!r}") from None
    return tuple(links)


def add_simulate_args(parser: argparse.ArgumentParser) -> None:
    from carpool.slo import parse_slo

    add_workload_args(parser, seed_flag="--workload-seed")
    add_cost_model_args(parser)
    add_simulation_args(parser)
    add_kv_tier_args(parser)
    add_pd_args(parser)
    out = parser.add_argument_group("results")
    out.add_argument("--slo", type=arg_type(parse_slo), default={},
                     help="per-request limits for goodput, e.g. ttft=500ms,tpot=100ms")
    out.add_argument("--label", default=None, help="name of this run in reports")
    out.add_argument("--price-per-hour", type=float, default=None,
                     help="$ per replica-hour for the fleet's cost (default: an assumed $1)")
    out.add_argument("--json", default=None, help="write the result here")
    out.add_argument("--html", default=None, help="write an HTML report with plots here (dir)")


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
                       kv_tier=kv_tier_from_args(args), pd=pd_from_args(args),
                       failures=failures_from_args(args),
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
