"""carpool's autoscaler live on a real local Ray (127.0.0.1, 2 CPUs).

One engine replica with one slot, and sixteen long requests at once: the
backlog reaches carpool's policy through Ray's own metrics path (the
replicas' ``record_autoscaling_stats``, pushed to Serve's controller, which
calls ``CarpoolAutoscalingPolicy``), Ray starts a second replica, and once
the fleet is idle it goes back to one. Every request completes, exactly
once.

The replicas push their metrics every half scale tick (the application
builder sets it: Ray's default is 10 s), so with a 0.5 s tick the test
runs in well under a minute.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from ray import serve

from tests.ray_helpers import serving

APP = "carpool-autoscale"


def _engine_replicas() -> int:
    """Engine replicas Ray reports RUNNING."""
    status = serve.status().applications.get(APP)
    if status is None:
        return 0
    states = status.deployments["CarpoolEngine"].replica_states
    return int(states.get("RUNNING", 0))


@pytest.fixture()
def ray_autoscaled_app(tiny_model_dir):
    with serving(APP, {
            "model": str(tiny_model_dir), "attention-backend": "torch", "adaptive": False,
            "served-model-name": "tiny", "max-num-seqs": 1, "replicas": 1,
            "routing": "least-outstanding", "autoscale": "reactive", "min-replicas": 1,
            "max-replicas": 2, "scale-tick": 0.5, "scale-out-backlog": 1,
            "scale-out-wait": 0, "scale-out-cooldown": 0, "scale-in-utilization": 0.5,
            "scale-in-after": 1, "scale-in-window": 1,
            "replica_cpus": 0.5, "ingress_cpus": 0.25}) as url:
        yield url


def test_ray_scales_out_on_backlog_and_back_in_when_idle(ray_autoscaled_app):
    assert _engine_replicas() == 1
    answers: list[httpx.Response] = []

    def ask(index: int) -> None:
        answers.append(httpx.post(ray_autoscaled_app + "/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": [index + 1] * 8, "max_tokens": 400, "ignore_eos": True}))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    most = 1
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        most = max(most, _engine_replicas())
        time.sleep(0.2)
    for thread in threads:
        thread.join(60)
    assert len(answers) == 16 and all(a.status_code == 200 for a in answers), \
        [a.text for a in answers if a.status_code != 200]
    assert all(a.json()["usage"]["completion_tokens"] == 400 for a in answers)
    assert most == 2
    deadline = time.monotonic() + 60
    while _engine_replicas() > 1 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _engine_replicas() == 1
