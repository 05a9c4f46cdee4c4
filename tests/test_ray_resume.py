"""A stream survives its Ray Serve replica (issue 47, item 1): two engine
replicas; the one serving a greedy stream is SIGKILLed 20 tokens in; the
ingress sends the request on to the other replica after the tokens the
client got, and the client sees one uninterrupted stream with the
undisturbed text. Counted on ``/carpool/policy`` and ``/metrics``."""
from __future__ import annotations

import json
import os
import signal

import httpx

from tests.ray_helpers import serving

BODY = {"model": "tiny", "prompt": "the long one", "max_tokens": 120, "temperature": 0,
        "ignore_eos": True}


def test_a_stream_goes_on_when_its_replica_is_killed(tiny_model_dir):
    with serving("carpool-resume", {
            "model": str(tiny_model_dir), "dtype": "float32", "attention-backend": "torch",
            "adaptive": False, "served-model-name": "tiny", "replicas": 2,
            "routing": "least-outstanding", "replica_cpus": 0.5, "ingress_cpus": 0.25}) as url:
        with httpx.Client(base_url=url, timeout=300) as http:
            expected = http.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
            text, finish, killed = "", None, None
            with http.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as reply:
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    text += event["choices"][0]["text"]
                    finish = event["choices"][0]["finish_reason"] or finish
                    if killed is None and len(text) > 40:
                        killed = _serving_replica_pid(http, event["id"])
                        os.kill(killed, signal.SIGKILL)
            assert killed is not None
            assert text == expected and finish == "length"
            routing = http.get("/carpool/policy").json()["routing"]
            assert routing["resumed"] == 1
            metrics = http.get("/metrics").text
            assert "carpool:requests_resumed_total{" in metrics


def _serving_replica_pid(http: httpx.Client, completion_id: str) -> int:
    routing = http.get("/carpool/policy").json()["routing"]
    replica = [d["replica"] for d in routing["decisions"]
               if d["request_id"].startswith(completion_id)][-1]
    return next(v["pid"] for v in routing["replicas"] if v["replica"] == replica)
