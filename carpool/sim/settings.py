"""What a simulation is asked (``SimSettings``: how to simulate, not what)
and what it gives back (``SimRun``). Pure Python."""
from __future__ import annotations

from dataclasses import dataclass, field

from carpool.cluster.autoscaler import AutoscaleConfig
from carpool.settings_fields import setting
from carpool.sim.failures import FailureSettings
from carpool.sim.fleet import ROUTING, KVTierSettings
from carpool.sim.pd import PDSettings
from carpool.workload.stats import RequestRecord


@dataclass
class SimSettings:
    """How to simulate (not what): replicas, routing, and the run's options."""

    replicas: int = 1
    routing: str = "round-robin"
    # jump over runs of identical decode steps
    fast_forward: bool = setting(
        True, "--fast-forward", None,
        "jump over runs of identical decode steps (--no-fast-forward: step through every "
        "one; same result, slower)", parse=bool)
    # keep every token's time (ITL); costs memory on big runs
    token_times: bool = setting(
        False, "--token-times", None,
        "keep every token's time, for inter-token latency (memory grows with output tokens)",
        parse=bool)
    max_model_len: int | None = None
    hash_block: int = 1  # tokens per Mooncake hash block (after token scaling)
    # processes simulating independent (round-robin) replicas
    workers: int = setting(
        1, "--workers", None,
        "processes for round-robin replicas, which are simulated independently (same result)",
        parse=int)
    # Autoscaling: (from time s, replicas taking new requests), times ascending;
    # before the first entry all ``replicas`` do. A replica scaled in stops
    # receiving requests and finishes the ones it has.
    replica_schedule: tuple[tuple[float, int], ...] = ()
    # Autoscaling (``carpool.cluster.autoscaler``): a policy name, its
    # settings, and for "schedule" its (seconds after midnight, replicas)
    # table; ``replicas`` is then the count at the start.
    autoscale: str | None = None
    autoscale_config: AutoscaleConfig | None = None
    autoscale_schedule: tuple[tuple[float, int], ...] = ()
    forecaster: str = "holt"  # predictive's (``carpool.cluster.forecast``)
    lost_block_events: float = 0.0  # the share of replicas' block events lost (a fault)
    kv_tier: KVTierSettings | None = None  # a shared external KV tier (fleet.py)
    pd: PDSettings | None = None  # prefill and decode pools (pd.py); the planner routes
    failures: FailureSettings | None = None  # replicas killed on a schedule (failures.py)
    # Fleet admission: the router turns a request away (429) when no replica's
    # predicted TTFT is within this many seconds (predicted-ttft routing).
    fleet_ttft_target: float | None = setting(
        None, "--fleet-ttft-target", "SECONDS",
        "fleet admission: turn a request away at the front (429) when no replica's predicted "
        "TTFT is within this (predicted-ttft routing)", parse=float)
    # The front's serial work per request (HTTP, tokenizing, routing, the hop
    # to a worker): requests reach the replicas one after another, each this
    # long after the one before left the front. Why it matters: requests of
    # a burst never reach a live engine at one instant, so an idle engine
    # starts a step on the first and the rest wait a whole step for it
    # (simulate.py's ``front_times``). 0: they arrive together.
    front_seconds: float = setting(
        0.0, "--front-seconds", "SECONDS",
        "the front's serial work per request (HTTP, tokenizing, routing, the hop to a "
        "worker): a burst reaches the replicas one request after another (default 0: at "
        "once)", parse=float)

    def validate(self) -> SimSettings:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        times = [t for t, _ in self.replica_schedule]
        if times != sorted(times) or any(not 1 <= n <= self.replicas
                                         for _, n in self.replica_schedule):
            raise ValueError(f"a replica schedule needs ascending times and counts in 1.."
                             f"{self.replicas}, got {self.replica_schedule}")
        if self.autoscale is not None and self.replica_schedule:
            raise ValueError("a replica schedule and an autoscaler exclude each other")
        if (self.autoscale == "schedule") != bool(self.autoscale_schedule):
            raise ValueError("--autoscale schedule and --scale-schedule go together")
        if self.pd is not None:
            self.pd.validate(self.replicas)
            if self.autoscale or self.replica_schedule or self.kv_tier:
                raise ValueError("prefill/decode pools do not yet combine with autoscaling, a "
                                 "replica schedule or a KV tier")
        if self.failures is not None:
            self.failures.validate(self.replicas)
            if self.pd or self.replica_schedule:
                raise ValueError("failures do not yet combine with P/D pools or a replica "
                                 "schedule")
        if self.fleet_ttft_target is not None and (
                self.fleet_ttft_target <= 0
                or self.routing.split("/")[0] not in ("predicted-ttft", "learned-ttft")):
            raise ValueError("--fleet-ttft-target needs a target > 0 and --routing "
                             "predicted-ttft or learned-ttft (the policies that predict TTFTs)")
        if not 0 <= self.lost_block_events < 1:
            raise ValueError(f"--lost-block-events must be in [0, 1), got "
                             f"{self.lost_block_events}")
        if not self.front_seconds >= 0:
            raise ValueError(f"--front-seconds must be >= 0, got {self.front_seconds}")
        if self.routing not in ROUTING:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING)}, got "
                             f"{self.routing!r}")
        return self


@dataclass
class SimRun:
    """A simulation's outcome: per-request records (bench-serve's), the
    virtual duration, queue gauges over time (t, waiting, running summed over
    replicas), and how much simulating it took."""

    records: list[RequestRecord]
    duration: float
    server_samples: list[tuple[float, float, float]] = field(default_factory=list)
    steps: int = 0
    fast_forwarded_steps: int = 0
    wall_seconds: float = 0.0
    per_replica: list[dict] = field(default_factory=list)
    scaling: dict | None = None  # the autoscaler's timeline, events and replica-hours
    kv_tier: dict | None = None  # the shared KV tier's size and counters
    pd: dict | None = None  # the P/D planner's choices
    failures: list[dict] | None = None  # what failed when, and what it took with it
    timeline: dict | None = None  # per replica over time (timeline.FleetSampler)
    routing: dict | None = None  # the router's TTFT prediction errors (MAPE) and corrections

    def replica_seconds(self) -> float:
        """Replica-seconds the fleet paid for: the autoscaler's account, else
        each replica from its creation to its failure or the run's end."""
        if self.scaling is not None:
            return self.scaling["replica_seconds"]
        return sum((row["failed_s"] if row["failed_s"] is not None else self.duration)
                   - row["created_s"] for row in self.per_replica)

    def speed(self) -> dict:
        wall = max(self.wall_seconds, 1e-9)
        return {"wall_s": self.wall_seconds, "requests": len(self.records),
                "requests_per_wall_s": len(self.records) / wall,
                "steps": self.steps, "steps_per_wall_s": self.steps / wall,
                "fast_forwarded_steps": self.fast_forwarded_steps,
                "simulated_s_per_wall_s": self.duration / wall}
