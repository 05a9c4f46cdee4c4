"""GGUF files of Mixtral, Gemma 3 and DeepSeek-V3, written the way llama.cpp's
converter (convert_hf_to_gguf.py) writes them from a small random HF model,
loaded through carpool: greedy tokens identical to transformers' generate
on the original model and the converted weights equal to the originals.
SentencePiece vocabularies are checked against a reference of llama.cpp's
SPM tokenizer (llama-vocab.cpp), as there is no sentencepiece package here.

The test-side converter names tensors with the ``gguf`` package's own
TensorNameMap (llama.cpp's table, not carpool's) and applies llama.cpp's
changes: q/k rows permuted (llama/Mixtral), norms stored as w + 1 (Gemma 3),
experts stacked (or one tensor each, Mixtral's older layout), kv_b_proj
split into k_b/v_b (newer DeepSeek files) with the MQA key/value lengths.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from carpool import LLM, SamplingParams
from carpool.model.gguf_convert import gguf_tokenizer_files, open_gguf
from carpool.model.loader import ModelLoadError, load_model, tokenizer_from_gguf
from carpool.model.tokenizer import Tokenizer
from tests.arch_models import greedy_reference, save_random_model
from tests.test_model_files import llamacpp_permute

PROMPTS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
           "café ✓ 12345", "a"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

# ------------------------------------------------------------ vocabularies

SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
SPM_BYTES = [f"<0x{b:02X}>" for b in range(256)]
# Pieces in merge order (score -i); each longer piece has exactly one split
# into two pieces, so SentencePiece's order and BPE's ranks cannot differ.
SPM_PIECES = ["▁", *"abcdefghijklmnopqrstuvwxyz,", "th", "▁th", "▁the", "he", "ll", "▁he", "llo",
              "▁hello", "wo", "▁wo", "▁wor", "ld", "▁world", "ow", "▁b", "▁▁", "in", "ck"]


def spm_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece vocabulary padded to ``size``."""
    tokens = SPM_SPECIALS + SPM_BYTES + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(SPM_PIECES))]
    pad = size - len(tokens)
    return (tokens + [f"<unused{i}>" for i in range(pad)], scores + [0.0] * pad,
            types + [5] * pad)


def spm_reference(text: str, tokens: list[str], scores: list[float], types: list[int],
                  prefix_space: bool) -> list[int]:
    """llama.cpp's llm_tokenizer_spm: characters merged pairwise, the pair
    whose concatenation is the highest-scoring token first (ties: leftmost),
    then every symbol that is no token spelled as its UTF-8 byte tokens."""
    ids = {tok: i for i, tok in enumerate(tokens)}
    text = ((" " if prefix_space and text else "") + text).replace(" ", "▁")
    symbols = list(text)
    while True:
        best = None
        for i in range(len(symbols) - 1):
            merged = ids.get(symbols[i] + symbols[i + 1])
            if merged is not None and (best is None or scores[merged] > best[0]):
                best = (scores[merged], i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for symbol in symbols:
        if symbol in ids:
            out.append(ids[symbol])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in symbol.encode())
    return out


def put_spm_vocab(w: gguf.GGUFWriter, size: int, prefix_space: bool | None) -> None:
    tokens, scores, types = spm_vocab(size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if prefix_space is not None:  # absent: llama.cpp prepends the space
        w.add_add_space_prefix(prefix_space)


def put_bpe_vocab(w: gguf.GGUFWriter, tokenizer_dir: Path, pre: str) -> None:
    """The tiny test model's byte-level BPE as llama.cpp's gpt2 vocabulary."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    by_id = {i: tok for tok, i in data["model"]["vocab"].items()}
    specials = {t["id"] for t in data["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([by_id[i] for i in range(len(by_id))])
    w.add_token_types([3 if i in specials else 1 for i in range(len(by_id))])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


# ---------------------------------------------- the test-side llama.cpp converter

_PER_EXPERT = re.compile(r"(model\.layers\.\d+\..*experts)\.(\d+)\.(\w+)\.weight")


def stacked_experts(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert tensors stacked into one [E, ...] tensor per layer and part,
    named as llama.cpp's converter names the stack before mapping it."""
    out, groups = {}, {}
    for name, array in state.items():
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            out[name] = array
        else:
            groups.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = array
    for name, experts in groups.items():
        out[name] = np.stack([experts[e] for e in sorted(experts)])
    return out


def gguf_tensors(state: dict[str, np.ndarray], arch: gguf.MODEL_ARCH,
                 layers: int) -> dict[str, np.ndarray]:
    names = gguf.get_tensor_name_map(arch, layers)
    out = {}
    for name, array in state.items():
        # llama.cpp's converter renames the bias before mapping it
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert mapped is not None, name
        out[mapped] = np.ascontiguousarray(array, dtype=np.float32)
    return out


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray],
               put_metadata: Callable[[gguf.GGUFWriter], None]) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    put_metadata(w)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def put_common(w: gguf.GGUFWriter, hf: dict, ffn: int) -> None:
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(ffn)
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])


def hf_model(tmp_path: Path, tiny_model_dir: Path, model_type: str, extra: dict):
    """(transformers' model, its config.json, its weights as numpy)."""
    directory = tmp_path / "hf"
    model = save_random_model(directory, tiny_model_dir, model_type, extra)
    config = json.loads((directory / "config.json").read_text())
    return model, config, load_file(str(directory / "model.safetensors"))


def assert_serves_like_transformers(gguf_path: Path, reference, cache: Path) -> LLM:  # noqa: ANN001
    llm = LLM(str(gguf_path), dtype="float32", cache_dir=str(cache), block_size=8,
              max_num_batched_tokens=16)
    for out in llm.generate(PROMPTS, GREEDY):
        prompt = list(out.prompt_token_ids)
        assert list(out.token_ids) == greedy_reference(reference, prompt, GREEDY.max_tokens)
    return llm


def assert_same_weights(gguf_path: Path, cache: Path, original: dict[str, np.ndarray],
                        expected: Callable[[str, np.ndarray], np.ndarray] = lambda n, a: a) -> None:
    converted = load_model(gguf_path, cache).weights
    assert set(converted) == set(original)
    for name, array in original.items():
        assert np.array_equal(converted[name].numpy(), expected(name, array)), name


# ------------------------------------------------------------------ Mixtral

@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-expert"])
def test_mixtral_gguf_says_what_transformers_says(tmp_path, tiny_model_dir, stacked):
    reference, hf, state = hf_model(tmp_path, tiny_model_dir, "mixtral",
                                    {"num_local_experts": 4, "num_experts_per_tok": 2})
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    permuted = {name: llamacpp_permute(a, heads if "q_proj" in name else kv_heads)
                if name.endswith(("q_proj.weight", "k_proj.weight")) else a
                for name, a in state.items()}
    if stacked:
        tensors = gguf_tensors(stacked_experts(permuted), gguf.MODEL_ARCH.LLAMA, 2)
    else:  # llama.cpp's layout before April 2024: blk.N.ffn_gate.E.weight
        part = {"w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"}
        tensors = {}
        for name, array in permuted.items():
            match = _PER_EXPERT.fullmatch(name)
            if match is None:
                tensors.update(gguf_tensors({name: array}, gguf.MODEL_ARCH.LLAMA, 2))
            else:
                layer = name.split(".")[2]
                tensors[f"blk.{layer}.{part[match[3]]}.{match[2]}.weight"] = array

    def metadata(w: gguf.GGUFWriter) -> None:
        put_common(w, hf, hf["intermediate_size"])
        w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
        w.add_rope_dimension_count(hf["hidden_size"] // heads)
        w.add_expert_count(4)
        w.add_expert_used_count(2)
        put_spm_vocab(w, hf["vocab_size"], prefix_space=None)

    src = tmp_path / "mixtral.gguf"
    write_gguf(src, "llama", tensors, metadata)
    llm = assert_serves_like_transformers(src, reference, tmp_path / "cache")
    config = llm.engine.model_config
    assert (config.architecture, config.moe.num_experts, config.moe.top_k) == ("mixtral", 4, 2)
    assert_same_weights(src, tmp_path / "cache", state)


# ------------------------------------------------------------------ Gemma 3

GEMMA3 = {"head_dim": 16, "num_hidden_layers": 6, "sliding_window": 6,
          "query_pre_attn_scalar": 16, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}


def test_gemma3_gguf_says_what_transformers_says(tmp_path, tiny_model_dir):
    reference, hf, state = hf_model(tmp_path, tiny_model_dir, "gemma3_text", GEMMA3)
    # Gemma's RMSNorm scales by 1 + w; llama.cpp's converter stores w + 1.
    shifted = {name: a + np.float32(1) if name.endswith("norm.weight") else a
               for name, a in state.items()}
    rope = hf["rope_parameters"]

    def metadata(w: gguf.GGUFWriter) -> None:
        put_common(w, hf, hf["intermediate_size"])
        w.add_key_length(16)
        w.add_value_length(16)
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(2.0)
        w.add_sliding_window(6)
        put_spm_vocab(w, hf["vocab_size"], prefix_space=False)  # as llama.cpp writes Gemma's

    src = tmp_path / "gemma3.gguf"
    write_gguf(src, "gemma3", gguf_tensors(shifted, gguf.MODEL_ARCH.GEMMA3, 6), metadata)
    llm = assert_serves_like_transformers(src, reference, tmp_path / "cache")
    c = llm.engine.model_config
    assert c.layer_types == ("sliding",) * 5 + ("full",) and c.sliding_window == 6
    assert (c.local_rope_theta, c.rope_scaling) == (10000.0, {"rope_type": "linear", "factor": 2.0})
    assert c.attention_scale == 16 ** -0.5 and c.final_logit_softcap is None
    # w + 1 - 1 in float32 is w up to its rounding; 1 + that is exactly the 1 + w HF computes.
    assert_same_weights(src, tmp_path / "cache", state,
                        lambda name, a: (a + np.float32(1)) - np.float32(1)
                        if name.endswith("norm.weight") else a)


# --------------------------------------------------------------- DeepSeek-V3

DEEPSEEK = {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
            "v_head_dim": 12, "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1,
            "first_k_dense_replace": 1, "num_key_value_heads": 4,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                             "original_max_position_embeddings": 128, "mscale": 0.707,
                             "mscale_all_dim": 0.707}}


def split_kv_b(state: dict[str, np.ndarray], heads: int, nope: int) -> dict[str, np.ndarray]:
    """Newer llama.cpp: kv_b_proj as k_b ([heads, kv_lora, nope]: each
    head's key rows transposed) and v_b ([heads, v, kv_lora])."""
    out = {}
    for name, array in state.items():
        if not name.endswith("kv_b_proj.weight"):
            out[name] = array
            continue
        per_head = array.reshape(heads, -1, array.shape[-1])
        out[name.replace("kv_b_proj", "k_b_proj")] = per_head[:, :nope].transpose(0, 2, 1)
        out[name.replace("kv_b_proj", "v_b_proj")] = per_head[:, nope:]
    return out


def put_deepseek_metadata(w: gguf.GGUFWriter, hf: dict, split: bool, sigmoid: bool = True) -> None:
    put_common(w, hf, hf["intermediate_size"])
    rope, latent = hf["rope_parameters"], hf["kv_lora_rank"]
    nope, rot, v = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    if split:  # llama.cpp runs MLA as MQA over the latent; the head sizes move to *_mla
        w.add_head_count_kv(1)
        w.add_key_length(latent + rot)
        w.add_value_length(latent)
        w.add_key_length_mla(nope + rot)
        w.add_value_length_mla(v)
    else:
        w.add_key_length(nope + rot)
        w.add_value_length(v)
    if hf["q_lora_rank"]:
        w.add_q_lora_rank(hf["q_lora_rank"])
    w.add_kv_lora_rank(latent)
    w.add_rope_dimension_count(rot)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_leading_dense_block_count(hf["first_k_dense_replace"])
    w.add_expert_count(hf["n_routed_experts"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_expert_shared_count(hf["n_shared_experts"])
    w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    w.add_expert_group_count(hf["n_group"])
    w.add_expert_group_used_count(hf["topk_group"])
    w.add_expert_weights_scale(hf["routed_scaling_factor"])
    w.add_expert_weights_norm(hf["norm_topk_prob"])
    if sigmoid:  # absent, llama.cpp reads softmax: DeepSeek-V2's routing
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


@pytest.mark.parametrize("split,q_lora", [(True, 24), (False, None)],
                         ids=["k_b-v_b-q_lora", "kv_b-plain-q"])
def test_deepseek2_gguf_says_what_transformers_says(tmp_path, tiny_model_dir, split, q_lora):
    reference, hf, state = hf_model(tmp_path, tiny_model_dir, "deepseek_v3",
                                    {**DEEPSEEK, "q_lora_rank": q_lora})
    stored = stacked_experts(state)
    if split:
        stored = split_kv_b(stored, hf["num_attention_heads"], hf["qk_nope_head_dim"])
    tensors = gguf_tensors(stored, gguf.MODEL_ARCH.DEEPSEEK2, hf["num_hidden_layers"])
    assert ("blk.0.attn_k_b.weight" in tensors) is split

    def metadata(w: gguf.GGUFWriter) -> None:
        put_deepseek_metadata(w, hf, split)
        put_bpe_vocab(w, tiny_model_dir, "deepseek-v3")

    src = tmp_path / "deepseek2.gguf"
    write_gguf(src, "deepseek2", tensors, metadata)
    llm = assert_serves_like_transformers(src, reference, tmp_path / "cache")
    c = llm.engine.model_config
    assert (c.mla.q_lora_rank, c.mla.qk_nope_head_dim, c.mla.v_head_dim) == (q_lora, 8, 12)
    assert c.moe_layers == (False, True) and c.num_kv_heads == 4
    assert c.rope_scaling["mscale_all_dim"] == pytest.approx(0.707)
    assert_same_weights(src, tmp_path / "cache", state)


def test_softmax_routed_deepseek2_is_refused(tmp_path, tiny_model_dir):
    _, hf, state = hf_model(tmp_path, tiny_model_dir, "deepseek_v3", DEEPSEEK)

    def metadata(w: gguf.GGUFWriter) -> None:
        put_deepseek_metadata(w, hf, split=False, sigmoid=False)
        put_bpe_vocab(w, tiny_model_dir, "deepseek-v3")

    src = tmp_path / "v2.gguf"
    tensors = gguf_tensors(stacked_experts(state), gguf.MODEL_ARCH.DEEPSEEK2, 2)
    write_gguf(src, "deepseek2", tensors, metadata)
    with pytest.raises(ModelLoadError, match="expert_gating_func 1.*only DeepSeek-V3's sigmoid") \
            as info:
        load_model(src, tmp_path / "cache")
    assert "\n" not in str(info.value)


# ----------------------------------------------------- SentencePiece vocabularies

def spm_tokenizer(tmp_path: Path, prefix_space: bool | None) -> Tokenizer:
    def metadata(w: gguf.GGUFWriter) -> None:
        put_common(w, {"num_hidden_layers": 1, "max_position_embeddings": 64,
                       "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2,
                       "rms_norm_eps": 1e-5}, 8)
        put_spm_vocab(w, 320, prefix_space)

    src = tmp_path / f"spm-{prefix_space}.gguf"
    write_gguf(src, "llama", {"token_embd.weight": np.zeros((320, 8), np.float32)}, metadata)
    return tokenizer_from_gguf(src)


@pytest.fixture(scope="module", params=[None, False], ids=["space-prefix", "no-prefix"])
def spm(request, tmp_path_factory) -> tuple[Tokenizer, bool]:
    prefix = request.param is None
    return spm_tokenizer(tmp_path_factory.mktemp("spm"), request.param), prefix


def test_sentencepiece_vocabulary_encodes_as_llamacpp(spm):
    tok, prefix = spm
    pieces = [tok.id_to_token(i) for i in tok.encode("hello world")]
    assert pieces == (["▁hello", "▁world"] if prefix else ["he", "llo", "▁world"])
    assert tok.decode(tok.encode("hello world")) == "hello world"
    # "é" is no token: its two UTF-8 bytes; "✓" its three.
    assert [tok.id_to_token(i) for i in tok.encode("é✓")][-5:] == [
        "<0xC3>", "<0xA9>", "<0xE2>", "<0x9C>", "<0x93>"]
    assert tok.decode(tok.encode("é✓")) == "é✓"
    # BOS framing (llama.cpp's default for SPM); specials matched whole and
    # skipped on decode; the stretch after a special token gets its own prefix space.
    assert tok.encode("the", add_special_tokens=True)[0] == 1
    ids = tok.encode("</s>the")
    assert ids[0] == 2 and [tok.id_to_token(i) for i in ids[1:]] == (
        ["▁the"] if prefix else ["th", "e"])
    assert tok.decode(ids) == ("the" if prefix else "the")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("helowrdtabck, ") + ["é", "✓", "\n", "😀"]),
               max_size=24))
def test_sentencepiece_matches_llamacpp_and_round_trips(spm, text):
    tok, prefix = spm
    tokens, scores, types = spm_vocab(320)
    ids = tok.encode(text)
    assert ids == spm_reference(text, tokens, scores, types, prefix)
    assert tok.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=100, deadline=None)
@given(st.text().filter(lambda t: "▁" not in t and "<" not in t))
def test_sentencepiece_round_trips_any_text(spm, text):
    tok, _ = spm
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_unsupported_tokenizer_model_is_one_line(tmp_path):
    def metadata(w: gguf.GGUFWriter) -> None:
        put_common(w, {"num_hidden_layers": 1, "max_position_embeddings": 64, "hidden_size": 8,
                       "num_attention_heads": 2, "num_key_value_heads": 2,
                       "rms_norm_eps": 1e-5}, 8)
        w.add_tokenizer_model("bert")
        w.add_token_list(["a"])

    src = tmp_path / "bert.gguf"
    write_gguf(src, "llama", {"token_embd.weight": np.zeros((1, 8), np.float32)}, metadata)
    with pytest.raises(ModelLoadError, match="unsupported GGUF tokenizer model 'bert'"):
        load_model(src, tmp_path / "cache")


def test_deepseek_v3_pre_tokenizer_splits_as_llamacpp(tmp_path, tiny_model_dir):
    """llama.cpp's "deepseek-v3" splits: digits in threes, CJK runs, and a
    punctuation mark kept with the letters after it."""
    def metadata(w: gguf.GGUFWriter) -> None:
        put_bpe_vocab(w, tiny_model_dir, "deepseek-v3")

    src = tmp_path / "vocab.gguf"
    write_gguf(src, "deepseek2", {}, metadata)
    text = "Hello12345 日本語!x y\n"
    tokenizer_json, _ = gguf_tokenizer_files(open_gguf(src))
    pre = tokenizers.Tokenizer.from_str(json.dumps(tokenizer_json)).pre_tokenizer
    splits = pre.pre_tokenize_str(text)
    assert [text[a:b] for _, (a, b) in splits] == ["Hello", "123", "45", " ", "日本語", "!x",
                                                   " y", "\n"]
