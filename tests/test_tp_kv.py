"""A sliced replica's KV blocks move as one replica's (carpool/parallel/
kv_slices.py): a TP 2 replica saves to and loads from a KV store in the
layout a TP 1 replica of the same model reads and writes, so the two share
prefixes both ways; a TP 2 P/D prefill streams its blocks layer by layer
(each rank's heads gathered inside the forward) to a TP 1 decode, and a TP
1 prefill hands off to a TP 2 decode; every answer is the unsliced one,
token for token. Dense (KV heads split), one KV head (replicated on both
ranks) and latent attention (MLA, whole on every rank)."""
from __future__ import annotations

import pytest

from carpool.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.wire import Handoff
from carpool.kv_transfer.stores import MemoryStore
from carpool.sampling_params import SamplingParams
from tests.arch_models import save_random_model
from tests.test_tensor_parallel import FAMILIES

KV_FAMILIES = ["llama-gqa", "llama-one-kv-head", "deepseek-v3"]
HASH_KEY = "00112233445566778899aabbccddeeff"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module", params=KV_FAMILIES)
def pair(request, tiny_model_dir, tmp_path_factory):
    """(TP 1 engine, TP 2 engine) of one family's model on one store."""
    model_type, extra = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_random_model(path, tiny_model_dir, model_type, extra, seed=3)
    store = MemoryStore(64 << 20)
    engines = []
    for size in (1, 2):
        config = EngineConfig()
        config.update({"model": str(path), "dtype": "float32", "num_blocks": 48,
                       "block_hash_key": HASH_KEY, "tensor_parallel_size": size, "threads": 1})
        engines.append(LLMEngine.from_config(config, kv_store=store))
    yield engines, store
    for engine in engines:
        engine.close()


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY,
         handoff: Handoff | None = None, request_id: str = "r"):
    engine.add_request(prompt, params, request_id=request_id, handoff=handoff)
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    engine.kv_connector.flush()
    return outputs[-1]


def _same(mine, theirs) -> None:
    assert mine.token_ids == theirs.token_ids
    assert [lp.logprob for lp in mine.logprobs] == pytest.approx(
        [lp.logprob for lp in theirs.logprobs], abs=1e-4)


def _prompt(seed: int, length: int = 40) -> list[int]:
    return [(i * seed) % 380 + 5 for i in range(length)]


def test_a_sliced_replica_shares_the_store_with_a_whole_one_both_ways(pair):
    (one, two), _ = pair
    first, second = _prompt(41), _prompt(43)
    saved_by_one = _run(one, first)  # two then loads it: each rank's heads scattered
    loaded_by_two = _run(two, first)
    _same(loaded_by_two, saved_by_one)
    assert loaded_by_two.num_cached_tokens == 32  # two full blocks of 16 from the store
    assert two.kv_connector.stats.blocks_loaded == 2
    saved_by_two = _run(two, second)  # gathered from both ranks, then one reads it
    loaded_by_one = _run(one, second)
    _same(loaded_by_one, saved_by_two)
    assert loaded_by_one.num_cached_tokens == 32
    assert one.kv_connector.stats.blocks_loaded == 2
    assert two.kv_connector.stats.blocks_refused == one.kv_connector.stats.blocks_refused == 0


@pytest.mark.parametrize("prefill_size", [2, 1], ids=["tp2-prefill", "tp2-decode"])
def test_pd_between_a_sliced_and_a_whole_replica_says_what_one_says(pair, prefill_size):
    (one, two), store = pair
    prompt = _prompt(47 + prefill_size, 50)
    alone = _run(one, prompt)
    store._blocks.clear()  # nothing of that run: the handoff alone brings the blocks
    # Fresh schedulers on the same executors: nothing of that run is cached.
    prefill, decode = [engine.renewed() for engine in
                       ((two, one) if prefill_size == 2 else (one, two))]
    first = _run(prefill, prompt, SamplingParams(**{**vars(GREEDY), "max_tokens": 1}),
                 Handoff("prefill"), "p")
    assert first.token_ids == alone.token_ids[:1]
    if prefill_size == 2:  # streamed by layer from inside the sliced forward
        assert prefill.kv_connector.stats.export_steps >= 1
    loaded = decode.kv_connector.stats.blocks_loaded
    final = _run(decode, prompt, GREEDY, Handoff("decode", list(first.token_ids),
                                                 first.logprobs), "d")
    assert final.token_ids == alone.token_ids
    assert decode.kv_connector.stats.blocks_loaded - loaded == 3
    assert final.num_cached_tokens == 48


def test_a_load_that_found_nothing_orders_no_rank():
    """A fetch can come back empty (the store lost its blocks since the
    lookup): nothing is ordered, gathered or scattered."""
    import torch

    from carpool.kv_transfer.blocks import KVBlockIO
    from carpool.parallel.kv_slices import ShardedBlockIO

    orders = []
    caches = [(torch.zeros(1, 4, 8, 16), torch.zeros(1, 4, 16, 8))]
    io = ShardedBlockIO(KVBlockIO(caches), None, [(0, 1), (1, 1)], 2,
                        lambda op, ids: orders.append(op))
    io.write([], [])
    assert io.read([]) == io.read_layer([], 0) == [] and orders == []
    assert io.layout.num_kv_heads == 2 and io.layout.data_bytes == 2 * 2 * 8 * 16 * 4
    with pytest.raises(ValueError, match="one data per block"):
        io.write([], [b"x"])


def test_auto_micro_batches_try_both_ways_and_every_rank_follows_rank_0(pair):
    """``--micro-batches auto`` under TP: rank 0 times each step shape both
    ways and sends its choice with the step; a follower that split
    differently would wait forever or answer wrong. Four sequences at once,
    the whole model's answers."""
    (one, two), _ = pair
    prompts = [_prompt(53 + k, 20 + 5 * k) for k in range(4)]

    def together(engine: LLMEngine) -> list[list[int]]:
        for k, prompt in enumerate(prompts):
            engine.add_request(prompt, GREEDY, request_id=f"m{k}")
        final = {}
        while engine.has_unfinished:
            final.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return [final[f"m{k}"] for k in range(4)]

    assert together(two) == together(one)
    decode = two.executor.choice.shapes[(True, 4)]  # four decodes a step
    assert len(decode.whole) >= 1 and len(decode.split) >= 1
