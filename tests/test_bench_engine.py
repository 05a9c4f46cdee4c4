"""``carpool bench engine``, the fake executor, and the engine's per-step fast
paths (the detokenizer's token pieces, lazily copied output token ids),
which must not change a single token or character."""
from __future__ import annotations

import json
import random

import pytest

from carpool.bench.engine import bench_config, format_summary, make_engine, run_bench
from carpool.cli import main
from carpool.config import EngineConfig
from carpool.engine.detokenizer import IncrementalDetokenizer, token_pieces
from carpool.engine.outputs import RequestOutput
from carpool.engine.step_log import StepPhases
from carpool.executor.base import BatchItem
from carpool.executor.fake import FakeExecutor
from carpool.model.sampler import SamplingRow
from carpool.model.tokenizer import Tokenizer
from carpool.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def _item(seed: int, step: int, sample: bool = True) -> BatchItem:
    row = SamplingRow(SamplingParams(), seed, step) if sample else None
    return BatchItem("r", [1, 2, 3], 2, 1, [0], row)


def test_fake_executor_samples_per_row_deterministically_from_its_pool():
    fake = FakeExecutor(num_blocks=8, block_size=16, vocab_size=100, token_ids=[5, 7, 9])
    items = [_item(1, 0), _item(1, 0, sample=False), _item(2, 3)]
    first = [r.token_id for r in fake.execute(items)]
    assert len(first) == 2  # only the items that sample
    assert [r.token_id for r in fake.execute(items)] == first
    assert first == [fake.token_for(1, 0), fake.token_for(2, 3)]
    drawn = {fake.token_for(seed, step) for seed in range(20) for step in range(20)}
    assert drawn == {5, 7, 9}
    assert (fake.steps, fake.items) == (2, 6)
    with pytest.raises(ValueError):
        FakeExecutor(num_blocks=8, block_size=16, vocab_size=10, token_ids=[])


def test_bench_config_makes_room_for_every_sequence():
    config = bench_config(EngineConfig(), num_seqs=300, prompt_len=64, blocks_per_seq=10)
    assert config.scheduler.max_num_seqs == 300
    assert config.scheduler.max_queue_requests >= 300
    assert config.scheduler.max_num_batched_tokens >= 300 + 64
    assert config.cache.num_blocks >= 3000
    assert EngineConfig().scheduler.max_num_seqs == 128  # the caller's config is not edited


def test_bench_times_steps_that_decode_every_sequence(tokenizer):
    engine = make_engine(EngineConfig(), tokenizer, num_seqs=24, prompt_len=16, blocks_per_seq=4)
    result = run_bench(engine, num_seqs=24, steps=6, warmup_steps=2, prompt_len=16,
                       output_len=30)
    assert result.decode_seqs == [24] * 6
    assert len(result.step_ms) == 6
    assert set(result.phase_ms) == set(StepPhases._fields)
    summary = result.summary()
    phases = sum(stats["median"] for stats in summary["phases"].values())
    assert 0 < summary["step"]["median"] and 0 < phases
    table = format_summary(summary)
    assert "| step (total) |" in table and "| commit |" in table


def test_cli_bench_engine_writes_json(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "engine.json"
    code = main(["bench", "engine", "--model", str(tiny_model_dir), "--num-seqs", "8",
                 "--steps", "3", "--warmup-steps", "1", "--prompt-len", "8",
                 "--json", str(out)])
    assert code == 0
    assert "8 sequences decoding, 3 steps timed" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["summary"]["num_seqs"] == 8 and data["decode_seqs"] == [8, 8, 8]
    assert set(data["summary"]["phases"]) == set(StepPhases._fields)


def _random_tokens(rng: random.Random, pieces, special: list[int], n: int) -> list[int]:
    """Ids that exercise both detokenizer paths: whole-text tokens, parts of
    characters (no piece), special tokens."""
    partial = [i for i, piece in enumerate(pieces) if piece is None]
    out = []
    for _ in range(n):
        r = rng.random()
        out.append(rng.choice(partial) if r < 0.3 else rng.choice(special) if r < 0.35
                   else rng.randrange(len(pieces)))
    return out


@pytest.mark.parametrize("stop", [[], ["e"], ["\n", "ab"], ["😀"]])
def test_token_pieces_do_not_change_the_text(tokenizer, stop):
    pieces = token_pieces(tokenizer)
    assert pieces is not None and len(pieces) == tokenizer.vocab_size
    assert any(piece is None for piece in pieces) and any(pieces)
    rng = random.Random(len(stop))
    text_ids = tokenizer.encode("Emoji: 😀👍🏽 CJK: 你好世界 café naïve\n\nab ok")
    for trial in range(150):
        params = SamplingParams(stop=stop, skip_special_tokens=trial % 3 > 0,
                                include_stop_str_in_output=trial % 2 == 0)
        prompt = _random_tokens(rng, pieces, tokenizer.all_special_ids, rng.randint(1, 10))
        tokens = _random_tokens(rng, pieces, tokenizer.all_special_ids, rng.randint(1, 70))
        tokens = [rng.choice(text_ids) if rng.random() < 0.4 else t for t in tokens]
        slow = IncrementalDetokenizer(tokenizer, prompt, params)
        fast = IncrementalDetokenizer(tokenizer, prompt, params, pieces)
        assert [fast.add_token(t) for t in tokens] == [slow.add_token(t) for t in tokens]
        assert fast.flush() == slow.flush()
        assert (fast.output_text, fast.stop_reason) == (slow.output_text, slow.stop_reason)


def test_token_pieces_need_a_byte_level_tokenizer():
    class Plain:
        all_special_ids: list[int] = []

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids)

    assert token_pieces(Plain()) is None


def test_request_output_copies_token_ids_and_joins_text_only_when_read():
    live, parts = [1, 2, 3, 4], ["t", "u"]
    output = RequestOutput.of_request("r", [1, 2], parts, live, "u", [3, 4], False, None, None,
                                      None, 0, 0.0, None, None)
    live.append(5)  # the request goes on; the output keeps what it had
    parts.append("v")
    assert output.num_output_tokens == 2
    assert output.token_ids == [3, 4] and output.text == "tu"
    live.append(6)
    parts.append("w")
    assert output.token_ids == [3, 4] and output.text == "tu"
    eager = RequestOutput("r", [1, 2], "tu", [3, 4], "u", [3, 4])
    assert eager == output and repr(eager) == repr(output)
    eager.finished = True
    assert eager != output


def test_engine_outputs_add_up_when_read_after_later_steps(tokenizer):
    engine = make_engine(EngineConfig(), tokenizer, num_seqs=4, prompt_len=8, blocks_per_seq=4)
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=9, ignore_eos=True, stop=["e"]),
              SamplingParams(max_tokens=7, ignore_eos=True, logprobs=0)]
    ids = [engine.add_request([5 + i] * 8, p) for i, p in enumerate(params)]
    outputs: list[RequestOutput] = []
    while engine.has_unfinished:
        outputs += engine.step()  # read only at the end, after every later step
    assert engine.counters.generation_tokens == sum(len(o.delta_token_ids) for o in outputs)
    for request_id in ids:
        mine = [o for o in outputs if o.request_id == request_id]
        tokens: list[int] = []
        text = ""
        for output in mine:
            tokens += output.delta_token_ids
            text += output.delta_text
            assert output.token_ids == tokens and output.text == text
        assert mine[-1].finished and mine[-1].finish_reason in ("length", "stop")
        assert text == tokenizer.decode(tokens) or mine[-1].finish_reason == "stop"
