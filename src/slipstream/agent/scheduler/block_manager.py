"""Paged KV block bookkeeping: which physical blocks hold which request's tokens.

Pure Python. The model runner owns the KV tensors; this class only hands out block ids
(``BLOCK_SIZE`` tokens each) from a free list, on the device and, for swap preemption, in a
host pool of the same block size.

Prefix caching (on unless ``prefix_caching=False``): device blocks are content-addressed.

    block hash h_i = blake2b(h_{i-1} || token ids of block i)      (h_-1 = b"")

so equal hashes mean equal tokens at equal positions, hence equal KV. Only full blocks whose
KV has been computed get a hash (``register``). Blocks are reference-counted: requests that
share a prefix hold the same block ids. A block whose count drops to zero keeps its hash and
its contents in an LRU list of cached free blocks; it is still free (``num_free`` counts it)
and is evicted, losing its hash, only when ``allocate`` runs out of blocks that hold nothing.
With KV tiers (kv_tiers.py) an evicted block goes on to the host tier, and a prefix found
there (or on disk) past the device's is loaded back instead of computed.
A shared block is always full, so nobody ever writes into it: a request writes only past its
cached prefix, into blocks of its own.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from slipstream.agent.scheduler.kv_tiers import KVTierConfig, KVTiers

BLOCK_SIZE = 16
HASH_BYTES = 16


def blocks_for_tokens(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


def chain_block_hashes(parent: bytes, token_ids: Sequence[int],
                       block_size: int = BLOCK_SIZE) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids``, chained from ``parent`` (the hash of the
    block before them, ``b""`` at the start of a sequence)."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=HASH_BYTES)
        digest.update(array("q", token_ids[start:start + block_size]).tobytes())
        parent = digest.digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    """A free list of block ids ``[0, num_blocks)``, with reference counts and, when
    ``caching``, an LRU list of free blocks that still hold a hashed block's KV."""

    def __init__(self, num_blocks: int, caching: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.caching = caching
        self._free: deque[int] = deque(range(num_blocks))  # free and holding nothing
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free, hashed; oldest first
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        # 1 once the block's KV was found in a cache (this pool or a lower tier) since it was
        # computed: the lower tiers keep such blocks ahead of others (tier_index.py).
        self.reused = bytearray(num_blocks)
        self.num_evictions = 0
        # Told of every evicted hashed block, and whether it was reused, before its id is
        # handed out again (KV tiers).
        self.on_evict: Callable[[int, bytes, bool], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks that hold a hashed block's KV (in use or free)."""
        return len(self.by_hash)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise MemoryError(f"asked for {count} blocks, {self.num_free} free")
        blocks: list[int] = []
        free, cached_free, refs = self._free, self._cached_free, self.ref_counts
        for _ in range(count):
            if free:
                block = free.popleft()
            else:  # evict the least recently freed cached block
                block, _ = cached_free.popitem(last=False)
                stale = self.block_hash[block]
                if stale is not None:
                    del self.by_hash[stale]
                    self.block_hash[block] = None
                    if self.on_evict is not None:
                        self.on_evict(block, stale, bool(self.reused[block]))
                self.num_evictions += 1
            refs[block] = 1
            self.reused[block] = 0
            blocks.append(block)
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. A block nobody holds becomes free; a hashed one
        keeps its KV in the LRU list. The list's tail blocks are freed first, so they are
        evicted before the prefix blocks that other requests are likelier to share."""
        refs = self.ref_counts
        for block in reversed(block_ids):
            count = refs[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} freed more often than it was taken")
            refs[block] = count
            if count == 0:
                if self.block_hash[block] is not None:
                    self._cached_free[block] = None
                else:
                    self._free.append(block)

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take one more reference to each (cached) block, reviving free ones."""
        refs = self.ref_counts
        for block in block_ids:
            if refs[block] == 0:
                del self._cached_free[block]
            refs[block] += 1

    def match(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """Block ids of the longest prefix of ``hashes`` (at most ``max_blocks``) held here."""
        blocks: list[int] = []
        by_hash = self.by_hash
        for block_hash in hashes[:max_blocks]:
            block = by_hash.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def note_reused(self, block_ids: Sequence[int]) -> None:
        """These blocks' KV was just found in a cache (a prefix hit, or a load from a tier)."""
        reused = self.reused
        for block in block_ids:
            reused[block] = 1

    def num_reviving(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` are free now (acquiring them takes them off the free list)."""
        refs = self.ref_counts
        return sum(1 for block in block_ids if refs[block] == 0)

    def unregister(self, block_ids: Sequence[int]) -> None:
        """These blocks do not hold what their hashes say (a failed load): forget the
        hashes, so that nobody finds them again; a free one holds nothing now."""
        for block in block_ids:
            block_hash = self.block_hash[block]
            if block_hash is None:
                continue
            self.block_hash[block] = None
            if self.by_hash.get(block_hash) == block:
                del self.by_hash[block_hash]
            if block in self._cached_free:
                del self._cached_free[block]
                self._free.append(block)

    def register(self, block: int, block_hash: bytes) -> None:
        """``block`` now holds the full, computed block ``block_hash``. A block that already
        has a hash, or a hash another block already holds, is left alone (a duplicate is
        harmless: it is simply never shared)."""
        if self.block_hash[block] is None and block_hash not in self.by_hash:
            self.block_hash[block] = block_hash
            self.by_hash[block_hash] = block


class BlockManager:
    """Device blocks for running requests, and a host pool for swapped-out ones."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int = 0,
                 block_size: int = BLOCK_SIZE, prefix_caching: bool = True,
                 tiers: KVTierConfig | None = None) -> None:
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.device = BlockPool(num_device_blocks, caching=prefix_caching)
        self.host = BlockPool(num_host_blocks)  # swap preemption's pool, not a cache tier
        # Lower cache tiers (host memory, disk) under the device pool, by block hash.
        self.tiers: KVTiers | None = None
        if prefix_caching and tiers is not None and tiers.enabled:
            self.tiers = KVTiers(tiers)
            self.device.on_evict = self.tiers.on_device_evict
        # Prompt tokens looked up in the cache at first admission, and those found there
        # (in any tier); of those, the ones loaded from the host and from the disk tier.
        self.prefix_lookup_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_hit_tokens_host = 0
        self.prefix_hit_tokens_disk = 0
        self.swap_in_reused_blocks = 0  # swapped-in blocks found cached, so not copied back

    @property
    def kv_blocks_total(self) -> int:
        return self.device.num_blocks

    @property
    def kv_blocks_used(self) -> int:
        return self.device.num_used

    @property
    def kv_blocks_free(self) -> int:
        return self.device.num_free

    @property
    def kv_blocks_cached(self) -> int:
        """Device blocks holding a reusable prefix block (held by requests or free)."""
        return self.device.num_cached

    @property
    def prefix_evictions(self) -> int:
        return self.device.num_evictions

    def blocks_needed(self, block_ids: list[int], num_tokens: int) -> int:
        """Extra blocks a request holding ``block_ids`` needs to store ``num_tokens`` tokens."""
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - len(block_ids))

    def can_grow(self, block_ids: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(block_ids, num_tokens) + reserve <= self.device.num_free

    def grow(self, block_ids: list[int], num_tokens: int) -> None:
        """Extend ``block_ids`` in place so it covers ``num_tokens`` tokens."""
        block_ids.extend(self.device.allocate(self.blocks_needed(block_ids, num_tokens)))

    def release(self, block_ids: list[int]) -> None:
        self.device.free(block_ids)
        block_ids.clear()

    # -- prefix caching ---------------------------------------------------------------------

    def match_prefix(self, block_hashes: Sequence[bytes], num_tokens: int) -> list[int]:
        """Cached device blocks for the longest prefix of a sequence of ``num_tokens`` tokens
        with these full-block hashes. Its last token is never covered: it must be computed
        for the sequence to have logits."""
        if not self.prefix_caching:
            return []
        return self.device.match(block_hashes, (num_tokens - 1) // self.block_size)

    def match_blocks(self, block_hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """Cached device blocks for the longest prefix of ``block_hashes`` (at most
        ``max_blocks``): a sequence whose first ``max_blocks`` blocks are computed already
        (a swapped-in request) may take them all."""
        if not self.prefix_caching:
            return []
        return self.device.match(block_hashes, max_blocks)

    def match_lower_tiers(self, block_hashes: Sequence[bytes], start_block: int,
                          num_tokens: int) -> tuple[int, int]:
        """Past the device's ``start_block`` cached blocks of a sequence of ``num_tokens``
        tokens: how many blocks the host tier holds in a row, then how many only the disk
        holds (its last token is never covered, as in ``match_prefix``)."""
        if self.tiers is None:
            return 0, 0
        return self.tiers.match(block_hashes, start_block, (num_tokens - 1) // self.block_size)

    def register(self, block_ids: Sequence[int], block_hashes: Sequence[bytes],
                 start_block: int, end_block: int) -> None:
        """Blocks ``[start_block, end_block)`` of a request are full and computed."""
        if self.prefix_caching:
            for index in range(start_block, end_block):
                self.device.register(block_ids[index], block_hashes[index])

    # -- swap -------------------------------------------------------------------------------

    def swap_out(self, block_ids: list[int]) -> list[int] | None:
        """Reserve host blocks for ``block_ids``; returns them, or None if the host is full."""
        if len(block_ids) > self.host.num_free:
            return None
        return self.host.allocate(len(block_ids))

    def release_host(self, host_block_ids: list[int]) -> None:
        self.host.free(host_block_ids)
        host_block_ids.clear()
