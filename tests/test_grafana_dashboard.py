"""The Grafana dashboard in deploy/grafana only queries metrics the server exports.

No network and no Grafana: the dashboard JSON is checked structurally, and every
metric name in its PromQL is checked against what ``carpool.server.metrics``
actually renders at /metrics.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from carpool.engine.stats import EngineCounters, EngineStats
from carpool.server.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "carpool-dashboard.json"
DS_VAR = "${DS_PROMETHEUS}"
MODEL_FILTER = 'model_name=~"$model_name"'
# Digits too: ``carpool:e2e_request_latency_seconds``.
METRIC_RE = re.compile(r"carpool:[a-z0-9_:]+")
# A metric name followed by its optional label matcher.
SELECTOR_RE = re.compile(r"(carpool:[a-z0-9_:]+)(\{[^}]*\})?")
HIST_SUFFIXES = ("_bucket", "_sum", "_count")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    with DASHBOARD.open() as f:
        return json.load(f)


def _all_panels(dashboard: dict) -> list[dict]:
    """Every panel, rows included, with panels nested in collapsed rows."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _data_panels(dashboard: dict) -> list[dict]:
    return [p for p in _all_panels(dashboard) if p["type"] != "row"]


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in _data_panels(dashboard) for t in p.get("targets", [])]


def _stats() -> EngineStats:
    return EngineStats(
        time=0.0, num_running=0, num_waiting=0, waiting_tokens=0, kv_num_blocks=0,
        kv_used_blocks=0, prefix_queries=0, prefix_hits=0, num_preemptions=0,
        counters=EngineCounters(), rejections={"queue_full": 0},
        sessions={"active_sessions": 0}, knobs={"max_num_seqs": 1})


@pytest.fixture(scope="module")
def exported() -> tuple[set[str], dict[str, str]]:
    """(series names a Prometheus server would store, {family name: type}).

    Family names are without ``_total``: depending on the prometheus-client
    version a counter's ``# TYPE`` line names it with or without the suffix.
    """
    metrics = Metrics("m", _stats)
    text = generate_latest(metrics.registry).decode()
    types: dict[str, str] = {}
    series: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "counter":
                name = name.removesuffix("_total")
            types[name] = kind
            if kind == "counter":
                series.add(f"{name}_total")
            elif kind == "histogram":
                series.update(f"{name}{s}" for s in HIST_SUFFIXES)
            else:
                series.add(name)
        elif line and not line.startswith("#"):
            series.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    assert types, text
    return series, types


def test_dashboard_is_importable_json(dashboard):
    assert dashboard["schemaVersion"] == 39
    assert dashboard["uid"] == "carpool-overview"
    assert dashboard["title"] == "carpool"
    assert dashboard.get("id") is None  # an import must not clash with an existing id
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    model = variables["model_name"]
    assert model["type"] == "query"
    assert model["datasource"]["uid"] == DS_VAR
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    assert query == "label_values(carpool:num_requests_running, model_name)"


def test_panels_have_titles_ids_and_fit_the_grid(dashboard):
    panels = _all_panels(dashboard)
    assert len(_data_panels(dashboard)) >= 10
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == ["Traffic", "Latency", "Throughput & efficiency", "KV & cache", "Policy"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        assert p.get("title", "").strip(), f"panel {p.get('id')} has no title"
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine


def test_datasources_use_the_variable(dashboard):
    for p in _data_panels(dashboard):
        assert p["datasource"] == {"type": "prometheus", "uid": DS_VAR}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no queries"
        for t in p["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": DS_VAR}, p["title"]
    for row in (p for p in _all_panels(dashboard) if p["type"] == "row"):
        assert "datasource" not in row or row["datasource"]["uid"] == DS_VAR


def test_every_query_filters_by_model(dashboard):
    for expr in _exprs(dashboard):
        selectors = SELECTOR_RE.findall(expr)
        assert selectors, expr
        for name, matcher in selectors:
            assert MODEL_FILTER in matcher, f"{name} without the model filter in: {expr}"
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr


def test_queries_reference_only_exported_metrics(dashboard, exported):
    series, types = exported
    referenced = {name for expr in _exprs(dashboard) for name in METRIC_RE.findall(expr)}
    unknown = sorted(referenced - series)
    assert not unknown, f"dashboard queries metrics the server does not export: {unknown}"
    # Histograms are queried through their series, never by their bare family name.
    for name in referenced:
        base = next((name[: -len(s)] for s in HIST_SUFFIXES if name.endswith(s)), name)
        if name.endswith("_bucket"):
            assert types.get(base) == "histogram", name
    for expr in _exprs(dashboard):
        if "histogram_quantile" in expr:
            assert "_bucket{" in expr and "by (le" in expr, expr


def test_dashboard_covers_the_main_metric_families(dashboard, exported):
    _, types = exported
    text = " ".join(_exprs(dashboard))
    families = set(METRIC_RE.findall(text))
    families = {next((f[: -len(s)] for s in ("_total", *HIST_SUFFIXES)
                      if f.endswith(s) and f[: -len(s)] in types), f) for f in families}
    expected = {
        "carpool:time_to_first_token_seconds", "carpool:inter_token_latency_seconds",
        "carpool:request_time_per_output_token_seconds", "carpool:e2e_request_latency_seconds",
        "carpool:request_queue_time_seconds", "carpool:request_outcomes",
        "carpool:prefix_cache_queries", "carpool:prefix_cache_hits", "carpool:num_preemptions",
        "carpool:prompt_tokens", "carpool:generation_tokens", "carpool:requests_rejected",
        "carpool:num_requests_running", "carpool:num_requests_waiting",
        "carpool:kv_cache_usage_perc", "carpool:effective_tokens_per_second",
        "carpool:engine_busy_fraction", "carpool:batch_fill_rate", "carpool:reject_rate",
        "carpool:arrival_rate", "carpool:controller_mode", "carpool:scheduler_knob",
        "carpool:sessions", "carpool:token_budget_fill", "carpool:seq_slot_fill",
        "carpool:host_cpu_utilization",
    }
    assert expected <= set(types), sorted(expected - set(types))
    assert expected <= families, sorted(expected - families)
