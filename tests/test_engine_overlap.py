"""Overlap: a step's outputs made while the executor runs the next one.

With ``overlap`` on, ``LLMEngine.step`` launches the batch, makes the
previous step's outputs (detokenizing, stop strings), then waits; a stop
string found there ends its request one step late and the commit drops
the extra token. None of it may change a token, a character, a finish
reason, or how many outputs a request gets.
"""
from __future__ import annotations

import pytest

from carpool import LLM
from carpool.bench.engine import make_engine
from carpool.config import EngineConfig
from carpool.executor.base import resolve_overlap
from carpool.executor.fake import FakeExecutor
from carpool.model.tokenizer import Tokenizer
from carpool.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def _engine(tokenizer, overlap: str, step_seconds: float = 0.0005):
    config = EngineConfig.from_dict({"overlap": overlap})
    return make_engine(config, tokenizer, num_seqs=16, prompt_len=8, blocks_per_seq=8,
                       step_seconds=step_seconds)


def _run(engine, requests: list[tuple[list[int], SamplingParams]], abort_at: dict | None = None):
    """Every output of every request, in order; ``abort_at`` {request index: step}."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    seen: dict[str, list] = {rid: [] for rid in ids}
    step = 0
    while engine.has_unfinished:
        for output in engine.step():
            seen[output.request_id].append(output)
        step += 1
        for index, when in (abort_at or {}).items():
            if when == step:
                final = engine.abort_request(ids[index])
                if final is not None:
                    seen[final.request_id].append(final)
        assert step < 500
    return [seen[rid] for rid in ids]


def _summary(outputs: list) -> tuple:
    final = outputs[-1]
    return (final.token_ids, final.text, final.finish_reason, final.stop_reason,
            [(lp.token_id, lp.logprob) for lp in final.logprobs or []])


def _requests(tokenizer, stop: str, stop_token: int | None) -> list:
    prompts = [[(7 * i + j) % 200 + 3 for j in range(8)] for i in range(6)]
    return [(prompts[0], SamplingParams(max_tokens=20, ignore_eos=True)),
            (prompts[1], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop], seed=11)),
            (prompts[2], SamplingParams(max_tokens=25, stop_token_ids=[stop_token]
                                        if stop_token is not None else [])),
            (prompts[3], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)),
            (prompts[4], SamplingParams(max_tokens=1, ignore_eos=True)),
            # The fake samples by seed: request 1's tokens, and its stop string.
            (prompts[5], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop], seed=11,
                                        include_stop_str_in_output=True))]


def _stops_seen_mid_output(tokenizer) -> tuple[str, int]:
    """A stop string and a stop token the fake samples halfway through
    requests 1 and 2 (read off a run without stops)."""
    engine = _engine(tokenizer, "off", step_seconds=0.0)
    plain = _requests(tokenizer, "\x00never\x00", None)
    outs = _run(engine, plain)
    text = outs[1][-1].text
    return text[len(text) // 2:len(text) // 2 + 3], outs[2][-1].token_ids[10]


def test_overlap_changes_no_token_text_or_finish(tokenizer):
    stop, stop_token = _stops_seen_mid_output(tokenizer)
    runs = {}
    for overlap in ("off", "on"):
        engine = _engine(tokenizer, overlap)
        assert engine.overlap == (overlap == "on")
        runs[overlap] = _run(engine, _requests(tokenizer, stop, stop_token))
    for off, on in zip(runs["off"], runs["on"], strict=True):
        assert _summary(off) == _summary(on)
        for outputs in (off, on):  # exactly one final output, last; deltas add up
            assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
            assert "".join(o.delta_text for o in outputs) == outputs[-1].text
            assert sum((o.delta_token_ids for o in outputs), []) == outputs[-1].token_ids
    by_reason = [_summary(outs)[2] for outs in runs["on"]]
    assert by_reason == ["length", "stop", "stop", "length", "length", "stop"]
    assert runs["on"][1][-1].stop_reason == stop and stop not in runs["on"][1][-1].text
    assert runs["on"][5][-1].text.endswith(stop)
    assert runs["on"][2][-1].stop_reason == stop_token


def test_an_abort_between_overlapped_steps_is_the_requests_last_output(tokenizer):
    engine = _engine(tokenizer, "on")
    requests = _requests(tokenizer, "\x00never\x00", None)[:3]
    outs = _run(engine, requests, abort_at={0: 4, 2: 1})
    for index in (0, 2):
        assert outs[index][-1].finish_reason == "abort"
        assert [o.finished for o in outs[index]].count(True) == 1
    assert outs[1][-1].finish_reason == "length" and len(outs[1][-1].token_ids) == 30
    assert engine.scheduler.kv.pool.num_free_blocks == engine.executor.num_blocks


def test_auto_overlaps_only_where_the_executor_waits_on_a_device():
    assert resolve_overlap("auto", FakeExecutor(4, 16, 10, step_seconds=0.01))
    assert not resolve_overlap("auto", FakeExecutor(4, 16, 10))
    assert resolve_overlap("on", FakeExecutor(4, 16, 10))
    assert not resolve_overlap("off", FakeExecutor(4, 16, 10, step_seconds=0.01))
    with pytest.raises(ValueError, match="overlap"):
        EngineConfig.from_dict({"overlap": "sometimes"}).validate()


def test_the_real_executor_gives_the_same_tokens_launched_and_overlapped(tiny_model_dir):
    prompts = ["The quick brown fox", "def add(a, b):", "café " * 5]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)]
    results = {}
    for overlap in ("off", "on"):
        llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="16MiB",
                  overlap=overlap)
        assert llm.engine.overlap == (overlap == "on")
        results[overlap] = [_summary([o]) for o in llm.generate(prompts, params)]
    assert results["off"] == results["on"]
