"""The scheduler side of a KV connector: prompt blocks loaded from an
external store instead of computed.

A replica whose prefix cache misses part of a prompt asks the external
store (``ExternalKV``: a fleet's shared KV tier, a CPU or disk offload)
how many of the following blocks it holds, by the same chained block
hashes the prefix cache keys. If it holds some, the request is admitted
with blocks for them, loads them (``LOADING``: it holds its blocks and a
sequence slot, but no step schedules it) and joins the running requests
at the first step after the load is done, with those tokens computed.
Steps go on meanwhile: a load never stalls the batch (vLLM's
``get_num_new_matched_tokens`` / ``WAITING_FOR_REMOTE_KVS`` split). Every
prompt block the replica computes is written through to the store
(decode blocks are not: a conversation's next turn re-sends them as its
prompt, and they are saved then). Moving the
bytes is the worker side's business; the scheduler only needs how many
blocks and how long. Pure Python; time from the scheduler's clock.

The live connector is split as vLLM v1 splits it: the *scheduler side*
(``KVConnectorScheduler``) decides loads and saves and hands them to the
*worker side* (``KVConnectorWorker``, on the executor) as a step's
``KVConnectorMeta``; the worker side moves the bytes and reports finished
fetches, which the scheduler side maps back to requests. Neither holds a
reference into the other or into the scheduler.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from carpool.scheduler.request import Request


class ExternalKV(Protocol):
    """An external source of KV blocks: a store keyed by chained block hash,
    or a prefill replica that computed one request's prompt for this one
    (which is why the request is passed too). What the KV manager calls;
    ``block_ids`` are the request's blocks at ``first``, ``first + 1``...
    (its block table's), so the connector needs no view of the scheduler."""

    def loadable(self, request: Request, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (the request's blocks after its local hit)
        it can give, leading ones first (no side effect)."""

    def load(self, request: Request, hashes: Sequence[int], first: int,
             block_ids: Sequence[int]) -> float:
        """Begin loading these blocks into ``block_ids``; seconds until they
        are in the replica, or ``math.inf`` for a live load that reports
        itself done (``PendingLoads.complete``)."""

    def save(self, request: Request, hashes: Sequence[int], first: int,
             block_ids: Sequence[int]) -> None:
        """Prompt blocks the replica has just computed (written through)."""

    def filling(self, request: Request, first: int, block_ids: Sequence[int],
                hashes: Sequence[int]) -> None:
        """This step's forward fills these prompt blocks of an exporting
        request (P/D): they may go out layer by layer as layers finish."""

    def forget(self, request: Request) -> None:
        """``request`` left the replica (its blocks are free)."""


@dataclass(frozen=True)
class LoadOrder:
    """Fetch ``hashes`` into ``block_ids``; ``handoff``: a P/D prefill
    replica is still sending them (wait for its layer parts)."""

    load_id: int
    hashes: tuple[int, ...]
    block_ids: tuple[int, ...]
    handoff: bool = False


@dataclass(frozen=True)
class SaveOrder:
    """Copy ``block_ids`` out now and put them under ``hashes``; ``export``:
    a P/D prefill's (never dropped, sent as layer parts)."""

    hashes: tuple[int, ...]
    block_ids: tuple[int, ...]
    export: bool = False


@dataclass
class KVConnectorMeta:
    """What the scheduler side hands the worker side with a step: loads to
    begin, saves to make, the (block id, hash) pairs of exporting requests
    this step's forward fills (streamed per layer), and the prompt block
    hashes of exporting requests that ended without a decode part to take
    their blocks (aborted, rejected, stopped at once): their store entries
    go now."""

    loads: list[LoadOrder] = field(default_factory=list)
    saves: list[SaveOrder] = field(default_factory=list)
    streamed: list[tuple[int, int]] = field(default_factory=list)
    drops: list[tuple[int, ...]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.streamed or self.drops)


class KVConnectorScheduler(ExternalKV, Protocol):
    """The scheduler side as the engine drives it (besides ``ExternalKV``)."""

    def take_meta(self) -> KVConnectorMeta:
        """The orders decided since the last call (then forgotten here)."""

    def resolve(self, fetched: Sequence[tuple[int, int]]) -> list[tuple[int, Request, int]]:
        """Finished loads ``(load id, blocks that arrived)`` as
        ``(load id, request, tokens)``."""


class KVConnectorWorker(Protocol):
    """The worker side as the engine drives it: it owns the block I/O and
    the store's thread, and knows requests only by the orders it gets."""

    def start(self, meta: KVConnectorMeta) -> None:
        """Carry out a step's orders: copy saved blocks out, begin fetches,
        note the blocks the next forward streams."""

    def begin_forward(self) -> bool:
        """Before the forward: True when it streams layer parts (then
        ``end_forward`` after it, whatever happens)."""

    def end_forward(self) -> None: ...

    def fetched(self) -> list[tuple[int, int]]:
        """Loads whose fetch ended since the last call: (load id, blocks)."""

    def write(self, load_ids: Sequence[int]) -> None:
        """Copy those fetched loads into their blocks; drop the others
        ``fetched`` returned (their requests left: the blocks are not theirs)."""

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a fetch to end."""

    def metrics(self) -> dict: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class PendingLoads:
    """Requests whose KV is loading: each with the time its load is done
    and the prompt tokens it brings."""

    def __init__(self) -> None:
        self._loads: dict[Request, tuple[float, int]] = {}  # in the order they began

    def __len__(self) -> int:
        return len(self._loads)

    def __iter__(self):
        return iter(self._loads)

    def begin(self, request: Request, done_at: float, num_tokens: int) -> None:
        self._loads[request] = (done_at, num_tokens)

    def remove(self, request: Request) -> None:
        del self._loads[request]

    def complete(self, request: Request, num_tokens: int) -> None:
        """A live load is done with ``num_tokens`` tokens (at most the ones
        it began with: fewer when blocks went missing or were refused; the
        rest are computed): the next ``pop_done`` returns it."""
        _, planned = self._loads[request]
        self._loads[request] = (-math.inf, min(num_tokens, planned))

    def pop_done(self, now: float) -> list[tuple[Request, int]]:
        """The loads done by ``now`` (request, tokens loaded), removed, in
        the order they began."""
        done = [(request, tokens) for request, (at, tokens) in self._loads.items() if at <= now]
        for request, _ in done:
            del self._loads[request]
        return done

    @property
    def next_done(self) -> float | None:
        """When the next load is done (None: none in progress)."""
        return min((at for at, _ in self._loads.values()), default=None)
