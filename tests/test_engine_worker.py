"""The engine in a worker process (``EngineClient`` <-> ``carpool.engine.worker``).

Real worker processes on the tiny model: the same outputs as the engine on
a thread, refusals and aborts across the wire, and every way a worker or
its front can die ending in a clear error or a clean exit, never a hang or
an orphan.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest

from carpool.config import EngineConfig
from carpool.engine.async_engine import AsyncEngine
from carpool.engine.client import EngineClient, EngineLaunchError
from carpool.engine.front import ContextLengthError
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.streams import EngineDeadError
from carpool.engine.wire import Add, Progress, to_front_decoder, to_worker_decoder
from carpool.sampling_params import SamplingParams
from carpool.scheduler import RejectedError

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], list(range(10, 40)), [5, 4, 3, 2, 1, 9, 9]]


def tiny_config(tiny_model_dir, **scheduler) -> EngineConfig:
    return EngineConfig.from_dict({"model": str(tiny_model_dir), "attention_backend": "torch",
                                   "kv_cache_memory": "16MiB", "adaptive": False, **scheduler})


async def _collect(engine, prompt, params, request_id=None):
    outputs = [out async for out in await engine.add_request(prompt, params,
                                                             request_id=request_id)]
    return outputs


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_worker_gives_the_outputs_of_the_engine_on_a_thread(tiny_model_dir) -> None:
    config = tiny_config(tiny_model_dir)
    cases = [SamplingParams(max_tokens=12, temperature=0, logprobs=2),
             SamplingParams(max_tokens=9, temperature=0.8, seed=11),
             SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[17], ignore_eos=True)]

    async def run(engine) -> list[list]:
        results = []
        for params in cases:
            runs = await asyncio.gather(*(_collect(engine, p, params) for p in PROMPTS))
            results.append([[(o.delta_text, o.delta_token_ids, o.finished, o.finish_reason,
                              o.text, o.token_ids, o.stop_reason, o.logprobs,
                              o.num_cached_tokens) for o in outs] for outs in runs])
        return results

    threaded = AsyncEngine(LLMEngine.from_config(config))
    try:
        expected = asyncio.run(run(threaded))
    finally:
        threaded.shutdown()

    async def in_worker():
        client = await EngineClient.start(config)
        try:
            assert client.info.max_model_len == threaded.info.max_model_len
            assert client.tokenizer.encode("hello world") == threaded.tokenizer.encode(
                "hello world")
            return await run(client)
        finally:
            await client.wait_closed()

    _assert_same_outputs(asyncio.run(in_worker()), expected)


def _assert_same_outputs(got, expected, where: str = "outputs") -> None:
    """Equal, floats (logprobs) to 1e-4: the two engines batch the concurrent
    prompts by their own timing, and a matrix product of another row count
    may round the last bits differently (seen on an AVX2-only CPU, where the
    same tokens came with logprobs 1e-6 apart); tokens and text must match."""
    if isinstance(expected, float):
        assert got == pytest.approx(expected, abs=1e-4), where
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), where
        for index, (a, b) in enumerate(zip(got, expected)):
            _assert_same_outputs(a, b, f"{where}[{index}]")
    elif hasattr(expected, "__struct_fields__") or hasattr(expected, "__dataclass_fields__"):
        assert type(got) is type(expected), where
        fields = getattr(expected, "__struct_fields__", None) or expected.__dataclass_fields__
        for name in fields:
            _assert_same_outputs(getattr(got, name), getattr(expected, name), f"{where}.{name}")
    else:
        assert got == expected, where


def test_refusals_aborts_stats_and_steps_cross_the_wire(tiny_model_dir) -> None:
    config = tiny_config(tiny_model_dir, max_queue_requests=1, max_num_seqs=1)

    async def main():
        client = await EngineClient.start(config)
        try:
            with pytest.raises(ContextLengthError, match="maximum context length"):
                await client.add_request([1, 2], SamplingParams(max_tokens=10**6))
            with pytest.raises(ValueError, match="token ids must be in"):
                await client.add_request([10**7], SamplingParams(max_tokens=2))
            long = await client.add_request(PROMPTS[0], SamplingParams(max_tokens=400,
                                                                       ignore_eos=True))
            first = await long.__anext__()
            queued = await client.add_request(PROMPTS[1], SamplingParams(max_tokens=4))
            with pytest.raises(RejectedError) as refused:  # the queue holds one
                await client.add_request(PROMPTS[2], SamplingParams(max_tokens=4))
            assert refused.value.reason == "queue_full" and refused.value.retry_after >= 1
            await long.aclose()  # aborts in the worker; the queued one runs next
            outs = [o async for o in queued]
            assert outs[-1].finished and outs[-1].finish_reason == "length"
            assert first.num_output_tokens >= 1
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (client.stats.num_running
                                                   or client.stats.kv_used_blocks):
                await asyncio.sleep(0.05)
            assert client.stats.num_running == 0 and client.stats.kv_used_blocks == 0
            assert client.stats.counters.finished.get("abort") == 1
            steps, total = client.step_log.snapshot()
            assert total == client.stats.counters.steps and steps[-1].shape.tokens >= 1
            assert client.num_in_flight == 0
        finally:
            await client.wait_closed()

    asyncio.run(main())


def test_a_killed_worker_fails_its_streams_and_calls_on_failure(tiny_model_dir) -> None:
    async def main():
        client = await EngineClient.start(tiny_config(tiny_model_dir))
        failures = []
        client.on_failure = failures.append
        try:
            stream = await client.add_request(PROMPTS[0], SamplingParams(max_tokens=480,
                                                                         ignore_eos=True))
            await stream.__anext__()
            os.kill(client.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exited unexpectedly"):
                async for _ in stream:
                    pass
            assert failures and not client.is_alive and client.num_in_flight == 0
            with pytest.raises(EngineDeadError):
                await client.add_request(PROMPTS[1], SamplingParams(max_tokens=2))
        finally:
            await client.wait_closed()

    asyncio.run(main())


def test_a_failing_engine_loop_ends_every_stream_with_its_error(tiny_model_dir,
                                                                monkeypatch) -> None:
    monkeypatch.setenv("CARPOOL_FAULT_AT_STEP", "3")

    async def main():
        client = await EngineClient.start(tiny_config(tiny_model_dir))
        try:
            stream = await client.add_request(PROMPTS[0], SamplingParams(max_tokens=50,
                                                                         ignore_eos=True))
            with pytest.raises(EngineDeadError, match="injected fault"):
                async for _ in stream:
                    pass
        finally:
            await client.wait_closed()

    asyncio.run(main())


def test_a_model_that_cannot_load_is_one_line_and_no_worker_is_left(tmp_path) -> None:
    config = EngineConfig.from_dict({"model": str(tmp_path / "missing"),
                                     "attention_backend": "torch"})

    async def main():
        with pytest.raises(EngineLaunchError) as failed:
            await EngineClient.start(config)
        return failed.value

    error = asyncio.run(main())
    assert error.usage and "\n" not in str(error) and "missing" in str(error)


def test_the_worker_dies_with_its_front(tiny_model_dir, tmp_path) -> None:
    """A front killed with SIGKILL leaves no worker holding the model."""
    script = tmp_path / "front.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, sys
        from carpool.config import EngineConfig
        from carpool.engine.client import EngineClient

        async def main():
            config = EngineConfig.from_dict({{"model": {str(tiny_model_dir)!r},
                "attention_backend": "torch", "kv_cache_memory": "16MiB", "adaptive": False}})
            client = await EngineClient.start(config)
            print(client.pid, flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
    """))
    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(front.stdout.readline())
        assert _pid_alive(worker_pid)
        front.kill()
        front.wait(10)
        deadline = time.monotonic() + 10
        while _pid_alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _pid_alive(worker_pid)
    finally:
        front.kill()
        front.stdout.close()


def test_a_worker_whose_front_is_gone_before_launch_exits(tmp_path) -> None:
    """A worker whose front died before sending ``Launch`` (or before the
    worker asked for its death signal) does not wait for ever: it exits."""
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    # Its front already gone: the pid given is not its parent.
    gone = subprocess.run([sys.executable, "-m", "carpool.engine.worker", "--connect", endpoint,
                           "--parent-pid", "1"], timeout=60)
    assert gone.returncode == 1
    # Its front leaves while it waits for Launch (an intermediate shell is the front).
    shell = subprocess.Popen(["sh", "-c", f"{sys.executable} -m carpool.engine.worker "
                              f"--connect {endpoint} --parent-pid $$ & echo $!; sleep 1"],
                             stdout=subprocess.PIPE, text=True)
    worker_pid = int(shell.stdout.readline())
    shell.wait(30)
    shell.stdout.close()
    deadline = time.monotonic() + 15
    while _pid_alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(worker_pid)


def test_the_schema_refuses_what_does_not_match() -> None:
    encoder = msgspec.msgpack.Encoder()
    frame = encoder.encode(Add("r1", [1, 2, 3], SamplingParams(max_tokens=3)))
    assert to_worker_decoder.decode(frame).prompt_token_ids == [1, 2, 3]
    with pytest.raises(msgspec.ValidationError):  # a front message is not a worker's
        to_front_decoder.decode(frame)
    with pytest.raises(msgspec.DecodeError):
        to_worker_decoder.decode(b"\x93not msgpack of ours")
    wrong_type = encoder.encode(["Add", "r1", "not a token list", {"max_tokens": 3}])
    with pytest.raises(msgspec.ValidationError):
        to_worker_decoder.decode(wrong_type)
    invalid = encoder.encode(["Add", "r1", [1], {"max_tokens": 0}])
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):  # checked as it is made
        to_worker_decoder.decode(invalid)
    assert to_front_decoder.decode(encoder.encode(Progress())) == Progress()


def test_two_workers_name_the_same_prefix_blocks_with_one_fleet_key(tiny_model_dir) -> None:
    """Keyed block hashes (CacheConfig.block_hash_key) agree across engine
    processes and with a router-side chain, reach the front as events, and
    the key itself never leaves in EngineInfo (whose cache labels /metrics
    shows)."""
    from carpool.scheduler.kv_events import BlockKeyChain

    secret = "ab" * 32
    config = tiny_config(tiny_model_dir)
    config.cache.block_hash_key = secret
    prompt = list(range(3, 3 + 3 * config.cache.block_size + 5))  # 3 full blocks

    async def stored_by_one_worker() -> list[int]:
        client = await EngineClient.start(config, kv_events=True)
        batches = []
        client.on_kv_events = batches.append
        try:
            assert all(secret not in value for value in client.info.cache_info.values())
            assert "block_hash_key" not in client.info.cache_info
            await _collect(client, prompt, SamplingParams(max_tokens=2, temperature=0))
            deadline = time.monotonic() + 10
            while not batches and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return [h for batch in batches for h in batch.stored]
        finally:
            await client.wait_closed()

    first, second = asyncio.run(stored_by_one_worker()), asyncio.run(stored_by_one_worker())
    chain = BlockKeyChain(config.cache.block_size, bytes.fromhex(secret))
    _, expected = chain.keys(chain.root(None), prompt, 0, 3)
    assert first[:3] == second[:3] == expected
