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

KV tiers (docs/kv-tiers.md): an agent with host-memory or disk tiers keeps what its GPU pool
evicts, so the index keeps, per instance, a second LRU below the first: keys pushed out of the
device-sized LRU move there, up to the tiers' capacity, and a key sent again moves back up.
``cached_split`` says how much of a prefix is thought to be on the device and how much in a
lower tier; the dispatcher values a lower-tier token at ``DEFAULT_LOWER_TIER_HIT_WEIGHT`` of a
device token (a load is cheap next to a recompute, but not free).

Pure Python: the simulator routes with the same class (on Mooncake's hash ids).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

from slipstream.agent.scheduler.block_manager import chain_block_hashes

DEFAULT_BLOCK_TOKENS = 64
# How many backlog tokens one cached prompt token is worth in the routing score. Above 1
# because routing a follow-up away costs more than its own prefill: the prefix is then held
# twice, and the conversation's later turns split between two caches. Measured on the first
# 120 s of the Mooncake trace at 12 QPS on 4 simulated instances (docs/prefix-caching.md):
# weight 1 kept 0.85 of the unbounded-cache hit rate, weight 2 kept 0.95.
DEFAULT_PREFIX_AFFINITY_WEIGHT = 2.0
# What a prompt token held in a lower KV tier (host memory, disk) is worth against one on the
# device. Loading costs bytes over PCIe where recomputing costs the prefill: on the live CPU
# engine a 16K-token follow-up loaded from the host took 0.06x of its recompute
# (docs/kv-tiers.md), so most of the value remains.
DEFAULT_LOWER_TIER_HIT_WEIGHT = 0.9


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
        self._lower: dict[str, OrderedDict[Hashable, None]] = {}  # pushed below the device

    def cached_tokens(self, instance: str, keys: Sequence[Hashable]) -> int:
        """Tokens of the longest prefix of ``keys`` this index thinks ``instance`` holds, in
        any tier."""
        device, lower = self.cached_split(instance, keys)
        return device + lower

    def cached_split(self, instance: str, keys: Sequence[Hashable]) -> tuple[int, int]:
        """Of the longest prefix of ``keys`` held in any tier: the tokens thought to be on the
        device, and those in a lower tier."""
        held = self._held.get(instance)
        if not held:
            return 0, 0
        lower: Mapping[Hashable, None] = self._lower.get(instance) or {}
        device_count = lower_count = 0
        for key in keys:
            if key in held:
                device_count += 1
            elif key in lower:
                lower_count += 1
            else:
                break
        return device_count * self.block_tokens, lower_count * self.block_tokens

    def record(self, instance: str, keys: Sequence[Hashable],
               capacity_tokens: int | None = None, lower_capacity_tokens: int = 0) -> None:
        """``instance`` was sent a prompt with these keys: they are its newest blocks. Keys
        past its device capacity move to its lower tiers (``lower_capacity_tokens``)."""
        held = self._held.setdefault(instance, OrderedDict())
        lower = self._lower.setdefault(instance, OrderedDict())
        for key in keys:
            lower.pop(key, None)
            held[key] = None
            held.move_to_end(key)
        capacity = max(1, (capacity_tokens or self.default_capacity_tokens) // self.block_tokens)
        lower_capacity = lower_capacity_tokens // self.block_tokens
        while len(held) > capacity:
            key, _ = held.popitem(last=False)
            if lower_capacity:
                lower[key] = None
        while len(lower) > lower_capacity:
            lower.popitem(last=False)

    def forget(self, instance: str) -> None:
        """The instance is gone (or restarted): it holds nothing."""
        self._held.pop(instance, None)
        self._lower.pop(instance, None)

    def num_keys(self, instance: str) -> int:
        return len(self._held.get(instance, ())) + len(self._lower.get(instance, ()))
