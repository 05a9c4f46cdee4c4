"""``carpool serve --prefill 1 --decode 1``: P/D serving through real
processes, driven over HTTP and by the official ``openai`` client.

The same greedy answers as colocated serving, on the tiny model and on the
default model; the first token streamed before the decode part runs; the
prompt's blocks loaded by the decode replica from the front's KV store; a
prefill replica that dies before its first token costs the client nothing
(the request runs on a decode replica), the only decode replica dying
holds its request for the restart, which goes on there; either way no KV
block stays held.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import openai
import pytest
from server_utils import ServerProcess

# Distinct from their first token on: no prompt finds another's blocks cached.
PROMPTS = [[(i * m + m) % 380 + 5 for i in range(n)] for m, n in ((41, 70), (43, 64), (47, 9),
                                                                  (53, 150))]


def _serve(model: str, *extra: str) -> ServerProcess:
    return ServerProcess([model, "--attention-backend", "torch", "--adaptive", "false",
                          "--dtype", "float32", "--served-model-name", "m", *extra])


def _answers(server: ServerProcess, prompts, max_tokens: int = 16) -> list[str]:
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    return [api.completions.create(model="m", prompt=p, max_tokens=max_tokens, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
            for p in prompts]


def _pd(http) -> dict:
    return http.get("/carpool/policy").json()["pd"]


def _metrics(http, prefix: str) -> dict[str, float]:
    """Series starting with ``prefix``: {labels: value}."""
    return {line.split("{", 1)[1].split("}")[0]: float(line.split()[-1])
            for line in http.get("/metrics").text.splitlines() if line.startswith(prefix + "{")}


def _wait_for(http, counter: str, value: float) -> None:
    """Until the fleet total of ``counter`` is ``value`` (stats are polled)."""
    deadline = time.monotonic() + 10
    while (total := sum(_metrics(http, counter).values())) != value:
        assert time.monotonic() < deadline and total < value, (counter, total, value)
        time.sleep(0.2)


def _tokenized(http, prompts: list[str]) -> list[list[int]]:
    return [http.post("/tokenize", json={"model": "m", "prompt": p}).json()["tokens"]
            for p in prompts]


def _nothing_held(http) -> None:
    """Every replica's KV pool back to no block in use (stats poll: wait a little)."""
    deadline = time.monotonic() + 10
    while True:
        usage = _metrics(http, "carpool:replica_kv_cache_usage_perc")
        if usage and not any(usage.values()):
            return
        assert time.monotonic() < deadline, usage
        time.sleep(0.2)


@pytest.mark.parametrize("store", ["local", "shm"])  # the front's TCP or shared-memory store
def test_pd_serving_says_what_colocated_serving_says_and_streams_the_first_token_at_once(
        tiny_model_dir, store):
    with _serve(str(tiny_model_dir)) as colocated:
        expected = _answers(colocated, PROMPTS)
    with _serve(str(tiny_model_dir), "--prefill", "1", "--decode", "1", "--kv-store",
                store) as server, server.client() as http:
        assert len(server.engine_workers()) == 2
        assert _answers(server, PROMPTS) == expected
        pd = _pd(http)
        assert pd["handoffs"] == len(PROMPTS) and pd["colocated"] == 0
        assert {v["replica"] for v in pd["prefill"]["replicas"]} == {"p0"}
        assert {v["replica"] for v in pd["decode"]["replicas"]} == {"d0"}
        # The decode replica loaded the prompts' full blocks from the store.
        blocks = sum(len(p) // 16 for p in PROMPTS)
        _wait_for(http, "carpool:kv_store_blocks_loaded_total", blocks)
        # The prefill streamed them layer by layer (the tiny model has 2 layers).
        _wait_for(http, "carpool:kv_handoff_layer_parts_sent_total", 2 * blocks)
        exported = _metrics(http, "carpool:kv_handoff_export_seconds_total")
        hidden = _metrics(http, "carpool:kv_handoff_export_hidden_seconds_total")
        assert 0 <= sum(hidden.values()) <= sum(exported.values()) > 0
        # Streaming: the first token comes as its own event, the rest follow.
        body = {"prompt": PROMPTS[0][:40], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "stream": True, "logprobs": 1}
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
        assert len(tokens) == 8 and events[-1]["choices"][0]["finish_reason"] == "length"
        # A request of one token has nothing to hand over.
        one = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()
        assert one["usage"]["completion_tokens"] == 1
        assert _pd(http)["handoffs"] == len(PROMPTS) + 1
        _nothing_held(http)


def test_pd_serving_matches_colocated_greedy_on_the_default_model(real_model_path):
    prompts = ["The capital of France is", "Write a haiku about the sea.\n",
               "def fibonacci(n):\n    " * 6, "Explain KV caches. " * 20]
    with _serve(str(real_model_path)) as colocated:
        expected = _answers(colocated, prompts, max_tokens=24)
    with _serve(str(real_model_path), "--prefill", "1", "--decode", "1") as server, \
            server.client() as http:
        assert _answers(server, prompts, max_tokens=24) == expected
        _wait_for(http, "carpool:kv_store_blocks_loaded_total",
                  sum(len(server_tokens) // 16 for server_tokens in _tokenized(http, prompts)))
        _nothing_held(http)


def _nothing_routed(http) -> None:
    """The front's router counts nothing in flight on any replica."""
    deadline = time.monotonic() + 10
    while True:
        pd = _pd(http)
        counts = {v["replica"]: v["in_flight"] for pool in ("prefill", "decode")
                  for v in pd[pool]["replicas"]}
        if not any(counts.values()):
            return
        assert time.monotonic() < deadline, counts
        time.sleep(0.2)


def test_the_planner_places_each_request_and_leaves_nothing_counted(tiny_model_dir):
    """``always``: the planner's prefill and decode legs; an aborted stream
    and a stop in the first token release both. ``conditional`` with a link
    too slow to pay: every request stays on the decode pool, same answers."""
    with _serve(str(tiny_model_dir)) as colocated:
        expected = _answers(colocated, PROMPTS)
    with _serve(str(tiny_model_dir), "--prefill", "1", "--decode", "1") as server, \
            server.client() as http:
        assert _pd(http)["mode"] == "always" and _pd(http)["placed_by"] == "planner"
        body = {"prompt": PROMPTS[3], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            next(line for line in response.iter_lines() if line.startswith("data: {"))
        # Closed after the first event: aborted wherever it is.
        first = _answers(server, [PROMPTS[0]], max_tokens=1)[0]
        stopped = http.post("/v1/completions", json={
            "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stop": [first]}).json()
        assert stopped["choices"][0]["text"] == ""
        assert stopped["choices"][0]["finish_reason"] == "stop"
        _nothing_routed(http)
        _nothing_held(http)
        decisions = [d["replica"] for d in _pd(http)["decode"]["decisions"]]
        assert "p0" in decisions and "d0" in decisions
    with _serve(str(tiny_model_dir), "--prefill", "1", "--decode", "1", "--pd-mode",
                "conditional", "--pd-bandwidth", "0.000001") as server, \
            server.client() as http:
        assert _answers(server, PROMPTS) == expected
        pd = _pd(http)
        assert (pd["mode"], pd["handoffs"], pd["colocated"]) == ("conditional", 0, len(PROMPTS))
        assert pd["link"]["bandwidth_gbps"] == 0.000001
        assert all(d["cause"].startswith("colocated") for d in pd["decode"]["decisions"]
                   if d["replica"] == "d0")
        _nothing_routed(http)


def _pids(http) -> dict[str, int]:
    pd = _pd(http)
    return {v["replica"]: v["pid"] for pool in ("prefill", "decode")
            for v in pd[pool]["replicas"]}


def test_a_prefill_replica_dead_before_its_first_token_costs_the_client_nothing(
        tiny_model_dir):
    body = {"prompt": PROMPTS[3], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with _serve(str(tiny_model_dir), "--prefill", "1", "--decode", "1") as server, \
            server.client() as http:
        expected = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        prefill_pid = _pids(http)["p0"]
        os.kill(prefill_pid, signal.SIGSTOP)  # it takes the request and never answers
        threading.Timer(0.5, os.kill, [prefill_pid, signal.SIGKILL]).start()
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events) == expected
        assert _pd(http)["rescued"] == 1
        deadline = time.monotonic() + 60  # the prefill pool restarts its replica
        while _pids(http).get("p0") in (None, prefill_pid):
            assert time.monotonic() < deadline, "the prefill replica was not restarted"
            time.sleep(0.2)
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected
        _nothing_held(http)


def test_a_decode_replica_dead_mid_request_holds_it_for_its_restart(tiny_model_dir):
    """The only decode replica dies with a handed-off stream on it (no other
    is up): the stream waits for the worker restarting in its place and goes
    on there, whole, with the undisturbed text."""
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with _serve(str(tiny_model_dir), "--prefill", "1", "--decode", "1") as server, \
            server.client() as http:
        decode_pid = _pids(http)["d0"]
        os.kill(decode_pid, signal.SIGSTOP)  # the handoff reaches it and goes nowhere
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])
            assert first["choices"][0]["text"]  # the first token came from the prefill
            os.kill(decode_pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        events = [first] + [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert not [e for e in events if "error" in e] and rest[-1] == "data: [DONE]"
        assert _pids(http).get("d0") not in (None, decode_pid)  # restarted, and it went on there
        again = http.post("/v1/completions", json={**body, "stream": False}).json()
        assert "".join(e["choices"][0]["text"] for e in events) == again["choices"][0]["text"]
        assert again["usage"]["completion_tokens"] == 12
        assert http.get("/carpool/policy").json()["pd"]["decode"]["held_for_restart"] == 1
        _nothing_held(http)
