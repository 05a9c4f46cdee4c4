"""Engine mechanics on a tiny random-weight Llama (fast, no download)."""
from __future__ import annotations

import asyncio
import sys

import pytest

from carpool import LLM, SamplingParams
from carpool.engine.async_engine import AsyncEngine

PROMPTS = [
    "The quick brown fox",
    "Continuous batching keeps the GPU busy while users get fast answers. " * 3,
    "def add(a, b):",
    "Emoji: 😀👍🏽",
    "Numbers 12345 67890 and punctuation!? (yes) [no] {maybe} " * 2,
    "café",
]


@pytest.fixture(scope="module")
def roomy(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="64MiB")


def greedy(n: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_outputs_in_input_order_with_exact_lengths(roomy):
    outs = roomy.generate(PROMPTS, [greedy(5 + i) for i in range(len(PROMPTS))])
    assert [len(o.token_ids) for o in outs] == [5 + i for i in range(len(PROMPTS))]
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    assert [o.prompt_token_ids for o in outs] == [roomy.tokenizer.encode(p) for p in PROMPTS]


def test_chunked_prefill_and_preemption_do_not_change_greedy_tokens(roomy, tiny_model_dir):
    expected = [o.token_ids for o in roomy.generate(PROMPTS, greedy())]
    # 6 blocks of 8 tokens for 6 requests of up to ~60 tokens: constant preemption.
    tight = LLM(str(tiny_model_dir), dtype="float32", block_size=8, num_blocks=14,
                max_num_batched_tokens=7, watermark=0.0)
    got = tight.generate(PROMPTS, greedy())
    assert [o.token_ids for o in got] == expected
    assert tight.engine.scheduler.num_preemptions > 0
    stats = tight.engine.scheduler.kv.stats()
    assert stats.used_blocks == 0, "blocks leaked"
    assert stats.prefix_hits > 0, "preempted requests should revive their cached blocks"


def test_offline_generate_feeds_more_prompts_than_the_queue_holds(roomy, tiny_model_dir):
    expected = [o.token_ids for o in roomy.generate(PROMPTS, greedy(6))]
    small_queue = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="16MiB",
                      max_num_seqs=1, max_queue_requests=2)
    got = small_queue.generate(PROMPTS, greedy(6))
    assert [o.token_ids for o in got] == expected
    assert small_queue.engine.scheduler.rejections.get("queue_full", 0) > 0


def test_prefix_cache_hits_across_requests(roomy):
    shared = PROMPTS[1]
    roomy.generate([shared + " first"], greedy(2))
    before = roomy.engine.scheduler.kv.stats()
    out = roomy.generate([shared + " second"], greedy(2))[0]
    after = roomy.engine.scheduler.kv.stats()
    assert out.num_cached_tokens >= 16
    assert after.prefix_hits - before.prefix_hits == out.num_cached_tokens


def test_seeded_sampling_is_independent_of_batch_mates(roomy):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = roomy.generate([PROMPTS[0]], params)[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=0.7, seed=s, ignore_eos=True)
              for s in range(5)]
    together = roomy.generate(PROMPTS[1:] + [PROMPTS[0]], others + [params])[-1].token_ids
    assert alone == together
    different = roomy.generate([PROMPTS[0]], SamplingParams(
        max_tokens=16, temperature=1.0, top_p=0.9, seed=4321, ignore_eos=True))[0].token_ids
    assert different != alone


def test_stop_string_truncates_and_reports_stop(roomy):
    full = roomy.generate([PROMPTS[2]], greedy(32))[0]
    text = full.text
    assert len(text) > 8
    stop = text[len(text) // 2: len(text) // 2 + 3]
    out = roomy.generate([PROMPTS[2]], greedy(32, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    out_incl = roomy.generate([PROMPTS[2]], greedy(32, stop=[stop],
                                                   include_stop_str_in_output=True))[0]
    assert out_incl.text == text[:text.index(stop) + len(stop)]


def test_stop_token_ids_and_eos(roomy):
    full = roomy.generate([PROMPTS[3]], greedy(12))[0].token_ids
    out = roomy.generate([PROMPTS[3]], greedy(12, stop_token_ids=[full[4]]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full[:full.index(full[4]) + 1]


def test_logprobs_are_sorted_and_include_the_chosen_token(roomy):
    out = roomy.generate([PROMPTS[0]], greedy(4, logprobs=5))[0]
    assert len(out.logprobs) == 4
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert entry.token_id == token_id
        values = [lp for _, lp in entry.top]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert entry.top[0][0] == token_id  # greedy picks the most likely token
        assert entry.logprob == pytest.approx(values[0])


def test_bad_requests_raise_clear_errors(roomy):
    with pytest.raises(ValueError, match="maximum context length"):
        roomy.generate(["x" * 2000], greedy(8))
    with pytest.raises(ValueError, match="empty"):
        roomy.engine.add_request([], greedy())
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert not roomy.engine.has_unfinished


def test_abort_frees_blocks_immediately(roomy):
    engine = roomy.engine
    ids = [engine.add_request(p, greedy(50)) for p in PROMPTS[:3]]
    for _ in range(3):
        engine.step()
    used = engine.scheduler.kv.stats().used_blocks
    table = list(engine.scheduler.kv.block_tables[ids[1]])
    output = engine.abort_request(ids[1])
    assert output.finished and output.finish_reason == "abort"
    assert engine.scheduler.kv.stats().used_blocks == used - len(table)
    while engine.has_unfinished:
        engine.step()
    assert engine.scheduler.kv.stats().used_blocks == 0


def test_async_engine_streams_and_aborts(roomy):
    engine = roomy.engine
    expected = roomy.generate([PROMPTS[0]], greedy(12))[0]

    async def main() -> None:
        streamer = AsyncEngine(engine)
        try:
            deltas, last = [], None
            async for out in await streamer.add_request(PROMPTS[0], greedy(12)):
                deltas.append(out.delta_text)
                last = out
            assert last.finished and "".join(deltas) == expected.text
            assert last.token_ids == expected.token_ids

            # Leaving the stream early aborts the request and frees its blocks.
            stream = await streamer.add_request(PROMPTS[1], greedy(200))
            async for _ in stream:
                break
            await stream.aclose()
            for _ in range(200):
                if not engine.has_unfinished:
                    break
                await asyncio.sleep(0.01)
            assert not engine.has_unfinished
            assert engine.scheduler.kv.stats().used_blocks == 0

            with pytest.raises(ValueError, match="maximum context length"):
                await streamer.add_request("x" * 2000, greedy(8))

            # Several concurrent streams all finish.
            async def collect(prompt: str) -> int:
                n = 0
                async for out in await streamer.add_request(prompt, greedy(10)):
                    n = len(out.token_ids)
                return n
            counts = await asyncio.gather(*(collect(p) for p in PROMPTS))
            assert counts == [10] * len(PROMPTS)
            # Shutting down with a request in flight ends its stream with an error.
            stream = await streamer.add_request(PROMPTS[1], greedy(300))
            await stream.__anext__()
        finally:
            streamer.shutdown()
        from carpool.engine.async_engine import EngineDeadError

        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        for request_id in list(engine.scheduler.requests):  # leave the shared engine clean
            engine.abort_request(request_id)

        with pytest.raises(EngineDeadError, match="shut down"):
            await streamer.add_request(PROMPTS[0], greedy(4))  # an error, never a hang

    asyncio.run(main())


def test_engine_failure_fails_streams_instead_of_hanging(roomy, monkeypatch):
    from carpool.engine.async_engine import EngineDeadError

    def broken_step():
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(roomy.engine, "step", broken_step)

    async def main() -> None:
        streamer = AsyncEngine(roomy.engine)
        with pytest.raises(EngineDeadError, match="simulated kernel failure"):
            async for _ in await asyncio.wait_for(streamer.add_request(PROMPTS[0], greedy(4)), 10):
                pass
        assert not streamer.is_alive
        with pytest.raises(EngineDeadError):
            await streamer.add_request(PROMPTS[0], greedy(4))

    asyncio.run(main())
    monkeypatch.undo()
    # The synchronous engine is still usable: abort what the failed loop left behind.
    for request_id in list(roomy.engine.scheduler.requests):
        roomy.engine.abort_request(request_id)
    assert roomy.engine.scheduler.kv.stats().used_blocks == 0


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_request_level_regimes_give_the_same_greedy_tokens(roomy, tiny_model_dir, batching):
    expected = [o.token_ids for o in roomy.generate(PROMPTS, greedy())]
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="16MiB", batching=batching,
              preferred_batch_size=2, max_batch_size=2, max_wait=0.0)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == expected
    gate = llm.engine.scheduler.gate
    assert gate.stats.batches >= 3 and gate.stats.mean_batch_size <= 2
    assert llm.engine.scheduler.cost_model.ready  # every executed step fed the cost model


def test_row_buckets_bound_the_linear_layers_shapes_and_change_no_token(roomy, tiny_model_dir):
    """Pad rows past a step's tokens (``ModelSettings.row_bucket``) are
    computed by the linear layers only: the tokens and logprobs equal the
    exact-rows engine's, and every step above ``EXACT_ROWS`` tokens reaches
    the linear layers as a multiple of the bucket."""
    from carpool.executor.shapes import EXACT_ROWS

    exact = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="64MiB", row_bucket=1)
    bucketed = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="64MiB",
                   row_bucket=16)
    rows_seen: list[int] = []
    layer = bucketed.engine.executor.model.layers[0]
    hook = layer.qkv_proj.register_forward_hook(
        lambda module, inputs, output: rows_seen.append(inputs[0].shape[0]))
    try:
        got = bucketed.generate(PROMPTS, greedy(logprobs=2))
    finally:
        hook.remove()
    expected = exact.generate(PROMPTS, greedy(logprobs=2))
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for mine, theirs in zip(got, expected):
        for a, b in zip(mine.logprobs, theirs.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert any(r > EXACT_ROWS for r in rows_seen), "the prompts should make a step pad"
    assert all(r <= EXACT_ROWS or r % 16 == 0 for r in rows_seen), rows_seen


def test_the_engine_thread_builds_and_steps_the_engine_given_a_factory(tiny_model_dir):
    """Every torch op of a served engine runs on one thread: with the main
    thread loading the model and another stepping it, each thread had its
    own OpenMP team and a decode step of the default model took 53 ms
    instead of 33 (2-core CPU; see carpool/engine/async_engine.py)."""
    import threading

    from carpool.config import EngineConfig
    from carpool.engine.llm_engine import LLMEngine

    threads: dict[str, set[int]] = {"build": set(), "step": set()}

    def build() -> LLMEngine:
        threads["build"].add(threading.get_ident())
        config = EngineConfig.from_dict({"model": str(tiny_model_dir),
                                         "attention_backend": "torch",
                                         "kv_cache_memory": "16MiB"})
        engine = LLMEngine.from_config(config)
        execute = engine.executor.execute

        def traced(*args, **kwargs):
            threads["step"].add(threading.get_ident())
            return execute(*args, **kwargs)

        engine.executor.execute = traced
        return engine

    async_engine = AsyncEngine(build)
    try:
        async def generate() -> list[int]:
            stream = await async_engine.add_request("hello", greedy(4))
            return [out async for out in stream][-1].token_ids

        assert len(asyncio.run(generate())) == 4
    finally:
        async_engine.shutdown()
    assert threads["build"] == threads["step"] == {async_engine._thread.ident}
    assert threading.get_ident() not in threads["build"]

    def broken() -> LLMEngine:
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        AsyncEngine(broken)


def test_carpool_serve_in_one_process_loads_the_model_on_the_engine_thread(monkeypatch):
    import threading

    from carpool.config import EngineConfig
    from carpool.server import launcher
    from carpool.server.config import ServerConfig

    where: list[str] = []

    def from_config(config, kernels_in_background=False, kv_store=None, start_followers=None):
        where.append(threading.current_thread().name)
        raise RuntimeError("stop here")

    monkeypatch.setattr(launcher.LLMEngine, "from_config", staticmethod(from_config))
    switch = sys.getswitchinterval()  # run_server sets the process's
    try:
        with pytest.raises(RuntimeError, match="stop here"):
            launcher.run_server(EngineConfig(), ServerConfig(engine_process=False))
    finally:
        sys.setswitchinterval(switch)
    assert where == ["carpool-engine"]
