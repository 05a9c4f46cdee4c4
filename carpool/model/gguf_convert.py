"""Convert a llama.cpp GGUF file into a Hugging Face style model directory.

The output holds config.json, generation_config.json, model.safetensors (every
tensor dequantized to float32, under HF names, then stored in the dtype asked
for: the one the model will be served in), tokenizer.json and
tokenizer_config.json (with the chat template), so the rest of carpool, and
transformers, load it like any HF checkpoint.

Supported: the GGUF architectures of carpool/model/gguf_arch.py ("llama":
Llama, Mistral, SmolLM2 and the like, and Mixtral; "qwen2", "qwen3",
"qwen3moe", "gemma3", "deepseek2"), with a byte-level BPE
(``tokenizer.ggml.model`` = "gpt2") or SentencePiece ("llama") vocabulary
(carpool/model/gguf_tokenizer.py), in any tensor type the ``gguf`` package
dequantizes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from carpool.model.config import ModelConfig
from carpool.model.gguf_arch import gguf_family, gguf_model_config, hf_tensors, unpermute_qk
from carpool.model.gguf_families import K_B_PROJ, V_B_PROJ, GGUFFamily
from carpool.model.gguf_tokenizer import gguf_tokenizer_files

__all__ = ["convert_gguf", "gguf_tokenizer_files", "gguf_weights", "open_gguf", "unpermute_qk"]
_STALE_TEMP_SECONDS = 6 * 3600


def convert_gguf(gguf_path: str | Path, out_dir: str | Path,
                 dtype: torch.dtype = torch.float32, progress: bool = False) -> Path:
    """Convert ``gguf_path`` into the HF-style directory ``out_dir`` and return it.

    Weights are stored in ``dtype`` (each dequantized to float32 first, then
    cast: the same values a float32 copy cast at load time would give).
    ``progress``: a progress bar over the tensors on stderr (shown on a
    terminal only). The directory appears atomically: files are written to a
    temporary sibling that is renamed into place, so an interrupted conversion
    leaves no partial ``out_dir``. If ``out_dir`` already exists (another
    process won the race) it is left alone. Raises ValueError for unsupported
    or malformed files.
    """
    out_dir = Path(out_dir)
    reader = open_gguf(gguf_path)
    config = gguf_model_config(reader)
    weights = gguf_weights(reader, config, dtype, progress)
    tokenizer_json, tokenizer_config = gguf_tokenizer_files(reader)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_json(tmp / "config.json", config.to_hf_config())
        _write_json(tmp / "generation_config.json", generation)
        _write_json(tmp / "tokenizer.json", tokenizer_json)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # mkdtemp (and safetensors) create private modes; a cache entry is ordinary.
        for written in tmp.iterdir():
            written.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not out_dir.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _remove_stale_temps(out_dir: Path) -> None:
    """Delete temporaries that killed conversions left behind (hours old, so not a live one)."""
    cutoff = time.time() - _STALE_TEMP_SECONDS
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        try:
            if stale.stat().st_mtime < cutoff:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def open_gguf(gguf_path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file, naming the likely problem when it cannot be parsed."""
    try:
        return gguf.GGUFReader(str(gguf_path))
    except (ValueError, IndexError, OverflowError) as exc:
        if "magic" in str(exc).lower():
            raise ValueError("not a GGUF file (bad magic number)") from exc
        # The reader maps every tensor up front; a short file fails while doing so.
        raise ValueError(f"truncated or corrupt GGUF file ({exc})") from exc


def gguf_weights(reader: gguf.GGUFReader, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 progress: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its HF name, with what
    llama.cpp's converter changed undone (``_restore``), then cast to
    ``dtype`` (one tensor at a time: the float32 copy of the whole model
    never exists when ``dtype`` is 16-bit)."""
    family = gguf_family(reader)
    weights: dict[str, torch.Tensor] = {}
    # disable=None: the bar shows on a terminal only, never in logs.
    bar = tqdm(reader.tensors, desc="carpool: converting", unit="tensor", file=sys.stderr,
               disable=None if progress else True, leave=False)
    for tensor in bar:
        if tensor.name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling
        named = hf_tensors(family, tensor.name, _dequantized(tensor))
        if named is None:
            raise ValueError(f"unexpected tensor {tensor.name!r} for a {config.architecture} model")
        for name, part in named:
            weights[name] = torch.from_numpy(_restore(family, config, name, part)).to(dtype)
    join_split_kv_b(weights, config)
    return weights


def _dequantized(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32 in HF's (row-major) shape; ValueError for a
    tensor type the ``gguf`` package cannot dequantize."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"cannot dequantize tensor {tensor.name!r} of type "
                         f"{tensor.tensor_type.name}") from exc
    array = np.array(values, dtype=np.float32, copy=True)
    expected = tuple(int(n) for n in reversed(tensor.shape))
    return array if array.shape == expected else array.reshape(expected)


def _restore(family: GGUFFamily, config: ModelConfig, name: str, array: np.ndarray) -> np.ndarray:
    """Undo llama.cpp's change to one HF tensor: q/k rows permuted for its
    rotary (llama, Mixtral), norm weights stored shifted (Gemma's 1 + w)."""
    if family.permuted_qk and ".self_attn.q_proj." in name:
        return unpermute_qk(array, config.num_heads)
    if family.permuted_qk and ".self_attn.k_proj." in name:
        return unpermute_qk(array, config.num_kv_heads)
    if family.norm_shift and name.endswith("norm.weight"):
        return array - np.float32(family.norm_shift)
    return array


def join_split_kv_b(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Rebuild each layer's ``kv_b_proj`` from llama.cpp's split ``attn_k_b``
    ([heads, kv_lora_rank, qk_nope]: each head's key rows, transposed) and
    ``attn_v_b`` ([heads, v_head_dim, kv_lora_rank]), in place. HF's rows
    are per head: its qk_nope key rows, then its v_head_dim value rows."""
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        if prefix + K_B_PROJ not in weights:
            continue
        k_b, v_b = weights.pop(prefix + K_B_PROJ), weights.pop(prefix + V_B_PROJ, None)
        if v_b is None or k_b.dim() != 3 or v_b.dim() != 3:
            raise ValueError(f"layer {i}: attn_k_b needs its attn_v_b, both 3-D")
        per_head = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
        weights[prefix + "self_attn.kv_b_proj.weight"] = per_head.reshape(-1, k_b.shape[1]).contiguous()


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2 if path.name != "tokenizer.json" else None)
