"""The metric families read from the engine when Prometheus scrapes.

Every family here is built unprefixed (``num_requests_running``); the
exporter in ``carpool.server.metrics`` adds ``carpool:`` and/or ``vllm:``.
Names, label names and meanings follow vLLM's where vLLM has the series
(``vllm/v1/metrics/loggers.py``); the rest are carpool's own.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from carpool.engine.stats import LONG_PROMPT_TOKENS, EngineStats

# vLLM creates these finish reasons' series at start (at 0), so a rate over
# the first requests has a base sample; "rejected" is not one: a request
# that never ran is counted by ``requests_rejected`` and ``request_outcomes``.
SUCCESS_REASONS = ("stop", "length", "abort")
# SessionStats fields that only ever grow: exported as counters as well.
SESSION_COUNTERS = {
    "session_requests": "Requests accepted with a session id.",
    "session_prefix_hit_tokens": "Prompt tokens of session requests served from the prefix cache.",
}


# The windowed rates (``RateWindow.rates``), in their order on /metrics, with their help.
RATE_HELP = {
    "effective_tokens_per_second": "Tokens computed per second, padding excluded.",
    "generation_tokens_per_second": "Tokens generated per second.",
    "engine_busy_fraction": "Share of wall time the engine spent running steps (0-1).",
    "batch_fill_rate": "Batch fill (0-1). Continuous batching: the step token budget's "
                       "occupancy (as token_budget_fill). Static / dynamic batching: real "
                       "tokens / computed token slots (1 - the padding's share).",
    "token_budget_fill": "Tokens per step / the live step token budget "
                         "(max_num_batched_tokens), over the steps that ran (0-1).",
    "seq_slot_fill": "Sequences holding a slot (running or loading) / the live sequence "
                     "slots (max_num_seqs), over the steps that ran (0-1).",
    "reject_rate": "Share of arrivals rejected, for any reason (0-1).",
    "long_request_share": "Share of admitted requests whose prompt is long "
                          f"(> {LONG_PROMPT_TOKENS} tokens).",
    "arrival_rate": "Arrivals per second, admitted or rejected.",
}


def _gauge(name: str, doc: str, model: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(model, value)
    return family


def _counter(name: str, doc: str, model: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(model, value)
    return family


def engine_families(stats: EngineStats, rates: dict[str, float], model_name: str,
                    window_s: float, cache: dict[str, str] | None) -> Iterator[Metric]:
    """Gauges and counters of one engine snapshot, plus ``rates`` (windowed
    over ``window_s``) and ``cache`` (``cache_config_info``'s labels, if known)."""
    model = [model_name]
    c = stats.counters
    yield _gauge("num_requests_running", "Requests in the running batch.", model,
                 stats.num_running)
    yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", model,
                 stats.num_waiting)
    yield _gauge("num_tokens_waiting", "Tokens still to compute for waiting requests.", model,
                 stats.waiting_tokens)
    yield _gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", model,
                 stats.kv_usage)
    yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                   model, stats.prefix_queries)
    yield _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", model,
                   stats.prefix_hits)
    yield _counter("num_preemptions", "Preemptions (by recompute).", model,
                   stats.num_preemptions)
    yield _counter("num_priority_preemptions",
                   "Preemptions that made room for a better-priority request.", model,
                   stats.num_priority_preemptions)
    yield _counter("batches", "Request-level batches formed (static / dynamic batching).",
                   model, stats.batches)
    yield _counter("prompt_tokens", "Prompt tokens of finished requests.", model,
                   c.prompt_tokens)
    yield _counter("generation_tokens", "Generated tokens.", model, c.generation_tokens)
    yield _counter("engine_steps", "Scheduler steps run.", model, c.steps)
    yield _counter("requests_rerouted", "Requests whose worker died before any output "
                   "reached the caller, sent again to another replica.", model,
                   stats.requests_rerouted)
    yield _counter("requests_resumed", "Streams whose worker died after some output reached "
                   "the caller, resumed on another replica after it.", model,
                   stats.requests_resumed)
    yield _counter("engine_busy_seconds", "Seconds the engine spent running steps.", model,
                   c.busy_seconds)
    yield _request_success(stats, model)
    rejected = CounterMetricFamily("requests_rejected",
                                   "Requests rejected by admission control, by reason.",
                                   labels=["model_name", "reason"])
    for reason, count in sorted(stats.rejections.items()):
        rejected.add_metric(model + [reason], count)
    yield rejected
    yield _counter("deferred_arrivals", "Arrivals admitted to start a step later than they "
                   "could, so as not to make the first tokens of that step's requests late "
                   "(operator SLO).", model, stats.deferred_arrivals)
    for name, value in rates.items():
        yield _gauge(name, f"{RATE_HELP[name]} Over the last {window_s:g} s.", model, value)
    if cache is not None:
        info = GaugeMetricFamily("cache_config_info", "The KV cache's settings (always 1).",
                                 labels=["model_name", *cache])
        info.add_metric(model + list(cache.values()), 1.0)
        yield info
    yield from _policy_families(stats, model)
    yield from _session_families(stats, model)
    yield from _pin_families(stats, model)
    if stats.kv_store:
        yield from _kv_store_families(stats.kv_store, model)
    if stats.expert_tokens:
        yield from _expert_families(stats, model)


def kernels_family(labels: dict[str, str], model_name: str) -> GaugeMetricFamily:
    """``cpu_kernels_info``: the CPU kernel plan this machine kind chose at
    start-up (carpool/kernel_plan.py), as labels (always 1)."""
    info = GaugeMetricFamily("cpu_kernels_info", "The CPU kernels chosen at start-up for this "
                             "machine kind: tier, dtype, decode, batched and attention paths "
                             "(always 1).", labels=["model_name", *labels])
    info.add_metric([model_name, *labels.values()], 1.0)
    return info


def _expert_families(stats: EngineStats, model: list[str]):  # noqa: ANN202
    tokens = CounterMetricFamily(
        "moe_expert_tokens", "Tokens routed to each expert (a token counts once per expert "
        "it picks), summed over the MoE layers.", labels=["model_name", "expert"])
    for expert, count in enumerate(stats.expert_tokens):
        tokens.add_metric(model + [str(expert)], count)
    yield tokens
    if stats.expert_rank_tokens:  # --enable-expert-parallel: each rank's load
        ranks = CounterMetricFamily(
            "moe_rank_tokens", "Tokens routed to each expert-parallel rank's experts, summed "
            "over the MoE layers.", labels=["model_name", "rank"])
        for rank, count in enumerate(stats.expert_rank_tokens):
            ranks.add_metric(model + [str(rank)], count)
        yield ranks
    if stats.expert_rank_dropped:  # --expert-capacity-factor: the rows past it
        dropped = CounterMetricFamily(
            "moe_rank_dropped", "(token, expert) rows past an expert-parallel rank's capacity "
            "(--expert-capacity-factor), by rank: dropped, they add nothing.",
            labels=["model_name", "rank"])
        for rank, count in enumerate(stats.expert_rank_dropped):
            dropped.add_metric(model + [str(rank)], count)
        yield dropped
    yield _gauge("moe_expert_imbalance", "The last step's busiest expert over the mean per "
                 "expert (1 = even), averaged over the MoE layers.", model,
                 stats.expert_imbalance)
    yield _gauge("moe_expert_imbalance_mean", "moe_expert_imbalance averaged over every step "
                 "so far.", model, stats.expert_imbalance_mean)


# The shared KV store's counters (``StoreConnector.metrics``): name, key, help.
_KV_STORE_COUNTERS = (
    ("kv_store_queries", "store_queries", "KV blocks looked up in the shared store."),
    ("kv_store_hits", "store_hits", "Of them, blocks the store held."),
    ("kv_store_blocks_loaded", "blocks_loaded", "KV blocks loaded from the store into this "
                                                "cache instead of computed."),
    ("kv_store_blocks_saved", "blocks_saved", "KV blocks written to the store."),
    ("kv_store_blocks_refused", "blocks_refused", "Fetched blocks refused (another model or "
                                                  "layout, damaged): computed instead."),
    ("kv_store_blocks_missing", "blocks_missing", "Blocks gone between lookup and fetch."),
    ("kv_store_saves_dropped", "saves_dropped", "Blocks not saved (in-flight bytes over the "
                                                "limit, or the store down)."),
    ("kv_store_errors", "store_errors", "Calls that found the store unavailable."),
    ("kv_store_bytes_read", "bytes_read", "Payload bytes fetched from the store."),
    ("kv_store_bytes_written", "bytes_written", "Payload bytes written to the store."),
    ("kv_handoff_layer_parts_sent", "layer_parts_sent", "P/D prefill: per-layer parts of "
                                                        "prompt blocks put for a decode replica."),
    ("kv_handoff_layer_parts_dropped", "layer_parts_dropped", "P/D: per-layer parts deleted "
     "from the store once taken by their decode replica, or when their request ended "
     "without one."),
    ("kv_handoff_export_seconds", "export_seconds", "P/D prefill: put time of the parts "
                                                    "streamed during forwards."),
    ("kv_handoff_export_hidden_seconds", "export_hidden_seconds",
     "Of it, time overlapped with the forward computing the next layers."),
    ("kv_handoff_export_exposed_seconds", "export_exposed_seconds",
     "Transfer tail after each streaming forward ended (summed over steps)."),
)


def _kv_store_families(values: dict, model: list[str]) -> Iterator[Metric]:
    from prometheus_client.core import HistogramMetricFamily

    from carpool.kv_transfer.connector import TRANSFER_BUCKETS

    for name, key, doc in _KV_STORE_COUNTERS:
        yield _counter(name, doc, model, values.get(key, 0))
    for name, key, total, doc in (
            ("kv_store_load_seconds", "load_buckets", "load_seconds",
             "Wall time of one fetch from the store (one request's blocks)."),
            ("kv_store_save_seconds", "save_buckets", "save_seconds",
             "Wall time of one write to the store (one commit's blocks).")):
        counts = values.get(key) or [0] * (len(TRANSFER_BUCKETS) + 1)
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, TRANSFER_BUCKETS), "+Inf"), counts):
            cumulative += count
            buckets.append((bound, cumulative))
        family = HistogramMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(model, buckets, sum_value=values.get(total, 0.0))
        yield family


def _request_success(stats: EngineStats, model: list[str]) -> CounterMetricFamily:
    finished = dict.fromkeys(SUCCESS_REASONS, 0) | stats.counters.finished
    finished.pop("rejected", None)
    family = CounterMetricFamily(
        "request_success", "Requests the engine finished, by reason (stop, length, abort); "
        "rejected ones are in requests_rejected.", labels=["model_name", "finished_reason"])
    for reason, count in sorted(finished.items()):
        family.add_metric(model + [reason], count)
    return family


def _policy_families(stats: EngineStats, model: list[str]) -> Iterator[Metric]:
    mode = GaugeMetricFamily("controller_mode", "1 for the scheduler's current mode.",
                             labels=["model_name", "mode", "batching"])
    mode.add_metric(model + [stats.mode, stats.batching], 1.0)
    yield mode
    knobs = GaugeMetricFamily("scheduler_knob", "Current value of each scheduler knob.",
                              labels=["model_name", "knob"])
    for knob, value in sorted(stats.knobs.items()):
        knobs.add_metric(model + [knob], value)
    yield knobs
    decisions = CounterMetricFamily(
        "controller_decisions", "Adaptive controller decisions by knob and reason.",
        labels=["model_name", "knob", "reason"])
    for (knob, reason), count in sorted(stats.decision_counts.items()):
        decisions.add_metric(model + [knob, reason], count)
    yield decisions


def _session_families(stats: EngineStats, model: list[str]) -> Iterator[Metric]:
    # The gauge keeps every stat, counts included, so existing dashboards keep
    # working; rate() belongs on the counters below.
    sessions = GaugeMetricFamily("sessions", "Session stats (the counts are cumulative: "
                                 "take rate() of session_requests_total and "
                                 "session_prefix_hit_tokens_total instead).",
                                 labels=["model_name", "stat"])
    for name, value in sorted(stats.sessions.items()):
        sessions.add_metric(model + [name], value)
    yield sessions
    for name, doc in SESSION_COUNTERS.items():
        yield _counter(name, doc, model, stats.sessions.get(name, 0))


def _pin_families(stats: EngineStats, model: list[str]) -> Iterator[Metric]:
    """Per pinned prefix (label ``prefix``: its name; at most
    ``max_pinned_prefixes`` of them, gone once unpinned): the requests that
    hit it, the tokens it served and the blocks it holds; and the first
    admissions checked against the pins, so that
    ``rate(pinned_prefix_hits_total) / rate(pinned_prefix_lookups_total)``
    is a prefix's hit rate. A fleet sums its replicas'."""
    labels = ["model_name", "prefix"]
    hits = CounterMetricFamily("pinned_prefix_hits", "Requests whose cached prefix began with "
                               "this pinned prefix's blocks.", labels=labels)
    tokens = CounterMetricFamily("pinned_prefix_hit_tokens", "Prompt tokens this pinned "
                                 "prefix's blocks served from the prefix cache.", labels=labels)
    blocks = GaugeMetricFamily("pinned_prefix_blocks", "KV blocks this pinned prefix holds "
                               "(every replica's; 0 while it is being computed).", labels=labels)
    for pin in stats.pinned:
        hits.add_metric(model + [pin.name], pin.hits)
        tokens.add_metric(model + [pin.name], pin.hit_tokens)
        blocks.add_metric(model + [pin.name], pin.blocks)
    yield from (hits, tokens, blocks)
    yield _counter("pinned_prefix_lookups", "Requests checked against the pinned prefixes at "
                   "their first admission (while some prefix was pinned).", model,
                   stats.pinned_lookups)


# The per-replica series of a fleet (``carpool serve --replicas N``): the
# fleet totals above keep their names, these add the ``replica`` label.
_REPLICA_GAUGES = (
    ("replica_num_requests_running", "Requests in the replica's running batch.",
     lambda s: s.num_running),
    ("replica_num_requests_waiting", "Requests waiting in the replica's queue.",
     lambda s: s.num_waiting),
    ("replica_kv_cache_usage_perc", "Share of the replica's KV blocks in use (0-1).",
     lambda s: s.kv_usage),
)
_REPLICA_COUNTERS = (
    ("replica_generation_tokens", "Tokens the replica generated.",
     lambda s: s.counters.generation_tokens),
    ("replica_prompt_tokens", "Prompt tokens of requests the replica finished.",
     lambda s: s.counters.prompt_tokens),
    ("replica_prefix_cache_queries", "Prompt tokens the replica looked up in its prefix cache.",
     lambda s: s.prefix_queries),
    ("replica_prefix_cache_hits", "Of them, tokens found cached.", lambda s: s.prefix_hits),
    ("replica_num_preemptions", "Requests the replica preempted.", lambda s: s.num_preemptions),
    ("replica_engine_steps", "Scheduler steps the replica ran.", lambda s: s.counters.steps),
)


def replica_families(per_replica: dict[str, EngineStats], model_name: str) -> Iterator[Metric]:
    """A fleet's per-replica gauges and counters, labelled ``replica``."""
    labels = ["model_name", "replica"]
    for name, doc, value in _REPLICA_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=labels)
        for replica, stats in sorted(per_replica.items()):
            family.add_metric([model_name, replica], value(stats))
        yield family
    for name, doc, value in _REPLICA_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=labels)
        for replica, stats in sorted(per_replica.items()):
            family.add_metric([model_name, replica], value(stats))
        yield family
