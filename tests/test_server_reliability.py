"""The server under abuse: auth, limits, malformed input, overload,
disconnects, SIGTERM drain and an engine fault. Tiny random-weight model."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess

KEY = "sk-test-key"
# Plain batching: the queue bound, not the SLO's predicted misses, turns the
# overload away here (tests/test_server_slo.py covers the default server).
TINY_FLAGS = ["--attention-backend", "torch", "--max-num-seqs", "2", "--max-queue-requests", "4",
              "--max-body-bytes", "65536", "--api-key", KEY, "--status-interval", "0.5",
              "--adaptive", "false"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess([str(tiny_model_dir), *TINY_FLAGS]) as proc:
        yield proc


@pytest.fixture
def client(server):
    with server.client(KEY) as c:
        yield c


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


def _wait_idle(client: httpx.Client, timeout: float = 20.0) -> dict:
    """Poll until nothing runs or waits; return the policy snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        state = client.get("/carpool/policy").json()
        if state["running"] == 0 and state["waiting"] == 0 or time.monotonic() > deadline:
            return state


ROUTES = [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/version"),
          ("GET", "/carpool/policy"), ("GET", "/openapi.json"), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
          ("GET", "/no/such/route"), ("GET", "/health/"), ("GET", "/health/../v1/models"),
          ("GET", "/%68ealth")]


def test_api_key_guards_every_route_but_health(server):
    with server.client() as anonymous, server.client("wrong-key") as wrong:
        assert anonymous.get("/health").status_code == 200
        for method, path in ROUTES:
            for c in (anonymous, wrong):
                body = _error(c.request(method, path, json={}), 401)
                assert body["code"] == "invalid_api_key", (method, path)
    with server.client(KEY) as ok:
        assert ok.get("/v1/models").status_code == 200
        assert ok.get("/no/such/route").status_code == 404


def test_oversized_and_malformed_bodies(client):
    _error(client.post("/v1/completions", content=b"{" + b" " * 70000 + b"}",
                       headers={"content-type": "application/json"}), 413)
    for raw in (b"{not json", b"\xff\xfe{}", b"[1, 2]", b'"text"', b""):
        _error(client.post("/v1/completions", content=raw,
                           headers={"content-type": "application/json"}), 400)
    assert _error(client.post("/v1/completions", json={"prompt": "hi", "temperature": "hot"}),
                  400)["param"] == "temperature"
    _error(client.post("/v1/completions", json={"prompt": "hi", "n": 0}), 400)
    _error(client.post("/v1/completions", json={"prompt": "hi", "n": 100}), 400)
    _error(client.post("/v1/completions", json={"prompt": "hi", "logprobs": 50}), 400)
    _error(client.post("/v1/completions", json={"prompt": "hi", "stop": ["x"] * 40}), 400)
    _error(client.post("/v1/completions", json={"prompt": "hi", "priority": "urgent"}), 400)
    _error(client.post("/v1/completions", json={"prompt": [10**9]}), 400)
    _error(client.post("/v1/chat/completions", json={"messages": []}), 400)
    _error(client.post("/v1/chat/completions",
                       json={"messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert _error(client.post("/v1/completions", json={"prompt": "hi", "model": "gpt-9"}),
                  404)["code"] == "model_not_found"
    long_prompt = "hello " * 1000  # over the 512-token context, under the character cap
    assert _error(client.post("/v1/completions", json={"prompt": long_prompt}),
                  400)["code"] == "context_length_exceeded"
    # The default character cap: 16 per token of context (8192 here), before tokenizing.
    assert _error(client.post("/v1/completions", json={"prompt": "hello " * 2000}),
                  400)["code"] == "prompt_too_long"
    assert _error(client.post("/v1/completions", json={"prompt": [[5] * 600]}),
                  400)["code"] == "context_length_exceeded"
    _error(client.get("/health", headers={"x-big": "a" * 20000}), 431)


async def _fire(url: str, count: int) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "load", "max_tokens": 64, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:
        return await asyncio.gather(*(c.post("/v1/completions", json=body)
                                      for _ in range(count)))


def test_overload_gives_429_with_retry_after_never_500(server, client):
    responses = asyncio.run(_fire(server.url, 24))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) > 0 and statuses.count(200) >= 4
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert _error(r, 429)["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == 64
    _wait_idle(client)
    metrics = client.get("/metrics").text
    assert 'carpool:request_outcomes_total{model_name="' in metrics
    assert 'outcome="rejected:queue_full"' in metrics
    assert server.wait_for_output("tok/s | busy"), server.text()  # the status line while busy


async def _deadline_while_busy(url: str) -> tuple[httpx.Response, list[httpx.Response]]:
    headers = {"Authorization": f"Bearer {KEY}"}
    long_body = {"prompt": "busy", "max_tokens": 300, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:
        busy = [asyncio.ensure_future(c.post("/v1/completions", json=long_body))
                for _ in range(2)]  # both of the server's sequence slots
        while (await c.get("/carpool/policy")).json()["running"] < 2:
            pass
        late = await c.post("/v1/completions", json={"prompt": "hurry", "max_tokens": 4},
                            headers={"x-deadline-ms": "1"})
        return late, await asyncio.gather(*busy)


def test_deadline_passed_in_the_queue_gives_429(server, client):
    late, busy = asyncio.run(_deadline_while_busy(server.url))
    # Expired in the queue, or turned away at arrival once the online cost
    # model has seen enough steps to predict the miss: which one depends on
    # how many steps ran before the late request came (timing).
    code = _error(late, 429)["code"]
    assert code in ("deadline", "predicted_deadline_miss")
    assert int(late.headers["retry-after"]) >= 1
    assert [r.status_code for r in busy] == [200, 200]
    assert f'outcome="rejected:{code}"' in client.get("/metrics").text


def _stream_then_leave(url: str, chunks: int) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "a long story", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            seen = 0
            while seen < chunks:
                seen += next(lines).startswith("data: ")
        # leaving the block closes the connection mid-stream


def test_disconnect_mid_stream_frees_every_block(server, client):
    idle = _wait_idle(client)
    assert idle["kv_usage"] == 0.0
    _stream_then_leave(server.url, chunks=3)
    state = _wait_idle(client)
    assert state["running"] == 0 and state["kv_usage"] == 0.0, state
    assert 'outcome="abort"' in client.get("/metrics").text


def test_sigterm_drains_in_flight_streams_then_exits_zero(tiny_model_dir):
    flags = [str(tiny_model_dir), "--attention-backend", "torch", "--shutdown-timeout", "60"]
    with ServerProcess(flags) as server, server.client() as c:
        body = {"prompt": "drain", "max_tokens": 400, "ignore_eos": True, "stream": True, "n": 4}
        with c.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.signal(signal.SIGTERM)
            health = c.get("/health")
            refused = c.post("/v1/completions", json={"prompt": "late"})
            rest = list(lines)
        assert health.status_code == 503
        assert _error(refused, 503)["code"] == "draining"
        events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        finished = [ch for e in events for ch in e["choices"] if ch["finish_reason"]]
        assert sorted(ch["finish_reason"] for ch in finished) == ["length"] * 4
        assert rest[-1] == "data: [DONE]" or rest[-2] == "data: [DONE]"
        assert server.wait(60) == 0, server.text()


def test_engine_fault_error_event_health_503_exit_nonzero(tiny_model_dir):
    flags = [str(tiny_model_dir), "--attention-backend", "torch"]
    with ServerProcess(flags, env={"CARPOOL_FAULT_AT_STEP": "20"}) as server, \
            server.client() as c:
        body = {"prompt": "boom", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        error = json.loads(lines[-2][6:])["error"]
        assert error["code"] == "engine_unavailable" and lines[-1] == "data: [DONE]"
        assert c.get("/health").status_code == 503
        assert server.wait(60) != 0
    assert "injected fault" in server.text()


def test_port_in_use_is_a_clear_error(tiny_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        import subprocess
        import sys

        result = subprocess.run(
            [sys.executable, "-m", "carpool.cli", "serve", str(tiny_model_dir),
             "--attention-backend", "torch", "--port", str(port)],
            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "address already in use" in (result.stdout + result.stderr).lower()


def _worker_of(server: ServerProcess) -> int:
    workers = server.engine_workers()
    assert len(workers) == 1, workers
    return workers[0]


def test_a_killed_engine_worker_is_an_error_event_health_503_and_exit_1(tiny_model_dir):
    """SIGKILL the worker mid-stream: the stream ends with an error event
    (never a hang), /health turns 503 and the server exits 1 (a supervisor
    restarts it); SIGTERM on a healthy server stops its worker too."""
    flags = [str(tiny_model_dir), "--attention-backend", "torch", "--adaptive", "false"]
    with ServerProcess(flags) as server, server.client() as c:
        worker = _worker_of(server)
        body = {"prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            os.kill(worker, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == "engine_unavailable" and rest[-1] == "data: [DONE]"
        assert "exited unexpectedly" in error["message"]
        assert c.get("/health").status_code == 503
        assert server.wait(60) == 1
    with ServerProcess(flags) as server:
        worker = _worker_of(server)
        server.signal(signal.SIGTERM)
        assert server.wait(60) == 0
        assert not Path(f"/proc/{worker}").exists() or \
            Path(f"/proc/{worker}/stat").read_text().split(")")[-1].split()[0] == "Z"


def test_one_process_mode_serves_the_same_answers(tiny_model_dir):
    flags = [str(tiny_model_dir), "--attention-backend", "torch", "--adaptive", "false"]
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 12, "temperature": 0, "logprobs": 2}
    answers = []
    for one_process in (False, True):
        with ServerProcess(flags + ["--no-engine-process"] * one_process) as server, \
                server.client() as c:
            assert len(server.engine_workers()) == (0 if one_process else 1)
            choice = c.post("/v1/completions", json=body).json()["choices"][0]
            answers.append((choice["text"], choice["logprobs"]))
    assert answers[0] == answers[1]
