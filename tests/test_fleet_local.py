"""``carpool serve --replicas 2``: one API process, two engine workers, carpool's router.

Real processes on the tiny model, driven by the official ``openai`` client:
streaming through the fleet, constrained (structured) outputs, session
affinity, cache-aware routing (the
replica holding a prefix gets its repeats: ``cached_tokens`` shows the
hit), and a worker SIGKILLed mid-stream (its stream goes on on the other
replica, the fleet says degraded, the worker is restarted, nothing is
lost).
"""
from __future__ import annotations

import json
import os
import signal
import time

import openai
from server_utils import ServerProcess


def _fleet(tiny_model_dir, routing: str) -> ServerProcess:
    return ServerProcess([str(tiny_model_dir), "--attention-backend", "torch", "--adaptive",
                          "false", "--replicas", "2", "--routing", routing,
                          "--served-model-name", "tiny"])


def _routing(client) -> dict:
    return client.get("/carpool/policy").json()["routing"]


def test_a_two_replica_fleet_streams_keeps_sessions_and_routes_by_cached_prefix(tiny_model_dir):
    with _fleet(tiny_model_dir, "cache-aware") as server, server.client() as http:
        assert len(server.engine_workers()) == 2
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        chunks = list(api.completions.create(model="tiny", prompt="hello", max_tokens=8,
                                             stream=True, temperature=0))
        assert chunks[-1].choices[0].finish_reason == "length"
        # Constrained requests route like any other; each replica compiles the grammar.
        for seed in range(4):
            reply = api.completions.create(model="tiny", prompt=f"pick {seed}", max_tokens=16,
                                           seed=seed, extra_body={"guided_choice": [
                                               "alpha beta", "gamma"]})
            assert reply.choices[0].text in ("alpha beta", "gamma")
        # A repeated long prefix goes where it is cached.
        prefix = list(range(5, 5 + 64))
        # The prefill's block events come in the same message as its output,
        # so the router knows the blocks before the first answer returns.
        first = http.post("/v1/completions", json={"prompt": prefix + [1], "max_tokens": 2})
        again = http.post("/v1/completions", json={"prompt": prefix + [2], "max_tokens": 2})
        assert first.status_code == again.status_code == 200
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
        # Every turn of a session lands on one replica.
        for turn in range(4):
            api.chat.completions.create(model="tiny", max_tokens=2, extra_headers={
                "x-session-id": "s-1"}, messages=[{"role": "user", "content": f"turn {turn}"}])
        routing = _routing(http)
        session = routing["decisions"][-4:]  # the four turns, sent one after another
        assert len({d["replica"] for d in session}) == 1, session
        assert {v["replica"] for v in routing["replicas"]} == {"r0", "r1"}
        assert sum(v["in_flight"] for v in routing["replicas"]) == 0
        # /metrics: fleet totals, and per-replica series with a replica label.
        metrics = http.get("/metrics").text
        steps = {line.split('replica="')[1][:2]: float(line.split()[-1])
                 for line in metrics.splitlines()
                 if line.startswith("carpool:replica_engine_steps_total{")}
        total = next(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("carpool:engine_steps_total{"))
        assert set(steps) == {"r0", "r1"} and sum(steps.values()) == total > 0
        # The shared step log tags each step with its replica (idle gaps per replica).
        logged = http.get("/carpool/steps").json()["steps"]
        tagged = {row["replica"] for row in logged}  # KeyError if a row is untagged
        assert {r for r, n in steps.items() if n > 0} <= tagged <= {"r0", "r1"}


def test_a_killed_replica_s_stream_goes_on_elsewhere_and_it_is_restarted(tiny_model_dir):
    with _fleet(tiny_model_dir, "round-robin") as server, server.client() as http:
        workers = server.engine_workers()
        body = {"prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as doomed:
            lines = doomed.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            victim = _routing(http)["decisions"][-1]["replica"]
            pids = {v["replica"]: v["pid"] for v in _routing(http)["replicas"]}
            assert sorted(pids.values()) == sorted(workers)
            deadline = time.monotonic() + 10  # its steps reported once at least
            while (victim_steps := _steps(http.get("/metrics").text)[1].get(victim, 0)) == 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            os.kill(pids[victim], signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        # Resumed on the other replica (tests/test_fleet_resume.py checks the text).
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert _routing(http)["resumed"] == 1
        health = http.get("/health")
        assert health.status_code == 200
        assert health.json()["status"] in ("degraded", "ok")
        # The other replica still serves meanwhile; then the fleet is whole again.
        for _ in range(3):
            answer = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert answer.status_code == 200, answer.text
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and http.get("/health").json()["status"] != "ok":
            time.sleep(0.5)
        assert http.get("/health").json() == {"status": "ok"}
        assert _routing(http)["restarts"] == 1 and len(server.engine_workers()) == 2
        answers = [http.post("/v1/completions", json={"prompt": "y", "max_tokens": 2})
                   for _ in range(4)]
        assert all(a.status_code == 200 for a in answers)
        # The fleet's totals keep the dead worker's counts (its replacement
        # began from zero): they never go backwards, so rates stay positive.
        fleet, replicas = _steps(http.get("/metrics").text)
        assert set(replicas) == {"r0", "r1"}
        assert fleet >= sum(replicas.values()) + victim_steps
        server.signal(signal.SIGTERM)
        assert server.wait(60) == 0


def _steps(metrics: str) -> tuple[float, dict[str, float]]:
    """The fleet's engine_steps_total, and each live replica's."""
    lines = metrics.splitlines()
    replicas = {line.split('replica="')[1].split('"')[0]: float(line.split()[-1])
                for line in lines if line.startswith("carpool:replica_engine_steps_total{")}
    fleet = next(float(line.split()[-1]) for line in lines
                 if line.startswith("carpool:engine_steps_total{"))
    return fleet, replicas


def test_fleet_stats_sum_the_replicas_counts_and_keep_one_configuration():
    from carpool.engine.stats import EngineCounters, EngineStats, merge_stats, retired_stats

    def snapshot(running: int, steps: int, stop: int, time_: float) -> EngineStats:
        return EngineStats(time=time_, num_running=running, num_waiting=1, waiting_tokens=10,
                           kv_num_blocks=100, kv_used_blocks=running, prefix_queries=4,
                           prefix_hits=2, num_preemptions=0,
                           counters=EngineCounters(steps=steps, finished={"stop": stop}),
                           rejections={"queue_full": 1}, sessions={"session_requests": 2},
                           knobs={"max_num_seqs": 64.0}, decision_counts={("a", "b"): 1})

    merged = merge_stats([snapshot(3, 10, 1, 5.0), snapshot(4, 7, 2, 6.0)])
    assert (merged.num_running, merged.num_waiting, merged.kv_num_blocks) == (7, 2, 200)
    assert merged.counters.steps == 17 and merged.counters.finished == {"stop": 3}
    assert merged.rejections == {"queue_full": 2} and merged.sessions == {"session_requests": 4}
    assert merged.decision_counts == {("a", "b"): 2} and merged.time == 6.0
    assert merged.knobs == {"max_num_seqs": 64.0} and merged.prefix_hit_rate == 0.5
    # A replica that left adds its counters, not its queues or blocks.
    left = retired_stats(snapshot(5, 30, 4, 7.0))
    fleet = merge_stats([snapshot(0, 1, 0, 8.0), left])
    assert (fleet.num_running, fleet.num_waiting, fleet.kv_num_blocks) == (0, 1, 100)
    assert fleet.counters.steps == 31 and fleet.counters.finished == {"stop": 4}
    assert fleet.prefix_queries == 8 and fleet.rejections == {"queue_full": 2}


def test_requests_a_killed_replica_had_not_started_go_to_another(tiny_model_dir):
    """One sequence per replica: A runs on r0, C waits behind it there. r0
    is SIGKILLed: A (started) is resumed on r1 and C (not started) is
    re-routed there; both are answered as if nothing happened."""
    import threading

    import httpx

    flags = [str(tiny_model_dir), "--attention-backend", "torch", "--adaptive", "false",
             "--replicas", "2", "--routing", "round-robin", "--max-num-seqs", "1"]
    with ServerProcess(flags) as server, server.client() as http:
        workers = server.engine_workers()
        body = {"prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            assert http.post("/v1/completions", json={"prompt": "b", "max_tokens": 2}
                             ).status_code == 200  # r1: round robin's next turn
            answer: list[httpx.Response] = []
            queued = threading.Thread(target=lambda: answer.append(httpx.post(
                server.url + "/v1/completions", json={"prompt": "c", "max_tokens": 3},
                timeout=120)))
            queued.start()
            deadline = time.monotonic() + 10
            while len(_routing(http)["decisions"]) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)  # C reaches r0's worker (re-routing also covers it in flight)
            decisions = _routing(http)["decisions"]
            assert [d["replica"] for d in decisions[-3:]] == ["r0", "r1", "r0"], decisions
            pids = {v["replica"]: v["pid"] for v in _routing(http)["replicas"]}
            assert sorted(pids.values()) == sorted(workers)
            os.kill(pids["r0"], signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        queued.join(120)
        assert answer and answer[0].status_code == 200, answer and answer[0].text
        assert answer[0].json()["choices"][0]["finish_reason"] == "length"
        assert (_routing(http)["rerouted"], _routing(http)["resumed"]) == (1, 1)


def test_the_autoscaler_adds_a_replica_under_backlog_and_drains_it_when_idle(tiny_model_dir):
    """One slot per replica and six long requests at once: a backlog the
    reactive rule answers with a second replica (bounded by --max-replicas);
    idle again, the fleet drains back to --min-replicas. Every request
    completes, exactly once."""
    import threading

    import httpx

    flags = [str(tiny_model_dir), "--attention-backend", "torch", "--adaptive", "false",
             "--max-num-seqs", "1", "--routing", "least-outstanding", "--autoscale", "reactive",
             "--min-replicas", "1", "--max-replicas", "2", "--scale-tick", "0.3",
             "--scale-out-backlog", "1", "--scale-out-wait", "0", "--scale-out-cooldown", "0",
             "--scale-in-utilization", "0.5", "--scale-in-after", "1", "--scale-in-window", "1"]
    with ServerProcess(flags) as server, server.client() as http:
        assert len(server.engine_workers()) == 1
        answers: list[httpx.Response] = []

        def ask(index: int) -> None:
            answers.append(httpx.post(server.url + "/v1/completions", timeout=300, json={
                "prompt": [index + 1] * 8, "max_tokens": 400, "ignore_eos": True}))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        most = 1
        deadline = time.monotonic() + 120
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            most = max(most, len(server.engine_workers()))
            time.sleep(0.1)
        for thread in threads:
            thread.join(60)
        assert len(answers) == 6 and all(a.status_code == 200 for a in answers)
        assert all(a.json()["usage"]["completion_tokens"] == 400 for a in answers)
        assert most == 2
        deadline = time.monotonic() + 60
        while len(server.engine_workers()) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(server.engine_workers()) == 1
        events = http.get("/carpool/policy").json()["scaling"]["events"]
        assert [(e["from"], e["to"]) for e in events][:2] == [(1, 2), (2, 1)], events
        # Sized by the replicas' own slots (--max-num-seqs 1): six at once is a
        # panic, or a backlog; idle again, utilisation brings it back.
        assert ("backlog" in events[0]["cause"] or "panic" in events[0]["cause"]) \
            and "utilization" in events[1]["cause"]


def test_an_idle_fleet_scales_to_zero_and_the_next_request_waits_for_a_replica(tiny_model_dir):
    """--min-replicas 0: once no request came for a whole scale-in window
    the last replica drains and the server stays healthy with no worker; the
    next request starts one and is answered, not refused, once the replica
    has also waited out --replica-start-delay (a GPU's cold model load)."""
    flags = [str(tiny_model_dir), "--attention-backend", "torch", "--adaptive", "false",
             "--autoscale", "reactive", "--min-replicas", "0", "--max-replicas", "1",
             "--scale-tick", "0.3", "--scale-in-utilization", "0.5", "--scale-in-after", "1",
             "--scale-in-window", "2", "--replica-start-delay", "3"]
    with ServerProcess(flags) as server, server.client() as http:
        assert len(server.engine_workers()) == 1
        first = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 4})
        assert first.status_code == 200, first.text
        deadline = time.monotonic() + 60
        while server.engine_workers() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.engine_workers() == []
        assert http.get("/health").json() == {"status": "ok"}  # idle by design
        assert "carpool:engine_steps_total" in http.get("/metrics").text
        began = time.monotonic()
        woken = http.post("/v1/completions", json={"prompt": "b", "max_tokens": 4}, timeout=120)
        assert woken.status_code == 200, woken.text
        assert woken.json()["usage"]["completion_tokens"] == 4
        waited = time.monotonic() - began
        assert len(server.engine_workers()) == 1 and 3.0 <= waited < 60, waited
        events = http.get("/carpool/policy").json()["scaling"]["events"]
        # Down to zero, then woken (idle again, it may go down once more
        # before this reads the log): by the request, or by the tick that
        # counted its arrival.
        moves = [(e["from"], e["to"]) for e in events]
        woke = moves.index((0, 1))
        assert moves[woke - 1] == (1, 0), events
        assert events[woke]["cause"] in ("a request at zero replicas",
                                         "requests at zero replicas"), events
        server.signal(signal.SIGTERM)
        assert server.wait(60) == 0


def test_a_client_that_leaves_frees_its_replicas_kv(tiny_model_dir):
    """Disconnects reach the worker holding the request (the fleet owns the
    streams): its KV is freed and the router's counts return to zero."""
    with _fleet(tiny_model_dir, "round-robin") as server, server.client() as http:
        for _ in range(2):  # one on each replica
            body = {"prompt": [3] * 40, "max_tokens": 400, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))
            # leaving the block closes the connection mid-stream
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            routing = _routing(http)
            metrics = http.get("/metrics").text
            used = [float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("carpool:replica_kv_cache_usage_perc{")]
            if sum(v["in_flight"] for v in routing["replicas"]) == 0 and used and not any(used):
                break
            time.sleep(0.2)
        assert sum(v["in_flight"] for v in routing["replicas"]) == 0, routing["replicas"]
        assert len(used) == 2 and not any(used), used
        aborted = [line for line in metrics.splitlines()
                   if line.startswith('carpool:request_success_total{') and "abort" in line]
        assert aborted and float(aborted[0].split()[-1]) == 2


def test_a_fleet_with_a_local_kv_store_serves_a_prefix_computed_on_the_other_replica(
        tiny_model_dir):
    """``--kv-store local``: the front serves a shared store; round-robin sends
    a repeated long prompt to the other replica, which loads its blocks."""
    with ServerProcess([str(tiny_model_dir), "--attention-backend", "torch", "--adaptive",
                        "false", "--replicas", "2", "--routing", "round-robin",
                        "--kv-store", "local", "--served-model-name", "tiny"]) as server, \
            server.client() as http:
        prompt = list(range(7, 7 + 64)) + [1]
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        first = http.post("/v1/completions", json=body).json()
        # The write-through runs off the step: wait until the store has the
        # prompt's four blocks (polled stats reach the front every 0.25 s).
        deadline = time.monotonic() + 30
        while _metric(http, "carpool:kv_store_blocks_saved_total{") < 4:
            assert time.monotonic() < deadline, "the prompt's blocks never reached the store"
            time.sleep(0.1)
        again = http.post("/v1/completions", json=body).json()
        replicas = [d["replica"] for d in _routing(http)["decisions"][-2:]]
        assert replicas[0] != replicas[1]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        deadline = time.monotonic() + 30
        while _metric(http, "carpool:kv_store_blocks_loaded_total{") < 4:
            assert time.monotonic() < deadline, "the load never showed in /metrics"
            time.sleep(0.1)
        assert _metric(http, "carpool:kv_store_blocks_loaded_total{") == 4


def _metric(http, prefix: str) -> float:
    """The fleet total of a counter on /metrics (0 before it exists)."""
    return next((float(line.split()[-1]) for line in http.get("/metrics").text.splitlines()
                 if line.startswith(prefix)), 0.0)
