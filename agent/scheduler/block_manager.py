"""Paged KV block bookkeeping: which physical blocks hold which request's tokens.

Pure Python. The model runner owns the KV tensors; this class only hands out block ids
(``BLOCK_SIZE`` tokens each) from a free list, on the device and, for swap preemption, in a
host pool of the same block size.
"""

from __future__ import annotations

from collections import deque

BLOCK_SIZE = 16


def blocks_for_tokens(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


class BlockPool:
    """A free list of block ids ``[0, num_blocks)``."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


class BlockManager:
    """Device blocks for running requests, and a host pool for swapped-out ones."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int = 0,
                 block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_device_blocks)
        self.host = BlockPool(num_host_blocks)

    @property
    def kv_blocks_total(self) -> int:
        return self.device.num_blocks

    @property
    def kv_blocks_used(self) -> int:
        return self.device.num_used

    @property
    def kv_blocks_free(self) -> int:
        return self.device.num_free

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

    def swap_out(self, block_ids: list[int]) -> list[int] | None:
        """Reserve host blocks for ``block_ids``; returns them, or None if the host is full."""
        if len(block_ids) > self.host.num_free:
            return None
        return self.host.allocate(len(block_ids))

    def swap_in(self, host_block_ids: list[int]) -> list[int] | None:
        if len(host_block_ids) > self.device.num_free:
            return None
        return self.device.allocate(len(host_block_ids))

    def release_host(self, host_block_ids: list[int]) -> None:
        self.host.free(host_block_ids)
        host_block_ids.clear()
