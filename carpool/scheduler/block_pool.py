"""Refcounted fixed-size KV blocks with a prefix cache and LRU eviction.

Pure Python bookkeeping; the tensors live in the executor and are indexed
by block id.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Chain seed for the first block of a sequence.
ROOT_HASH = 0


def block_key(parent_hash: int, tokens: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """The exact identity of a full block: its parent's hash and its tokens.

    The cache is keyed by this tuple, so two blocks collide only when their
    parents' 64-bit hashes collide *and* their tokens are equal.
    """
    return (parent_hash, tuple(tokens))


def chain_hash(key: tuple[int, tuple[int, ...]]) -> int:
    """Hash of a block key; the parent hash of the next block in the chain."""
    return hash(key)


class BlockPool:
    """A pool of ``num_blocks`` blocks.

    Invariants:
    - every block is either referenced (``ref_count > 0``) or in ``_free``,
      never both;
    - a block in ``_cached`` holds the KV of its key's tokens; when
      unreferenced it stays cached (and can be revived by a hit) until it
      is evicted, least recently freed first;
    - a block id appears at most once in ``_cached``.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Block id -> None, in eviction order (front = evicted first).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[tuple[int, tuple[int, ...]], int] = {}
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` fresh blocks (ref_count 1), evicting cached ones LRU."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._uncache(block_id)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def lookup(self, key: tuple[int, tuple[int, ...]]) -> int | None:
        """The block caching ``key``, if any (does not take a reference)."""
        return self._cached.get(key)

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by ``lookup``."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block.

        Callers pass a sequence's blocks in order; they are queued for
        eviction tail first, so a shared prefix outlives the suffixes that
        extend it.
        """
        for block_id in reversed(block_ids):
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} released more often than taken")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    def register(self, block_id: int, key: tuple[int, tuple[int, ...]]) -> None:
        """Record that ``block_id`` now holds the KV of ``key`` (a full block)."""
        if not self.enable_prefix_caching or block_id in self._key_of:
            return
        if key in self._cached:
            return  # another block already caches these tokens; keep the first
        self._cached[key] = block_id
        self._key_of[block_id] = key

    def _uncache(self, block_id: int) -> None:
        key = self._key_of.pop(block_id, None)
        if key is not None:
            del self._cached[key]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (tests)."""
        for block_id, count in enumerate(self.ref_counts):
            assert count >= 0, f"block {block_id} has ref_count {count}"
            assert (count == 0) == (block_id in self._free), f"block {block_id} free-list mismatch"
        assert len(self._cached) == len(self._key_of)
        for key, block_id in self._cached.items():
            assert self._key_of[block_id] == key
