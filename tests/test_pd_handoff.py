"""A request split between a prefill engine and a decode engine (P/D) in
one process: the prefill part's prompt blocks go through a store, the
decode part goes on from its first token and says what one engine says;
blocks late on their way are waited for, blocks that never come (the
prefill replica died mid-transfer) are computed, and no block stays held."""
from __future__ import annotations

import threading
import time

import pytest

from carpool import LLM, SamplingParams
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.outputs import RequestOutput
from carpool.engine.wire import Handoff
from carpool.kv_transfer.blocks import KVBlockIO, weights_fingerprint
from carpool.kv_transfer.connector import StoreConnector
from carpool.kv_transfer.stores import MemoryStore

HASH_KEY = "00112233445566778899aabbccddeeff"


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="16MiB",
               block_hash_key=HASH_KEY)


def _replica(llm: LLM, store, handoff_wait_s: float = 5.0, layered: bool = True) -> LLMEngine:
    """An engine on ``llm``'s model and (zeroed) KV tensors, sharing ``store``;
    ``layered``: a P/D prefill streams its blocks layer by layer."""
    base, executor = llm.engine, llm.engine.executor
    for k, v in executor.kv_caches:
        k.zero_()
        v.zero_()
    fingerprint = weights_fingerprint(executor.model, f"{base.model_config!r} {executor.dtype}")
    connector = StoreConnector(store, KVBlockIO(executor.kv_caches), fingerprint,
                               handoff_wait_s=handoff_wait_s,
                               model=executor.model if layered else None)
    return LLMEngine(base.config, base.tokenizer, base.model_config, executor,
                     base.max_model_len, kv_connector=connector)


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams,
         handoff: Handoff | None = None) -> list[RequestOutput]:
    engine.add_request(prompt, params, request_id="r", handoff=handoff)
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    return outputs


PARAMS = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)]


@pytest.mark.parametrize("layered", [True, False], ids=["by-layer", "whole"])
@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("length", [70, 64, 9])  # full blocks and a tail, full only, no full
def test_prefill_then_decode_says_what_one_engine_says(tiny, params, length, layered):
    prompt = [(i * 41) % 380 + 5 for i in range(length)]
    store = MemoryStore(64 << 20)
    colocated = _run(_replica(tiny, store), prompt, params)[-1]
    store = MemoryStore(64 << 20)  # nothing of the colocated run
    prefill = _replica(tiny, store, layered=layered)
    first = _run(prefill, prompt, SamplingParams(**{**vars(params), "max_tokens": 1}),
                 Handoff("prefill"))[-1]
    prefill.kv_connector.flush()
    assert first.token_ids == colocated.token_ids[:1]
    layers = prefill.executor.model.config.num_layers
    stats = prefill.kv_connector.stats
    assert stats.layer_parts_sent == length // 16 * layers == len(store)
    # Streamed: one step's parts, each put timed, some of it while layers computed.
    assert stats.export_steps == (1 if layered and length >= 16 else 0)
    if stats.export_steps:
        assert stats.export_seconds > 0
        assert 0 <= stats.export_hidden_seconds <= stats.export_seconds
    assert prefill.scheduler.kv.pool.num_free_blocks == prefill.executor.num_blocks
    decode = _replica(tiny, store)
    handoff = Handoff("decode", list(first.token_ids), first.logprobs)
    outputs = _run(decode, prompt, params, handoff)
    final = outputs[-1]
    assert final.token_ids == colocated.token_ids
    assert first.text + "".join(o.delta_text for o in outputs) == colocated.text
    assert sum(len(o.delta_token_ids) for o in outputs) == params.max_tokens - 1
    if params.logprobs is not None:
        assert [lp.token_id for lp in final.logprobs] == colocated.token_ids
        assert [lp.logprob for lp in final.logprobs] == pytest.approx(
            [lp.logprob for lp in colocated.logprobs], abs=1e-4)
    assert decode.kv_connector.stats.blocks_loaded == length // 16
    assert final.num_cached_tokens == length // 16 * 16
    assert decode.scheduler.kv.pool.num_free_blocks == decode.executor.num_blocks
    decode.kv_connector.flush()
    assert len(store) == 0  # the parts were taken: deleted at once, not left to the TTL
    assert decode.kv_connector.stats.layer_parts_dropped == length // 16 * layers


def test_a_prefill_that_saves_blocks_it_found_cached_exports_them_too(tiny):
    prompt = [(i * 43) % 380 + 5 for i in range(50)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    store = MemoryStore(64 << 20)
    prefill = _replica(tiny, store)
    _run(prefill, prompt, params)  # cached there; then the store loses them
    prefill.kv_connector.flush()
    store._blocks.clear()
    prefill.add_request(prompt, params, request_id="again", handoff=Handoff("prefill"))
    while prefill.has_unfinished:
        prefill.step()
    prefill.kv_connector.flush()
    layers = prefill.executor.model.config.num_layers
    assert len(store) == 3 * layers  # the three cached blocks' parts, exported anyway


def test_blocks_late_on_their_way_are_waited_for(tiny):
    prompt = [(i * 47) % 380 + 5 for i in range(70)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = _run(_replica(tiny, MemoryStore(64 << 20)), prompt, params)[-1]
    staged = MemoryStore(64 << 20)
    prefill = _replica(tiny, staged)
    first = _run(prefill, prompt, params.__class__(**{**vars(params), "max_tokens": 1}),
                 Handoff("prefill"))[-1]
    prefill.kv_connector.flush()
    store = MemoryStore(64 << 20)  # empty until the blocks "arrive", 0.2 s in
    items = [(k, staged.get_many([k])[0]) for k in list(staged._blocks)]
    threading.Timer(0.2, store.put_many, [items]).start()
    decode = _replica(tiny, store)
    started = time.monotonic()
    out = _run(decode, prompt, params, Handoff("decode", list(first.token_ids)))[-1]
    assert time.monotonic() - started >= 0.2
    assert out.token_ids == expected.token_ids
    assert decode.kv_connector.stats.blocks_loaded == 4


def test_blocks_that_never_come_are_computed_after_the_wait(tiny):
    prompt = [(i * 53) % 380 + 5 for i in range(70)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = _run(_replica(tiny, MemoryStore(64 << 20)), prompt, params)[-1]
    decode = _replica(tiny, MemoryStore(64 << 20), handoff_wait_s=0.3)
    started = time.monotonic()
    out = _run(decode, prompt, params, Handoff("decode", list(expected.token_ids[:1])))[-1]
    assert 0.3 <= time.monotonic() - started < 5.0
    assert out.token_ids == expected.token_ids
    stats = decode.kv_connector.stats
    assert stats.blocks_loaded == 0 and stats.blocks_missing == 1
    assert decode.scheduler.kv.pool.num_free_blocks == decode.executor.num_blocks


def test_handoffs_are_checked(tiny):
    with pytest.raises(ValueError, match="role"):
        Handoff("middle")
    with pytest.raises(ValueError, match="output tokens"):
        Handoff("decode")
    plain = tiny.engine  # no KV connector
    with pytest.raises(ValueError, match="KV store"):
        plain.add_request([5, 6, 7], SamplingParams(max_tokens=1), handoff=Handoff("prefill"))
    engine = _replica(tiny, MemoryStore(1 << 20))
    with pytest.raises(ValueError, match="tokens left"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=1),
                           handoff=Handoff("decode", [9]))


def test_an_aborted_prefill_part_drops_what_it_exported(tiny):
    """A prefill part aborted after its forward streamed its parts (the
    client left): no decode part will take them, so they leave the store at
    once; one that ends normally keeps them for its decode part."""
    import copy

    prompt = [(i * 53) % 380 + 5 for i in range(70)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    store = MemoryStore(64 << 20)
    whole = _replica(tiny, store)
    config = copy.deepcopy(whole.config)
    config.scheduler.max_num_batched_tokens = 32  # the prompt in chunks of 2 blocks
    prefill = LLMEngine(config, whole.tokenizer, whole.model_config, whole.executor,
                        whole.max_model_len, kv_connector=whole.kv_connector)
    prefill.add_request(prompt, params, request_id="gone", handoff=Handoff("prefill"))
    prefill.step()  # the prompt's first chunk: its 2 blocks' parts streamed
    prefill.kv_connector.flush()
    layers = prefill.executor.model.config.num_layers
    assert len(store) == 2 * layers
    prefill.abort_request("gone")
    while prefill.has_unfinished:
        prefill.step()
    prefill.step()  # the drop goes with the next step's orders
    prefill.kv_connector.flush()
    assert len(store) == 0 and prefill.kv_connector.stats.layer_parts_dropped == 4 * layers
    kept = _run(prefill, prompt, params, Handoff("prefill"))[-1]
    prefill.kv_connector.flush()
    assert kept.finish_reason == "length" and len(store) == 4 * layers


def test_a_decode_part_drops_the_parts_it_did_not_fetch(tiny):
    """A decode part whose replica holds the prompt's blocks already fetches
    none of the handoff's parts; when it ends, it drops them all (not at
    the TTL), and says what one engine says."""
    prompt = [(i * 59) % 380 + 5 for i in range(70)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    store = MemoryStore(64 << 20)
    prefill = _replica(tiny, store)
    first = _run(prefill, prompt, SamplingParams(max_tokens=1, temperature=0.0),
                 Handoff("prefill"))[-1]
    prefill.kv_connector.flush()
    layers = prefill.executor.model.config.num_layers
    assert len(store) == 4 * layers  # the prompt's 4 full blocks, one part per layer
    decode = _replica(tiny, store)
    colocated = _run(decode, prompt, params)[-1]  # its cache now holds the prompt
    decode.kv_connector.flush()
    saved = len(store) - 4 * layers  # the colocated run's whole blocks
    outputs = _run(decode, prompt, params, Handoff("decode", list(first.token_ids)))
    decode.kv_connector.flush()
    assert outputs[-1].token_ids == colocated.token_ids
    assert decode.kv_connector.stats.blocks_loaded == 0
    assert len(store) == saved and decode.kv_connector.stats.layer_parts_dropped == 4 * layers
