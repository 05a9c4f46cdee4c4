"""Loading a model: config, weights and tokenizer, from a HF directory, a GGUF
file or a Hugging Face Hub repo id.

A GGUF file is converted once into an HF-style directory under
``cache_dir/converted/``, in the dtype the model will be served in, and
loaded from there afterwards, so only the first load pays for
dequantization. A repo id (``owner/name``) is downloaded into the Hugging
Face cache first (carpool/model/hf_repo.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import tokenizers
import torch
from safetensors import safe_open

from carpool.model.arch import Architecture, architecture_of
from carpool.model.config import ModelConfig
from carpool.model.gguf_arch import gguf_model_config
from carpool.model.gguf_convert import convert_gguf, gguf_tokenizer_files, open_gguf
from carpool.model.hf_names import expected_shapes
from carpool.model.hf_repo import download_model, is_repo_id
from carpool.model.hub import DEFAULT_MODEL_NAME, ModelFetchError, fetch_default_model
from carpool.model.tokenizer import Tokenizer, compile_chat_template, read_chat_template
from carpool.paths import default_cache_dir, format_bytes, tree_bytes

# Part of every conversion key: bump it when the converter's output changes so
# stale conversions are not reused.
CONVERTER_VERSION = 2
_KEY_SAMPLE_BYTES = 1 << 20
_T = TypeVar("_T")


class ModelLoadError(Exception):
    """A model could not be loaded; the message is one line naming the path and the problem."""


@dataclasses.dataclass
class LoadedModel:
    """A model ready for the executor.

    ``weights`` use HF tensor names and keep the dtype they were stored in
    (for a converted GGUF file, the dtype ``load_model`` was asked for).
    ``path`` is the HF-style directory the model was loaded from; ``source``
    is what the caller named (the GGUF file for a converted model).
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: Path
    source: Path | None = None


def load_model(spec: str | Path | None, cache_dir: Path | None = None,
               dtype: torch.dtype | None = None, tokenizer: str | None = None,
               chat_template: str | None = None) -> LoadedModel:
    """Load the model ``spec`` names: None (the default model), a .gguf file,
    a HF directory or a Hugging Face Hub repo id (``owner/name``).

    ``cache_dir`` (default: `default_cache_dir()`) holds the default model and
    GGUF conversions. ``dtype``: the dtype a GGUF file is converted to (the
    one the model will be served in; default float32); a HF directory's
    weights stay as stored. ``tokenizer``: another tokenizer (a directory, a
    tokenizer.json, a .gguf or a repo id; vLLM's ``--tokenizer``);
    ``chat_template``: a template file or the template text (vLLM's
    ``--chat-template``), checked before any weight is read. Raises
    ModelLoadError with a one-line message.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    template = _chat_template(chat_template) if chat_template is not None else None
    own_tokenizer = load_tokenizer(tokenizer, cache_dir) if tokenizer is not None else None
    path = model_path(spec, cache_dir)
    if not path.exists():
        raise ModelLoadError(f"cannot load model {path}: no such file or directory")
    if path.is_dir():
        loaded = load_model_dir(path, own_tokenizer)
    elif path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"cannot load model {path}: expected a .gguf file or a model directory")
    else:
        loaded = _load_gguf(path, cache_dir, dtype or torch.float32, own_tokenizer)
    if template is not None:
        loaded.tokenizer = loaded.tokenizer.with_chat_template(template)
    return loaded


def model_path(spec: str | Path | None, cache_dir: Path, tokenizer_only: bool = False) -> Path:
    """The local path of the model ``spec`` names: the default model's GGUF
    file (fetched on first use), a Hub repo's download, or ``spec`` itself."""
    if spec is None or str(spec) == DEFAULT_MODEL_NAME:
        return _guarded(cache_dir, "fetching the default model failed",
                        lambda: fetch_default_model(cache_dir))
    text = str(spec)
    if isinstance(spec, str) and is_repo_id(text):
        try:
            return download_model(text, tokenizer_only)
        except ModelFetchError as exc:
            kind = "tokenizer" if tokenizer_only else "model"
            raise ModelLoadError(f"cannot load {kind} {text} (no such local path; tried the "
                                 f"Hugging Face Hub): {exc}") from exc
    return Path(text).expanduser()


def load_tokenizer(spec: str | Path | None, cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer ``spec`` names: a model directory, a tokenizer.json, a
    .gguf file (read from its metadata; no conversion), a Hub repo id (its
    tokenizer files alone) or None (the default model's). Raises
    ModelLoadError with a one-line message."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = model_path(spec, cache_dir, tokenizer_only=True)
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if path.is_dir():
        return _guarded(path, "cannot load the tokenizer", lambda: Tokenizer.from_dir(path),
                        kind="tokenizer")
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _guarded(path, "not a usable GGUF file", lambda: tokenizer_from_gguf(path),
                        kind="tokenizer")
    problem = "no such file or directory" if not path.exists() else \
        "expected a directory, a tokenizer.json or a .gguf file"
    raise ModelLoadError(f"cannot load tokenizer {path}: {problem}")


def tokenizer_from_gguf(gguf_path: Path) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes (what its conversion would hold)."""
    reader = open_gguf(gguf_path)
    tokenizer_json, tokenizer_config = gguf_tokenizer_files(reader)
    backend = tokenizers.Tokenizer.from_str(json.dumps(tokenizer_json))
    generation = {"eos_token_id": gguf_model_config(reader).eos_token_ids}
    return Tokenizer.from_parts(backend, tokenizer_config, generation)


def _chat_template(value: str) -> str:
    """``--chat-template``'s text, compiled once now so a bad one fails at start-up."""
    shown = value if len(value) <= 60 else value[:57] + "..."
    try:
        template = read_chat_template(value)
        compile_chat_template(template)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"cannot use chat template {shown!r}: {_one_line(exc)}") from exc
    return template


def _load_gguf(path: Path, cache_dir: Path, dtype: torch.dtype,
               tokenizer: Tokenizer | None) -> LoadedModel:
    """Load ``path``'s conversion; one that no longer loads (a damaged disk,
    an older carpool's) is converted again, once."""
    fresh = not _guarded(path, "cannot read the file",
                         lambda: converted_dir(path, cache_dir, dtype)).is_dir()
    directory = ensure_converted(path, cache_dir, dtype)
    try:
        loaded = load_model_dir(directory, tokenizer)
    except ModelLoadError as exc:
        if fresh:
            raise
        print(f"carpool: the cached conversion {directory} does not load ({exc}); converting "
              "again", file=sys.stderr, flush=True)
        shutil.rmtree(directory, ignore_errors=True)
        loaded = load_model_dir(ensure_converted(path, cache_dir, dtype), tokenizer)
    loaded.source = path
    return loaded


def converted_dir(gguf_path: Path, cache_dir: Path, dtype: torch.dtype | None = None) -> Path:
    """The directory a GGUF file converts into: ``cache_dir/converted/<stem>-<key>``,
    with ``-<dtype>`` after it unless float32 (the name every carpool used).

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
    suffix = "" if dtype in (None, torch.float32) else f"-{_dtype_name(dtype)}"
    return Path(cache_dir) / "converted" / f"{gguf_path.stem}-{digest.hexdigest()[:16]}{suffix}"


def ensure_converted(gguf_path: Path, cache_dir: Path, dtype: torch.dtype | None = None) -> Path:
    """Convert ``gguf_path`` (to ``dtype``, default float32) unless already
    converted; returns the directory. Says on stderr what it converts and
    what the cache then holds."""
    gguf_path = Path(gguf_path)
    dtype = dtype or torch.float32
    target = _guarded(gguf_path, "cannot read the file",
                      lambda: converted_dir(gguf_path, cache_dir, dtype))
    if target.is_dir():
        return target
    source = f"{gguf_path.name} ({format_bytes(tree_bytes(gguf_path))})"
    print(f"carpool: converting {source} to {_dtype_name(dtype)} safetensors (once) ...",
          file=sys.stderr, flush=True)
    out = _guarded(gguf_path, "not a usable GGUF file",
                   lambda: convert_gguf(gguf_path, target, dtype, True))
    print(f"carpool: cached {out} ({format_bytes(tree_bytes(out))}; converted from "
          f"{gguf_path})", file=sys.stderr, flush=True)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_model_dir(path: Path, tokenizer: Tokenizer | None = None) -> LoadedModel:
    """Load a HF-style directory: config.json, *.safetensors and the tokenizer
    files (unless ``tokenizer`` is given)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"cannot load model {path}: no config.json in the directory")
    config, arch = _guarded(config_file, "bad model config", lambda: _read_config(config_file))
    weights = _guarded(path, "cannot read the weights", lambda: _read_weights(path, arch))
    problem = _weights_problem(config, weights)
    if problem:
        raise ModelLoadError(f"cannot load model {path}: {problem}")
    if tokenizer is None:
        tokenizer = _guarded(path, "cannot load the tokenizer", lambda: Tokenizer.from_dir(path))
    # generation_config.json may list more stop ids than config.json does.
    config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, path=path)


def _guarded(path: Path, what: str, action: Callable[[], _T], kind: str = "model") -> _T:
    """Run ``action``; turn any failure into a one-line ModelLoadError about ``path``."""
    try:
        return action()
    except ModelLoadError:
        raise
    except Exception as exc:  # the loader's contract: one error type, one line
        raise ModelLoadError(f"cannot load {kind} {path}: {what}: {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if len(text) > 300:
        text = text[:297] + "..."
    # ValueError/OSError texts read on their own; other types need their name (KeyError: 'x').
    return text if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: {text}"


def _read_config(config_file: Path) -> tuple[ModelConfig, Architecture]:
    with open(config_file, encoding="utf-8") as f:
        raw = json.load(f)
    return ModelConfig.from_hf_config(raw), architecture_of(raw)


def _read_weights(path: Path, arch: Architecture) -> dict[str, torch.Tensor]:
    """Every tensor the decoder reads, under the name it reads it by
    (``Architecture.checkpoint_name``: a multimodal checkpoint's text model)."""
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
        with safe_open(str(shard), framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 - safe_open is not a dict
                name = arch.checkpoint_name(key)
                if name is not None:
                    weights[name] = tensors.get_tensor(key)
    return weights


def _weights_problem(config: ModelConfig, weights: dict[str, torch.Tensor]) -> str | None:
    """A description of the first missing or misshapen tensor, or None."""
    expected = expected_shapes(config, weights.keys())
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"checkpoint lacks tensor {missing[0]}{more}"
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            return f"tensor {name} has shape {tuple(weights[name].shape)}, config expects {shape}"
    return None
