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


def setup(prefix_block_tokens: int = BLOCK, names=("a", "b", "c"),
          instance_queue_order: str = "shorter-first"):
    table = InstanceTable()
    for index, name in enumerate(names):
        table.upsert(BackendSpec(name=name, url=f"http://127.0.0.1:{9100 + index}", pool="short",
                                 instance=name))
    config = RouterConfig(long_prefill_threshold_tokens=1 << 20,
                          static_backends=(StaticBackend("http://127.0.0.1:1", "short"),),
                          prefix_block_tokens=prefix_block_tokens,
                          instance_queue_order=instance_queue_order)
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


def _follow_up_behind_long_prefills(order: str, queued: int, question_tokens: int = 50
                                    ) -> tuple[str, str]:
    """A conversation's home gets ``queued`` 8000-token prefills (held open, no first token);
    then a follow-up over its 2000-token prefix is routed. Returns (home, choice)."""
    table, dispatcher, classifier = setup(instance_queue_order=order)
    turn_1 = conversation(20, 2000)

    async def scenario():
        first = await dispatcher.acquire(routed(classifier, turn_1), 0.0)
        first.first_token()
        first.finish(10)
        home = first.instance
        for index in range(queued):  # long prefills the home serves; they stay queued
            lease = await dispatcher.acquire(routed(classifier, conversation(30 + index, 8000)),
                                             0.0, exclude=frozenset(
                                                 i.name for i in table if i is not home))
            assert lease.instance is home
        follow_up = await dispatcher.acquire(
            routed(classifier, turn_1 + conversation(21, question_tokens)), 0.0)
        return home.name, follow_up.instance.name

    return asyncio.run(scenario())


def test_behind_long_prefills_a_short_follow_up_still_goes_home_to_a_shorter_first_instance():
    # Two 8000-token prefills queued at home: 16000 tokens of backlog against 2 x 1984 cached.
    # An FCFS instance would make the follow-up wait behind all of it, so a router that
    # assumes FIFO sends it away (and recomputes the prefix). LARS serves the 66 uncached
    # tokens in its short lane ahead of both, so the follow-up only waits behind 2 x 66.
    home, choice = _follow_up_behind_long_prefills("fifo", queued=2)
    assert choice != home
    home, choice = _follow_up_behind_long_prefills("shorter-first", queued=2)
    assert choice == home


def test_a_shorter_first_home_overloaded_with_queued_prefills_loses_the_follow_up():
    # A 500-token question: 516 uncached tokens, and 2 x 1984 cached. Each queued prefill
    # puts 516 tokens ahead of it: 4 of them (2064) keep it home, 12 (6192) send it away.
    home, choice = _follow_up_behind_long_prefills("shorter-first", queued=4,
                                                   question_tokens=500)
    assert choice == home
    home, choice = _follow_up_behind_long_prefills("shorter-first", queued=12,
                                                   question_tokens=500)
    assert choice != home


def test_a_fresh_short_request_goes_where_it_waits_behind_the_least():
    async def scenario(order: str):
        table, dispatcher, classifier = setup(names=("a", "b"), instance_queue_order=order)
        a, b = table.get("a"), table.get("b")
        for seed, tokens, home in ((40, 10_000, a), (41, 300, b), (42, 300, b), (43, 300, b)):
            lease = await dispatcher.acquire(
                routed(classifier, conversation(seed, tokens)), 0.0,
                exclude=frozenset({"b"} if home is a else {"a"}))
            assert lease.instance is home
        lease = await dispatcher.acquire(routed(classifier, conversation(44, 200)), 0.0)
        return lease.instance.name

    # a: one 10000-token prefill; b: three 300-token ones. FIFO: b (900 < 10000 tokens
    # ahead). Shorter-first: a, where 200 tokens of the long prefill go first, not 600.
    assert asyncio.run(scenario("fifo")) == "b"
    assert asyncio.run(scenario("shorter-first")) == "a"


def test_the_backlog_counts_each_own_prefill_up_to_the_new_requests_size_and_forgets_it():
    table, dispatcher, classifier = setup(names=("a",))
    instance = table.get("a")

    async def scenario():
        leases = [await dispatcher.acquire(routed(classifier, conversation(50 + i, tokens)), 0.0)
                  for i, tokens in enumerate((100, 1000, 1000))]
        assert instance.predicted_backlog_tokens(32, 0.0) == 2100
        assert instance.predicted_backlog_tokens(32, 0.0, ahead_of=500) == 100 + 500 + 500
        leases[1].first_token()  # one 1000-token prefill becomes a decode
        assert instance.predicted_backlog_tokens(32, 0.0, ahead_of=500) == 100 + 500 + 32
        leases[2].finish()  # aborted before its first token
        leases[0].finish()
        assert instance.predicted_backlog_tokens(32, 0.0, ahead_of=500) == 32
        busy(table, "a", prefill_requests=3)  # another router's, at the mean prompt length
        assert instance.predicted_backlog_tokens(32, 700.0, ahead_of=500) == 3 * 500 + 32

    asyncio.run(scenario())


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


# -- KV tiers: a prefix pushed off an instance's GPU is still held there --------------------------

def test_keys_past_the_device_capacity_move_to_the_lower_tiers_and_back():
    from slipstream.agent.router.prefix_affinity import PrefixAffinityIndex

    index = PrefixAffinityIndex(block_tokens=64)
    doc, other = [f"d{i}" for i in range(4)], [f"o{i}" for i in range(4)]
    index.record("a", doc, capacity_tokens=4 * 64, lower_capacity_tokens=8 * 64)
    index.record("a", other, capacity_tokens=4 * 64, lower_capacity_tokens=8 * 64)
    assert index.cached_split("a", doc) == (0, 4 * 64)  # evicted from the GPU, kept below
    assert index.cached_tokens("a", doc) == 4 * 64
    index.record("a", doc, capacity_tokens=4 * 64, lower_capacity_tokens=8 * 64)
    assert index.cached_split("a", doc) == (4 * 64, 0)
    assert index.cached_split("a", other) == (0, 4 * 64)
    # Without tiers the same eviction forgets the prefix.
    index.record("b", doc, capacity_tokens=4 * 64)
    index.record("b", other, capacity_tokens=4 * 64)
    assert index.cached_tokens("b", doc) == 0


def test_the_agent_reports_its_tier_capacity_to_the_router():
    from slipstream.agent.router.stats_poller import parse_agent_metrics

    text = ("# TYPE slipstream_kv_cache_blocks_capacity gauge\n"
            "slipstream_kv_cache_blocks_capacity 100\n"
            "# TYPE slipstream_kv_tier_blocks_capacity gauge\n"
            'slipstream_kv_tier_blocks_capacity{tier="host"} 400\n'
            'slipstream_kv_tier_blocks_capacity{tier="disk"} 1000\n')
    report = parse_agent_metrics(text)
    assert report.kv_capacity_tokens == 1600 and report.kv_tier_capacity_tokens == 1400 * 16
