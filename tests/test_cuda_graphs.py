"""CUDA-graph decode: bucket choice, padding to a bucket, the static
buffers and the eager fallback, driven on the CPU.

The executor's graph path runs here with ``EagerGraph`` (the same static
buffers and padded batches, replayed by running the forward again) and the
Triton attention backend in Triton's interpreter; only the capture itself
(``CudaGraph``) needs a GPU, and ``scripts/gpu_check.sh`` runs it there.
"""
from __future__ import annotations

import pytest

from carpool import LLM, SamplingParams
from carpool.config import EngineConfig, capture_sizes
from carpool.engine.llm_engine import LLMEngine
from carpool.executor.cuda_graphs import EagerGraph, GraphStats, bucket_for
from carpool.executor.torch_executor import TorchExecutor
from carpool.model.loader import load_model

pytest.importorskip("triton")

PROMPTS = ["The quick brown fox", "def add(a, b):", "café " * 9, "Numbers 12345 67890",
           "Emoji: 😀👍🏽", "Continuous batching keeps the GPU busy " * 2]


def test_capture_sizes_auto_caps_at_max_num_seqs():
    assert capture_sizes("auto", 256)[-4:] == [160, 192, 224, 256]
    assert capture_sizes("auto", 100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert capture_sizes("auto", 1) == [1]
    assert capture_sizes("8, 1,2,2", 64) == [1, 2, 8]
    for bad in ("", "0,4", "x", "1.5"):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            capture_sizes(bad, 8)


def test_bucket_is_the_smallest_size_that_fits():
    sizes = [1, 2, 4, 8, 16, 24]
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 24)] == \
        [1, 2, 4, 8, 8, 16, 24, 24]
    assert bucket_for(25, sizes) is None


def test_padding_waste():
    stats = GraphStats(replays=2, rows=6, pad_rows=2)
    assert stats.padding_waste == pytest.approx(0.25)
    assert GraphStats().padding_waste == 0.0


def _engine(model_dir, sizes: str, graphs: bool, **knobs) -> LLM:
    config = EngineConfig.from_dict(dict(dtype="float32", attention_backend="triton",
                                         cuda_graph_sizes=sizes, kv_cache_memory="16MiB",
                                         **knobs)).validate()
    loaded = load_model(str(model_dir))
    max_len = 256
    executor = TorchExecutor(loaded.config, loaded.weights, config.model, config.cache, max_len,
                             config.scheduler.max_num_seqs,
                             graph_type=EagerGraph if graphs else None)
    return LLM.from_engine(LLMEngine(config, loaded.tokenizer, loaded.config, executor, max_len))


def _greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_graph_decode_equals_eager_and_the_torch_path(tiny_model_dir):
    reference = LLM(str(tiny_model_dir), dtype="float32", attention_backend="torch",
                    kv_cache_memory="16MiB")
    expected = [o.token_ids for o in reference.generate(PROMPTS, _greedy())]
    eager = _engine(tiny_model_dir, "1,2,4,8", graphs=False)
    assert eager.engine.executor.graphs is None
    assert [o.token_ids for o in eager.generate(PROMPTS, _greedy())] == expected
    graphed = _engine(tiny_model_dir, "1,2,4,8", graphs=True)
    assert [o.token_ids for o in graphed.generate(PROMPTS, _greedy())] == expected
    stats = graphed.engine.executor.graphs.stats
    # 6 decodes replay in the 8-row graph: 2 pad rows a step, in scratch blocks.
    assert stats.replays > 0 and stats.pad_rows > 0 and stats.eager_fallbacks == 0
    assert graphed.engine.scheduler.kv.stats().used_blocks == 0


def test_batches_past_the_largest_graph_run_eagerly(tiny_model_dir):
    reference = LLM(str(tiny_model_dir), dtype="float32", attention_backend="torch",
                    kv_cache_memory="16MiB")
    expected = [o.token_ids for o in reference.generate(PROMPTS, _greedy(6))]
    graphed = _engine(tiny_model_dir, "1,2", graphs=True)
    assert [o.token_ids for o in graphed.generate(PROMPTS, _greedy(6))] == expected
    stats = graphed.engine.executor.graphs.stats
    assert stats.eager_fallbacks > 0, "6 decodes exceed the 2-row graph: eager"
