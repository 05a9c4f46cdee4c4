"""Which replica holds which prompt prefix.

``FleetPrefixIndex`` is precise: it holds exactly the blocks the replicas
said they store, fed by each replica's block-stored and block-evicted
events under the chained block hashes their prefix caches use. A chained
hash names a whole prefix (block i's hash covers blocks 0..i), so the
cached prefix of a prompt on a replica is the longest run of the prompt's
leading hashes that replica holds.

``ApproximatePrefixIndex`` is the baseline in the style of SGLang's router:
each replica's index holds what the router *sent* there, kept to a size
limit least recently used first, with no word from the replica about
what it really evicted.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class FleetPrefixIndex:
    """Block hash -> replicas holding that block, fed by replica events."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._held: dict[str, set[int]] = {}  # replica -> its hashes (the inverse)

    def stored(self, replica_id: str, hashes: Iterable[int]) -> None:
        """A replica cached blocks with these chained hashes."""
        held = self._held.setdefault(replica_id, set())
        for block_hash in hashes:
            self._holders.setdefault(block_hash, set()).add(replica_id)
            held.add(block_hash)

    def evicted(self, replica_id: str, hashes: Iterable[int]) -> None:
        """A replica evicted blocks with these chained hashes."""
        held = self._held.get(replica_id)
        if held is None:
            return
        for block_hash in hashes:
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(replica_id)
                if not holders:
                    del self._holders[block_hash]
            held.discard(block_hash)

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica's blocks (it left, died or restarted empty)."""
        self.evicted(replica_id, list(self._held.get(replica_id, ())))
        self._held.pop(replica_id, None)

    def num_blocks(self, replica_id: str) -> int:
        return len(self._held.get(replica_id, ()))

    def matches(self, hashes: Sequence[int]) -> dict[str, int]:
        """Replica -> number of leading blocks of ``hashes`` it holds
        (replicas holding none are left out)."""
        depth: dict[str, int] = {}
        if not hashes:
            return depth
        alive = set(self._holders.get(hashes[0], ()))
        for position, block_hash in enumerate(hashes):
            if position:
                alive &= self._holders.get(block_hash, set())
            if not alive:
                break
            for replica_id in alive:
                depth[replica_id] = position + 1
        return depth


class ApproximatePrefixIndex:
    """Per replica, the block hashes of prompts sent there, LRU-bounded."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._trees: dict[str, OrderedDict[int, None]] = {}

    def sent(self, replica_id: str, hashes: Sequence[int]) -> None:
        tree = self._trees.setdefault(replica_id, OrderedDict())
        for block_hash in hashes:
            tree[block_hash] = None
            tree.move_to_end(block_hash)
        while len(tree) > self.capacity_blocks:
            tree.popitem(last=False)

    def remove_replica(self, replica_id: str) -> None:
        self._trees.pop(replica_id, None)

    def size(self, replica_id: str) -> int:
        return len(self._trees.get(replica_id, ()))

    def match(self, replica_id: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` the router believes ``replica_id`` holds."""
        tree = self._trees.get(replica_id)
        if not tree:
            return 0
        count = 0
        for block_hash in hashes:
            if block_hash not in tree:
                break
            count += 1
        return count
