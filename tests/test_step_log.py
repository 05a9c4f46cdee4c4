"""The live engine's step log: the ring, what the engine logs, the
operator-only ``GET /carpool/steps`` and ``carpool measure --from URL``."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from carpool.engine.step_log import StepLog
from carpool.executor.shapes import StepShape
from carpool.measure.live import MIN_LIVE_STEPS, fit_live, server_root
from carpool.measure.steps import load_steps
from tests.server_utils import ServerProcess, in_process_app

DATA = Path(__file__).parent / "data" / "real-steps-azure-conv-avx512.jsonl.gz"
LOCAL = "http://127.0.0.1"


def test_the_ring_keeps_the_last_steps_and_counts_all() -> None:
    log = StepLog(capacity=4)
    for i in range(10):
        log.record(StepShape(i, 1, i + 1, 2), 0.01 * (i + 1), float(i))
    steps, total = log.snapshot()
    assert total == 10 and [s.started for s in steps] == [6.0, 7.0, 8.0, 9.0]
    assert [s.started for s in log.snapshot(2)[0]] == [8.0, 9.0]
    assert log.snapshot(0)[0] == []
    row = steps[-1].as_dict()
    assert row["prefill_tokens"] == 9 and row["seconds"] == pytest.approx(0.1)
    with pytest.raises(ValueError):
        StepLog(capacity=0)


def test_reads_while_the_engine_thread_appends_never_fail() -> None:
    """Iterating a deque another thread appends to raises RuntimeError; the
    HTTP thread reads the log while the engine thread writes it."""
    log = StepLog(capacity=64)
    stop = threading.Event()

    def write() -> None:
        while not stop.is_set():
            log.record(StepShape(1, 1, 2, 2), 0.001, 0.0)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(2000):
            steps, total = log.snapshot()
            assert len(steps) <= 64 and total >= len(steps)
    finally:
        stop.set()
        writer.join()


def _tiny_engine(tiny_model_dir):
    from carpool.config import EngineConfig
    from carpool.engine.llm_engine import LLMEngine

    return LLMEngine.from_config(EngineConfig.from_dict({
        "model": str(tiny_model_dir), "attention_backend": "torch", "kv_cache_memory": "16MiB"}))


def test_the_engine_logs_every_step_it_runs(tiny_model_dir) -> None:
    from carpool.sampling_params import SamplingParams

    engine = _tiny_engine(tiny_model_dir)
    engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request(list(range(30, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    steps, total = engine.step_log.snapshot()
    assert total == len(steps) == engine.counters.steps
    first = steps[0].shape  # both prompts in one step, nothing decoding yet
    assert (first.prefill_tokens, first.decode_seqs, first.seqs) == (30, 0, 2)
    assert first.context_tokens == 30 and first.attention_pairs == 20 * 20 + 10 * 10
    last = steps[-1].shape  # the fourth token of each: two decodes
    assert (last.prefill_tokens, last.decode_seqs) == (0, 2)
    assert last.context_tokens == (20 + 3) + (10 + 3)
    assert all(s.seconds > 0 for s in steps)
    assert [s.started for s in steps] == sorted(s.started for s in steps)


def test_the_step_log_is_served_to_operators_only(tiny_async_engine, tmp_path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n"
                    "  - {key: sk-tenant-a-0001, tenant: a}\n"
                    "  - {key: sk-operator-0001, tenant: ops, operator: true}\n")
    app = in_process_app(tiny_async_engine, api_keys=str(keys))
    with TestClient(app, base_url=LOCAL) as client:
        reply = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3},
                            headers={"Authorization": "Bearer sk-tenant-a-0001"})
        assert reply.status_code == 200
        tenant = client.get("/carpool/steps",
                            headers={"Authorization": "Bearer sk-tenant-a-0001"})
        assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "forbidden"
        assert client.get("/carpool/steps").status_code == 401
        ops = {"Authorization": "Bearer sk-operator-0001"}
        document = client.get("/carpool/steps", headers=ops).json()
        assert document["total_steps"] >= 3 and len(document["steps"]) >= 3
        assert document["machine"]["cpus"] >= 1 and document["kv_bytes_per_token"] > 0
        assert {"prefill_tokens", "decode_seqs", "context_tokens", "seqs", "attention_pairs",
                "seconds", "started", "new_shape"} <= set(document["steps"][-1])
        # one request: a prompt, then decodes of one token each; a token count
        # is new the first time the process runs it, never again
        decodes = [step for step in document["steps"] if step["prefill_tokens"] == 0]
        assert len(decodes) >= 2 and not any(step["new_shape"] for step in decodes[1:])
        assert len(client.get("/carpool/steps?limit=2", headers=ops).json()["steps"]) == 2
        for bad in ("0", "-1", "x", "100000", "9" * 5000):  # 5000 digits: a 500 before
            wrong = client.get(f"/carpool/steps?limit={bad}", headers=ops)
            assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "limit"
        spec = client.get("/openapi.json", headers=ops).json()
        assert "403" in spec["paths"]["/carpool/steps"]["get"]["responses"]


def test_keys_file_operator_must_be_a_bool(tmp_path) -> None:
    from carpool.server.auth import read_keys_file

    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {key: sk-operator-0001, tenant: ops, operator: 'yes'}\n")
    with pytest.raises(ValueError, match="operator must be true or false"):
        read_keys_file(keys)


def _document(samples) -> dict:
    """A step log of ``samples``, each started after the one before ended
    and its idle gap."""
    steps, clock = [], 1000.0
    for s, t, idle, new in samples:
        clock += idle
        steps.append({"prefill_tokens": s.prefill_tokens, "decode_seqs": s.decode_seqs,
                      "context_tokens": s.context_tokens, "seqs": s.seqs,
                      "attention_pairs": s.attention_pairs, "seconds": t, "started": clock,
                      "new_shape": new})
        clock += t
    return {"machine": {"cpu_model": "test cpu", "cpus": 2, "isa": [], "arch": "x86_64",
                        "torch": "2.13.0", "device": "cpu"},
            "model": "m", "dtype": "bfloat16", "kv_bytes_per_token": 1024,
            "max_model_len": 2048, "max_num_batched_tokens": 512, "max_num_seqs": 64,
            "total_steps": len(steps), "steps": steps}


def test_a_fit_on_recorded_real_steps_prices_them_by_kind() -> None:
    """The live fit on 6,936 real steps of a replay (recorded data, no
    timing here): every region of 100 steps or more within its kind's bound
    at the median (those of tests/test_measure_steps.py)."""
    samples = load_steps(DATA)
    model, notes = fit_live(_document(samples), "http://127.0.0.1:8000/v1")
    assert notes == []
    source = model.meta["source"]
    assert source["server"] == "http://127.0.0.1:8000" and source["steps"] == len(samples)
    assert model.meta["machine"]["cpu_model"] == "test cpu"
    for key, row in model.meta["errors_by_region"].items():
        if row["steps"] >= 100:
            bound = {"decode": 0.05, "mixed": 0.10, "prefill": 0.15}[key.split(",")[0]]
            assert abs(row["median"]) < bound, (key, row)


def test_a_log_without_a_kind_says_so_and_a_short_log_is_refused() -> None:
    samples = [sample for sample in load_steps(DATA) if not sample.shape.prefill_tokens]
    _, notes = fit_live(_document(samples[:500]), "http://127.0.0.1:1")
    assert notes == [f"the log holds no {kind} steps: the fit extrapolates to them"
                     for kind in ("mixed", "prefill")]
    with pytest.raises(ValueError, match="send it some traffic first"):
        fit_live(_document(samples[:MIN_LIVE_STEPS - 1]), "http://127.0.0.1:1")
    assert server_root("http://h:1/v1/") == "http://h:1"


def test_measure_from_a_live_server(tiny_model_dir, tmp_path, capsys) -> None:
    """`carpool measure --from URL` against a real `carpool serve`: refused
    before traffic (too few steps: a calibration run logs a few), fitted after."""
    from carpool.cli import main

    out = tmp_path / "live.json"
    with ServerProcess([str(tiny_model_dir), "--attention-backend", "torch",
                        "--kv-cache-memory", "16MiB", "--adaptive", "false"]) as server:
        assert main(["measure", "--from", server.url, "--out", str(out)]) != 0
        assert "send it some traffic first" in capsys.readouterr().err
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for i in range(12):
                reply = client.post("/v1/completions", json={
                    "prompt": "hello " * (1 + 7 * i), "max_tokens": 12, "ignore_eos": True})
                assert reply.status_code == 200
        assert main(["measure", "--from", server.url + "/v1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fitted on" in printed and "step kind, batch" in printed
    saved = json.loads(out.read_text())
    assert saved["source"]["steps"] >= MIN_LIVE_STEPS and saved["grid"] == "live server"
    assert saved["machine"]["cpus"] >= 1
    from carpool.sim.costs import load_cost_model, machine_warning

    assert machine_warning(load_cost_model(out)) is None  # measured here, so no warning


def test_a_request_is_stamped_when_it_arrives_not_when_the_step_in_flight_ends(
        tiny_model_dir) -> None:
    """The wait for the step in flight is part of a request's TTFT: the
    engine once stamped requests when it took them between two steps, so
    neither admission's prediction nor its learned margin saw that wait, and
    admission added a whole mean step for it (half a step too much on
    average: it shed 8-11% of calm phases the plain server kept in its SLO).
    A step is held in flight until the second request was handed over."""
    import asyncio

    from carpool.engine.async_engine import AsyncEngine
    from carpool.sampling_params import SamplingParams

    engine = _tiny_engine(tiny_model_dir)
    inner, in_step, release = engine.executor.execute, threading.Event(), threading.Event()

    def held_execute(items, padding=None):
        in_step.set()
        release.wait(30)  # the step in flight lasts until the test lets it end
        return inner(items, padding)

    engine.executor.execute = held_execute
    streamer = AsyncEngine(engine)

    async def run() -> tuple[float, float, float]:
        first = await streamer.add_request("hello", SamplingParams(max_tokens=3))
        await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 30)
        sent = engine.clock()
        adding = asyncio.ensure_future(streamer.add_request("world", SamplingParams(max_tokens=1)))
        await asyncio.sleep(0)  # it runs up to its wait for the engine to accept it
        released = engine.clock()
        release.set()
        outputs = [out async for out in await adding]
        async for _ in first:
            pass
        return sent, released, outputs[-1].arrival_time

    try:
        sent, released, arrival = asyncio.run(run())
    finally:
        release.set()
        streamer.shutdown()
    assert sent <= arrival < released, (sent, released, arrival)


def test_delivery_lag_is_the_90th_percentile_of_recent_first_tokens() -> None:
    from carpool.engine.async_engine import DeliveryLag

    lag = DeliveryLag(window=10)
    assert lag.seconds == 0.0
    for value in [0.01] * 8 + [0.5, -1.0]:  # a negative (clock noise) counts as 0
        lag.observe(value)
    assert lag.seconds == pytest.approx(0.01)
    for value in [0.2] * 10:
        lag.observe(value)
    assert lag.seconds == pytest.approx(0.2)  # only the last ten count


def test_a_server_stamps_a_request_when_it_received_it(tiny_async_engine) -> None:
    """``received_at`` (before the HTTP server parsed and tokenized it)
    moves the arrival back: that time is in the client's TTFT too."""
    import asyncio
    import time

    from carpool.sampling_params import SamplingParams

    async def run() -> tuple[float, float]:
        received = time.monotonic() - 0.5
        stream = await tiny_async_engine.add_request("hi", SamplingParams(max_tokens=1),
                                                     received_at=received)
        outputs = [out async for out in stream]
        return tiny_async_engine.engine.clock() - 0.5, outputs[-1].arrival_time

    expected, arrival = asyncio.run(run())
    assert arrival == pytest.approx(expected, abs=0.1)


def test_a_fleet_log_measures_idle_per_replica() -> None:
    """A fleet's log interleaves its replicas' steps (rows tagged
    ``replica``): a step's idle gap runs from the end of its own replica's
    last step, not from whichever replica logged the row before it."""
    from carpool.measure.live import samples_of

    def row(replica: str, started: float, seconds: float) -> dict:
        return {"prefill_tokens": 0, "decode_seqs": 1, "context_tokens": 10, "seqs": 1,
                "attention_pairs": 10, "seconds": seconds, "started": started,
                "replica": replica}

    # r0 runs 0-1 and 5-6 (idle 4 s between); r1 runs 1.5-2.5 and 2.5-3.5.
    document = {"steps": [row("r0", 0.0, 1.0), row("r1", 1.5, 1.0), row("r1", 2.5, 1.0),
                          row("r0", 5.0, 1.0)]}
    assert [s.idle_s for s in samples_of(document)] == [0.0, 0.0, 0.0, 4.0]
    # Untagged (one engine): each gap is from the row before.
    for step in document["steps"]:
        del step["replica"]
    assert [s.idle_s for s in samples_of(document)] == [0.0, 0.5, 0.0, 1.5]
