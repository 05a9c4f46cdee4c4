"""Per-request block tables on top of the block pool, with prefix reuse."""
from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from carpool.scheduler.block_pool import BlockPool, LazyRun
from carpool.scheduler.kv_connector import ExternalKV
from carpool.scheduler.kv_events import BlockEvents, BlockKey, BlockKeyChain, KvEventBuffer
from carpool.scheduler.request import Request


@dataclass
class KVCacheStats:
    """Counters are cumulative (Prometheus counters); gauges are current."""

    num_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found cached
    external_hits: int = 0  # of those, tokens loaded from the external store instead

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class KVCacheManager:
    """Owns every request's block table.

    Invariant: ``block_tables[rid]`` covers at least the request's computed
    tokens, each entry holds one reference on its block, and the first
    ``_num_registered[rid]`` entries are registered in the prefix cache,
    keyed or in the request's lazy run (``_run_of[rid]``, while the pool
    still has it). ``held[owner]`` lists blocks a holder (a pinned prefix,
    ``pinned_prefixes``) keeps one reference on each, outside any request:
    cached blocks no eviction can take until ``unhold``.

    ``external`` (``kv_connector.ExternalKV``): a store the blocks past a
    local hit may be loaded from; ``try_admit`` then allocates blocks for
    them too and leaves the load for the caller to take (``take_load``).

    ``block_hash_key``: the secret of the blocks' chained hashes
    (``kv_events.BlockKeyChain``), the same for a whole fleet so its router
    and replicas agree; None: Python's ``hash``, exact within one process
    only (the simulator). The live engine always passes one
    (``CacheConfig.block_hash_secret``).
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, watermark: float = 0.01,
                 external: ExternalKV | None = None, *,
                 block_hash_key: bytes | None = None,
                 session_checkpoint_batches: int = 0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.key_chain = BlockKeyChain(block_size, block_hash_key)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = max(1, int(num_blocks * watermark)) if watermark > 0 else 0
        self.block_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        self._run_of: dict[str, LazyRun] = {}  # request id -> its lazy run while it holds blocks
        self.held: dict[str, list[int]] = {}
        self.num_held_blocks = 0  # distinct blocks in ``held``
        # False keys every block when it is registered: the reference the
        # lazy runs must match exactly (tests compare the two).
        self.lazy_keys = True
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.external = external if enable_prefix_caching else None
        self.external_hits = 0
        self._loads: dict[str, tuple[int, float]] = {}  # admitted, load not yet taken
        # Sessions' checkpoints (``CacheConfig.kv_session_checkpoint_batches``):
        # request id -> (blocks saved to the store, its output tokens then).
        self.session_checkpoint_batches = session_checkpoint_batches
        self._checkpoints: dict[str, tuple[int, int]] = {}
        if self.external is not None:
            self.lazy_keys = False  # the store is told every block's hash

    def report_blocks_to(self, events: BlockEvents) -> None:
        """Tell ``events`` the chained hash of every block cached and evicted
        from now on; call before the first request. Every block is then
        keyed when registered (a lazy one would have no hash to report)."""
        self.pool.events = events
        self.lazy_keys = False

    def event_buffer(self, limit: int = 65536) -> KvEventBuffer:
        """A new ``KvEventBuffer`` this manager reports to (``report_blocks_to``;
        before the first request), resyncing from the pool on overflow.
        Drain it once per engine step for the fleet router. Its first drain
        is a reset with the pool's snapshot, as a subscription starts from
        the state: a restarted engine's listener drops the blocks it still
        held for it (an "all blocks cleared" event), whether or not it saw
        the old engine die."""
        buffer = KvEventBuffer(limit, snapshot=self.pool.reported_hashes)
        buffer.resync()
        self.report_blocks_to(buffer)
        return buffer

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of this many tokens fits in the pool alone."""
        return (self.blocks_for(num_tokens)
                <= self.pool.num_blocks - self.watermark_blocks - self.num_held_blocks)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks that already hold a prefix of the request (no reference taken).

        At least the last token is left uncached: its logits must be computed.
        A lazy run with the same first block gets its keys first (what the
        cache holds stays the same; only how it is indexed changes).
        """
        max_blocks = (request.num_tokens - 1) // self.block_size
        if not self.enable_prefix_caching or max_blocks < 1:
            return []
        self._materialize(self._root(request))
        hits: list[int] = []
        keys = request.block_keys
        while len(hits) < max_blocks:  # keys only as far as the hits go
            self._extend_hashes(request, len(hits) + 1)
            block_id = self.pool.lookup(keys[len(hits)])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def lookup_prefix(self, request: Request, num_blocks: int) -> list[int]:
        """The cached blocks of the request's first ``num_blocks`` full
        blocks, up to the first one not cached (no reference taken; a lazy
        run of the same first block is keyed first)."""
        num_blocks = min(num_blocks, request.num_tokens // self.block_size)
        if not self.enable_prefix_caching or num_blocks < 1:
            return []
        self._materialize(self._root(request))
        self._extend_hashes(request, num_blocks)
        blocks: list[int] = []
        for key in request.block_keys[:num_blocks]:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def hold(self, owner: str, block_ids: list[int]) -> None:
        """Take one reference on each of the cached ``block_ids`` for
        ``owner`` (one holding per owner), until ``unhold(owner)``."""
        assert owner not in self.held, f"{owner} already holds blocks"
        self.pool.acquire(block_ids)
        self.held[owner] = list(block_ids)
        self._count_held()

    def unhold(self, owner: str) -> None:
        """Drop ``owner``'s references (its blocks stay cached, evictable)."""
        blocks = self.held.pop(owner, None)
        if blocks:
            self.pool.release(blocks)
        self._count_held()

    def _count_held(self) -> None:
        self.num_held_blocks = len({b for blocks in self.held.values() for b in blocks})

    def try_admit(self, request: Request, num_new_tokens: int) -> bool:
        """Give a waiting request blocks for its cached prefix plus
        ``num_new_tokens`` more, keeping ``watermark_blocks`` free.

        On success sets ``num_computed_tokens`` to the cached prefix length
        (the caller then schedules from there); on failure changes nothing.
        """
        assert request.request_id not in self.block_tables
        hits = self.find_cached_prefix(request)
        loadable = self._loadable(request, len(hits))
        shortfall, fresh = self._admit_need(request, num_new_tokens, hits, frozenset(), loadable)
        if shortfall > 0:
            return False
        num_cached = len(hits) * self.block_size
        self.pool.acquire(hits)
        self.block_tables[request.request_id] = hits + self.pool.allocate(fresh)
        self._num_registered[request.request_id] = len(hits)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_cached
        request.num_computed_tokens = num_cached
        if request.kv_export and hits and self.external is not None:
            # A P/D prefill exports its whole prompt: the blocks it found
            # cached here too (computed ones are saved as they fill up).
            self._extend_hashes(request, len(hits))
            self.external.save(request, request.block_hashes[:len(hits)], 0, hits)
        if loadable:
            first, table = len(hits), self.block_tables[request.request_id]
            seconds = self.external.load(request, request.block_hashes[first:first + loadable],
                                         first, table[first:first + loadable])
            self._loads[request.request_id] = (loadable * self.block_size, seconds)
            self.external_hits += loadable * self.block_size
        return True

    def take_load(self, request: Request) -> tuple[int, float] | None:
        """(tokens, seconds) of the external load ``try_admit`` began for
        ``request``, once; None if it began none. Those tokens are the
        ones after ``num_computed_tokens``: count them computed when the
        load is done (their blocks are already in the request's table)."""
        return self._loads.pop(request.request_id, None)

    def _loadable(self, request: Request, num_hits: int) -> int:
        """Blocks after the first ``num_hits`` the external store can give
        (the last prompt token is always computed, as for local hits)."""
        if self.external is None:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= num_hits:
            return 0
        self._extend_hashes(request, max_blocks)
        return self.external.loadable(request, request.block_hashes[num_hits:max_blocks])

    def admit_shortfall(self, request: Request, num_new_tokens: int,
                        released: AbstractSet[int] = frozenset(),
                        hits: list[int] | None = None) -> int:
        """Blocks missing for ``try_admit(request, num_new_tokens)`` to succeed
        (<= 0: it would), as if the blocks in ``released`` had no reference
        left. ``hits``: ``find_cached_prefix(request)`` if already known
        (releasing blocks does not change it). Changes nothing the cache
        holds (it may key a lazy run, as ``find_cached_prefix`` does)."""
        if hits is None:
            hits = self.find_cached_prefix(request)
        loadable = self._loadable(request, len(hits))
        return self._admit_need(request, num_new_tokens, hits, released, loadable)[0]

    def _admit_need(self, request: Request, num_new_tokens: int, hits: list[int],
                    released: AbstractSet[int], loadable: int = 0) -> tuple[int, int]:
        """(blocks missing, fresh blocks to allocate) to admit with ``hits``
        reused and ``loadable`` more blocks loaded into fresh ones."""
        num_cached = (len(hits) + loadable) * self.block_size
        num_new_tokens = min(num_new_tokens, request.num_tokens - num_cached)
        # A reused block with no other reference comes off the free list too.
        revived = sum(1 for b in hits if self.pool.ref_counts[b] == 0 or b in released)
        fresh = self.blocks_for(num_cached + num_new_tokens) - len(hits)
        free = self.pool.num_free_blocks + len(released)
        return revived + fresh + self.watermark_blocks - free, fresh

    def try_grow(self, request: Request, num_new_tokens: int) -> bool:
        """Add blocks so a running request can compute ``num_new_tokens`` more."""
        table = self.block_tables[request.request_id]
        fresh = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
        if fresh <= 0:
            return True
        if fresh > self.pool.num_free_blocks:
            return False
        table.extend(self.pool.allocate(fresh))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly computed full blocks for reuse."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self._num_registered[rid]
        if request.num_computed_tokens // self.block_size <= start:
            return  # no block filled up since the last call (most steps)
        table = self.block_tables[rid]
        full = min(request.num_computed_tokens // self.block_size, len(table))
        self._num_registered[rid] = full
        pool, root = self.pool, self._root(request)
        # A request's first registration starts a lazy run when nothing of
        # its chain is cached; the run grows until a lookup from the same
        # first block keys it. Sessions' blocks get protected, which needs
        # keys: never lazy.
        run = self._run_of.get(rid)
        if (run is None and self.lazy_keys and start == 0 and request.session_id is None
                and pool.may_start_lazy(root)):
            run = self._run_of[rid] = pool.start_lazy(root, request)
        if run is not None and pool.lazy_run(root) is run:
            pool.extend_lazy(run, table[start:full])
            return
        self._run_of.pop(rid, None)  # ended by a lookup from the same first block
        self._materialize(root)
        self._extend_hashes(request, full)
        pool.register(table[start:full], request.block_keys[start:full], root,
                      request.block_hashes[start:full] if pool.events is not None else None)
        if self.external is not None:  # the prompt's blocks (LMCache's default too)
            prompt_blocks = min(full, request.num_prompt_tokens // self.block_size)
            if prompt_blocks > start:
                self.external.save(request, request.block_hashes[start:prompt_blocks], start,
                                   table[start:prompt_blocks])
            if request.session_id is not None and self.session_checkpoint_batches:
                self._checkpoint(request, full, ended=False)

    def _checkpoint(self, request: Request, full: int, ended: bool) -> None:
        """Save a session request's output blocks filled since its last
        checkpoint, once ``session_checkpoint_batches`` of its batches (one
        output token each) passed, or at its end (``ended``)."""
        rid = request.request_id
        prompt_blocks = request.num_prompt_tokens // self.block_size
        saved, at = self._checkpoints.get(rid, (prompt_blocks, 0))
        outputs = request.num_output_tokens
        if full <= saved or not (ended or outputs - at >= self.session_checkpoint_batches):
            return
        self._checkpoints[rid] = (full, outputs)
        table = self.block_tables[rid]
        self.external.save(request, request.block_hashes[saved:full], saved, table[saved:full])

    def free(self, request: Request) -> None:
        """Return all of the request's blocks (cached ones stay revivable);
        a session's last checkpoint is taken first (the save copies the
        blocks out before any later forward could write them)."""
        rid = request.request_id
        if (request.session_id is not None and self.session_checkpoint_batches
                and self.external is not None and rid in self.block_tables):
            self._checkpoint(request, self._num_registered.get(rid, 0), ended=True)
            self._checkpoints.pop(rid, None)
        table = self.block_tables.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        self._run_of.pop(request.request_id, None)  # its blocks stay cached in the run
        self._loads.pop(request.request_id, None)
        if self.external is not None:
            self.external.forget(request)
        if table:
            self.pool.release(table)

    def note_exports(self, spans) -> None:  # noqa: ANN001 - ScheduledSpan list
        """Tell the external store which prompt blocks of exporting requests
        (P/D prefills) this step's spans fill up (``ExternalKV.filling``)."""
        if self.external is None:
            return
        for span in spans:
            request = span.request
            if not request.kv_export:
                continue
            start = span.start // self.block_size
            end = min(span.start + span.num_tokens, request.num_prompt_tokens) // self.block_size
            if end > start:
                hashes = self.block_hashes_of(request, end)
                table = self.block_tables[request.request_id]
                self.external.filling(request, start, table[start:end], hashes[start:end])

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.pool.num_blocks, used_blocks=self.pool.num_used_blocks,
            free_blocks=self.pool.num_free_blocks, cached_blocks=self.pool.num_cached_blocks,
            prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits,
            external_hits=self.external_hits)

    def _root(self, request: Request) -> BlockKey:
        """The key of the request's first block (it must be full)."""
        self._extend_hashes(request, 1)
        return request.block_keys[0]

    def _materialize(self, root: BlockKey) -> None:
        """Key the lazy run starting with ``root``, if any: a lookup or a
        keyed registration from that first block is about to need it."""
        run = self.pool.lazy_run(root)
        if run is not None:
            owner = run.owner
            self._extend_hashes(owner, len(run.blocks))
            self.pool.materialize(run, owner.block_keys, owner.block_hashes)

    def block_hashes_of(self, request: Request, num_blocks: int) -> list[int]:
        """The chained hashes of the request's first ``num_blocks`` full
        blocks (computed now if not yet)."""
        self._extend_hashes(request, num_blocks)
        return request.block_hashes[:num_blocks]

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        if len(hashes) >= num_blocks:
            return
        parent = hashes[-1] if hashes else self.key_chain.root(request.cache_salt)
        keys, new_hashes = self.key_chain.keys(parent, request.token_ids, len(hashes),
                                               num_blocks)
        request.block_keys += keys
        hashes += new_hashes

    def check_invariants(self) -> None:
        """Refcounts equal the number of block-table and holding entries
        per block (tests)."""
        self.pool.check_invariants()
        expected = [0] * self.pool.num_blocks
        for table in (*self.block_tables.values(), *self.held.values()):
            for block_id in table:
                expected[block_id] += 1
        assert expected == self.pool.ref_counts, "refcounts do not match block tables"
        assert self.num_held_blocks == len({b for held in self.held.values() for b in held})
