"""``--tokenizer`` and ``--chat-template`` (vLLM's flags): a tokenizer or chat
template other than the model's own, and one clear line at start-up when
they cannot be used."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub
from test_model_files import write_gguf

from carpool.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.model import loader
from carpool.model.loader import ModelLoadError, load_model, load_tokenizer

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}]


def engine(model: Path, **settings: str) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig.from_dict({
        "model": str(model), "attention_backend": "torch", "kv_cache_memory": "8MiB",
        **settings}))


def test_a_chat_template_given_as_text_or_as_a_file(tiny_model_dir, tmp_path):
    own = engine(tiny_model_dir).tokenizer.apply_chat_template(MESSAGES)
    assert own == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    as_text = engine(tiny_model_dir, chat_template=TEMPLATE).tokenizer
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    as_file = engine(tiny_model_dir, chat_template=str(tmp_path / "chat.jinja")).tokenizer
    assert as_text.apply_chat_template(MESSAGES) == as_file.apply_chat_template(MESSAGES) \
        == "[user] hi\n"
    assert as_file.chat_template == TEMPLATE


@pytest.mark.parametrize("template,needle", [
    ("{% for m in messages %}{{ m }}", "does not compile (line 1)"),
    ("{{ messages | no_such_filter }}", "does not compile"),
    ("templates/missing.jinja", "no such file, and no template text either"),
])
def test_a_bad_chat_template_fails_before_the_weights_load(tiny_model_dir, monkeypatch, template,
                                                           needle):
    def no_weights(path: Path, arch: object = None) -> None:
        raise AssertionError("read the weights before checking the template")

    monkeypatch.setattr(loader, "_read_weights", no_weights)
    with pytest.raises(ModelLoadError) as info:
        engine(tiny_model_dir, chat_template=template)
    message = str(info.value)
    assert "\n" not in message and message.startswith("cannot use chat template ") \
        and needle in message, message


def test_a_bad_chat_template_is_one_line_from_the_command_line(tiny_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "generate", "hi", "--model", str(tiny_model_dir),
         "--attention-backend", "torch", "--chat-template", "{% if %}"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("carpool: error: cannot use chat template '{% if %}': "), lines
    assert "Traceback" not in result.stderr


def other_tokenizer(tiny_model_dir: Path, where: Path) -> Path:
    """The tiny tokenizer with another chat template and <unk> as its EOS."""
    where.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", where / "tokenizer.json")
    (where / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<unk>", "chat_template": TEMPLATE}))
    return where


def test_another_tokenizer_directory_or_file(tiny_model_dir, tmp_path):
    other = other_tokenizer(tiny_model_dir, tmp_path / "other")
    for spec in (other, other / "tokenizer.json"):
        served = engine(tiny_model_dir, tokenizer=str(spec))
        assert served.tokenizer.apply_chat_template(MESSAGES) == "[user] hi\n"
        unk = served.tokenizer.token_to_id("<unk>")
        assert unk in served.tokenizer.eos_token_ids and unk in served.model_config.eos_token_ids
    both = engine(tiny_model_dir, tokenizer=str(other), chat_template="{{ 'fixed' }}")
    assert both.tokenizer.apply_chat_template(MESSAGES) == "fixed"


def test_a_model_without_tokenizer_files_runs_with_another_tokenizer(tiny_model_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, bare / name)
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        engine(bare)
    served = engine(bare, tokenizer=str(tiny_model_dir))
    served.add_request("The quick brown fox")
    while served.has_unfinished:
        served.step()


def test_a_gguf_tokenizer_is_read_without_converting(tmp_path):
    write_gguf(tmp_path / "tiny.gguf")
    tokenizer = load_tokenizer(tmp_path / "tiny.gguf", tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    converted = load_model(tmp_path / "tiny.gguf", tmp_path / "cache").tokenizer
    for text in ("the the", "<|im_start|>héllo 12<|im_end|>"):
        assert tokenizer.encode(text) == converted.encode(text)
    assert (tokenizer.eos_token_ids, tokenizer.bos_token_id, tokenizer.chat_template) == \
        (converted.eos_token_ids, converted.bos_token_id, converted.chat_template)


def test_a_tokenizer_repo_id_fetches_only_the_tokenizer(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with FakeHub({"tiny/llama": FakeHub.from_dir(tiny_model_dir)}) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        tokenizer = load_tokenizer("tiny/llama", tmp_path / "cache")
    assert tokenizer.encode("fox") == load_tokenizer(tiny_model_dir).encode("fox")
    fetched = {os.path.basename(p) for m, p in fake.requests if m == "GET" and "/resolve/" in p}
    assert fetched == {"tokenizer.json", "tokenizer_config.json"}


def test_a_missing_tokenizer_is_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(ModelLoadError) as info:
        engine(tiny_model_dir, tokenizer=str(tmp_path / "nowhere"))
    assert str(info.value) == f"cannot load tokenizer {tmp_path / 'nowhere'}: no such file or " \
                              "directory"
