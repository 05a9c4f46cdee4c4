"""The families beyond Llama (Qwen3, Gemma 3, Mixtral, Qwen3-MoE; sliding
windows) through the
whole engine: greedy tokens identical to transformers' ``generate`` in fp32
on random configs whose sizes hypothesis picks, batched with ragged prompts
and chunked prefill; a prefix-cache hit whose blocks a sliding-window layer
reads; preemption; a prefill/decode split through the KV store; tokens of
one batch routed to different experts, counted on /metrics; and bf16 logits
within a stated tolerance."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from carpool import LLM, SamplingParams
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.wire import Handoff
from carpool.kv_transfer.blocks import KVBlockIO, weights_fingerprint
from carpool.kv_transfer.connector import StoreConnector
from carpool.kv_transfer.stores import MemoryStore
from tests.arch_models import greedy_reference, reference_logprobs, save_random_model

PROMPTS = ["The quick brown fox jumps over the lazy dog " * 2, "def add(a, b):\n    return a + b\n",
           "café 😀", "x"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# With log-probabilities: random models often repeat one token, so the
# tokens alone would hide a wrong mask; the log-probabilities do not.
GREEDY_LP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)


def assert_says_what_transformers_says(reference, out) -> None:  # noqa: ANN001
    prompt, tokens = list(out.prompt_token_ids), list(out.token_ids)
    assert tokens == greedy_reference(reference, prompt, len(tokens))
    assert [lp.logprob for lp in out.logprobs] == pytest.approx(
        reference_logprobs(reference, prompt, tokens), abs=1e-4)


@st.composite
def family_configs(draw):
    """(model_type, config keys): heads, KV heads, head dim, layers and the
    window (shorter than most prompts) drawn."""
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    layers = draw(st.integers(1, 3))
    window = draw(st.integers(2, 20))
    model_type = draw(st.sampled_from(["qwen3", "gemma3_text", "mixtral", "qwen3_moe",
                                       "deepseek_v3"]))
    extra = {"num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "head_dim": head_dim, "num_hidden_layers": layers, "hidden_size": 48}
    if model_type == "deepseek_v3":
        del extra["head_dim"]  # transformers takes it as the rotary part's
        groups = draw(st.sampled_from([1, 2, 4]))
        topk_group = draw(st.integers(1, groups))
        extra.update(num_key_value_heads=heads, kv_lora_rank=draw(st.sampled_from([8, 24])),
                     q_lora_rank=draw(st.sampled_from([None, 16])),
                     qk_nope_head_dim=draw(st.sampled_from([4, 8])),
                     qk_rope_head_dim=draw(st.sampled_from([4, 8])),
                     v_head_dim=draw(st.sampled_from([4, 12])), n_routed_experts=8,
                     n_group=groups, topk_group=topk_group,
                     # at most the experts of the groups a token may pick from
                     num_experts_per_tok=draw(st.integers(1, min(3, topk_group * 8 // groups))),
                     moe_intermediate_size=16,
                     n_shared_experts=draw(st.integers(0, 1)),
                     first_k_dense_replace=draw(st.integers(0, layers)),
                     rope_interleave=draw(st.booleans()))
    elif model_type in ("mixtral", "qwen3_moe"):
        experts = draw(st.integers(2, 8))
        extra.update(num_local_experts=experts, num_experts=experts,
                     num_experts_per_tok=draw(st.integers(1, min(4, experts))),
                     moe_intermediate_size=draw(st.sampled_from([16, 40])),
                     norm_topk_prob=draw(st.booleans()))
        if model_type == "qwen3_moe":
            extra["mlp_only_layers"] = draw(st.lists(st.integers(0, layers - 1), max_size=1))
    elif model_type == "qwen3":
        extra.update(use_sliding_window=draw(st.booleans()), sliding_window=window,
                     max_window_layers=draw(st.integers(0, layers)))
    else:
        extra.update(sliding_window=window, layer_types=draw(st.lists(
            st.sampled_from(["sliding_attention", "full_attention"]),
            min_size=layers, max_size=layers)),
            query_pre_attn_scalar=draw(st.sampled_from([8, 24, 64])))
    return model_type, extra


# CARPOOL_FAMILY_EXAMPLES=200 with --hypothesis-show-statistics: the counts
# per architecture of the closing note (15 in CI).
@settings(max_examples=int(os.environ.get("CARPOOL_FAMILY_EXAMPLES", "15")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family_configs())
def test_greedy_tokens_match_transformers_generate(tiny_model_dir, family):
    model_type, extra = family
    event(model_type)
    with tempfile.TemporaryDirectory() as tmp:
        reference = save_random_model(Path(tmp), tiny_model_dir, model_type, extra)
        llm = LLM(tmp, dtype="float32", max_num_batched_tokens=16, block_size=8)
        outs = llm.generate(PROMPTS, GREEDY)
    for out in outs:
        want = greedy_reference(reference, list(out.prompt_token_ids), GREEDY.max_tokens)
        assert list(out.token_ids) == want, f"{model_type} {extra}"


GEMMA = {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 6,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
DEEPSEEK = {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
            "v_head_dim": 12, "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "num_key_value_heads": 4}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, tiny_model_dir):
    """(directory, transformers' model) of a small Gemma 3 with 6-token windows."""
    path = tmp_path_factory.mktemp("gemma3")
    return path, save_random_model(path, tiny_model_dir, "gemma3_text", GEMMA)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, tiny_model_dir):
    """(directory, transformers' model) of a small DeepSeek-V3 (MLA and MoE)."""
    path = tmp_path_factory.mktemp("deepseek")
    return path, save_random_model(path, tiny_model_dir, "deepseek_v3", DEEPSEEK)


def test_a_prefix_cache_hit_read_by_a_sliding_window_layer_says_what_transformers_says(gemma):
    path, reference = gemma
    llm = LLM(str(path), dtype="float32", block_size=8)
    shared = PROMPTS[0] + PROMPTS[1]  # well past the window and several blocks
    llm.generate([shared + " one"], GREEDY)
    out = llm.generate([shared + " two"], GREEDY_LP)[0]
    assert out.num_cached_tokens >= 16  # the second prompt's prefill starts past the window
    assert_says_what_transformers_says(reference, out)


@pytest.mark.parametrize("family", ["gemma", "deepseek"])
def test_preemption_and_chunked_prefill_keep_windowed_and_latent_layers_exact(family, request):
    path, reference = request.getfixturevalue(family)
    tight = LLM(str(path), dtype="float32", block_size=8, num_blocks=14,
                max_num_batched_tokens=7, watermark=0.0)
    outs = tight.generate(PROMPTS * 2, SamplingParams(max_tokens=10, temperature=0.0,
                                                      ignore_eos=True, logprobs=1))
    assert tight.engine.scheduler.num_preemptions > 0
    for out in outs:
        assert_says_what_transformers_says(reference, out)
    assert tight.engine.scheduler.kv.stats().used_blocks == 0


def _replica(llm: LLM, store) -> LLMEngine:
    """An engine on ``llm``'s model and (zeroed) KV tensors, sharing ``store``."""
    base, executor = llm.engine, llm.engine.executor
    for k, v in executor.kv_caches:
        k.zero_()
        v.zero_()
    fingerprint = weights_fingerprint(executor.model, f"{base.model_config!r} {executor.dtype}")
    connector = StoreConnector(store, KVBlockIO(executor.kv_caches), fingerprint,
                               handoff_wait_s=5.0, model=executor.model)
    return LLMEngine(base.config, base.tokenizer, base.model_config, executor,
                     base.max_model_len, kv_connector=connector)


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams,
         handoff: Handoff | None = None):
    engine.add_request(prompt, params, request_id="r", handoff=handoff)
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("family", ["gemma", "deepseek"])
def test_a_prefill_decode_split_says_what_transformers_says(family, request):
    """Gemma 3's windowed layers, and DeepSeek's latent blocks (one tensor
    per layer in the payload) through the store."""
    path, reference = request.getfixturevalue(family)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB",
              block_hash_key="00112233445566778899aabbccddeeff")
    prompt = [(i * 41) % 380 + 5 for i in range(40)]
    store = MemoryStore(64 << 20)
    prefill = _replica(llm, store)
    first = _run(prefill, prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=1),
                 Handoff("prefill"))[-1]
    prefill.kv_connector.flush()
    decode = _replica(llm, store)
    handoff = Handoff("decode", list(first.token_ids), first.logprobs)
    final = _run(decode, prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                ignore_eos=True, logprobs=1), handoff)[-1]
    assert decode.kv_connector.stats.blocks_loaded == 40 // 16
    assert_says_what_transformers_says(reference, final)


@pytest.mark.parametrize("model_type,extra", [
    ("qwen3", {"head_dim": 16}), ("gemma3_text", GEMMA),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}), ("deepseek_v3", DEEPSEEK)],
    ids=["qwen3", "gemma3", "mixtral", "deepseek"])
@pytest.mark.parametrize("packed", ["off", "on"])
def test_bf16_logits_stay_close_to_transformers_fp32(tmp_path, tiny_model_dir, model_type, extra,
                                                     packed):
    """bf16 rounds every matmul: the top-5 log-probabilities of the first
    token within 0.1 nats of transformers' fp32 (measured: at most 0.02
    for Qwen3, 0.04 for Gemma 3, 0.02 for Mixtral, 0.03 for DeepSeek, on
    log-probabilities spread over 4 to 24 nats; dropping the q norm moves
    them by 1.3 and 3.1). ``packed`` on: the packed decode weights, and the
    MoE experts on the fused kernel (whatever this CPU's instructions)."""
    reference = save_random_model(tmp_path, tiny_model_dir, model_type, extra)
    llm = LLM(str(tmp_path), dtype="bfloat16", packed_decode=packed)
    blocks = [layer.moe for layer in llm.engine.executor.model.layers if layer.moe is not None]
    assert all((block.cpu_experts.__class__.__name__ == "PackedExperts") == (packed == "on")
               for block in blocks)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    for out in llm.generate(PROMPTS, params):
        with torch.inference_mode():
            logits = reference(torch.tensor([list(out.prompt_token_ids)])).logits[0, -1]
        want = torch.log_softmax(logits.float(), -1)
        top = out.logprobs[0].top
        assert len(top) == 5
        for token_id, logprob in top:
            assert logprob == pytest.approx(want[token_id].item(), abs=0.1)


def test_tokens_of_one_batch_go_to_different_experts_and_metrics_count_them(
        tmp_path, tiny_model_dir):
    from prometheus_client import generate_latest

    from carpool.server.metrics import Metrics

    reference = save_random_model(tmp_path, tiny_model_dir, "qwen3_moe", {
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True})
    llm = LLM(str(tmp_path), dtype="float32")
    outs = llm.generate(PROMPTS, GREEDY_LP)
    for out in outs:
        assert_says_what_transformers_says(reference, out)
    stats = llm.engine.stats()
    layers, top_k = 2, 2
    computed = stats.counters.computed_tokens
    assert sum(stats.expert_tokens) == computed * layers * top_k
    assert sum(1 for n in stats.expert_tokens if n) > 1, stats.expert_tokens
    assert 1.0 <= stats.expert_imbalance <= 8 / top_k
    text = generate_latest(Metrics("m", lambda: stats).registry).decode()
    for expert, count in enumerate(stats.expert_tokens):
        assert f'carpool:moe_expert_tokens_total{{expert="{expert}",model_name="m"}} {float(count)}' \
            in text
    assert "carpool:moe_expert_imbalance{" in text


def test_mla_caches_the_latent_only(deepseek):
    """The cache holds kv_lora_rank + rope dims per token and layer, not K
    and V per head; DeepSeek-V3's own shape gives 70,272 bytes per token in
    bf16 against 4,997,120 expanded (128 heads of 192 + 128)."""
    path, _ = deepseek
    llm = LLM(str(path), dtype="float32")
    executor, config = llm.engine.executor, llm.engine.model_config
    latent, other = executor.kv_caches[0]
    assert latent is other and latent.shape[-1] == 16 + 8
    per_block = sum(k.numel() * k.element_size() for k, _ in executor.kv_caches) // (
        executor.num_blocks + 1)
    assert per_block == executor.block_size * config.kv_bytes_per_token(4) == (
        executor.block_size * 2 * (16 + 8) * 4)
    assert llm.engine.info().cache_info["kv_bytes_per_token"] == str(2 * 24 * 4)
    from carpool.model.config import ModelConfig

    v3 = ModelConfig.from_hf_config({
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 2048})
    assert v3.kv_bytes_per_token(2) == 70_272
    assert 61 * 128 * (192 + 128) * 2 == 4_997_120


@pytest.mark.parametrize("model_type,extra", [
    ("qwen3", {"head_dim": 16}), ("gemma3_text", GEMMA),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32}),
    ("deepseek_v3", DEEPSEEK)])
def test_each_family_loads_from_a_hub_repo_id(tmp_path, tiny_model_dir, monkeypatch,
                                              model_type, extra):
    """Through huggingface_hub from the stand-in hub on 127.0.0.1, as a user's
    ``carpool serve owner/name`` would."""
    from fake_hub import FakeHub

    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    reference = save_random_model(tmp_path / "model", tiny_model_dir, model_type, extra)
    repo = f"tiny/{model_type.replace('_', '-')}"
    with FakeHub({repo: FakeHub.from_dir(tmp_path / "model")}) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        llm = LLM(repo, dtype="float32")
    assert llm.engine.model_config.architecture == model_type
    for out in llm.generate(PROMPTS[:2], GREEDY_LP):
        assert_says_what_transformers_says(reference, out)


def test_a_fleet_moves_latent_blocks_between_replicas_through_the_store(deepseek):
    """``carpool serve --replicas 2 --kv-store local`` on DeepSeek (MLA, MoE):
    a prompt computed on one replica is served from its latent blocks on the
    other, with the tokens one engine gives; expert load reaches /metrics."""
    import time

    from server_utils import ServerProcess

    path, reference = deepseek
    prompt = list(range(7, 7 + 64)) + [1]
    want = greedy_reference(reference, prompt, 4)
    with ServerProcess([str(path), "--dtype", "float32", "--adaptive", "false", "--replicas",
                        "2", "--routing", "round-robin", "--kv-store", "local",
                        "--served-model-name", "ds"]) as server, server.client() as http:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        first = http.post("/v1/completions", json=body).json()
        deadline = time.monotonic() + 30
        while _metric(http, "carpool:kv_store_blocks_saved_total{") < 4:
            assert time.monotonic() < deadline, "the prompt's blocks never reached the store"
            time.sleep(0.1)
        again = http.post("/v1/completions", json=body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        metrics = http.get("/metrics").text
        assert "carpool:moe_expert_tokens_total{" in metrics
        assert 'kv_bytes_per_token="192"' in metrics  # 2 layers x (16 + 8) x 4 bytes
    offline = LLM(str(path), dtype="float32").generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert list(offline.token_ids) == want  # one engine says what transformers says
    assert first["choices"][0]["text"] == offline.text  # and the fleet what one engine says


def _metric(http, prefix: str) -> float:
    lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith(prefix)]
    return sum(float(line.split()[-1]) for line in lines)


def test_a_multimodal_gemma3_checkpoint_serves_its_text_model(tmp_path, tiny_model_dir):
    """Gemma3ForConditionalGeneration (gemma-3-4b and up): carpool reads its
    text model (``language_model.*``) and leaves the vision tower unread; the
    text it generates is what transformers' whole model generates."""
    import shutil

    from tokenizers import Tokenizer
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vocab = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).get_vocab_size()
    config = Gemma3Config(
        text_config={**GEMMA, "hidden_size": 64, "intermediate_size": 128,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab,
                     "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4, image_token_index=vocab - 1, boi_token_index=vocab - 3,
        eoi_token_index=vocab - 2)
    torch.manual_seed(0)
    reference = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0.0, 0.3)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.engine.model_config.architecture == "gemma3_text"
    for out in llm.generate(PROMPTS[:2], GREEDY_LP):
        assert_says_what_transformers_says(reference, out)
