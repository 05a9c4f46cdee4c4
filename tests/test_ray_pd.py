"""P/D serving on the Ray Serve backend: a real local Ray (127.0.0.1, 2
CPUs), the tiny model in float32, one prefill and one decode replica (half
a CPU each), KV blocks moving through Ray's object store
(``RayObjectStore``).

Greedy completions over HTTP are those of an in-process colocated engine
(``carpool.LLM``); each went from the prefill to the decode replica, whose
store metrics show the prompts' blocks loaded; streaming sends the first
token (the prefill's) as its own event; no KV block stays held. A replica killed mid-request: a prefill one costs
the client nothing (Ray Serve retries it, or it runs on the decode
replica), a decode one ends the stream with an error event after the first
token (or, if its part had not started there, Ray Serve retries it on the
restarted replica); Ray Serve restarts both and no block stays held.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

import carpool
from carpool.sampling_params import SamplingParams
from tests.ray_helpers import serving

APP = "carpool-pd"
MAX_TOKENS = 16
# Distinct from their first token on: no prompt finds another's blocks cached.
PROMPTS = [[(i * m + m) % 380 + 5 for i in range(n)] for m, n in ((41, 70), (43, 64), (47, 9),
                                                                  (53, 150))]
STREAMED = [(i * 59 + 59) % 380 + 5 for i in range(40)]


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> list[str]:
    """Colocated greedy texts, in this process: every prompt, then STREAMED."""
    llm = carpool.LLM(str(tiny_model_dir), dtype="float32", attention_backend="torch",
                      adaptive=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    texts = [llm.generate(prompt, params)[0].text for prompt in [*PROMPTS, STREAMED]]
    del llm
    return texts


@pytest.fixture(scope="module")
def pd_app(tiny_model_dir, expected):
    with serving(APP, {
            "model": str(tiny_model_dir), "attention-backend": "torch", "adaptive": False,
            "dtype": "float32", "served-model-name": "m", "prefill": 1, "decode": 1,
            "replica_cpus": 0.5, "ingress_cpus": 0.25}) as url:
        yield url


def _metrics(http: httpx.Client, prefix: str) -> dict[str, float]:
    """Series starting with ``prefix``: {labels: value}."""
    return {line.split("{", 1)[1].split("}")[0]: float(line.split()[-1])
            for line in http.get("/metrics").text.splitlines() if line.startswith(prefix + "{")}


def _wait_for(http: httpx.Client, counter: str, value: float) -> None:
    """Until the total of ``counter`` is ``value`` (the replicas' stats are polled)."""
    deadline = time.monotonic() + 20
    while (total := sum(_metrics(http, counter).values())) != value:
        assert time.monotonic() < deadline and total < value, (counter, total, value)
        time.sleep(0.25)


def test_pd_on_ray_answers_as_colocated_loading_blocks_through_the_object_store(
        pd_app, expected):
    api = openai.OpenAI(base_url=pd_app + "/v1", api_key="none", max_retries=0, timeout=60)
    answers = [api.completions.create(model="m", prompt=p, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True}
                                      ).choices[0].text for p in PROMPTS]
    assert answers == expected[:len(PROMPTS)]
    with httpx.Client(base_url=pd_app, timeout=60) as http:
        pd = http.get("/carpool/policy").json()["pd"]
        assert pd["handoffs"] == len(PROMPTS) and pd["colocated"] == 0
        assert len(pd["prefill"]["replicas"]) == len(pd["decode"]["replicas"]) == 1
        # The decode replica loaded the prompts' full blocks from Ray's object
        # store, streamed there layer by layer (the tiny model has 2 layers).
        blocks = sum(len(p) // 16 for p in PROMPTS)
        _wait_for(http, "carpool:kv_store_blocks_loaded_total", blocks)
        _wait_for(http, "carpool:kv_handoff_layer_parts_sent_total", 2 * blocks)
        assert sum(_metrics(http, "carpool:kv_store_errors_total").values()) == 0
        # Streaming: the first token (the prefill's) comes as its own event.
        body = {"model": "m", "prompt": STREAMED, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "logprobs": 1}
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        assert len(events) >= 2
        assert "".join(e["choices"][0]["text"] for e in events) == expected[-1]
        tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
        assert len(tokens) == MAX_TOKENS
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        # A request of one token has nothing to hand over.
        one = http.post("/v1/completions", json={"model": "m", "prompt": "hi",
                                                 "max_tokens": 1}).json()
        assert one["usage"]["completion_tokens"] == 1
        assert http.get("/carpool/policy").json()["pd"]["handoffs"] == len(PROMPTS) + 1
        _usage_back_to_zero(http)  # no KV block stays held on either replica


def _usage_back_to_zero(http: httpx.Client) -> None:
    """Every serving replica's KV pool back to no block in use (the stats of
    replicas that died leave after STALE_S)."""
    deadline = time.monotonic() + 40
    while True:
        usage = _metrics(http, "carpool:replica_kv_cache_usage_perc")
        if len(usage) == 2 and not any(usage.values()):
            return
        assert time.monotonic() < deadline, usage
        time.sleep(0.25)


def _pids(http: httpx.Client, besides: tuple[int, ...] = ()) -> dict[str, int]:
    """Each pool's replica process (as the replicas' stats replies name it),
    none of ``besides`` (killed ones: wait for Ray Serve's restart)."""
    deadline = time.monotonic() + 90
    while True:
        pd = http.get("/carpool/policy").json()["pd"]
        pids = {pool: {v["pid"] for v in pd[pool]["replicas"]} - {None, *besides}
                for pool in ("prefill", "decode")}
        if all(len(found) == 1 for found in pids.values()):
            return {pool: found.pop() for pool, found in pids.items()}
        assert time.monotonic() < deadline, pd
        time.sleep(0.25)


def _stream(http: httpx.Client, prompt: list[int]):
    return http.stream("POST", "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "stream": True})


def test_pd_on_ray_survives_a_dead_prefill_or_decode_replica(pd_app, expected):
    with httpx.Client(base_url=pd_app, timeout=120) as http:
        pids = _pids(http)
        before = http.get("/carpool/policy").json()["pd"]
        os.kill(pids["prefill"], signal.SIGSTOP)  # it takes the request and never answers
        threading.Timer(0.5, os.kill, [pids["prefill"], signal.SIGKILL]).start()
        with _stream(http, PROMPTS[3]) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events) == expected[3]
        after = http.get("/carpool/policy").json()["pd"]
        # Run on the decode replica, or retried by Ray Serve on the restarted one.
        assert (after["rescued"] - before["rescued"]) + (after["handoffs"] -
                                                        before["handoffs"]) == 1
        pids = _pids(http, besides=(pids["prefill"],))
        os.kill(pids["decode"], signal.SIGSTOP)  # the handoff reaches it and goes nowhere
        with _stream(http, PROMPTS[0]) as response:
            lines = response.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])
            assert first["choices"][0]["text"]  # the first token came from the prefill
            os.kill(pids["decode"], signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in rest[:-1]]
        errors = [e for e in events if "error" in e]
        if errors:  # the decode part had started on the replica that died
            assert "engine" in errors[0]["error"]["message"]
        else:  # it had not: Ray Serve sent it to the restarted replica
            text = "".join(e["choices"][0]["text"] for e in [first, *events])
            assert text == expected[0]
        _pids(http, besides=(pids["decode"],))  # Ray Serve restarted it
        api = openai.OpenAI(base_url=pd_app + "/v1", api_key="none", max_retries=0, timeout=60)
        again = api.completions.create(model="m", prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                       temperature=0, extra_body={"ignore_eos": True})
        assert again.choices[0].text == expected[1]
        _usage_back_to_zero(http)
