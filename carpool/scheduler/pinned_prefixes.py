"""Pinned prefixes: prompt prefixes an operator keeps in the prefix cache.

A pin is a prefix (a system prompt, a code snippet) whose full blocks stay
cached until it is unpinned. Its blocks are computed once by an ordinary
request (the pin's *prefill*: the prefix as the prompt, ``max_tokens`` 1, in
the pin's cache namespace, through the normal scheduler path, so its blocks
are registered under exactly the keys later requests look up). When that
request finishes, the blocks caching the prefix's keys are *held*: the KV
manager takes one reference on each (``KVCacheManager.hold``), and a
referenced block is never on a free list, so no eviction can take it,
however hard other traffic presses (session protection, by contrast, only
orders eviction). Unpinning drops the references; the blocks then age out
like any other cached block.

Requests of the pin's namespace whose prompt starts with the prefix find its
blocks as ordinary prefix-cache hits. Each first admission is checked
against the pins for per-pin counters: requests that hit a pin and the
cached tokens it served them (``first_admitted``); ``lookups`` counts every
first admission while some pin is held, the hit rate's denominator.

Who may pin how much is bounded by ``PinLimits`` (checked by the front that
takes the operator's call, ``carpool.engine.pins``): the number of pins
(which bounds the metrics' label set), the tokens of one prefix (the
context less the one token the prefill samples) and the blocks all pins
hold together (a share of the pool). Pure Python.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from carpool.scheduler.kv_manager import KVCacheManager
from carpool.scheduler.request import Request, RequestStatus

OWNER_PREFIX = "prefix:"  # the KV manager's holder name of a pin: prefix:<pin id>


@dataclass(frozen=True)
class PinSpec:
    """One pinned prefix, as the engines behind a front are told it.

    ``pin_id``: ``pin_id_of(token_ids, cache_salt)``, so pinning the same
    prefix in the same namespace twice names the same pin everywhere.
    ``cache_salt``: the namespace (``Request.cache_salt``; None: the shared
    one). ``name``: the metric label; ``namespace``: for people only."""

    pin_id: str
    name: str
    token_ids: tuple[int, ...]
    cache_salt: str | None = None
    namespace: str = "shared"


def pin_id_of(token_ids, cache_salt: str | None) -> str:
    """The id of the pin of ``token_ids`` in namespace ``cache_salt``."""
    digest = hashlib.sha256()
    digest.update(b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode(
        "utf-8", "surrogatepass") + b"\x00")
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.hexdigest()[:16]


class PinError(ValueError):
    """A pin refused: ``kind`` ``invalid`` (bad prefix), ``too_large`` (over
    the token limit), ``conflict`` (the name is another pin's) or ``full``
    (the pin count or the block budget is spent)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class PinLimits:
    """What pins may take of one engine."""

    block_size: int
    max_blocks: int  # blocks all pins may hold together (0: pinning is off)
    max_pins: int
    max_tokens: int  # tokens of one prefix

    @classmethod
    def of(cls, block_size: int, num_blocks: int, share: float, max_pins: int,
           max_model_len: int, prefix_caching: bool = True,
           watermark_blocks: int = 0) -> "PinLimits":
        """``share`` of the pool, less whatever would leave a sequence of
        ``max_model_len`` tokens no room beside the pins: any request the
        engine accepts can still run (none waits for blocks a pin holds)."""
        room = num_blocks - watermark_blocks - -(-max_model_len // block_size)
        blocks = max(0, min(int(num_blocks * share), room)) if prefix_caching else 0
        return cls(block_size, blocks, max_pins, max(0, max_model_len - 1))

    def blocks_of(self, spec: PinSpec) -> int:
        """The full blocks the prefix fills (what its pin holds)."""
        return len(spec.token_ids) // self.block_size

    def check(self, spec: PinSpec, pins: Mapping[str, PinSpec]) -> None:
        """``PinError`` unless ``spec`` may join ``pins`` (a new id)."""
        if self.max_blocks <= 0 or self.max_pins <= 0:
            raise PinError("pinning is off on this server (no prefix caching, or "
                           "--pinned-prefix-share / --max-pinned-prefixes is 0)", "full")
        if len(spec.token_ids) > self.max_tokens:
            raise PinError(f"the prefix has {len(spec.token_ids)} tokens, more than the "
                           f"{self.max_tokens} a pin may hold", "too_large")
        blocks = self.blocks_of(spec)
        if blocks < 1:
            raise PinError(f"the prefix has {len(spec.token_ids)} tokens: less than one "
                           f"{self.block_size}-token block, nothing to pin", "invalid")
        if blocks > self.max_blocks:
            raise PinError(f"the prefix fills {blocks} blocks, more than the {self.max_blocks} "
                           f"all pins may hold (--pinned-prefix-share)", "too_large")
        if any(p.name == spec.name for p in pins.values()):
            raise PinError(f"another pin is named {spec.name!r}", "conflict")
        if len(pins) >= self.max_pins:
            raise PinError(f"{len(pins)} prefixes are pinned, the most allowed "
                           f"(--max-pinned-prefixes); unpin one first", "full")
        held = sum(self.blocks_of(p) for p in pins.values())
        if held + blocks > self.max_blocks:
            raise PinError(f"pins hold {held} blocks; this one's {blocks} more would pass the "
                           f"{self.max_blocks} they may hold (--pinned-prefix-share)", "full")


@dataclass(frozen=True)
class PinStats:
    """One pin's counters in an engine (a fleet sums its replicas')."""

    pin_id: str
    name: str
    blocks: int  # blocks held (0 while its prefill runs)
    hits: int  # requests whose cached prefix began with its blocks
    hit_tokens: int  # cached tokens its blocks served them


class _Held:
    __slots__ = ("spec", "blocks", "hits", "hit_tokens")

    def __init__(self, spec: PinSpec, blocks: list[int]) -> None:
        self.spec, self.blocks = spec, blocks
        self.hits = self.hit_tokens = 0


class PinnedPrefixes:
    """The pins of one engine: their prefills in flight, their held blocks
    and their counters (see the module docstring).

    Invariants: a held pin's blocks are the KV manager's holding
    ``prefix:<id>``, non-empty, cached and in chain order; ``_by_first``
    maps each held pin's first block to exactly the held pins starting with
    it; every pending prefill is a request the scheduler knows by id.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._pending: dict[str, PinSpec] = {}  # prefill request id -> its pin
        self._held: dict[str, _Held] = {}
        self._by_first: dict[int, list[str]] = {}
        self.lookups = 0  # first admissions while some pin was held

    def expect(self, request_id: str, spec: PinSpec) -> None:
        """Request ``request_id`` (queued) computes ``spec``'s prefix: hold
        its blocks when it finishes. Pinning a held pin again does nothing."""
        self._pending[request_id] = spec

    def finished(self, request: Request, status: RequestStatus) -> None:
        """A request leaves; call before its blocks are released. A pin's
        prefill that ran to its end makes its pin held."""
        spec = self._pending.pop(request.request_id, None)
        if spec is None or spec.pin_id in self._held:
            return
        if status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return  # aborted or rejected: nothing computed to hold
        blocks = self.kv.lookup_prefix(request, len(spec.token_ids) // self.kv.block_size)
        if not blocks:
            return
        self.kv.hold(OWNER_PREFIX + spec.pin_id, blocks)
        self._held[spec.pin_id] = _Held(spec, blocks)
        self._by_first.setdefault(blocks[0], []).append(spec.pin_id)

    def unpin(self, pin_id: str) -> bool:
        """Let the pin's blocks go (they stay cached until evicted); a
        prefill still running for it then holds nothing. False: unknown."""
        pending = [rid for rid, spec in self._pending.items() if spec.pin_id == pin_id]
        for request_id in pending:
            del self._pending[request_id]
        held = self._held.pop(pin_id, None)
        if held is None:
            return bool(pending)
        self.kv.unhold(OWNER_PREFIX + pin_id)
        first = self._by_first[held.blocks[0]]
        first.remove(pin_id)
        if not first:
            del self._by_first[held.blocks[0]]
        return True

    def first_admitted(self, request: Request) -> None:
        """Count a request's hits on pins at its first admission (its
        cached blocks lead its block table). A P/D decode leg is not
        counted: its prefill leg was."""
        if not self._held or request.request_id in self._pending or request.kv_handoff:
            return
        self.lookups += 1
        cached = request.num_computed_tokens // self.kv.block_size
        if cached < 1:
            return
        table = self.kv.block_tables[request.request_id]
        for pin_id in self._by_first.get(table[0], ()):
            held = self._held[pin_id]
            matched = 0
            for ours, theirs in zip(table[:cached], held.blocks):
                if ours != theirs:
                    break
                matched += 1
            held.hits += 1
            held.hit_tokens += matched * self.kv.block_size

    def pinned(self) -> list[PinSpec]:
        """The held pins."""
        return [held.spec for held in self._held.values()]

    def stats(self) -> tuple[PinStats, ...]:
        """Every held or pending pin's counters, by pin id."""
        stats = {pin_id: PinStats(pin_id, h.spec.name, len(h.blocks), h.hits, h.hit_tokens)
                 for pin_id, h in self._held.items()}
        for spec in self._pending.values():
            stats.setdefault(spec.pin_id, PinStats(spec.pin_id, spec.name, 0, 0, 0))
        return tuple(stats[k] for k in sorted(stats))

    def check_invariants(self, requests: Mapping[str, Request]) -> None:
        """Raise ``AssertionError`` on inconsistent bookkeeping (tests)."""
        holders = {OWNER_PREFIX + pin_id for pin_id in self._held}
        assert holders == set(self.kv.held), "pins and the KV manager's holdings differ"
        firsts: dict[int, list[str]] = {}
        for pin_id, held in self._held.items():
            assert held.blocks and self.kv.held[OWNER_PREFIX + pin_id] == held.blocks
            assert all(self.kv.pool.ref_counts[b] > 0 for b in held.blocks)
            assert all(self.kv.pool.is_cached(b) for b in held.blocks), "a held block is uncached"
            firsts.setdefault(held.blocks[0], []).append(pin_id)
        assert {b: sorted(p) for b, p in firsts.items()} == {
            b: sorted(p) for b, p in self._by_first.items()}, "first-block index is off"
        assert set(self._pending) <= set(requests), "a pending prefill the scheduler lost"
