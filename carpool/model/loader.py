"""Loading a model: config, weights and tokenizer, from a HF directory or a GGUF file.

A GGUF file is converted once into an HF-style directory under
``cache_dir/converted/`` and loaded from there afterwards, so only the first
load pays for dequantization.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import load_file

from carpool.model.config import ModelConfig
from carpool.model.gguf_convert import convert_gguf
from carpool.model.hf_names import expected_shapes
from carpool.model.hub import DEFAULT_MODEL_NAME, fetch_default_model
from carpool.model.tokenizer import Tokenizer
from carpool.paths import default_cache_dir

# Part of every conversion key: bump it when the converter's output changes so
# stale conversions are not reused.
CONVERTER_VERSION = 1
_KEY_SAMPLE_BYTES = 1 << 20
_T = TypeVar("_T")


class ModelLoadError(Exception):
    """A model could not be loaded; the message is one line naming the path and the problem."""


@dataclasses.dataclass
class LoadedModel:
    """A model ready for the executor.

    ``weights`` use HF tensor names and keep the dtype they were stored in
    (float32 for converted GGUF files). ``path`` is the HF-style directory the
    model was loaded from; ``source`` is what the caller named (the GGUF file
    for a converted model).
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: Path
    source: Path | None = None


def load_model(spec: str | Path | None, cache_dir: Path | None = None) -> LoadedModel:
    """Load the model ``spec`` names: None (the default model), a .gguf file or a HF directory.

    ``cache_dir`` (default: `default_cache_dir()`) holds the default model and
    GGUF conversions. Raises ModelLoadError with a one-line message.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if spec is None or str(spec) == DEFAULT_MODEL_NAME:
        path = _guarded(cache_dir, "fetching the default model failed",
                        lambda: fetch_default_model(cache_dir))
    else:
        path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"cannot load model {path}: no such file or directory")
    if path.is_dir():
        return load_model_dir(path)
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"cannot load model {path}: expected a .gguf file or a model directory")
    directory = ensure_converted(path, cache_dir)
    loaded = load_model_dir(directory)
    loaded.source = path
    return loaded


def converted_dir(gguf_path: Path, cache_dir: Path) -> Path:
    """The directory a GGUF file converts into: ``cache_dir/converted/<stem>-<key>``.

    The key hashes the file size and its first and last MiB (and the converter
    version): cheap on a large file, yet a different or rewritten file gets a
    fresh conversion, while a copy of the same file reuses the old one.
    """
    gguf_path = Path(gguf_path)
    digest = hashlib.sha256(f"carpool-gguf-v{CONVERTER_VERSION}".encode())
    with open(gguf_path, "rb") as f:
        size = f.seek(0, 2)
        digest.update(str(size).encode())
        f.seek(0)
        digest.update(f.read(_KEY_SAMPLE_BYTES))
        f.seek(max(0, size - _KEY_SAMPLE_BYTES))
        digest.update(f.read(_KEY_SAMPLE_BYTES))
    return Path(cache_dir) / "converted" / f"{gguf_path.stem}-{digest.hexdigest()[:16]}"


def ensure_converted(gguf_path: Path, cache_dir: Path) -> Path:
    """Convert ``gguf_path`` unless already converted; returns the directory."""
    gguf_path = Path(gguf_path)
    target = _guarded(gguf_path, "cannot read the file", lambda: converted_dir(gguf_path, cache_dir))
    if target.is_dir():
        return target
    return _guarded(gguf_path, "not a usable GGUF file", lambda: convert_gguf(gguf_path, target))


def load_model_dir(path: Path) -> LoadedModel:
    """Load a HF-style directory: config.json, *.safetensors and the tokenizer files."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"cannot load model {path}: no config.json in the directory")
    config = _guarded(config_file, "bad model config", lambda: _read_config(config_file))
    weights = _guarded(path, "cannot read the weights", lambda: _read_weights(path))
    problem = _weights_problem(config, weights)
    if problem:
        raise ModelLoadError(f"cannot load model {path}: {problem}")
    tokenizer = _guarded(path, "cannot load the tokenizer", lambda: Tokenizer.from_dir(path))
    # generation_config.json may list more stop ids than config.json does.
    config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=path)


def _guarded(path: Path, what: str, action: Callable[[], _T]) -> _T:
    """Run ``action``; turn any failure into a one-line ModelLoadError about ``path``."""
    try:
        return action()
    except ModelLoadError:
        raise
    except Exception as exc:  # the loader's contract: one error type, one line
        raise ModelLoadError(f"cannot load model {path}: {what}: {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if len(text) > 300:
        text = text[:297] + "..."
    # ValueError/OSError texts read on their own; other types need their name (KeyError: 'x').
    return text if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: {text}"


def _read_config(config_file: Path) -> ModelConfig:
    with open(config_file, encoding="utf-8") as f:
        return ModelConfig.from_hf_config(json.load(f))


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        shards = [path / name for name in files]
    else:
        shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError("no *.safetensors files (only safetensors checkpoints are supported)")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(shard)))
    return weights


def _weights_problem(config: ModelConfig, weights: dict[str, torch.Tensor]) -> str | None:
    """A description of the first missing or misshapen tensor, or None."""
    expected = expected_shapes(config)
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"checkpoint lacks tensor {missing[0]}{more}"
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            return f"tensor {name} has shape {tuple(weights[name].shape)}, config expects {shape}"
    return None
