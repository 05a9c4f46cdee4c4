"""Refcounted fixed-size KV blocks with a prefix cache and LRU eviction.

Pure Python bookkeeping; the tensors live in the executor and are indexed
by block id.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

# The keys and their hashes live with the events that carry them; imported
# here under their old home's names too (``X as X``: a re-export).
from carpool.scheduler.kv_events import ROOT_HASH as ROOT_HASH
from carpool.scheduler.kv_events import BlockEvents as BlockEvents
from carpool.scheduler.kv_events import BlockKey as BlockKey
from carpool.scheduler.kv_events import BlockKeyChain as BlockKeyChain


class LazyRun:
    """Full blocks of one sequence, cached without their keys yet.

    Computing a key costs a hash per block; most sequences are never
    looked up by anyone (their first block is unique), so the KV manager
    registers them as a run and computes the keys only when a lookup from
    the same first block may need them (``BlockPool.materialize``).
    ``owner`` is opaque to the pool (what the keys come from); ``blocks``
    holds the sequence's blocks 0, 1, ... in order, an entry counting only
    while the pool's ``_lazy_of`` still points at this run; ``live`` is how
    many do.
    """

    __slots__ = ("root", "owner", "blocks", "live")

    def __init__(self, root: BlockKey, owner: object) -> None:
        self.root, self.owner = root, owner
        self.blocks: list[int] = []
        self.live = 0


class BlockPool:
    """A pool of ``num_blocks`` blocks.

    Invariants:
    - every block is either referenced (``ref_count > 0``) or in exactly one
      of the free lists ``_free`` and ``_free_protected``, never both;
    - a block in ``_cached`` holds the KV of its key's tokens; when
      unreferenced it stays cached (and can be revived by a hit) until it
      is evicted, least recently freed first;
    - a block id appears at most once in ``_cached``;
    - protection: ``_owners[b]`` is the non-empty set of owners (sessions)
      protecting cached block ``b``, and ``_owned`` is its exact inverse.
      A free block is in ``_free_protected`` iff it has owners. Eviction
      takes ``_free`` first and ``_free_protected`` only when ``_free`` is
      empty; an evicted block loses its cache entry and its owners;
    - a cached block is either keyed (in ``_cached``, its chain's first key
      in ``_root_of``) or lazy (``_lazy_of[b]`` is its run, which is
      ``_lazy_runs[run.root]``); at most one run per first key, and none
      while a keyed block of that chain is cached. A lazy block has no
      owners. So a run's keys, computed whenever, are what eager
      registration would have cached: nothing else under its first key
      could have been registered before it or since.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Block id -> None, in eviction order (front = evicted first).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_protected: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockKey, int] = {}
        self._key_of: list[BlockKey | None] = [None] * num_blocks  # by block id
        self._owners: dict[int, set[str]] = {}
        self._owned: dict[str, set[int]] = {}
        self._root_of: list[BlockKey | None] = [None] * num_blocks  # keyed blocks' first key
        self._keyed_per_root: dict[BlockKey, int] = {}
        self._lazy_of: list[LazyRun | None] = [None] * num_blocks
        self._lazy_runs: dict[BlockKey, LazyRun] = {}
        self._num_lazy = 0
        # Told of every keyed block cached and evicted; None: nobody listens.
        # With a listener the KV manager keys every block at once (a lazy
        # block has no hash to report). Set it before anything is cached:
        # only blocks reported stored are ever reported evicted.
        self.events: BlockEvents | None = None
        self._hash_of: list[int | None] = [None] * num_blocks  # the hash reported stored

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._free_protected)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_protected_blocks(self) -> int:
        """Cached blocks (referenced or free) that some owner protects."""
        return len(self._owners)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached) + self._num_lazy

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` fresh blocks (ref_count 1), evicting cached ones LRU,
        unprotected before protected."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} blocks, {self.num_free_blocks} free")
        blocks = []
        ref_counts, key_of, cached, owners = self.ref_counts, self._key_of, self._cached, self._owners
        lazy_of, free = self._lazy_of, self._free
        evicted: list[int] | None = [] if self.events is not None else None
        for _ in range(count):
            if not free:
                free = self._free_protected
            block_id, _ = free.popitem(last=False)
            key = key_of[block_id]
            if key is not None:  # evict: the block forgets its tokens
                key_of[block_id] = None
                del cached[key]
                self._forget_root(block_id)
                if block_id in owners:
                    self._disown(block_id)
                if evicted is not None and self._hash_of[block_id] is not None:
                    evicted.append(self._hash_of[block_id])
                    self._hash_of[block_id] = None
            elif lazy_of[block_id] is not None:
                self._forget_lazy(block_id)
            ref_counts[block_id] = 1
            blocks.append(block_id)
        if evicted:
            self.events.evicted(evicted)
        return blocks

    def is_cached(self, block_id: int) -> bool:
        """Whether the block holds the KV of a key (keyed or lazy)."""
        return self._key_of[block_id] is not None or self._lazy_of[block_id] is not None

    def lookup(self, key: BlockKey) -> int | None:
        """The block caching ``key``, if any (does not take a reference)."""
        return self._cached.get(key)

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by ``lookup``."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                self._free_list(block_id).pop(block_id)
            self.ref_counts[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block.

        Callers pass a sequence's blocks in order; they are queued for
        eviction tail first, so a shared prefix outlives the suffixes that
        extend it.
        """
        ref_counts, owners = self.ref_counts, self._owners
        for block_id in reversed(block_ids):
            count = ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} released more often than taken")
            ref_counts[block_id] = count - 1
            if count == 1:
                (self._free_protected if block_id in owners else self._free)[block_id] = None

    def register(self, block_ids: Sequence[int], keys: Sequence[BlockKey],
                 root: BlockKey, hashes: Sequence[int] | None = None) -> None:
        """Record that each of ``block_ids`` now holds the KV of its key in
        ``keys`` (full blocks of a chain whose first key is ``root``).
        ``root`` must have no lazy run: materialize it first (it came first).
        ``hashes``: the keys' chained hashes, for ``events`` (None: Python's
        hash of each key, which is ``BlockKeyChain(secret=None)``'s)."""
        if not self.enable_prefix_caching:
            return
        if self.events is not None:
            self._register_reported(block_ids, keys, root, hashes)
            return
        cached, key_of, root_of = self._cached, self._key_of, self._root_of
        registered = 0
        for block_id, key in zip(block_ids, keys):
            # Already registered, or another block caches these tokens: keep the first.
            if key_of[block_id] is None and key not in cached:
                cached[key] = block_id
                key_of[block_id] = key
                root_of[block_id] = root
                registered += 1
        if registered:
            self._keyed_per_root[root] = self._keyed_per_root.get(root, 0) + registered

    def _register_reported(self, block_ids: Sequence[int], keys: Sequence[BlockKey],
                           root: BlockKey, hashes: Sequence[int] | None) -> None:
        """``register`` telling ``events`` (apart: the fast path stays lean)."""
        if hashes is None:
            hashes = [hash(key) for key in keys]
        cached, key_of, root_of, hash_of = self._cached, self._key_of, self._root_of, self._hash_of
        stored: list[int] = []
        for block_id, key, block_hash in zip(block_ids, keys, hashes):
            if key_of[block_id] is None and key not in cached:
                cached[key] = block_id
                key_of[block_id] = key
                root_of[block_id] = root
                hash_of[block_id] = block_hash
                stored.append(block_hash)
        if stored:
            self._keyed_per_root[root] = self._keyed_per_root.get(root, 0) + len(stored)
            self.events.stored(stored)

    def reported_hashes(self) -> list[int]:
        """The hashes of the cached blocks reported stored to ``events`` and
        not evicted since: what a listener's index of this pool holds."""
        return [h for h in self._hash_of if h is not None]

    # -- lazy runs ------------------------------------------------------------------

    def lazy_run(self, root: BlockKey) -> LazyRun | None:
        """The lazy run of the chain starting with key ``root``, if any."""
        return self._lazy_runs.get(root)

    def may_start_lazy(self, root: BlockKey) -> bool:
        """Whether a new chain with first key ``root`` may be cached lazily:
        no other block of such a chain is cached, keyed or lazy."""
        return root not in self._lazy_runs and root not in self._keyed_per_root

    def start_lazy(self, root: BlockKey, owner: object) -> LazyRun:
        """A new, empty lazy run (``may_start_lazy(root)`` must hold)."""
        self._lazy_runs[root] = LazyRun(root, owner)
        return self._lazy_runs[root]

    def extend_lazy(self, run: LazyRun, block_ids: Sequence[int]) -> None:
        """Cache the run's next blocks (fresh ones: neither keyed nor lazy)."""
        lazy_of = self._lazy_of
        for block_id in block_ids:
            lazy_of[block_id] = run
        run.blocks += block_ids
        run.live += len(block_ids)
        self._num_lazy += len(block_ids)

    def materialize(self, run: LazyRun, keys: Sequence[BlockKey],
                    hashes: Sequence[int] | None = None) -> None:
        """Key the run's still-cached blocks: ``keys[i]`` (hash ``hashes[i]``,
        as for ``register``) is the key of its ``blocks[i]``. The run ends."""
        del self._lazy_runs[run.root]
        lazy_of = self._lazy_of
        still = [i for i, b in enumerate(run.blocks[:len(keys)]) if lazy_of[b] is run]
        for i in still:
            lazy_of[run.blocks[i]] = None
        self._num_lazy -= len(still)
        run.live = 0
        self.register([run.blocks[i] for i in still], [keys[i] for i in still], run.root,
                      None if hashes is None else [hashes[i] for i in still])

    def _forget_lazy(self, block_id: int) -> None:
        run = self._lazy_of[block_id]
        self._lazy_of[block_id] = None
        self._num_lazy -= 1
        run.live -= 1
        if not run.live and self._lazy_runs.get(run.root) is run:
            del self._lazy_runs[run.root]

    def _forget_root(self, block_id: int) -> None:
        root = self._root_of[block_id]
        self._root_of[block_id] = None
        left = self._keyed_per_root[root] - 1
        if left:
            self._keyed_per_root[root] = left
        else:
            del self._keyed_per_root[root]

    # -- protection (session prefixes) ------------------------------------------

    def protect(self, owner: str, block_ids: Iterable[int]) -> None:
        """Protect the cached ones among ``block_ids`` on behalf of ``owner``.

        Protected free blocks are evicted only when no unprotected free
        block is left. Uncached blocks are ignored: nothing could hit them.
        """
        for block_id in block_ids:
            assert self._lazy_of[block_id] is None, "a lazy block cannot be protected"
            if self._key_of[block_id] is None:
                continue
            owners = self._owners.setdefault(block_id, set())
            if not owners and self.ref_counts[block_id] == 0:
                del self._free[block_id]
                self._free_protected[block_id] = None
            owners.add(owner)
            self._owned.setdefault(owner, set()).add(block_id)

    def unprotect(self, owner: str) -> None:
        """Drop every protection ``owner`` holds.

        Free blocks left without owners go to the front of the eviction
        order: they were already kept past their LRU turn.
        """
        for block_id in self._owned.pop(owner, ()):
            owners = self._owners[block_id]
            owners.discard(owner)
            if owners:
                continue
            del self._owners[block_id]
            if self.ref_counts[block_id] == 0:
                del self._free_protected[block_id]
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)

    def protected_by(self, owner: str) -> frozenset[int]:
        """The blocks ``owner`` currently protects."""
        return frozenset(self._owned.get(owner, ()))

    def protection_owners(self) -> set[str]:
        """The owners that protect at least one block."""
        return set(self._owned)

    def _free_list(self, block_id: int) -> OrderedDict[int, None]:
        return self._free_protected if block_id in self._owners else self._free

    def _disown(self, block_id: int) -> None:
        for owner in self._owners.pop(block_id):
            owned = self._owned[owner]
            owned.discard(block_id)
            if not owned:
                del self._owned[owner]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (tests)."""
        assert not self._free.keys() & self._free_protected.keys(), "block in both free lists"
        for block_id, count in enumerate(self.ref_counts):
            assert count >= 0, f"block {block_id} has ref_count {count}"
            is_free = block_id in self._free or block_id in self._free_protected
            assert (count == 0) == is_free, f"block {block_id} free-list mismatch"
            if is_free:
                assert (block_id in self._free_protected) == (block_id in self._owners), \
                    f"free block {block_id} in the wrong free list"
        assert len(self._cached) == len(self._key_of) - self._key_of.count(None)
        assert all(k is not None for k, h in zip(self._key_of, self._hash_of) if h is not None), \
            "an uncached block keeps a reported hash"
        for key, block_id in self._cached.items():
            assert self._key_of[block_id] == key
        pairs = {(b, o) for b, owners in self._owners.items() for o in owners}
        assert pairs == {(b, o) for o, blocks in self._owned.items() for b in blocks}, \
            "protection maps are not inverse"
        assert all(self._owners.values()) and all(self._owned.values()), "empty protection set"
        assert all(self._key_of[b] is not None for b in self._owners), "an uncached block is protected"
        roots = [r for r in self._root_of if r is not None]
        assert len(roots) == len(self._cached), "a keyed block without its chain's first key"
        assert self._keyed_per_root == dict(Counter(roots)), "keyed counts per chain are off"
        lazy = [(b, run) for b, run in enumerate(self._lazy_of) if run is not None]
        assert len(lazy) == self._num_lazy, "lazy count is off"
        for block_id, run in lazy:
            assert self._key_of[block_id] is None, f"block {block_id} is keyed and lazy"
            assert self._lazy_runs.get(run.root) is run, f"block {block_id} in an ended run"
        for root, run in self._lazy_runs.items():
            assert run.root == root and run.live == sum(r is run for _, r in lazy) > 0
            assert root not in self._keyed_per_root, "a lazy run beside keyed blocks of its chain"
