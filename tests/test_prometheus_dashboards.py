"""vLLM's own Grafana dashboards work on carpool unchanged.

A real Prometheus (Debian's ``prometheus`` package) scrapes a live
``carpool serve --metrics-prefix vllm`` on the tiny random model every
second; after a few requests, every PromQL expression of vLLM's dashboards
(``tests/data/vllm_dashboard_exprs.json``, with Grafana's variables
substituted) must return data: at least one finite value. The dashboards'
variable queries must offer the served model's name.

Skips only when the ``prometheus`` binary is absent (``.ci/run`` installs it).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import httpx
import pytest

from tests.prometheus_utils import PROMETHEUS, Prometheus
from tests.server_utils import ServerProcess

needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus binary is not installed (Debian: apt-get "
    "install prometheus; .ci/run installs it), so vLLM's dashboards cannot be evaluated")

EXPRS = Path(__file__).parent / "data" / "vllm_dashboard_exprs.json"
SERVED = "tiny-llama"  # no regex metacharacters: it is also matched with =~
# Grafana's variables, as a dashboard showing the last 5 minutes would fill them.
VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m",
             "model_name": SERVED, "Deployment_id": SERVED}
VARIABLE_RE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
# Expressions allowed to return no data, each with its reason (reviewed; keep it tiny).
NO_DATA: dict[str, str] = {}


def grafana_to_promql(expr: str) -> str:
    """``expr`` with Grafana's variables replaced; an unknown one is a KeyError."""
    return VARIABLE_RE.sub(lambda m: VARIABLES[m.group(1) or m.group(2)], expr)


def _variable_query(prom: Prometheus, query: str) -> list[str]:
    """Grafana's ``label_values(label)`` / ``label_values(metric, label)``."""
    args = [a.strip() for a in re.fullmatch(r"label_values\((.*)\)", query).group(1).split(",")]
    return prom.label_values(args[-1], args[0] if len(args) == 2 else None)


def _send_traffic(client: httpx.Client) -> None:
    for i in range(3):
        reply = client.post("/v1/completions", json={"prompt": "hello " * (1 + 4 * i),
                                                     "max_tokens": 8, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
    reply = client.post("/v1/completions", json={"prompt": "two samples", "n": 2,
                                                 "max_tokens": 6, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "stream": True}) as stream:
        assert stream.status_code == 200
        assert any("[DONE]" in line for line in stream.iter_lines())


def _e2e_count(text: str) -> float:
    found = re.search(r"^vllm:e2e_request_latency_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    assert found, text[:2000]
    return float(found.group(1))


@needs_prometheus
def test_every_vllm_dashboard_expression_returns_data(tiny_model_dir, tmp_path):
    dashboards = json.loads(EXPRS.read_text())["dashboards"]
    with ServerProcess([str(tiny_model_dir), "--attention-backend", "torch",
                        "--kv-cache-memory", "16MiB", "--adaptive", "false",
                        "--served-model-name", SERVED, "--metrics-prefix", "vllm"]) as server, \
            Prometheus(server.url.removeprefix("http://"), tmp_path) as prom, \
            server.client() as client:
        # A scrape before any request: the base the rates over the traffic start from.
        prom.wait_for(lambda: prom.query("vllm:e2e_request_latency_seconds_count"), 30,
                      "the first scrape")
        _send_traffic(client)
        expected = _e2e_count(client.get("/metrics").text)
        prom.wait_for(lambda: prom.query("sum(vllm:e2e_request_latency_seconds_count)")
                      == [expected], 30, f"a scrape showing {expected} requests")
        failures = []
        for dashboard in dashboards:
            for name, query in dashboard["variables"].items():
                if SERVED not in _variable_query(prom, query):
                    failures.append(f"{dashboard['name']}: variable {name}: {query}")
            for expr in dashboard["exprs"]:
                values = prom.query(grafana_to_promql(expr))
                if not any(math.isfinite(v) for v in values) and expr not in NO_DATA:
                    failures.append(f"{dashboard['name']}: {expr} -> {values}")
        assert not failures, "\n".join(failures)
    assert all(expr in {e for d in dashboards for e in d["exprs"]} for expr in NO_DATA)


def test_the_data_file_lists_both_dashboards_whole():
    """The classic dashboard's 27 expressions and the newer two; each one
    names vLLM's series only by the ``vllm:`` prefix and uses known variables."""
    dashboards = {d["name"]: d for d in json.loads(EXPRS.read_text())["dashboards"]}
    counts = {name: len(d["exprs"]) for name, d in dashboards.items()}
    assert counts == {"vLLM": 27, "Performance Statistics": 21, "Query Statistics": 14}
    for d in dashboards.values():
        for expr in d["exprs"]:
            assert "vllm:" in expr and "carpool:" not in expr, expr
            assert "$" not in grafana_to_promql(expr), expr
