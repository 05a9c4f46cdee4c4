"""Models named by a Hugging Face Hub repo id, as vLLM takes them.

``carpool serve HuggingFaceTB/SmolLM2-135M-Instruct``: a model argument that
is no existing path and reads ``owner/name`` is downloaded with
huggingface_hub (its progress bars, its cache: ``$HF_HUB_CACHE``,
``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``; ``$HF_ENDPOINT``,
``$HF_TOKEN`` and ``$HF_HUB_OFFLINE`` work as everywhere in the HF stack) and
loaded from the snapshot directory. Only what carpool loads is fetched: the
top level's JSON files (config, tokenizer, generation config), chat
templates and safetensors. A repo without safetensors but with GGUF files
(llama.cpp's kind) gives one GGUF file: its only one, or the one a tag after
a colon names, as in llama.cpp's ``-hf owner/name:Q4_K_M``.
"""
from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from carpool.model.hub import ModelFetchError
from carpool.paths import format_bytes, hf_hub_cache, tree_bytes

# owner/name, optionally :tag; the characters and length the Hub allows.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}(:[\w.-]+)?", re.ASCII)
_MODEL_FILES = ["*.json", "*.safetensors", "*.jinja"]
_TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "chat_template.json", "chat_template.jinja"]
# Subfolders hold other formats (original/, onnx/); Mistral's consolidated
# file repeats the sharded weights.
_IGNORED = ["*/*", "consolidated*.safetensors"]
_FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin", ".pt", ".pth")
_T = TypeVar("_T")


def is_repo_id(spec: str) -> bool:
    """Whether ``spec`` names a Hub repo: ``owner/name[:tag]``, no existing
    path, and no model-file name (a missing ``models/x.gguf`` stays a
    missing file rather than a Hub look-up)."""
    if not _REPO_ID.fullmatch(spec) or "--" in spec or ".." in spec:
        return False
    if Path(spec).expanduser().exists():
        return False
    return not spec.partition(":")[0].lower().endswith(_FILE_SUFFIXES)


def download_model(spec: str, tokenizer_only: bool = False) -> Path:
    """The local copy of the repo ``spec`` names: its snapshot directory, or
    the GGUF file chosen in it (see the module docstring). ``tokenizer_only``:
    the tokenizer's files alone. Raises ModelFetchError (one line)."""
    repo_id, _, tag = spec.partition(":")
    patterns = _TOKENIZER_FILES if tokenizer_only else _MODEL_FILES
    snapshot = Path(_hub_call(lambda hub: hub.snapshot_download(
        repo_id, allow_patterns=patterns, ignore_patterns=_IGNORED, **_where())))
    wanted = "tokenizer.json" if tokenizer_only else "*.safetensors"
    path = snapshot if not tag and any(snapshot.glob(wanted)) else _gguf_file(repo_id, tag, snapshot)
    print(f"carpool: {spec} is in the Hugging Face cache: {path} "
          f"({format_bytes(tree_bytes(path))})", file=sys.stderr, flush=True)
    return path


def _gguf_file(repo_id: str, tag: str, snapshot: Path) -> Path:
    """The repo's GGUF file for ``tag`` ("": the only one), fetched once."""
    fetched = sorted(p.name for p in snapshot.glob("*.gguf"))
    name = _pick(fetched, tag, quiet=True) if fetched else None
    if name is None:
        def top_level_ggufs(hub: Any) -> list[str]:
            files = hub.HfApi(endpoint=_where()["endpoint"]).list_repo_files(repo_id)
            return sorted(f for f in files if "/" not in f and f.lower().endswith(".gguf"))

        listed = _hub_call(top_level_ggufs)
        if not listed:
            raise ModelFetchError("the repo holds neither safetensors weights nor a GGUF file")
        name = _pick(listed, tag)
    return Path(_hub_call(lambda hub: hub.hf_hub_download(repo_id, name, **_where())))


def _pick(names: list[str], tag: str, quiet: bool = False) -> str | None:
    """The GGUF file ``tag`` names (case-insensitive, in the file name), or
    the only one when there is no tag; else None if ``quiet``, or an error
    listing the choices."""
    found = [n for n in names if tag.lower() in n.lower()] if tag else names
    if len(found) > 1 and tag:  # Q4_K vs Q4_K_M: a tag that ends the name wins
        found = [n for n in found if n.lower().removesuffix(".gguf").endswith(tag.lower())] \
            or found
    if len(found) == 1:
        return found[0]
    if quiet:
        return None
    choices = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
    if not found:
        raise ModelFetchError(f"no GGUF file of the repo matches :{tag} (it holds {choices})")
    raise ModelFetchError(f"the repo holds {len(found)} GGUF files: name one with "
                          f"owner/name:TAG, e.g. :Q4_K_M ({choices})")


def _where() -> dict[str, Any]:
    """Endpoint and cache, read from the environment now: huggingface_hub
    reads them once, at import, which may predate a change."""
    return {"endpoint": os.environ.get("HF_ENDPOINT") or None, "cache_dir": hf_hub_cache()}


def _hub_call(action: Callable[[Any], _T]) -> _T:
    """Run ``action(huggingface_hub)``, its failures told in one line."""
    try:
        import huggingface_hub as hub
        from huggingface_hub import utils as errors  # where every version exports them
    except ImportError as exc:
        raise ModelFetchError("huggingface_hub is not installed (pip install "
                              "huggingface_hub)") from exc
    endpoint = _where()["endpoint"] or "https://huggingface.co"
    try:
        return action(hub)
    except errors.GatedRepoError as exc:
        raise ModelFetchError("the repo is gated: accept its terms on its Hugging Face page, "
                              "then set HF_TOKEN") from exc
    except errors.RepositoryNotFoundError as exc:
        raise ModelFetchError(f"no such model on the Hugging Face Hub ({endpoint}), or it is "
                              "private (set HF_TOKEN)") from exc
    except errors.RevisionNotFoundError as exc:
        raise ModelFetchError("no such revision of the repo on the Hugging Face Hub") from exc
    except errors.HfHubHTTPError as exc:
        raise ModelFetchError(f"the Hugging Face Hub ({endpoint}) refused: "
                              f"{_first_line(exc)}") from exc
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as exc:
        raise ModelFetchError(f"the Hugging Face Hub ({endpoint}) cannot be reached and the "
                              f"repo is not in the cache {hf_hub_cache()}") from exc
    except Exception as exc:  # network errors of whichever HTTP client the hub library uses
        raise ModelFetchError(f"fetching from the Hugging Face Hub ({endpoint}) failed: "
                              f"{type(exc).__name__}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__
