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
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from carpool.scheduler.request import Request


class ExternalKV(Protocol):
    """An external source of KV blocks: a store keyed by chained block hash,
    or a prefill replica that computed one request's prompt for this one
    (which is why the request is passed too)."""

    def loadable(self, request: Request, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (the request's blocks after its local hit)
        it can give, leading ones first (no side effect)."""

    def load(self, request: Request, hashes: Sequence[int], first: int) -> float:
        """Begin loading these blocks (the request's blocks ``first``,
        ``first + 1``, ... in its block table); seconds until they are in
        the replica, or ``math.inf`` for a live load that reports itself
        done (``PendingLoads.complete``)."""

    def save(self, request: Request, hashes: Sequence[int], first: int) -> None:
        """Prompt blocks the replica has just computed (written through),
        the request's blocks ``first``, ``first + 1``, ..."""


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
