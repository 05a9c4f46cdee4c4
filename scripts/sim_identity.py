#!/usr/bin/env python
"""Compare two folders written by scripts/sim_identity.sh: every JSON must
be equal except for wall-clock fields (and paths of the code that ran).

    python scripts/sim_identity.py OLD_DIR NEW_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

# Keys whose values depend on when and how fast the run went, not on what it simulated.
VOLATILE = {"started_at", "speed", "json", "html"}


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _first_difference(a, b, path="$"):
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}.{key}: only in {'new' if key not in a else 'old'}"
            found = _first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def main(old_dir: str, new_dir: str) -> int:
    status = 0
    for old in sorted(Path(old_dir).glob("*.json")):
        new = Path(new_dir) / old.name
        if not new.is_file():
            print(f"MISSING {new}")
            status = 1
            continue
        diff = _first_difference(_strip(json.loads(old.read_text())),
                                 _strip(json.loads(new.read_text())))
        print(f"{'SAME   ' if diff is None else 'DIFFERS'} {old.name}" + (f": {diff}" if diff else ""))
        status |= diff is not None
    return status


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
