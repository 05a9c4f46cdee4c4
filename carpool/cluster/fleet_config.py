"""The fleet's settings, shared by ``carpool serve`` (``ServerConfig``
inherits them) and ``carpool simulate``: replicas, the router's policy, the
P/D planner's link and mode, the autoscaler's bounds and rules. Each is
declared once, with its flag; a command whose default differs says why in
its ``--help`` (``settings_fields.add_setting_args``'s ``defaults``).
Plain Python."""
from __future__ import annotations

from dataclasses import dataclass

from carpool.cluster.forecast import FORECASTERS
from carpool.cluster.pd import PD_MODES
from carpool.cluster.policies import POLICIES
from carpool.settings_fields import setting

# reactive, predictive (forecast, never below reactive) and forecast (the
# forecast alone) serve live; schedule (a timetable) and oracle (the ideal
# count from hindsight) are the simulator's baselines.
AUTOSCALE_POLICIES = ("reactive", "predictive", "forecast", "schedule", "oracle")


@dataclass
class FleetConfig:
    """How many replicas serve, how requests reach them, how the count moves."""

    # Engine worker processes behind the router (carpool.fleet.local); 1 =
    # one engine. Each takes its own KV pool and torch threads: on one
    # machine, at most about one per two cores pays.
    replicas: int = setting(
        1, "--replicas", "N",
        "engine worker processes behind carpool's router (each its own KV pool and threads)",
        parse=int)
    # P/D serving (carpool.fleet.pd): prefill and decode replica pools,
    # the KV of each prompt moving from one to the other through the KV
    # store (kv_store: local by default). 0 and 0: colocated (--replicas).
    prefill: int = setting(
        0, "--prefill", "N",
        "P/D serving: N prefill replicas (with --decode), each prompt's KV sent to a decode "
        "replica through the KV store", parse=int)
    decode: int = setting(
        0, "--decode", "N",
        "P/D serving: N decode replicas (with --prefill)", parse=int)
    # Where each P/D request runs (carpool.cluster.pd.PDPlanner): always (every
    # request prefilled on the prefill pool) | conditional (only where the
    # predicted first token with the transfer beats a prefill on the decode
    # replica; local backend). The link the planner prices the KV transfer
    # with: GB/s and seconds per transfer (default: the local TCP store's
    # load rate on a 2-core machine, docs/numbers/pd.md); shortest uncached prompt sent.
    pd_mode: str = setting(
        "always", "--pd-mode", "MODE",
        "P/D: always (every prompt on the prefill pool) | conditional (where the predicted "
        "TTFT says it pays; local backend)", choices=PD_MODES)
    pd_bandwidth: float = setting(
        0.5, "--pd-bandwidth", "GBPS",
        "P/D: GB/s the planner prices a KV transfer at", parse=float)
    pd_latency: float = setting(
        0.0002, "--pd-latency", "SECONDS",
        "P/D: seconds per KV transfer besides the bytes", parse=float)
    pd_min_remote_tokens: int = setting(
        0, "--pd-min-remote-tokens", "N",
        "P/D conditional: shortest uncached prompt prefilled remotely (0: the predictions "
        "decide)", parse=int)
    # conditional: what a colocated prefill's stall of the decode replica's
    # running requests weighs against the request's own TTFT (PDPlanner).
    pd_stall_weight: float = setting(
        0.0, "--pd-stall-weight", "W",
        "P/D conditional: weight of the decodes a colocated prefill stalls against the "
        "request's own TTFT (1: alike)", parse=float)
    # The fleet router's policy (carpool.cluster.policies.POLICIES).
    routing: str = setting(
        "predicted-ttft", "--routing", "POLICY",
        "the router's policy with --replicas > 1: predicted-ttft | cache-aware | "
        "approx-cache-aware | kv-cost | learned-ttft | session | least-outstanding | "
        "response-time | round-robin | random", choices=tuple(POLICIES))
    # Live replica counts (carpool.cluster.autoscaler): reactive | predictive,
    # None = the fixed --replicas. The count moves within [min, max]
    # (max: default --replicas); the rules' thresholds follow.
    autoscale: str | None = setting(
        None, "--autoscale", "POLICY",
        "change the replica count live: reactive | predictive (a forecast, never below what "
        "reactive wants) | forecast (the forecast alone) (default: fixed --replicas; `carpool "
        "simulate` also takes schedule and oracle)", choices=AUTOSCALE_POLICIES)
    forecaster: str = setting(
        "holt", "--forecaster", "NAME",
        "--autoscale predictive/forecast: the arrival-rate forecaster: holt (damped trend) | "
        "seasonal (yesterday's shape, today's level) | arima (statsmodels: pip install "
        "'carpool[forecast]')", choices=FORECASTERS)
    min_replicas: int = setting(
        1, "--min-replicas", "N",
        "--autoscale: fewest replicas; 0 lets an idle fleet scale to zero (the next request "
        "waits for a cold start instead of being refused)", parse=int)
    max_replicas: int | None = setting(
        None, "--max-replicas", "N",
        "--autoscale: most replicas (default: --replicas; one machine: its cores bound it)",
        parse=int)
    # seconds between autoscaler ticks
    scale_tick: float = setting(
        10.0, "--scale-tick", "SECONDS",
        "--autoscale: seconds between ticks", parse=float)
    # scale out when more than this many wait ...
    scale_out_backlog: int = setting(
        100, "--scale-out-backlog", "N",
        "--autoscale: scale out when more than N requests wait ...", parse=int)
    # ... longer than this at the recent rate (0: the count alone)
    scale_out_wait: float = setting(
        1.0, "--scale-out-wait", "SECONDS",
        "... longer than this at the recent arrival rate (0: the count alone)", parse=float)
    scale_out_cooldown: float = setting(
        30.0, "--scale-out-cooldown", "SECONDS",
        "--autoscale: seconds between two scale-outs (unless arrivals panic)", parse=float)
    # scale in when slots stay less used than this ...
    scale_in_utilization: float = setting(
        0.5, "--scale-in-utilization", "FRACTION",
        "--autoscale: scale in when slot use stays under this ...", parse=float)
    # ... for this many seconds
    scale_in_after: float = setting(
        300.0, "--scale-in-after", "SECONDS",
        "... for this long", parse=float)
    # and the highest want of this window is lower
    scale_in_window: float = setting(
        300.0, "--scale-in-window", "SECONDS",
        "--autoscale: scale in only to the highest want of this window", parse=float)
    # What a replica holds and where the scaler keeps it: demand is sized as
    # rate x service time / (concurrency x target utilisation).
    scale_target_utilization: float = setting(
        0.8, "--scale-target-utilization", "FRACTION",
        "--autoscale: the share of each replica's slots the scaler sizes the pool to fill "
        "(the design's 80-90%)", parse=float)
    replica_concurrency: int | None = setting(
        None, "--replica-concurrency", "N",
        "--autoscale: requests one replica serves within the SLO (default: its live "
        "max_num_seqs)", parse=int)
    forecast_horizon: float = setting(
        900.0, "--forecast-horizon", "SECONDS",
        "--autoscale predictive: how far past a replica's start-up the forecast looks",
        parse=float)
    # A replica's start-up as the scaler plans for it, and an extra wait
    # before a started replica takes requests (a GPU's cold model load, here).
    startup_s: float = setting(
        60.0, "--startup-s", "SECONDS",
        "--autoscale: a replica's start-up time the scaler plans ahead for", parse=float)
    replica_start_delay: float = setting(
        0.0, "--replica-start-delay", "SECONDS",
        "--autoscale: hold each replica it starts this long before it takes requests "
        "(models a cold model load on a GPU; 0: none)", parse=float)

    def validate_pd(self) -> None:
        """The P/D planner's settings (``ServerConfig.validate`` checks the pools)."""
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

    def pd_link(self):
        """The planner's ``Link`` (``pd_bandwidth`` GB/s, ``pd_latency`` s)."""
        from carpool.cluster.pd import Link

        return Link(self.pd_bandwidth * 1e9, self.pd_latency)

    def autoscale_config(self):
        """The ``AutoscaleConfig`` these settings describe (``--autoscale``)."""
        from carpool.cluster.autoscaler import AutoscaleConfig

        if self.replica_start_delay < 0:
            raise ValueError(f"replica_start_delay must be >= 0, got {self.replica_start_delay}")
        return AutoscaleConfig(
            min_replicas=self.min_replicas, max_replicas=self.max_replicas or self.replicas,
            tick_s=self.scale_tick, scale_out_backlog=self.scale_out_backlog,
            scale_out_wait_s=self.scale_out_wait, scale_out_cooldown_s=self.scale_out_cooldown,
            scale_in_utilization=self.scale_in_utilization, scale_in_after_s=self.scale_in_after,
            scale_in_window_s=self.scale_in_window,
            target_utilization=self.scale_target_utilization,
            replica_concurrency=(32.0 if self.replica_concurrency is None
                                 else self.replica_concurrency),
            forecast_horizon_s=self.forecast_horizon, startup_s=self.startup_s
        ).validate()
