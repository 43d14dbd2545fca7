"""Prefix-aware routing in the router's dispatcher (no network): a follow-up of a conversation
goes to the instance that holds its prefix unless that instance is overloaded, and the
approximate index ages out what an instance's cache can no longer hold."""

from __future__ import annotations

import asyncio
import random

from slipstream.agent.router.classify import COMPLETIONS, LengthClassifier
from slipstream.agent.router.config import RouterConfig, StaticBackend
from slipstream.agent.router.dispatcher import Dispatcher
from slipstream.agent.router.instances import AgentReport, BackendSpec, InstanceTable
from slipstream.agent.router.metrics import RouterMetrics
from slipstream.agent.router.prefix_affinity import PrefixAffinityIndex, prefix_keys

BLOCK = 64


def setup(prefix_block_tokens: int = BLOCK, names=("a", "b", "c")):
    table = InstanceTable()
    for index, name in enumerate(names):
        table.upsert(BackendSpec(name=name, url=f"http://127.0.0.1:{9100 + index}", pool="short",
                                 instance=name))
    config = RouterConfig(long_prefill_threshold_tokens=1 << 20,
                          static_backends=(StaticBackend("http://127.0.0.1:1", "short"),),
                          prefix_block_tokens=prefix_block_tokens)
    dispatcher = Dispatcher(table, config, RouterMetrics(), clock=lambda: 0.0)
    classifier = LengthClassifier(None, config.long_prefill_threshold_tokens,
                                  prefix_block_tokens or None)
    return table, dispatcher, classifier


def routed(classifier, tokens):
    return classifier.classify(COMPLETIONS, {"prompt": list(tokens)}, now_s=0.0)


def busy(table, name: str, prefill_requests: int = 0, decode_requests: int = 0) -> None:
    """Another router's load on ``name``, as its agent reports it."""
    table.get(name).report(AgentReport(prefill_requests=prefill_requests,
                                       decode_requests=decode_requests, kv_capacity_tokens=None))


def conversation(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(tokens)]


def test_a_follow_up_goes_to_the_instance_holding_its_prefix():
    table, dispatcher, classifier = setup()
    turn_1 = conversation(1, 2000)

    async def scenario():
        first = await dispatcher.acquire(routed(classifier, turn_1), 0.0)
        first.first_token()
        first.finish(10)
        holder = first.instance.name
        # The holder is now the busiest instance (another router's decodes), but its cache
        # saves ~2000 prefill tokens, far more than the extra load.
        busy(table, holder, decode_requests=8)  # 8 x 32 = 256 tokens of backlog
        follow_up = await dispatcher.acquire(
            routed(classifier, turn_1 + conversation(2, 40) + conversation(3, 30)), 0.0)
        return holder, follow_up

    holder, follow_up = asyncio.run(scenario())
    assert follow_up.instance.name == holder
    # Only what the cache lacks counts as the holder's new prefill backlog.
    assert follow_up.prefill_tokens < 200


def test_an_overloaded_holder_loses_the_follow_up_to_an_idle_instance():
    table, dispatcher, classifier = setup()
    turn_1 = conversation(4, 2000)

    async def scenario():
        first = await dispatcher.acquire(routed(classifier, turn_1), 0.0)
        first.first_token()
        first.finish(10)
        holder = first.instance.name
        busy(table, holder, decode_requests=200)  # 6400 tokens of backlog: more than 2000 saved
        follow_up = await dispatcher.acquire(routed(classifier, turn_1 + conversation(5, 50)),
                                             0.0)
        return holder, follow_up

    holder, follow_up = asyncio.run(scenario())
    assert follow_up.instance.name != holder
    assert follow_up.prefill_tokens == 2050  # nothing cached there


def test_different_conversations_spread_by_load_and_each_returns_home():
    table, dispatcher, classifier = setup()
    turns = [conversation(10 + i, 1500) for i in range(3)]

    async def scenario():
        homes = []
        for turn in turns:
            lease = await dispatcher.acquire(routed(classifier, turn), 0.0)
            homes.append(lease.instance.name)  # held open: its backlog steers the next
        follow_ups = []
        for turn in reversed(turns):
            lease = await dispatcher.acquire(routed(classifier, turn + [7, 8, 9]), 0.0)
            follow_ups.append(lease.instance.name)
        return homes, follow_ups[::-1]

    homes, follow_ups = asyncio.run(scenario())
    assert len(set(homes)) == 3
    assert follow_ups == homes


def test_without_prefix_keys_routing_is_by_backlog_only():
    table, dispatcher, classifier = setup(prefix_block_tokens=0)
    turn_1 = conversation(6, 2000)

    async def scenario():
        first = await dispatcher.acquire(routed(classifier, turn_1), 0.0)
        first.first_token()
        first.finish(10)
        busy(table, first.instance.name, decode_requests=8)
        follow_up = await dispatcher.acquire(routed(classifier, turn_1 + [1, 2, 3]), 0.0)
        return first.instance.name, follow_up

    holder, follow_up = asyncio.run(scenario())
    assert follow_up.instance.name != holder


def test_the_index_matches_whole_prefixes_and_ages_out_the_oldest_blocks():
    index = PrefixAffinityIndex(block_tokens=BLOCK, default_capacity_tokens=10 * BLOCK)
    old = prefix_keys(conversation(7, 6 * BLOCK), BLOCK)
    new = prefix_keys(conversation(8, 6 * BLOCK), BLOCK)
    index.record("a", old)
    assert index.cached_tokens("a", old) == 6 * BLOCK
    assert index.cached_tokens("b", old) == 0
    # A different first block: nothing matches, even where later tokens agree.
    assert index.cached_tokens("a", prefix_keys([1] + conversation(7, 6 * BLOCK)[1:], BLOCK)) == 0
    index.record("a", new)  # 12 blocks into a 10-block instance: old's first two age out
    assert index.num_keys("a") == 10
    assert index.cached_tokens("a", new) == 6 * BLOCK
    assert index.cached_tokens("a", old) == 0  # its first block is gone, so is the prefix
