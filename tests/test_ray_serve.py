"""The Ray Serve backend on a real local Ray (127.0.0.1, 2 CPUs) and the tiny model.

One application for the module: carpool's ingress and two engine replicas
(half a CPU each), carpool's router as Ray's request router and carpool's
autoscaler as its policy (bounds 2..2 here: loaded and ticking, the count
fixed). Driven by the official ``openai`` client and ``httpx``; the
replicas' own counters (asked through a deployment handle) show that
every request ended exactly once, and where. The autoscaling policy's
decisions are checked by calling it with Ray's ``AutoscalingContext``.
The KubeRay manifest must name this builder and arguments it accepts.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from ray import serve
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from carpool.engine.stats import EngineStats
from carpool.ray_serve.app import settings_from_args
from carpool.ray_serve.autoscaling import CarpoolAutoscalingPolicy
from carpool.ray_serve.wire import stats_decoder
from carpool.server.config import ServerConfig
from tests.ray_helpers import serving

ROOT = Path(__file__).resolve().parents[1]
APP = "carpool"


@pytest.fixture(scope="module")
def ray_app(tiny_model_dir):
    with serving(APP, {
            "model": str(tiny_model_dir), "attention-backend": "torch", "adaptive": False,
            "served-model-name": "tiny", "replicas": 2, "routing": "predicted-ttft",
            "autoscale": "reactive", "min-replicas": 2, "max-replicas": 2, "scale-tick": 1,
            "replica_cpus": 0.5, "ingress_cpus": 0.25}) as url:
        yield url


def _replicas() -> dict[str, EngineStats]:
    """Every engine replica's stats, asked through a handle (the router
    spreads these calls over the replicas)."""
    handle = serve.get_deployment_handle("CarpoolEngine", APP)
    seen: dict[str, EngineStats] = {}
    for _ in range(40):
        reply = stats_decoder.decode(handle.stats.remote().result(timeout_s=10))
        seen[reply.replica] = reply.stats
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only replicas {sorted(seen)} answered")


def _settled(before: dict[str, EngineStats], sent: int) -> dict[str, EngineStats]:
    """The replicas' stats once ``sent`` more requests were added and ended
    there, and none is left running or waiting (bounded wait)."""
    deadline = time.monotonic() + 30
    while True:
        now = _replicas()
        added = sum(s.counters.requests_added - before[r].counters.requests_added
                    for r, s in now.items())
        ended = sum(sum(s.counters.finished.values()) - sum(before[r].counters.finished.values())
                    for r, s in now.items())
        idle = all(s.num_running == s.num_waiting == 0 for s in now.values())
        if (added, ended, idle) == (sent, sent, True) or time.monotonic() > deadline:
            assert (added, ended, idle) == (sent, sent, True), (added, ended, idle)
            return now
        time.sleep(0.3)


def _delta(after: dict[str, EngineStats], before: dict[str, EngineStats], field) -> dict:
    return {r: field(s) - field(before[r]) for r, s in after.items()}


def test_openai_streams_through_two_replicas_each_request_ending_once(ray_app):
    before = _replicas()
    api = openai.OpenAI(base_url=ray_app + "/v1", api_key="none", max_retries=0)

    def stream(i: int) -> list[str]:
        chunks = list(api.completions.create(model="tiny", prompt=f"hello {i}", max_tokens=8,
                                             stream=True, temperature=0))
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        return [c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason]

    with ThreadPoolExecutor(6) as pool:
        finals = list(pool.map(stream, range(6)))
    assert finals == [["length"]] * 6
    # A client that leaves mid-stream: the abort reaches its replica.
    body = {"model": "tiny", "prompt": "long", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=ray_app, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as doomed:
            assert next(line for line in doomed.iter_lines() if line.startswith("data: {"))
        after = _settled(before, 7)
        aborted = _delta(after, before, lambda s: s.counters.finished.get("abort", 0))
        assert sum(aborted.values()) == 1
        # Both replicas served (the router spreads concurrent requests).
        added = _delta(after, before, lambda s: s.counters.requests_added)
        assert all(n > 0 for n in added.values()), added
        # carpool's endpoints, auth and metrics, as `carpool serve` has them.
        assert http.get("/health").json()["status"] == "ok"
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}
                         ).status_code == 400
        # Per-replica series come from the ingress's stats polls, each
        # answered by the replica Ray's router picks: wait for both to answer.
        deadline = time.monotonic() + 30
        while True:
            metrics = http.get("/metrics").text
            replicas = {line.split('replica="')[1].split('"')[0]
                        for line in metrics.splitlines()
                        if line.startswith("carpool:replica_engine_steps_total{")}
            if replicas == set(after) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert replicas == set(after)


def test_sessions_stay_on_one_replica_and_prefixes_go_where_they_are_cached(ray_app):
    api = openai.OpenAI(base_url=ray_app + "/v1", api_key="none", max_retries=0)
    with httpx.Client(base_url=ray_app, timeout=60) as http:
        # Every turn of a session lands on one replica.
        before = _replicas()
        for turn in range(4):
            api.chat.completions.create(model="tiny", max_tokens=2, extra_headers={
                "x-session-id": "s-1"}, messages=[{"role": "user", "content": f"turn {turn}"}])
        after = _settled(before, 4)
        added = _delta(after, before, lambda s: s.counters.requests_added)
        assert sorted(added.values()) == [0, 4], added
        # /carpool/policy shows Ray's request router's decisions, with causes.
        routing = http.get("/carpool/policy").json()["routing"]
        assert routing["policy"] == "predicted-ttft" and len(routing["replicas"]) == 2
        turns = routing["decisions"][-4:]
        assert [d["replica"] for d in turns] == [next(r for r, n in added.items() if n)] * 4
        assert turns[-1]["cause"] == "session home", turns
        # Four long prefixes at once spread over both replicas; once their
        # replicas reported them (routing stats, every 0.5 s), each repeat
        # goes where its prefix is cached.
        prefixes = [[5 + 100 * k + i for i in range(64)] for k in range(4)]
        with ThreadPoolExecutor(4) as pool:
            firsts = list(pool.map(lambda p: http.post("/v1/completions", json={
                "prompt": p + [1], "max_tokens": 2}), prefixes))
        assert all(r.status_code == 200 for r in firsts)
        spread = _settled(after, 4)
        assert all(n > 0 for n in _delta(spread, after,
                                         lambda s: s.counters.requests_added).values())
        time.sleep(2.0)  # the replicas' next routing reports reach the router
        for prefix in prefixes:
            again = http.post("/v1/completions", json={"prompt": prefix + [2], "max_tokens": 2})
            assert again.status_code == 200
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
        _settled(spread, 4)


def test_constrained_requests_spread_over_the_replicas_each_compiling_its_grammar(ray_app):
    """Structured outputs through Ray: the spec travels on the wire, each
    replica compiles it; a bad schema is the ingress's 400, never queued."""
    api = openai.OpenAI(base_url=ray_app + "/v1", api_key="none", max_retries=0)
    before = _replicas()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}

    def ask(i: int) -> str:
        if i % 2:
            return api.completions.create(model="tiny", prompt=f"pick {i}", max_tokens=8,
                                          seed=i, extra_body={"guided_choice": ["yes", "no"]}
                                          ).choices[0].text
        chunks = list(api.completions.create(model="tiny", prompt=f"json {i}", max_tokens=24,
                                             stream=True, seed=i,
                                             extra_body={"guided_json": schema}))
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(ask, range(6)))
    for i, text in enumerate(texts):
        if i % 2:
            assert text in ("yes", "no"), text
        else:  # complete JSON, or a prefix of one where the 24 tokens ran out
            assert text.startswith('{"n": '), text
    after = _settled(before, 6)
    assert all(n > 0 for n in _delta(after, before,
                                     lambda s: s.counters.requests_added).values())
    with httpx.Client(base_url=ray_app, timeout=60) as http:
        bad = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                                 "guided_json": {"type": "nope"}})
        assert bad.status_code == 400 and "invalid json constraint" in bad.text, bad.text
    assert _replicas().keys() == after.keys()
    _settled(after, 0)


def _context(now: float, waiting: float, running: float, added: float,
             replicas: int) -> AutoscalingContext:
    deployment = DeploymentID("CarpoolEngine", APP)
    ids = [ReplicaID(f"r{i}", deployment) for i in range(replicas)]
    per = {name: {r: value / replicas for r in ids}
           for name, value in (("waiting", waiting), ("running", running), ("slots", 8.0))}
    per["requests_added"] = {r: added / replicas for r in ids}
    return AutoscalingContext(
        deployment_id=deployment, deployment_name="CarpoolEngine", app_name=APP,
        current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=ids,
        total_num_requests=waiting + running, total_queued_requests=0.0,
        aggregated_metrics=per, raw_metrics={}, capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=3, policy_state={}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=now,
        config=AutoscalingConfig(min_replicas=1, max_replicas=3))


def test_the_autoscaling_policy_scales_up_on_backlog_and_down_when_idle():
    config = ServerConfig(autoscale="reactive", replicas=1, max_replicas=3, scale_tick=1.0,
                          scale_out_backlog=4, scale_out_wait=0.0, scale_out_cooldown=0.0,
                          scale_in_after=3.0, scale_in_window=3.0).validate()
    from carpool.ray_serve.autoscaling import policy_kwargs

    policy = CarpoolAutoscalingPolicy(**policy_kwargs("reactive", 1,
                                                      config.autoscale_config()))
    assert policy(_context(100.0, waiting=0, running=1, added=1, replicas=1))[0] == 1
    # Within a tick nothing is decided again.
    assert policy(_context(100.5, waiting=12, running=8, added=20, replicas=1))[0] == 1
    replicas, state = policy(_context(101.0, waiting=12, running=8, added=20, replicas=1))
    assert replicas == 3 and "backlog 12 > 4" in state["carpool_cause"]
    counts = [policy(_context(102.0 + t, waiting=0, running=0, added=20, replicas=3))[0]
              for t in range(6)]
    assert counts[0] == 3 and counts[-1] == 1, counts


def test_the_kuberay_manifest_names_the_builder_with_arguments_it_takes():
    manifest = yaml.safe_load((ROOT / "deploy/kuberay/rayservice.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    module, name = app["import_path"].split(":")
    builder = getattr(__import__(module, fromlist=[name]), name)
    assert builder.__module__ == "carpool.ray_serve.app" and name == "build_app"
    settings = settings_from_args(app["args"])
    assert settings.server.autoscale == "reactive" and settings.replica_cpus == 4
    assert builder(app["args"]) is not None  # builds without a cluster
    with pytest.raises(ValueError, match="unknown config key"):
        settings_from_args({**app["args"], "no-such-flag": 1})
    with pytest.raises(ValueError, match="backend must be one of"):
        ServerConfig(backend="k8s").validate()
