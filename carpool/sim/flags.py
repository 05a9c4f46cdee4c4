"""The flags only ``carpool simulate`` (and the commands built on it) take,
declared once on these dataclasses (``settings_fields``): a simulated
fleet's prefill pool and links, its failures, its shared KV tier, and where
its results go. The fleet's flags shared with ``carpool serve`` are
``carpool.cluster.fleet_config.FleetConfig``'s; the simulation's own
options are ``SimSettings``'s. Fields hold what the user types (GB/s,
seconds): the ``*_from_args`` functions of ``sim/command.py`` convert."""
from __future__ import annotations

from dataclasses import dataclass

from carpool.config import parse_size
from carpool.settings_fields import setting
from carpool.sim.failures import parse_failures
from carpool.sim.fleet import TIER_BANDWIDTH, TIER_LATENCY_S, TIER_MEMORY_PER_REPLICA
from carpool.sim.scale_flags import parse_scale_schedule
from carpool.slo import parse_slo
from carpool.workload.flag_types import arg_type


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


@dataclass
class SimPoolFlags:
    """A simulated fleet's prefill pool (out of ``--replicas``, the rest
    decode; `carpool serve` sizes both with --prefill and --decode) and
    the links that differ from the planner's default link."""

    prefill_replicas: int = setting(
        0, "--prefill-replicas", None,
        "replicas of the prefill pool (the rest decode); 0: all replicas mixed (colocated)",
        parse=int)
    pd_link: tuple = setting(
        (), "--pd-link", "P:D:GBPS[:LATENCY],...",
        "links that differ from --pd-bandwidth/--pd-latency, between prefill replica P and "
        "decode replica D (indices)", parse=arg_type(parse_pd_links))


@dataclass
class SimScaleFlags:
    """The simulated autoscaler's flags `carpool serve` has no use for."""

    scale_schedule: tuple = setting(
        (), "--scale-schedule", "SECONDS:REPLICAS,...",
        "--autoscale schedule: the replicas from each time on",
        parse=arg_type(parse_scale_schedule))
    startup_s: float = setting(
        60.0, "--startup-s", None, "seconds a new replica takes before it serves", parse=float)
    replica_concurrency: float = setting(
        32.0, "--replica-concurrency", None,
        "requests one replica holds within the SLO (sizing)", parse=float)


@dataclass
class FailureFlags:
    """Replicas killed on a schedule (``failures.FailureSettings``)."""

    fail: tuple | None = setting(
        None, "--fail", "SECONDS:REPLICA,...",
        "kill replica REPLICA (its index) SECONDS into the run; its streams are resumed on "
        "another replica, the others routed again (a request's third dead replica fails it)",
        parse=arg_type(parse_failures))
    lost_block_events: float = setting(
        0.0, "--lost-block-events", "FRACTION",
        "lose this share of the replicas' block events on their way to the router (seeded): "
        "its index then drifts from the caches, and first tokens correct it", parse=float)
    failure_restart_s: float = setting(
        60.0, "--failure-restart-s", None,
        "seconds until a fresh replica replaces a failed one (without --autoscale; default 60)",
        parse=float)


@dataclass
class KVTierFlags:
    """A fleet-wide external KV store (``fleet.KVTierSettings``, in bytes/s)."""

    kv_tier: bool = setting(
        False, "--kv-tier", None,
        "give the fleet a shared KV tier replicas write through to and load prefixes from "
        "on a local miss", parse=bool)
    kv_tier_memory: int | None = setting(
        None, "--kv-tier-memory", None,
        f"its capacity, e.g. 4TiB (default: {TIER_MEMORY_PER_REPLICA >> 30} GiB per replica)",
        parse=arg_type(parse_size))
    kv_tier_bandwidth: float = setting(
        TIER_BANDWIDTH / 1e9, "--kv-tier-bandwidth", None,
        f"GB/s a replica loads at (default {TIER_BANDWIDTH / 1e9:g})", parse=float)
    kv_tier_latency: float = setting(
        TIER_LATENCY_S, "--kv-tier-latency", None,
        f"seconds per load besides the bytes (default {TIER_LATENCY_S:g})", parse=float)
    kv_tier_ttl: float = setting(
        1800.0, "--kv-tier-ttl", None,
        "seconds a block is kept after its last use (default 1800)", parse=float)


@dataclass
class ResultFlags:
    """Where a simulated run's results go, and what they are measured against."""

    slo: dict = setting(
        {}, "--slo", None, "per-request limits for goodput, e.g. ttft=500ms,tpot=100ms",
        parse=arg_type(parse_slo))
    label: str | None = setting(None, "--label", None, "name of this run in reports")
    price_per_hour: float | None = setting(
        None, "--price-per-hour", None,
        "$ per replica-hour for the fleet's cost (default: an assumed $1)", parse=float)
    json: str | None = setting(None, "--json", None, "write the result here")
    html: str | None = setting(None, "--html", None,
                               "write an HTML report with plots here (dir)")
