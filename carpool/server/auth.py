"""Who is calling: API keys, the tenant each belongs to, and its privileges.

A key maps to a ``Principal``: the tenant its requests are accounted to
(session ids and the prefix cache are scoped by it) and the best priority
class it may claim. Privileges are bound to keys, never taken from the
request: a client's ``priority`` is clamped to what its key allows.

The keys file (``--api-keys FILE``, YAML or JSON)::

    keys:
      - key: sk-ops-...          # or key_env: NAME, read from the environment
        tenant: ops
        max_priority: high       # high | normal | low (default normal)
        operator: true           # may read the server's step log (GET /carpool/steps)
      - key: sk-team-a-...
        tenant: team-a
        share_prefix_cache: true # reuse cached prefixes with other sharing tenants
"""
from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

# Priority classes (lower runs first, vLLM's convention). Every request's
# priority is one of these, so the aging bound (one class per aging
# interval) holds for all: at most 2 classes to climb.
PRIORITY_CLASSES = {"high": -1, "normal": 0, "low": 1}
BEST_PRIORITY = min(PRIORITY_CLASSES.values())
WORST_PRIORITY = max(PRIORITY_CLASSES.values())


@dataclass(frozen=True)
class Principal:
    """The caller as the server knows it after authentication."""

    tenant: str
    max_priority: int = PRIORITY_CLASSES["normal"]  # the best class it may claim
    share_prefix_cache: bool = False
    # May read what spans tenants: the step log's shapes and timings of
    # everyone's requests (GET /carpool/steps).
    operator: bool = False

    def clamp_priority(self, requested: int) -> int:
        """``requested`` moved into [this key's best class, low]."""
        return min(WORST_PRIORITY, max(self.max_priority, requested))


# A server without keys, or with the one ``--api-key``: every caller is the
# same tenant (so the operator too), and nobody may claim more than normal
# priority.
ANONYMOUS = Principal("default", operator=True)


class KeyRing:
    """API keys -> principals. Keys are compared in constant time: the
    caller's key is hashed and compared with every stored digest, with no
    early exit, so timing tells nothing about which key came close."""

    def __init__(self, keys: dict[str, Principal]) -> None:
        self._digests = [(_digest(key.encode()), who) for key, who in keys.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def authenticate(self, authorization: bytes) -> Principal | None:
        """The principal of an ``Authorization: Bearer KEY`` header value, or None."""
        scheme, _, key = authorization.partition(b" ")
        digest = _digest(key.strip())
        found = None
        for stored, who in self._digests:
            if hmac.compare_digest(stored, digest) and scheme.lower() == b"bearer":
                found = who
        return found

    @classmethod
    def from_config(cls, api_key: str | None, api_keys_file: str | None) -> "KeyRing":
        keys = {api_key: ANONYMOUS} if api_key else {}
        if api_keys_file:
            keys.update(read_keys_file(api_keys_file))
        return cls(keys)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def read_keys_file(path: str | Path) -> dict[str, Principal]:
    """Parse a keys file; ``ValueError`` naming the entry on any mistake."""
    from carpool.config import read_yaml

    data = read_yaml(path)
    entries = data.get("keys")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a non-empty list under 'keys'")
    keys: dict[str, Principal] = {}
    for index, entry in enumerate(entries):
        where = f"{path}: keys[{index}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping")
        unknown = set(entry) - {"key", "key_env", "tenant", "max_priority", "share_prefix_cache",
                                "operator"}
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
        key = _entry_key(entry, where)
        tenant = entry.get("tenant")
        if not isinstance(tenant, str) or not tenant or len(tenant) > 128:
            raise ValueError(f"{where}: 'tenant' must be a non-empty string (at most 128 chars)")
        level = entry.get("max_priority", "normal")
        if level not in PRIORITY_CLASSES:
            raise ValueError(f"{where}: max_priority must be one of {sorted(PRIORITY_CLASSES)}")
        if key in keys:
            raise ValueError(f"{where}: the same key appears twice")
        flags = {name: entry.get(name, False) for name in ("share_prefix_cache", "operator")}
        wrong = [name for name, value in flags.items() if not isinstance(value, bool)]
        if wrong:
            raise ValueError(f"{where}: {', '.join(wrong)} must be true or false")
        keys[key] = Principal(tenant, PRIORITY_CLASSES[level], **flags)
    return keys


def _entry_key(entry: dict, where: str) -> str:
    if ("key" in entry) == ("key_env" in entry):
        raise ValueError(f"{where}: give exactly one of 'key' or 'key_env'")
    key = entry.get("key")
    if "key_env" in entry:
        key = os.environ.get(str(entry["key_env"]))
        if not key:
            raise ValueError(f"{where}: environment variable {entry['key_env']!r} is not set")
    if not isinstance(key, str) or len(key) < 8:
        raise ValueError(f"{where}: a key must be a string of at least 8 characters")
    return key
