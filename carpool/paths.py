"""Where carpool keeps what it fetches (models, traces): one cache root."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CARPOOL_CACHE"


def default_cache_dir() -> Path:
    """``$CARPOOL_CACHE`` if set, else ``~/.cache/carpool``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "carpool"


def hf_hub_cache() -> Path:
    """Where Hugging Face Hub downloads go, by huggingface_hub's own rule
    (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``),
    read when called: huggingface_hub reads it once, at import."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def tree_bytes(root: Path) -> int:
    """Bytes in the files under ``root`` (``root`` itself when a file; files
    vanishing meanwhile count 0)."""
    root = Path(root)
    total = 0
    for path in [root, *root.rglob("*")] if root.is_dir() else [root]:
        try:
            total += path.stat().st_size if path.is_file() else 0
        except OSError:
            pass
    return total


def format_bytes(count: int) -> str:
    """``count`` bytes as people read them: 93 MB, 1.2 GB (decimal units, as pip and HF)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            value = count / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{count} B"
