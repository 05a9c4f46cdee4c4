"""Where carpool keeps what it fetches (models, traces): one cache root."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CARPOOL_CACHE"


def default_cache_dir() -> Path:
    """``$CARPOOL_CACHE`` if set, else ``~/.cache/carpool``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "carpool"
