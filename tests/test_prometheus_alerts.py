"""deploy/prometheus/alerts.yml: the design's bands as Prometheus alerting
rules over series the server really exports.

``promtool`` checks the file and runs its unit tests
(deploy/prometheus/alerts_test.yml: each band fires past its threshold once
its ``for:`` has passed, and not inside it). A real Prometheus loading the
file then scrapes a live ``carpool serve`` on the tiny model that can hold
one request and queue one: bursts of concurrent requests are turned away
(429), and the drop-rate rule must go pending (or firing) in
``/api/v1/alerts``.

Skips only when the ``prometheus`` / ``promtool`` binaries are absent
(Debian's ``prometheus`` package; ``.ci/run`` installs it).
"""
from __future__ import annotations

import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import generate_latest

from carpool.server.metrics import Metrics
from tests.prometheus_utils import PROMETHEUS, PROMTOOL, Prometheus
from tests.server_utils import ServerProcess
from tests.test_host_metrics import FakeNvml, _stats

RULES_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
ALERTS = RULES_DIR / "alerts.yml"
ALERTS_TEST = RULES_DIR / "alerts_test.yml"
SERVED = "tiny-llama"
_WHY = ("is not installed (Debian: apt-get install prometheus; .ci/run installs it), so "
        "the alerting rules cannot be checked")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=f"promtool {_WHY}")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason=f"prometheus {_WHY}")
METRIC_RE = re.compile(r"carpool:[a-z0-9_]+")
# The design's bands, each with the rules that hold it.
BANDS = {
    "utilization": {"CarpoolEngineUtilizationHigh", "CarpoolEngineUtilizationLow",
                    "CarpoolGpuUtilizationHigh", "CarpoolGpuUtilizationLow"},
    "memory": {"CarpoolKvCacheFull", "CarpoolGpuMemoryHigh"},
    "fill": {"CarpoolBatchFillHigh", "CarpoolBatchFillLow"},
    "drops": {"CarpoolDropRateHigh"},
    "latency": {"CarpoolTtftP95High", "CarpoolE2eP99High"},
    "mix": {"CarpoolLongRequestsHigh"},
}


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"]
            for rule in group["rules"]]


def test_every_band_has_its_rules_with_severity_and_text():
    rules = _rules()
    by_band: dict[str, set[str]] = {}
    for rule in rules:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        by_band.setdefault(rule["labels"]["band"], set()).add(rule["alert"])
    assert by_band == BANDS


def test_the_rules_query_only_series_the_server_exports():
    """With the GPU families a CUDA server adds (a fake NVML): every name
    in the rules is one /metrics renders (histograms by their _bucket)."""
    metrics = Metrics("m", _stats)
    metrics.bind_engine(None, None, {"machine": {"device": "cuda:0"}}, load_nvml=FakeNvml)
    text = generate_latest(metrics.registry).decode()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                if line and not line.startswith("#")}
    referenced = {name for rule in _rules() for name in METRIC_RE.findall(rule["expr"])}
    assert referenced - exported == set()
    assert {"carpool:gpu_utilization", "carpool:reject_rate",
            "carpool:time_to_first_token_seconds_bucket"} <= referenced


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60,
                          cwd=RULES_DIR)


@needs_promtool
def test_promtool_checks_the_rules():
    done = _promtool("check", "rules", ALERTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout


@needs_promtool
def test_the_rules_unit_tests_pass():
    done = _promtool("test", "rules", ALERTS_TEST.name)
    assert done.returncode == 0, done.stdout + done.stderr


def _burst(client: httpx.Client, size: int = 6) -> list[int]:
    """``size`` concurrent completions; their status codes."""
    body = {"prompt": "hello " * 8, "max_tokens": 48, "ignore_eos": True}
    with ThreadPoolExecutor(size) as pool:
        replies = list(pool.map(lambda _: client.post("/v1/completions", json=body),
                                range(size)))
    return [reply.status_code for reply in replies]


def _drop_alert(prom: Prometheus) -> dict | None:
    return next((a for a in prom.alerts() if a["labels"]["alertname"] == "CarpoolDropRateHigh"
                 and a["labels"].get("model_name") == SERVED), None)


@needs_prometheus
def test_the_drop_rate_rule_fires_against_a_live_server(tiny_model_dir, tmp_path):
    with ServerProcess([str(tiny_model_dir), "--attention-backend", "torch",
                        "--kv-cache-memory", "16MiB", "--adaptive", "false",
                        "--served-model-name", SERVED, "--max-num-seqs", "1",
                        "--max-queue-requests", "1"]) as server, \
            Prometheus(server.url.removeprefix("http://"), tmp_path, (ALERTS,)) as prom, \
            server.client(timeout=30) as client:
        prom.wait_for(lambda: prom.query("carpool:reject_rate"), 30, "the first scrape")
        # Every rule loaded and evaluates without error (absent GPU series: no data).
        groups = prom.rule_groups()
        assert {r["name"] for g in groups for r in g["rules"]} == set().union(*BANDS.values())
        assert _drop_alert(prom) is None  # no arrival yet: reject_rate is NaN, never alerts
        codes: list[int] = []
        deadline = time.monotonic() + 40
        while (alert := _drop_alert(prom)) is None and time.monotonic() < deadline:
            codes += _burst(client)
            time.sleep(0.5)
        assert set(codes) <= {200, 429}, codes
        assert 429 in codes and 200 in codes, codes
        assert alert is not None, (codes, prom.alerts(), prom.logs())
        assert alert["state"] in ("pending", "firing")
        assert alert["labels"]["severity"] == "critical" and float(alert["value"]) > 0.001
        unhealthy = [(r["name"], r.get("lastError")) for g in prom.rule_groups()
                     for r in g["rules"] if r["health"] not in ("ok", "unknown")]
        assert unhealthy == []
        # A CPU server: the host's CPU is on /metrics, no GPU family is.
        text = client.get("/metrics").text
        assert re.search(r"^carpool:host_cpu_utilization\{", text, re.M)
        assert re.search(r"^carpool:token_budget_fill\{", text, re.M)
        assert "carpool:gpu_" not in text
