"""One lower KV tier's index (host memory or disk): slots, a segmented LRU of block hashes, pins.

    KVTiers (kv_tiers.py) --insert(hash, reused)--> a slot, and the hash evicted for it
                          --touch / slot / remove / pin--> the rest of its bookkeeping

Which blocks to keep is a segmented LRU (SLRU): a block that has been reused at least once
(found in the prefix cache of some tier since it was computed) enters the *protected*
segment, one that never was enters *probation*. Eviction takes the oldest unpinned block of
probation first, and of the protected segment only when probation has none. The protected
segment holds at most ``protected_fraction`` of the slots; past that its oldest block moves
to the newest end of probation, where it has to earn its place again.

Why: most blocks are never reused. On the Mooncake conversation trace 77% of the distinct
512-token prefixes appear in one request only; of those seen once so far, 23% come back, of
those seen twice 42%. A plain LRU gives a fresh, probably-dead block the same room as a
prefix that conversations keep returning to. Keeping probation as an LRU of its own still
lets a conversation's newest turn wait for its next question. With ``protected_fraction``
0 the index is a plain LRU again.

The reuse bit travels with a block between tiers: the device pool marks the blocks a
request takes from its cache or loads from a tier (BlockPool.note_reused), and passes the
bit down when it evicts the block; a block fetched from disk is on its way to a hit.
"""

from __future__ import annotations

from collections import OrderedDict


class TierIndex:
    """One lower tier: slots ``[0, num_blocks)``, a segmented LRU of ``hash -> slot``, pins."""

    def __init__(self, name: str, num_blocks: int, protected_fraction: float = 0.0) -> None:
        if not 0.0 <= protected_fraction < 1.0:
            raise ValueError("protected_fraction must be in [0, 1)")
        self.name = name
        self.num_blocks = num_blocks
        self.max_protected = int(num_blocks * protected_fraction)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._probation: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self._protected: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self._pinned: dict[bytes, int] = {}  # hash -> pin count; never evicted while pinned
        self.num_evictions = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._probation or block_hash in self._protected

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def slot(self, block_hash: bytes) -> int | None:
        slot = self._probation.get(block_hash)
        return self._protected.get(block_hash) if slot is None else slot

    def is_protected(self, block_hash: bytes) -> bool:
        return block_hash in self._protected

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self._protected:
            self._protected.move_to_end(block_hash)
        else:
            self._probation.move_to_end(block_hash)

    def pin(self, block_hash: bytes) -> None:
        self._pinned[block_hash] = self._pinned.get(block_hash, 0) + 1

    def unpin(self, block_hash: bytes) -> None:
        count = self._pinned.get(block_hash, 0) - 1
        if count > 0:
            self._pinned[block_hash] = count
        else:
            self._pinned.pop(block_hash, None)

    def is_pinned(self, block_hash: bytes) -> bool:
        return block_hash in self._pinned

    def insert(self, block_hash: bytes, reused: bool = False) -> tuple[int, bytes | None] | None:
        """A slot for ``block_hash`` (newest of its segment), and the hash evicted to make
        room, if any; None when every slot is pinned (the block is not kept)."""
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = self._victim()
            if victim is None:
                return None
            segment = self._probation if victim in self._probation else self._protected
            slot = segment.pop(victim)
            self.num_evictions += 1
            evicted = victim
        if reused and self.max_protected:
            self._protected[block_hash] = slot
            self._demote()
        else:
            self._probation[block_hash] = slot
        return slot, evicted

    def remove(self, block_hash: bytes) -> None:
        segment = self._probation if block_hash in self._probation else self._protected
        slot = segment.pop(block_hash, None)
        self._pinned.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def _victim(self) -> bytes | None:
        """The oldest unpinned block of probation, else of the protected segment."""
        pinned = self._pinned
        for segment in (self._probation, self._protected):
            for block_hash in segment:
                if block_hash not in pinned:
                    return block_hash
        return None

    def _demote(self) -> None:
        """Keep the protected segment within its share: its oldest go back to probation."""
        protected, probation = self._protected, self._probation
        while len(protected) > self.max_protected:
            block_hash, slot = protected.popitem(last=False)
            probation[block_hash] = slot
