"""Prefix caching in the block manager and the scheduler (pure Python, fake clock).

The fake runner (offline_driver.FakeKvRunner) keeps canary KV contents: before every sampled
token it checks each earlier position holds that position's token, and it refuses a write
into a block another request holds. So an evicted, reused or overwritten shared block fails
these tests, and so does a block table that points at someone else's tokens.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.agent.scheduler.batch import Batch, BlockCopy
from slipstream.agent.scheduler.block_manager import (
    BLOCK_SIZE, BlockManager, BlockPool, chain_block_hashes)
from slipstream.agent.scheduler.offline_driver import Arrival, FakeKvRunner, drive, make_request
from slipstream.agent.scheduler.predictor import AnalyticModel
from slipstream.agent.scheduler.request import FinishReason, RequestStatus
from slipstream.agent.scheduler.scheduler import Scheduler, SchedulerConfig

MODEL = AnalyticModel(ms_per_token=0.05, ms_per_attended_pair=1e-7, ms_per_decode_kv_token=1e-5,
                      iteration_overhead_ms=0.5)


def scheduler_with(blocks: int = 4096, caching: bool = True, host_blocks: int = 0,
                   predictor=MODEL, **config) -> Scheduler:
    config.setdefault("target_batch_time_ms", 20.0)
    return Scheduler(SchedulerConfig(prefix_caching=caching, **config),
                     BlockManager(blocks, host_blocks, prefix_caching=caching), predictor=predictor)


def computed_tokens(batches) -> dict[str, int]:
    counts: dict[str, int] = {}
    for batch in batches:
        for chunk in batch.chunks:
            counts[chunk.request_id] = counts.get(chunk.request_id, 0) + chunk.num_tokens
    return counts


# -- the block pool --------------------------------------------------------------------------

def test_hash_chain_depends_on_the_whole_prefix():
    a = chain_block_hashes(b"", list(range(48)), 16)
    b = chain_block_hashes(b"", [99] + list(range(1, 48)), 16)
    assert len(a) == 3 and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, b))  # one token changed in block 0 changes them all
    assert chain_block_hashes(a[0], list(range(16, 48)), 16) == a[1:]  # extending = chaining
    assert chain_block_hashes(b"", list(range(47)), 16) == a[:2]  # partial blocks: no hash


def test_freed_blocks_stay_cached_until_memory_is_needed_then_lru_goes_first():
    pool = BlockPool(4, caching=True)
    first, second = pool.allocate(2), pool.allocate(2)
    pool.register(first[0], b"a")
    pool.register(second[0], b"b")
    pool.free(first)
    pool.free(second)
    assert pool.num_free == 4 and pool.num_cached == 2  # free, but still holding a and b
    assert pool.match([b"a"], 1) == [first[0]]
    pool.allocate(2)  # the two blocks that hold nothing go first
    assert pool.num_cached == 2 and pool.num_evictions == 0
    pool.allocate(1)  # then the least recently freed cached block: a
    assert pool.num_evictions == 1
    assert pool.match([b"a"], 1) == [] and pool.match([b"b"], 1) == [second[0]]


def test_reference_counts_never_go_negative_and_shared_blocks_are_not_free():
    pool = BlockPool(2, caching=True)
    block = pool.allocate(1)
    pool.register(block[0], b"x")
    pool.acquire(block)  # a second request shares it
    pool.free(block)
    assert pool.num_free == 1  # still held by one
    pool.free(block)
    assert pool.num_free == 2 and pool.ref_counts == [0, 0]
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(block)


def test_a_duplicate_hash_is_never_registered_twice():
    pool = BlockPool(2, caching=True)
    a, b = pool.allocate(2)
    pool.register(a, b"h")
    pool.register(b, b"h")  # a second copy of the same content (computed concurrently)
    assert pool.by_hash == {b"h": a} and pool.block_hash[b] is None


# -- the scheduler ---------------------------------------------------------------------------

def test_a_repeated_prompt_hits_the_cache_and_computes_only_its_last_token():
    prompt = tuple(range(1000, 1000 + 10 * BLOCK_SIZE))  # exactly 10 blocks
    scheduler = scheduler_with()
    batches = []
    drive(scheduler, [Arrival("cold", 0.0, len(prompt), 3, prompt=prompt),
                      Arrival("warm", 5.0, len(prompt), 3, prompt=prompt)],
          on_batch=lambda batch, now: batches.append(batch))
    counts = computed_tokens(batches)
    assert counts["cold"] == len(prompt) + 2  # the prompt, then two decodes
    # 9 of its 10 blocks are reused: the last block is computed so that it has logits.
    assert counts["warm"] == BLOCK_SIZE + 2
    manager = scheduler.block_manager
    assert manager.prefix_lookup_tokens == 2 * len(prompt)
    assert manager.prefix_hit_tokens == 9 * BLOCK_SIZE
    assert manager.kv_blocks_used == 0  # nothing leaked; the cached blocks are free


def test_cached_tokens_is_recorded_on_the_request_at_first_admission():
    prompt = tuple(range(200))
    scheduler = scheduler_with()
    result = drive(scheduler, [Arrival("a", 0.0, 200, 2, prompt=prompt),
                               Arrival("b", 1.0, 200, 2, prompt=prompt),
                               Arrival("c", 2.0, 200, 2, prompt=tuple(range(5, 205)))])
    assert result.finished["a"].num_cached_tokens == 0
    assert result.finished["b"].num_cached_tokens == 192  # 12 full blocks of 200 tokens
    assert result.finished["c"].num_cached_tokens == 0  # shifted by 5: nothing in common


def test_follow_up_over_a_cached_4k_document_computes_only_its_new_tokens():
    document = tuple(random.Random(1).randrange(32_000) for _ in range(4096))
    question_1 = tuple(range(7, 7 + 40))
    question_2 = tuple(range(500, 500 + 23))
    scheduler = scheduler_with()
    batches = []
    drive(scheduler, [Arrival("q1", 0.0, 0, 4, prompt=document + question_1),
                      Arrival("q2", 10.0, 0, 4, prompt=document + question_2)],
          on_batch=lambda batch, now: batches.append(batch))
    counts = computed_tokens(batches)
    assert counts["q1"] == 4096 + 40 + 3
    assert counts["q2"] == 23 + 3  # the 4096-token document (256 blocks) is reused whole


def test_a_follow_up_on_a_cached_document_is_scheduled_as_a_short_request():
    document = tuple(random.Random(2).randrange(32_000) for _ in range(8192))
    scheduler = scheduler_with(policy="lars")
    drive(scheduler, [Arrival("first", 0.0, 0, 1, prompt=document + (1, 2, 3))])
    follow_up = make_request(Arrival("follow-up", 50.0, 0, 1, prompt=document + (4, 5, 6)))
    cold = make_request(Arrival("cold", 50.0, 0, 1, prompt=tuple(range(8195))))
    scheduler.add(follow_up)
    scheduler.add(cold)
    assert follow_up.prefix_hit_tokens == 8192 and cold.prefix_hit_tokens == 0
    assert follow_up.prefill_work_s < cold.prefill_work_s / 50
    # The short one's deadline is the short-request minimum, not 1.5x an 8K prefill.
    assert follow_up.ttft_deadline_s < cold.ttft_deadline_s
    assert scheduler.urgency.remaining_prefill_s(follow_up) < \
        scheduler.urgency.remaining_prefill_s(cold) / 50


def test_without_prefix_caching_every_prompt_is_computed_in_full():
    prompt = tuple(range(320))
    scheduler = scheduler_with(caching=False)
    batches = []
    result = drive(scheduler, [Arrival("a", 0.0, 0, 2, prompt=prompt),
                               Arrival("b", 1.0, 0, 2, prompt=prompt)],
                   on_batch=lambda batch, now: batches.append(batch))
    assert computed_tokens(batches) == {"a": 321, "b": 321}
    assert result.finished["b"].num_cached_tokens == 0
    assert scheduler.block_manager.kv_blocks_cached == 0


def test_running_requests_share_blocks_and_free_them_only_when_both_finish():
    prompt = tuple(range(64))
    scheduler = scheduler_with()
    scheduler.add(make_request(Arrival("a", 0.0, 0, 50, prompt=prompt)))
    a = scheduler.requests["a"]
    now = 0.0
    while a.num_computed_tokens < 64:  # prefill a and let it decode a little
        batch = scheduler.schedule(now)
        scheduler.update(batch, {c.request_id: 1 for c in batch.chunks if c.sample}, now)
        now += 0.01
    scheduler.add(make_request(Arrival("b", now, 0, 50, prompt=prompt)))
    b = scheduler.requests["b"]
    batch = scheduler.schedule(now)
    assert b.block_ids[:3] == a.block_ids[:3]  # 3 full blocks shared; the 4th is recomputed
    refs = scheduler.block_manager.device.ref_counts
    assert all(refs[block] == 2 for block in a.block_ids[:3])
    scheduler.finish("a", FinishReason.ABORT, now)
    assert all(refs[block] == 1 for block in b.block_ids[:3])
    scheduler.finish("b", FinishReason.ABORT, now)
    assert scheduler.block_manager.kv_blocks_used == 0 and min(refs) == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_shared_blocks_keeps_outputs_and_canaries_intact(mode):
    # Twelve requests over three shared 300-token prefixes in a cache of 60 blocks (960
    # tokens): requests are preempted while they share blocks with running ones.
    rng = random.Random(3)
    prefixes = [tuple(rng.randrange(32_000) for _ in range(300)) for _ in range(3)]
    arrivals = [Arrival(f"r{i}", 0.001 * i, 0, 60,
                        prompt=prefixes[i % 3] + tuple(rng.randrange(32_000) for _ in range(20)))
                for i in range(12)]
    results = {}
    for caching in (False, True):
        scheduler = scheduler_with(blocks=60, host_blocks=60 if mode == "swap" else 0,
                                   caching=caching, preemption=mode, policy="fcfs")
        result = drive(scheduler, arrivals, max_steps=50_000)
        assert scheduler.num_preemptions_total > 0
        assert scheduler.block_manager.kv_blocks_used == 0
        assert scheduler.block_manager.host.num_used == 0
        assert min(scheduler.block_manager.device.ref_counts) == 0
        if mode == "swap":  # swap-in found blocks still cached only with the cache on
            assert (scheduler.block_manager.swap_in_reused_blocks > 0) == caching
        results[caching] = {rid: r.output_token_ids for rid, r in result.finished.items()}
    assert results[True] == results[False]


def test_swap_in_reuses_the_device_blocks_still_cached_for_its_prefix():
    # a and b share a 64-token prefix (4 blocks). b is swapped out while a keeps running, so
    # the shared blocks stay on the device and b's own full blocks stay cached (free but not
    # evicted). Swapping b back in takes all of them again and copies only its partial last
    # block; the fake runner's canary check on b's next tokens then passes.
    prefix = tuple(range(100, 164))
    scheduler = scheduler_with(host_blocks=64, preemption="swap", policy="fcfs")
    manager = scheduler.block_manager
    runner = FakeKvRunner(BLOCK_SIZE, ref_counts=manager.device.ref_counts,
                          sequences=lambda rid, end: scheduler.requests[rid].token_ids(0, end))
    now = 0.0

    def step() -> Batch:
        nonlocal now
        batch = scheduler.schedule(now)
        sampled = runner.execute(batch)
        now += 0.01
        scheduler.update(batch, sampled, now)
        return batch

    scheduler.add(make_request(Arrival("a", 0.0, 0, 500, prompt=prefix + (7,) * 5)))
    while scheduler.requests["a"].num_output_tokens < 2:
        step()
    scheduler.add(make_request(Arrival("b", now, 0, 500, prompt=prefix + tuple(range(40)))))
    a, b = scheduler.requests["a"], scheduler.requests["b"]
    while b.num_output_tokens < 3:
        step()
    shared = a.block_ids[:4]
    assert b.block_ids[:4] == shared
    full_blocks = b.num_computed_tokens // BLOCK_SIZE  # 106 tokens: 6 full blocks, 1 partial
    assert (full_blocks, len(b.block_ids)) == (6, 7)
    before = list(b.block_ids)
    out: list[BlockCopy] = []
    scheduler._preempt(b, now, out)  # as KV pressure would
    runner.execute(Batch(chunks=(), swap_out=tuple(out)))
    assert b.status is RequestStatus.SWAPPED and b.block_ids == []
    assert all(manager.device.ref_counts[block] == 1 for block in shared)  # a still holds them
    assert all(manager.device.ref_counts[block] == 0 for block in before[4:])

    batch = step()  # swaps b back in, then runs its next decode
    assert b.status is RequestStatus.RUNNING
    assert b.block_ids[:full_blocks] == before[:full_blocks]  # the same physical blocks
    assert manager.swap_in_reused_blocks == full_blocks
    (copy,) = batch.swap_in
    assert len(copy.src_block_ids) == 1 and copy.dst_block_ids == (b.block_ids[full_blocks],)
    assert all(manager.device.ref_counts[block] == 2 for block in shared)
    assert manager.host.num_used == 0
    while b.num_output_tokens < 8:  # every sampled token checks every earlier position
        step()
    scheduler.finish("a", FinishReason.ABORT, now)
    scheduler.finish("b", FinishReason.ABORT, now)
    assert manager.kv_blocks_used == 0 and min(manager.device.ref_counts) == 0


def test_swap_in_copies_everything_back_when_the_cached_blocks_were_evicted():
    prompt = tuple(range(200, 264)) + (5,) * 8
    scheduler = scheduler_with(blocks=8, host_blocks=16, preemption="swap", policy="fcfs")
    manager = scheduler.block_manager
    scheduler.add(make_request(Arrival("a", 0.0, 0, 500, prompt=prompt)))
    a = scheduler.requests["a"]
    now = 0.0
    while a.num_output_tokens < 2:
        batch = scheduler.schedule(now)
        scheduler.update(batch, {c.request_id: 1 for c in batch.chunks if c.sample}, now)
        now += 0.01
    scheduler._preempt(a, now, [])
    # Something else takes every device block, evicting a's cached ones.
    taken = manager.device.allocate(manager.kv_blocks_free)
    assert manager.kv_blocks_cached == 0
    manager.device.free(taken)
    copy = scheduler.preemptor.swap_in(a)
    assert copy is not None and manager.swap_in_reused_blocks == 0
    assert len(copy.dst_block_ids) == len(a.block_ids) == 5


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(40, 400),
       max_batched_tokens=st.integers(8, 300), preemption=st.sampled_from(["recompute", "swap"]),
       policy=st.sampled_from(["fcfs", "lars", "edf", "srpt"]))
def test_property_shared_prefixes_random_chunks_and_eviction_pressure(
        seed, num_blocks, max_batched_tokens, preemption, policy):
    """Random shared prefixes, chunk sizes (token budget) and memory: every canary holds, no
    block leaks, and outputs match the run without a cache."""
    rng = random.Random(seed)
    documents = [tuple(rng.randrange(32_000) for _ in range(rng.randrange(10, 300)))
                 for _ in range(rng.randrange(1, 4))]
    arrivals = []
    for i in range(rng.randrange(4, 14)):
        prompt = rng.choice(documents)[:rng.randrange(1, 300)]
        prompt += tuple(rng.randrange(32_000) for _ in range(rng.randrange(0, 40)))
        if not prompt:
            prompt = (1,)
        arrivals.append(Arrival(f"r{i}", rng.random() * 0.05, 0, rng.randrange(1, 30),
                                prompt=prompt))
    capacity = num_blocks * BLOCK_SIZE
    arrivals = [a for a in arrivals if len(a.prompt or ()) + a.output_tokens + 1 <= capacity]
    outputs = []
    for caching in (True, False):
        scheduler = scheduler_with(blocks=num_blocks, host_blocks=num_blocks, caching=caching,
                                   predictor=None, max_batched_tokens=max_batched_tokens,
                                   preemption=preemption, policy=policy)
        result = drive(scheduler, arrivals, max_steps=200_000)
        manager = scheduler.block_manager
        assert manager.kv_blocks_used == 0 and manager.host.num_used == 0
        assert min(manager.device.ref_counts) == 0
        outputs.append({rid: r.output_token_ids for rid, r in result.finished.items()})
    assert outputs[0] == outputs[1]
    assert set(outputs[0]) == {a.request_id for a in arrivals}


# -- choices of one request (n > 1) share the prompt's prefill --------------------------------

def choices(prompt: tuple[int, ...], n: int, output_tokens: int = 3, share: bool = True,
            at: float = 0.0) -> list[Arrival]:
    return [Arrival(f"c{i}", at, 0, output_tokens, prompt=prompt,
                    share_prompt_with="c0" if share and i else None) for i in range(n)]


@pytest.mark.parametrize("policy", ["fcfs", "lars", "edf", "srpt"])
def test_choices_of_one_request_compute_their_prompt_once(policy):
    prompt = tuple(range(3000, 3000 + 10 * BLOCK_SIZE + 5))  # 10 full blocks and 5 tokens
    scheduler = scheduler_with(policy=policy, max_batched_tokens=48, predictor=None)
    batches = []
    result = drive(scheduler, choices(prompt, 4),
                   on_batch=lambda batch, now: batches.append(batch))
    counts = computed_tokens(batches)
    assert counts["c0"] == len(prompt) + 2  # in chunks of at most 48 tokens, then two decodes
    for name in ("c1", "c2", "c3"):
        assert counts[name] == 5 + 2  # only the partial last block (the canaries check the KV)
        assert result.finished[name].num_cached_tokens == 10 * BLOCK_SIZE
    manager = scheduler.block_manager
    assert manager.prefix_hit_tokens == 3 * 10 * BLOCK_SIZE
    assert manager.kv_blocks_used == 0 and min(manager.device.ref_counts) == 0
    assert not scheduler.prompt_waiters


def test_without_sharing_choices_admitted_together_each_compute_the_prompt():
    # The control for the test above: same arrivals, no share_prompt_with.
    prompt = tuple(range(3000, 3000 + 10 * BLOCK_SIZE + 5))
    scheduler = scheduler_with(max_batched_tokens=2048, predictor=None)
    batches = []
    drive(scheduler, choices(prompt, 4, share=False),
          on_batch=lambda batch, now: batches.append(batch))
    assert computed_tokens(batches) == {f"c{i}": len(prompt) + 2 for i in range(4)}
    assert scheduler.block_manager.prefix_hit_tokens == 0


def step(scheduler: Scheduler, now: float) -> None:
    batch = scheduler.schedule(now)
    scheduler.update(batch, {c.request_id: 7 for c in batch.chunks if c.sample}, now)


def test_held_choices_are_released_when_the_first_leaves_and_their_own_abort_leaks_nothing():
    prompt = tuple(range(200))
    scheduler = scheduler_with(max_batched_tokens=32, predictor=None)
    for arrival in choices(prompt, 3):
        scheduler.add(make_request(arrival))
    c0, c1, c2 = (scheduler.requests[f"c{i}"] for i in range(3))
    assert scheduler.num_waiting == 3 and len(scheduler.prompt_waiters["c0"]) == 2
    step(scheduler, 0.0)
    assert c0.num_computed_tokens == 32 and c1.num_computed_tokens == c2.num_computed_tokens == 0
    scheduler.finish("c2", FinishReason.ABORT, 0.01)  # a held choice goes away
    assert scheduler.prompt_waiters["c0"] == [c1]
    scheduler.finish("c0", FinishReason.ABORT, 0.02)  # the first goes before its prefill ends
    assert not scheduler.prompt_waiters and scheduler.num_waiting == 1
    now = 0.03
    while c1.num_output_tokens < 2:
        step(scheduler, now)
        now += 0.01
    assert c1.num_cached_tokens == 32  # the two blocks c0 computed before it left
    scheduler.finish("c1", FinishReason.ABORT, now)
    assert scheduler.block_manager.kv_blocks_used == 0 and not scheduler.requests


def test_choices_are_not_held_without_a_full_block_to_share_or_without_caching():
    short = tuple(range(16))  # its only full block holds the last token, computed by each
    scheduler = scheduler_with()
    for arrival in choices(short, 2):
        scheduler.add(make_request(arrival))
    assert not scheduler.prompt_waiters
    uncached = scheduler_with(caching=False)
    for arrival in choices(tuple(range(100)), 2):
        uncached.add(make_request(arrival))
    assert not uncached.prompt_waiters and uncached.num_waiting == 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_choices_sharing_a_prompt_under_preemption_keep_their_outputs(mode):
    rng = random.Random(5)
    arrivals = []
    for group in range(4):
        prompt = tuple(rng.randrange(32_000) for _ in range(150 + 37 * group))
        arrivals += [Arrival(f"g{group}c{i}", 0.002 * group, 0, 40, prompt=prompt,
                             share_prompt_with=f"g{group}c0" if i else None) for i in range(3)]
    results = {}
    for share in (False, True):
        runs = arrivals if share else [
            Arrival(a.request_id, a.arrival_s, 0, 40, prompt=a.prompt) for a in arrivals]
        scheduler = scheduler_with(blocks=70, host_blocks=70 if mode == "swap" else 0,
                                   preemption=mode, policy="fcfs")
        result = drive(scheduler, runs, max_steps=50_000)
        assert scheduler.num_preemptions_total > 0
        assert scheduler.block_manager.kv_blocks_used == 0 and not scheduler.prompt_waiters
        results[share] = {rid: r.output_token_ids for rid, r in result.finished.items()}
    assert results[True] == results[False] and len(results[True]) == 12
