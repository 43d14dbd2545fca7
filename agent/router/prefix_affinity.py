"""Prefix-aware routing: which instance probably holds a request's prompt prefix in its cache.

    prompt --prefix_keys()--> chained block keys --PrefixAffinityIndex.cached_tokens(instance)
        --> pick the instance with the least (predicted backlog - w x prefill its cache saves)
        --> record(instance, keys): that instance now holds these blocks (most recently used)

Approximate, like llm-d's approximate prefix scorer: the router remembers what it sent where,
per instance an LRU of block keys no larger than the instance's KV capacity, and forgets the
oldest first, as the engine's own LRU of free cached blocks does. The alternative, exact
tracking from cache events the agents publish (llm-d's precise scorer, Dynamo's KV router),
needs an event stream from every agent to every router replica and an index kept consistent
with it; the approximate index needs nothing from the agents, survives router restarts by
relearning within a few requests, and errs only in two harmless ways: a block the engine
evicted early costs a prefill that routing expected to save, and a prefix another router
replica sent elsewhere is not known here. Both degrade to load-based routing, never worse.

A key is the chained hash of a block of ``block_tokens`` prompt tokens (block_manager's hash
chain), so a key stands for the whole prefix up to its block: matching stops at the first
miss, as the engine's lookup does. The router's blocks need not match the engine's.

Pure Python: the simulator routes with the same class (on Mooncake's hash ids).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from slipstream.agent.scheduler.block_manager import chain_block_hashes

DEFAULT_BLOCK_TOKENS = 64
# How many backlog tokens one cached prompt token is worth in the routing score. Above 1
# because routing a follow-up away costs more than its own prefill: the prefix is then held
# twice, and the conversation's later turns split between two caches. Measured on the first
# 120 s of the Mooncake trace at 12 QPS on 4 simulated instances (docs/prefix-caching.md):
# weight 1 kept 0.85 of the unbounded-cache hit rate, weight 2 kept 0.95.
DEFAULT_PREFIX_AFFINITY_WEIGHT = 2.0


def prefix_keys(token_ids: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[bytes]:
    """The chained keys of the full blocks of a prompt."""
    return chain_block_hashes(b"", token_ids, block_tokens)


class PrefixAffinityIndex:
    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 default_capacity_tokens: int = 1 << 20) -> None:
        if block_tokens < 1 or default_capacity_tokens < block_tokens:
            raise ValueError("block_tokens must be >= 1 and the capacity at least one block")
        self.block_tokens = block_tokens
        self.default_capacity_tokens = default_capacity_tokens
        self._held: dict[str, OrderedDict[Hashable, None]] = {}

    def cached_tokens(self, instance: str, keys: Sequence[Hashable]) -> int:
        """Tokens of the longest prefix of ``keys`` this index thinks ``instance`` holds."""
        held = self._held.get(instance)
        if not held:
            return 0
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count * self.block_tokens

    def record(self, instance: str, keys: Sequence[Hashable],
               capacity_tokens: int | None = None) -> None:
        """``instance`` was sent a prompt with these keys: they are its newest blocks."""
        held = self._held.setdefault(instance, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        capacity = max(1, (capacity_tokens or self.default_capacity_tokens) // self.block_tokens)
        while len(held) > capacity:
            held.popitem(last=False)

    def forget(self, instance: str) -> None:
        """The instance is gone (or restarted): it holds nothing."""
        self._held.pop(instance, None)

    def num_keys(self, instance: str) -> int:
        return len(self._held.get(instance, ()))
