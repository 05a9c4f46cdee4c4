"""Built-in settings profiles: YAML files with the same layout as ``--config``.

``--profile NAME`` loads ``carpool/profiles/NAME.yaml``; a path to a YAML
file works too. Flags and ``--config`` override what a profile sets.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from carpool.config import read_yaml

_DIR = Path(__file__).parent


def list_profiles() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.yaml"))


def load_profile(name_or_path: str) -> dict[str, Any]:
    """The settings of a built-in profile or a YAML file."""
    builtin = _DIR / f"{name_or_path}.yaml"
    if builtin.is_file():
        return read_yaml(builtin)
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return read_yaml(path)
    raise ValueError(f"unknown profile {name_or_path!r}; built-in profiles: "
                     f"{', '.join(list_profiles())} (or give a YAML file)")
