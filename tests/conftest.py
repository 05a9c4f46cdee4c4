"""Shared fixtures: a tiny random-weight model for fast tests, and the real
default model (fetched once into the cache dir) loaded once per session."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Triton decides at decoration time whether a kernel compiles for the GPU or
# runs in its interpreter: without a GPU, the kernels' tests (and any test
# that picks the Triton backend) run interpreted on the CPU.
if not os.environ.get("CARPOOL_TEST_TRITON_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")



@pytest.fixture(scope="session", autouse=True)
def _cpu_kernels_built():
    """The C++ CPU kernels built once, before any test (the first engine test
    would build them anyway): a server a test starts then runs them from its
    first step, instead of serving on the portable path while they compile
    and switching midway, which exact-token comparisons must not see."""
    from carpool.model.cpu_kernels import load_cpu_ops

    load_cpu_ops()


TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Continuous batching keeps the GPU busy while users get fast answers.",
    "def add(a, b):\n    return a + b\n",
    "Emoji: 😀👍🏽🚗 and CJK: 你好世界，日本語のテキスト。 Accents: café naïve façade.",
    "Numbers 12345 67890 and punctuation!? (yes) [no] {maybe}",
] * 20

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 512, "tie_word_embeddings": True, "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2,
}

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _write_tiny_model(path: Path) -> Path:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TINY_CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    config = dict(TINY_CONFIG, vocab_size=tokenizer.get_vocab_size())
    (path / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    weights = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": torch.ones(h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h)})
    save_file(weights, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF-style directory: 2-layer random Llama + a small byte-level BPE."""
    return _write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """The default model's GGUF (``CARPOOL_TEST_GGUF`` overrides), fetched once."""
    override = os.environ.get("CARPOOL_TEST_GGUF")
    if override:
        return Path(override)
    from carpool.model.hub import fetch_default_model
    from carpool.paths import default_cache_dir

    return fetch_default_model(default_cache_dir())


@pytest.fixture(scope="session")
def hf_reference(real_model_path: Path):
    """(model, tokenizer) that transformers itself loads from the GGUF, fp32:
    the reference implementation, loaded once per session."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": real_model_path.name}
    model = AutoModelForCausalLM.from_pretrained(real_model_path.parent, dtype=torch.float32,
                                                 **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(real_model_path.parent, **kwargs)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def tiny_async_engine(tiny_model_dir):
    """An ``AsyncEngine`` on the tiny model (torch attention, 16 MiB of KV),
    shut down after the module."""
    from carpool.config import EngineConfig
    from carpool.engine.async_engine import AsyncEngine
    from carpool.engine.llm_engine import LLMEngine

    config = EngineConfig.from_dict({"model": str(tiny_model_dir), "attention_backend": "torch",
                                     "kv_cache_memory": "16MiB"})
    async_engine = AsyncEngine(LLMEngine.from_config(config))
    yield async_engine
    async_engine.shutdown()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config.carpool_exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process with pytest's own status once everything pytest
    does is done (results printed, plugins unconfigured), without the
    interpreter's teardown of the native libraries the session loaded.

    Why: twice a run whose every test passed then died with SIGSEGV (exit
    139) in that teardown: past Python's own finalization (a faulthandler
    enabled here printed nothing), so in native destructors of what the
    session imported (Ray's core worker, Triton's LLVM, torch's and
    llguidance's thread pools, ZeroMQ); a run under gdb exited cleanly.
    None of that teardown is what the tests test, and carpool's own
    shutdown paths (engines, fleets, followers, Ray) are tested explicitly.
    """
    import sys

    status = getattr(config, "carpool_exit_status", None)
    if status is None:  # pytest stopped before a session (usage error): its own way
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
