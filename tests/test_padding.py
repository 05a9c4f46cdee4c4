"""Padded execution of static and dynamic batches: same tokens as the ragged
path, the padding cost really computed and counted (tiny random-weight model)."""
from __future__ import annotations

import pytest

from carpool import LLM, SamplingParams
from carpool.config import EngineConfig, SchedulerConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.executor.base import BatchItem, Padding
from carpool.scheduler.request import Request
from tests.test_engine_tiny import PROMPTS

# Unequal lengths: batch members finish at different steps and keep their rows.
PARAMS = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True)
          for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="16MiB").engine


def engine_like(base: LLMEngine, **scheduler) -> LLMEngine:
    """A fresh engine with other scheduler knobs on ``base``'s executor."""
    config = EngineConfig()
    config.update({"model": vars(base.config.model), "cache": vars(base.config.cache),
                   "scheduler": {**vars(base.config.scheduler), **scheduler}})
    config.validate()
    return LLMEngine(config, base.tokenizer, base.model_config, base.executor,
                     base.max_model_len)


def run(engine: LLMEngine, prompts, params) -> list[list[int]]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = {}
    while engine.has_unfinished:
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return [final[i].token_ids for i in ids]


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_greedy_tokens_are_the_same_padded_or_not(base, batching):
    expected = run(engine_like(base), PROMPTS, PARAMS)
    for padding in ("none", "left", "right", "center"):
        engine = engine_like(base, batching=batching, padding=padding, preferred_batch_size=3,
                             max_batch_size=4, max_wait=0.0, bucket_tolerance=0.9)
        assert run(engine, PROMPTS, PARAMS) == expected, padding
        counters = engine.counters
        if padding == "none":
            assert counters.slot_tokens == counters.computed_tokens
        else:
            assert counters.slot_tokens > counters.computed_tokens


def test_padding_survives_chunked_prefill_and_preemption(tiny_model_dir, base):
    expected = run(engine_like(base), PROMPTS, PARAMS)
    tight = LLM(str(tiny_model_dir), dtype="float32", block_size=8, num_blocks=14,
                max_num_batched_tokens=7, watermark=0.0, attention_backend="torch",
                batching="static", preferred_batch_size=6, max_wait=0.0,
                padding="center").engine
    assert run(tight, PROMPTS, PARAMS) == expected
    assert tight.scheduler.num_preemptions > 0
    assert tight.scheduler.kv.stats().used_blocks == 0, "blocks leaked"


def test_slot_tokens_count_the_whole_rectangle(base):
    engine = engine_like(base, batching="static", padding="right", preferred_batch_size=3,
                         max_wait=None)
    tokens_run: list[int] = []  # tokens attention ran over (the row bucket's pad rows apart)
    hook = base.executor.model.register_forward_hook(
        lambda module, inputs, output: tokens_run.append(inputs[1].positions.numel()))
    try:
        # Prompts of 5, 9 and 3 tokens; 2, 4 and 3 output tokens.
        prompts = [[10 + i for i in range(5)], [40 + i for i in range(9)], [80, 81, 82]]
        run(engine, prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                              for n in (2, 4, 3)])
    finally:
        hook.remove()
    # Step 1: prefills of 5, 9, 3 padded to 3 x 9. Steps 2-4: decodes 3 x 1, the
    # finished members' rows computed as padding (3, then 2, then 1 real token).
    counters = engine.counters
    assert counters.computed_tokens == 17 + 3 + 2 + 1
    assert counters.slot_tokens == 27 + 3 + 3 + 3
    assert tokens_run == [27, 3, 3, 3]  # the padding really ran through the model
    fill = counters.computed_tokens / counters.slot_tokens
    assert fill == pytest.approx(23 / 36) and fill < 1


def test_alignment_places_pad_tokens_around_the_real_ones(base):
    executor = base.executor
    items = [BatchItem("a", list(range(10, 18)), 0, 8, [0]), BatchItem("b", [5, 6], 0, 2, [1])]
    layouts = {}
    for align in ("left", "right", "center"):
        runs = executor._runs(items, Padding(rows=3, align=align))
        layouts[align] = [items[run.item].request_id if run.item is not None
                          else run.span.num_tokens for run in runs]
        scratch = {b for run in runs if run.item is None for b in run.span.block_table}
        assert scratch and min(scratch) >= executor.num_blocks, "pad K/V outside the pool"
        assert sum(run.span.num_tokens for run in runs) == 3 * 8
    # Pad runs by their length; the missing third row is 8 pad tokens.
    assert layouts["left"] == ["a", 6, "b", 8]
    assert layouts["right"] == ["a", "b", 6, 8]
    assert layouts["center"] == ["a", 3, "b", 3, 8]
    assert Padding(2, "center").split(3, 8) == (2, 3)


def test_padding_config_is_validated():
    SchedulerConfig(batching="continuous", padding="none").validate()
    assert SchedulerConfig().padding_mode == "none"
    assert SchedulerConfig(batching="static").padding_mode == "right"
    assert SchedulerConfig(batching="dynamic", padding="none").padding_mode == "none"
    with pytest.raises(ValueError, match="continuous batching never pads"):
        SchedulerConfig(batching="continuous", padding="right").validate()
    with pytest.raises(ValueError, match="padding must be"):
        SchedulerConfig(batching="static", padding="diagonal").validate()
    with pytest.raises(ValueError, match="alignment"):
        Padding(2, "none")
    from carpool.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "hi", "--batching", "dynamic",
                                      "--padding", "center"])
    assert engine_config_from_args(args).scheduler.padding == "center"


def test_pad_rows_keep_the_dispatch_size_until_the_batch_completes():
    from test_scheduler_properties import make_scheduler, run_step_output

    scheduler = make_scheduler(num_blocks=64, max_seqs=8, budget=64, policy="fcfs",
                               batching="static", preferred_batch_size=3, max_wait=None)
    for rid, max_tokens in (("a", 1), ("b", 3), ("c", 2)):
        scheduler.add_request(Request(rid, [1, 2, 3], max_tokens, 0.0))
    scheduler.add_request(Request("d", [4, 5], 1, 0.0))
    rows, running = [], []
    for _ in range(4):
        out, _ = run_step_output(scheduler)
        rows.append(out.pad_rows)
        running.append(len(out.spans))
    assert running == [3, 2, 1, 0]  # a finished after step 1, c after step 2, b after step 3
    assert rows == [3, 3, 3, 0]  # finished members keep their rows; then nothing in flight
    for rid in "efg":  # fills the second batch
        scheduler.add_request(Request(rid, [6, 7, 8], 1, 0.0))
    out, _ = run_step_output(scheduler)
    assert out.pad_rows == 3 and len(out.spans) == 3
    ragged = make_scheduler(num_blocks=64, max_seqs=8, budget=64, policy="fcfs",
                            batching="static", preferred_batch_size=1, padding="none")
    ragged.add_request(Request("a", [1, 2, 3], 2, 0.0))
    out, _ = run_step_output(ragged)
    assert out.pad_rows == 0 and out.num_slots == out.num_tokens == 3
