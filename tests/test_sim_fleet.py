"""The cluster router inside the simulator (carpool.sim.fleet)."""
from __future__ import annotations

import random

import pytest

from carpool.cluster import POLICIES
from carpool.config import EngineConfig
from carpool.sim.analytic import analytic_from_names
from carpool.sim.evaluate import ideal_hit_rate
from carpool.sim.simulate import SimSettings, simulate
from carpool.workload.traces import TraceRequest


def _outcome(run):
    return [(r.index, r.status, r.reason, r.sent, r.finished, r.chunk_times, r.output_tokens)
            for r in run.records]


def _conversations(count: int, rate: float, seed: int = 3) -> list[TraceRequest]:
    """Requests of 24 conversations: each turn's prompt extends the one before
    (hash ids shared with the previous turn), as Mooncake's hash ids say."""
    rng = random.Random(seed)
    history = {c: [] for c in range(24)}
    plan, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        chat = rng.randrange(24)
        history[chat] = history[chat] + [1000 * chat + len(history[chat]) + k for k in range(3)]
        plan.append(TraceRequest(t, 32 * len(history[chat]) + 20, rng.randrange(8, 64),
                                 tuple(history[chat])))
    return plan


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_one_replica_cluster_equals_the_single_replica_simulation(policy):
    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _conversations(150, 20.0)
    alone = simulate(plan, EngineConfig(), cost, 400, SimSettings(hash_block=32))
    fleet = simulate(plan, EngineConfig(), cost, 400,
                     SimSettings(routing=policy, hash_block=32))
    assert _outcome(fleet) == _outcome(alone)
    assert fleet.steps == alone.steps and fleet.per_replica == alone.per_replica


def _hit_rate(run) -> float:
    rows = run.per_replica
    return sum(r["prefix_hits"] for r in rows) / max(1, sum(r["prefix_queries"] for r in rows))


def test_cache_aware_routing_keeps_conversations_where_their_prefix_is():
    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _conversations(400, 30.0)
    runs = {policy: simulate(plan, EngineConfig(), cost, 2000,
                             SimSettings(replicas=4, routing=policy, hash_block=32))
            for policy in ("round-robin", "least-outstanding", "cache-aware", "predicted-ttft")}
    rates = {policy: _hit_rate(run) for policy, run in runs.items()}
    assert rates["cache-aware"] > rates["round-robin"] + 0.15, rates
    assert rates["predicted-ttft"] > rates["least-outstanding"] + 0.15, rates
    for run in runs.values():
        assert all(r.status == "ok" for r in run.records)
        assert sum(r["steps"] > 0 for r in run.per_replica) == 4  # nobody starved


def test_a_replica_schedule_drains_the_replicas_scaled_in():
    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _conversations(200, 40.0)
    run = simulate(plan, EngineConfig(), cost, 2000,
                   SimSettings(replicas=3, routing="predicted-ttft", hash_block=32,
                               replica_schedule=((plan[100].arrival, 1),)))
    assert all(r.status == "ok" for r in run.records)
    late = [r for r in run.records if r.index > 100]
    # After the schedule's time only replica 0 takes requests: the others'
    # steps all end by when their last early request finished.
    assert late and run.per_replica[0]["steps"] > max(row["steps"] for row in run.per_replica[1:])


def test_a_shared_kv_tier_serves_prefixes_another_replica_computed():
    from carpool.sim.fleet import KVTierSettings

    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _conversations(400, 30.0)
    settings = dict(replicas=4, routing="round-robin", hash_block=32)
    alone = simulate(plan, EngineConfig(), cost, 2000, SimSettings(**settings))
    shared = simulate(plan, EngineConfig(), cost, 2000,
                      SimSettings(**settings, kv_tier=KVTierSettings()))
    assert all(r.status == "ok" for r in shared.records)
    loaded = sum(r["external_hits"] for r in shared.per_replica)
    assert loaded > 0 and shared.kv_tier["stored"] > 0
    # Round-robin scatters a conversation; the tier recovers what the
    # replicas' own caches miss, so the fleet hits nearly the ideal.
    ideal = ideal_hit_rate(plan, 32)
    assert _hit_rate(alone) < 0.8 * ideal
    total = _hit_rate(shared) + loaded / sum(r["prefix_queries"] for r in shared.per_replica)
    assert total > 0.95 * ideal
    mean_ttft = [sum(r.chunk_times[0] - r.sent for r in run.records) / len(plan)
                 for run in (alone, shared)]
    assert mean_ttft[1] < mean_ttft[0]


def test_a_one_replica_fleet_never_loads_what_its_own_cache_holds():
    from carpool.sim.fleet import KVTierSettings

    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _conversations(150, 20.0)
    alone = simulate(plan, EngineConfig(), cost, 4000, SimSettings(hash_block=32))
    tiered = simulate(plan, EngineConfig(), cost, 4000,
                      SimSettings(hash_block=32, kv_tier=KVTierSettings()))
    assert _outcome(tiered) == _outcome(alone)  # a pool that never evicts: all local
    assert sum(r["external_hits"] for r in tiered.per_replica) == 0


def test_ideal_hit_rate_counts_leading_blocks_seen_before():
    from carpool.sim.evaluate import ideal_hit_rate

    plan = [TraceRequest(0.0, 40, 1, (1, 2)), TraceRequest(1.0, 50, 1, (1, 2, 3)),
            TraceRequest(2.0, 30, 1, (4, 2)), TraceRequest(3.0, 20, 1, (1, 2))]
    # 16-token blocks: the second hits (1, 2) = 32 tokens; the third nothing
    # ((4,) is new, so its (4, 2) is too); the fourth all but its last token.
    assert ideal_hit_rate(plan, 16) == pytest.approx((32 + 19) / 140)


def test_evaluate_routing_replays_the_same_arrivals_for_every_policy(tmp_path):
    import json

    from carpool.cli import main

    out = tmp_path / "routing.json"
    code = main(["evaluate", "routing", "--workload", "mooncake-conv", "--arrival", "trace",
                 "--num-requests", "300", "--max-input-len", "200000",
                 "--hardware", "h100-sxm", "--model-shape", "llama-3-8b", "--replicas", "2,3",
                 "--policies", "round-robin,predicted-ttft", "--load", "0.7",
                 "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["replicas"], r["policy"]) for r in rows] == [
        (2, "round-robin"), (2, "predicted-ttft"), (3, "round-robin"), (3, "predicted-ttft")]
    for row in rows:
        assert row["requests"] == 300 and 0 < row["ideal_hit_rate"] < 1
        assert 0 <= row["hit_rate"] <= row["ideal_hit_rate"] + 1e-9
        assert row["offered_rate"] == pytest.approx(0.7 * row["capacity"])
    # A fleet of 3 serves about 3/2 of what a fleet of 2 does.
    assert rows[2]["capacity"] / rows[0]["capacity"] == pytest.approx(1.5, rel=0.15)


def test_evaluate_routing_as_planned_reports_each_prediction_s_error(tmp_path):
    """``--load 0`` replays the arrivals as planned (llm-d's ramp) with no
    capacity probe; each row carries the MAPE of the TTFT predictions (none
    for a policy that predicts nothing), and the default's ablations run."""
    import json

    from carpool.cli import main

    out = tmp_path / "routing.json"
    code = main(["evaluate", "routing", "--workload", "llm-d-prefix", "--arrival", "poisson",
                 "--rate", "3", "--ramp", "1x-4x@0+40", "--num-requests", "150",
                 "--max-input-len", "200000", "--hardware", "h100-sxm", "--model-shape",
                 "llama-3-8b", "--replicas", "2", "--load", "0", "--policies",
                 "round-robin,learned-ttft,predicted-ttft/no-affinity", "--json", str(out)])
    assert code == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["capacity"] is None and r["time_factor"] == 1.0 for r in rows.values())
    assert rows["round-robin"]["mape_decided"] is None
    learned = rows["learned-ttft"]
    assert learned["mape_analytic"] > 0 and learned["mape_learned"] > 0
    assert learned["mape_decided"] > 0
    assert rows["predicted-ttft/no-affinity"]["requests"] == 150
    assert rows["learned-ttft"]["hit_rate"] > rows["round-robin"]["hit_rate"]


def _step_plan(low: float, high: float, until: float, step_at: float, seed: int = 5):
    rng = random.Random(seed)
    plan, t = [], 0.0
    while t < until:
        t += rng.expovariate(high if t >= step_at else low)
        plan.append(TraceRequest(t, rng.randrange(100, 600), rng.randrange(20, 120)))
    return plan


@pytest.mark.parametrize("policy", ["reactive", "predictive", "oracle"])
def test_the_autoscaler_grows_the_fleet_for_a_surge_with_start_up_delay(policy):
    from carpool.cluster.autoscaler import AutoscaleConfig

    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _step_plan(1.0, 12.0, 500.0, 200.0)
    config = AutoscaleConfig(max_replicas=12, startup_s=60.0, tick_s=5.0,
                             replica_concurrency=16, scale_out_backlog=20)
    run = simulate(plan, EngineConfig(), cost, 3000,
                   SimSettings(replicas=1, routing="predicted-ttft", autoscale=policy,
                               autoscale_config=config))
    # While the new replicas start, the one replica's queue may overflow.
    assert {(r.status, r.reason) for r in run.records} <= {("ok", None),
                                                           ("rejected", "queue_full")}
    assert sum(r.status == "ok" for r in run.records) > 0.8 * len(plan)
    scaling = run.scaling
    assert scaling["policy"] == policy and scaling["events"]
    out = [e for e in scaling["events"] if e["replicas_to"] > e["replicas_from"]]
    assert out and all(e["cause"] for e in scaling["events"])
    if policy != "oracle":  # the oracle moves before the surge comes
        assert min(e["time"] for e in out) >= 200.0
    peak = max(row["replicas"] for row in scaling["timeline"])
    assert 2 <= peak <= 12
    if policy == "reactive":
        # The oracle serves everything with 7. Sized with overloaded replicas'
        # service times, or adding for the same backlog at every tick of a
        # start-up, reactive went to the cap of 12.
        assert peak <= 9
    # A replica takes requests only after its start-up.
    first = min(e["time"] for e in out)
    ready = [row for row in scaling["timeline"] if row["t"] < first + 60.0 - 1e-9]
    assert max(row["ready"] for row in ready) == 1
    # Paid for: less than the peak all the time, more than one replica.
    duration = run.duration
    assert duration < scaling["replica_seconds"] < peak * duration
    assert len(run.per_replica) >= peak


def test_a_request_no_replica_can_take_is_rejected_at_the_front(monkeypatch):
    from carpool.cluster import RoutingError
    from carpool.sim.fleet import FleetRouter

    picked = FleetRouter.pick

    def refuse_odd(self, replicas, index, item, now):
        if index % 2:
            raise RoutingError("predicted_ttft_miss", 1.0, "every replica over target")
        return picked(self, replicas, index, item, now)

    monkeypatch.setattr(FleetRouter, "pick", refuse_odd)
    plan = _conversations(60, 20.0)
    run = simulate(plan, EngineConfig(), analytic_from_names("l4", "llama-3-8b"), 2000,
                   SimSettings(replicas=2, routing="least-outstanding", hash_block=32))
    for record in run.records:
        expected = ("rejected", "predicted_ttft_miss") if record.index % 2 else ("ok", None)
        assert (record.status, record.reason) == expected
        assert record.finished is not None


def test_fleet_admission_turns_away_at_the_front_what_no_replica_can_serve_in_time():
    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _conversations(400, 60.0)  # beyond two L4 replicas
    settings = dict(replicas=2, routing="predicted-ttft", hash_block=32)
    queued = simulate(plan, EngineConfig(), cost, 2000, SimSettings(**settings))
    admitted = simulate(plan, EngineConfig(), cost, 2000,
                        SimSettings(**settings, fleet_ttft_target=1.0))
    turned = [r for r in admitted.records if r.status == "rejected"]
    assert turned and all(r.reason == "predicted_ttft_miss" for r in turned)
    assert all(r.finished == r.sent == r.scheduled for r in turned)  # answered on arrival
    p99 = [sorted(r.chunk_times[0] - r.sent for r in run.records if r.status == "ok")
           for run in (queued, admitted)]
    assert p99[1][int(0.99 * len(p99[1]))] < p99[0][int(0.99 * len(p99[0]))]
    with pytest.raises(ValueError, match="predicted-ttft"):
        SimSettings(replicas=2, fleet_ttft_target=1.0).validate()


def test_a_scheduled_fleet_follows_its_table():
    """carpool simulate --autoscale schedule --scale-schedule: the pool takes
    each count at its time, new replicas after their start-up."""
    import argparse

    from carpool.sim.command import add_simulate_args, settings_from_args

    parser = argparse.ArgumentParser()
    add_simulate_args(parser)
    args = parser.parse_args(["--replicas", "1", "--autoscale", "schedule",
                              "--scale-schedule", "0:1,100:3,300:2", "--startup-s", "30"])
    cost = analytic_from_names("l4", "llama-3-8b")
    settings = settings_from_args(EngineConfig(), cost, args)
    assert settings.autoscale == "schedule" and settings.autoscale_schedule[1] == (100.0, 3)
    run = simulate(_step_plan(2.0, 2.0, 900.0, 0.0), EngineConfig(), cost, 3000, settings)
    rows = sorted((row["t"], row["replicas"], row["ready"]) for row in run.scaling["timeline"])
    # Asked one start-up ahead of 100 s (at 70 s), ready 30 s later.
    assert all(n == 1 for t, n, _ in rows if t < 70) and max(n for _, n, _ in rows) == 3
    assert all(ready == 1 for t, _, ready in rows if t < 100)
    assert any(ready == 3 for t, _, ready in rows if t <= 110)
    # Down to 2 once the 5-minute scale-in window has passed (asked at 270 s).
    assert rows[-1][1] == 2 and all(n == 3 for t, n, _ in rows if 100 <= t < 560)
    with pytest.raises(SystemExit):
        parser.parse_args(["--autoscale", "schedule", "--scale-schedule", "100:2,0:1"])


@pytest.mark.parametrize("replicas,policy", [(1, "round-robin"), (2, "round-robin"),
                                             (2, "predicted-ttft")])
def test_simulated_records_carry_each_prompts_cached_tokens(replicas, policy):
    from carpool.workload.results import LoadRun, make_result

    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _conversations(200, 20.0)
    run = simulate(plan, EngineConfig(), cost, 2000,
                   SimSettings(replicas=replicas, routing=policy, hash_block=32))
    assert all(r.status == "ok" and r.cached_tokens is not None for r in run.records)
    # What the replicas' schedulers counted, request by request: a hit is
    # whole 16-token blocks of the prompt's shared (hash id) part.
    cached = [r.cached_tokens for r in run.records]
    assert sum(cached) == sum(row["cached_tokens"] for row in run.per_replica) > 0
    for record, item in zip(run.records, plan):
        assert record.cached_tokens % 16 == 0
        assert record.cached_tokens <= 32 * len(item.hash_ids)
    summary = make_result("sim", {}, LoadRun(run.records, run.duration), {})["summary"]
    assert summary["cache_reported"] == len(plan)
    assert summary["prefix_hit_rate"] == pytest.approx(
        sum(cached) / sum(item.input_len for item in plan))


@pytest.mark.parametrize("routing", ["round-robin", "least-outstanding"])
def test_a_burst_reaches_the_replicas_one_request_after_another_past_the_front(routing):
    """Three requests arriving at one instant on one idle replica: with no
    front time they share one prefill step; with the front's serial work
    the first reaches the engine alone and starts a step, and the other two
    wait for it (as on a live server). Either way each TTFT counts from the
    arrival, the front's time included."""
    from carpool.sim.simulate import front_times

    cost = analytic_from_names("l4", "llama-3-8b")
    plan = [TraceRequest(1.0, 256, 4) for _ in range(3)]
    together = simulate(plan, EngineConfig(), cost, 400, SimSettings(routing=routing))
    staggered = simulate(plan, EngineConfig(), cost, 400,
                         SimSettings(routing=routing, front_seconds=0.002))
    first = [r.chunk_times[0] for r in together.records]
    assert len(set(first)) == 1 and together.steps < staggered.steps
    assert all(r.sent == 1.0 for r in staggered.records)  # the client's send, not the engine's
    ttft = sorted(r.ttft for r in staggered.records)
    assert 0.002 < ttft[0] < min(first) - 1.0 < ttft[1] == ttft[2]
    assert front_times(plan, [0, 1, 2], 0.002) == pytest.approx([1.002, 1.004, 1.006])
    assert front_times(plan, [0, 1, 2], 0.0) is None


def test_a_fleet_whose_traffic_stops_scales_to_zero_and_the_next_request_waits():
    """min_replicas 0: after a whole scale-in window without a request the
    pool goes to zero (and stops costing); requests that come then are held,
    not refused, and answered once a replica has started."""
    from carpool.cluster.autoscaler import AutoscaleConfig

    cost = analytic_from_names("l4", "llama-3-8b")
    rng = random.Random(5)
    plan, t = [], 0.0
    while t < 120:
        t += rng.expovariate(2.0)
        plan.append(TraceRequest(t, rng.randrange(100, 600), rng.randrange(20, 120)))
    late = [TraceRequest(3000.0 + i, 300, 50) for i in range(5)]
    config = AutoscaleConfig(min_replicas=0, max_replicas=4, startup_s=60.0, tick_s=10.0,
                             scale_in_after_s=120.0, scale_in_window_s=300.0)
    run = simulate(plan + late, EngineConfig(), cost, 3000,
                   SimSettings(replicas=1, routing="predicted-ttft", autoscale="reactive",
                               autoscale_config=config))
    assert all(r.status == "ok" for r in run.records), {(r.status, r.reason)
                                                        for r in run.records}
    events = run.scaling["events"]
    to_zero = next(e for e in events if e["replicas_to"] == 0)
    assert to_zero["time"] >= plan[-1].arrival + config.scale_in_window_s
    woken = next(e for e in events if e["replicas_from"] == 0)
    assert woken["time"] == pytest.approx(3000.0) and woken["cause"] == \
        "requests at zero replicas"
    first_late = run.records[len(plan)]
    assert first_late.sent == 3000.0  # its TTFT counts the wait
    assert config.startup_s <= first_late.ttft < config.startup_s + 5  # the cold start
    # Nothing paid while at zero: the replica-seconds are far below a pool of one.
    assert run.scaling["replica_seconds"] < 0.5 * run.duration


def test_lost_block_events_cost_cache_hits_unless_first_tokens_resync_the_index(monkeypatch):
    """90% of the replicas' block events lost on their way: the router's
    index drifts from the caches and cache-aware routing sends prompts
    where their prefix no longer is. First tokens that find fewer cached
    blocks than the index claimed resync the replica's entries from its
    cache, and more blocks than it claimed are added (``Router._reconcile``),
    which recovers the hit rate; without that check it falls."""
    from carpool.cluster.router import Router

    cost = analytic_from_names("l4", "llama-3-8b")
    plan = _conversations(600, 30.0)

    def hit_rate(lost: float) -> float:
        run = simulate(plan, EngineConfig(), cost, 2000,
                       SimSettings(replicas=4, routing="cache-aware", hash_block=32,
                                   lost_block_events=lost))
        assert all(r.status == "ok" for r in run.records)
        return _hit_rate(run)

    whole, guarded = hit_rate(0.0), hit_rate(0.9)
    monkeypatch.setattr(Router, "_reconcile", lambda self, *args: None)
    blind = hit_rate(0.9)
    assert guarded > 0.97 * whole, (whole, guarded)
    assert blind < 0.92 * whole, (whole, blind)
    with pytest.raises(ValueError, match="lost-block-events"):
        SimSettings(replicas=2, lost_block_events=1.0).validate()
