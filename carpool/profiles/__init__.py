"""Built-in settings profiles: YAML files with the same layout as ``--config``.

``--profile NAME`` loads ``carpool/profiles/NAME.yaml``; a path to a YAML
file works too. Flags and ``--config`` override what a profile sets. A
profile may also carry a time-of-day ``schedule:`` (see ``schedule.py``);
it resolves to the settings of the current local time at start-up.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from carpool.config import read_yaml

_DIR = Path(__file__).parent


def list_profiles() -> list[str]:
    """Names of the built-in profiles, sorted."""
    return sorted(p.stem for p in _DIR.glob("*.yaml"))


def profile_path(name_or_path: str) -> Path:
    """The YAML file of a built-in profile name or a path to a YAML file."""
    builtin = _DIR / f"{name_or_path}.yaml"
    if builtin.is_file():
        return builtin
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    raise ValueError(f"unknown profile {name_or_path!r}; built-in profiles: "
                     f"{', '.join(list_profiles())} (or give a YAML file)")


def load_profile(name_or_path: str) -> dict[str, Any]:
    """The settings of a built-in profile or a YAML file (``schedule`` included)."""
    return read_yaml(profile_path(name_or_path))


def describe(name_or_path: str) -> str:
    """A profile's one-line description: its leading comment up to the first
    blank comment line, joined into one line ('' if the file has none)."""
    words: list[str] = []
    for line in profile_path(name_or_path).read_text(encoding="utf-8").splitlines():
        text = line.lstrip("#").strip()
        if not line.startswith("#") or (not text and words):
            break
        words += text.split()
    return " ".join(words)
