"""KV tiers under the block manager (pure Python, fake clock, canary KV).

The fake runner (offline_driver.FakeKvRunner) moves canaries between the device, a host tier
and a disk tier as ``Batch.tier_ops`` says, and checks every position before sampling, so a
block loaded into the wrong place, a host slot overwritten before it was read, or a corrupt
disk block that was served fails these tests.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.agent.scheduler.block_manager import BLOCK_SIZE, BlockManager, chain_block_hashes
from slipstream.agent.scheduler.kv_tiers import KVTierConfig, KVTiers, TierIndex, TierResults
from slipstream.agent.scheduler.offline_driver import Arrival, drive
from slipstream.agent.scheduler.predictor import AnalyticModel
from slipstream.agent.scheduler.scheduler import Scheduler, SchedulerConfig

MODEL = AnalyticModel(ms_per_token=0.05, ms_per_attended_pair=1e-7, ms_per_decode_kv_token=1e-5,
                      iteration_overhead_ms=0.5)
BYTES_PER_BLOCK = 1 << 20


def tiered(blocks: int, host_blocks: int = 0, disk_blocks: int = 0, predictor=MODEL,
           **config) -> Scheduler:
    config.setdefault("target_batch_time_ms", 20.0)
    tiers = KVTierConfig(host_blocks=host_blocks, disk_blocks=disk_blocks,
                         bytes_per_block=BYTES_PER_BLOCK) if host_blocks else None
    return Scheduler(SchedulerConfig(**config),
                     BlockManager(blocks, tiers=tiers), predictor=predictor)


def document(seed: int, tokens: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(32_000) for _ in range(tokens))


def questions_over(doc: tuple[int, ...], count: int, gap_s: float, other: int = 0
                   ) -> list[Arrival]:
    """``count`` questions over ``doc``, each followed by an unrelated prompt of ``other``
    tokens that pushes the document out of a small device pool."""
    arrivals = []
    for i in range(count):
        arrivals.append(Arrival(f"q{i}", i * gap_s, 0, 2, prompt=doc + document(100 + i, 20)))
        if other:
            arrivals.append(Arrival(f"x{i}", i * gap_s + gap_s / 2, 0, 2,
                                    prompt=document(200 + i, other)))
    return arrivals


# -- the tier index ---------------------------------------------------------------------------

def test_tier_index_is_an_lru_that_never_evicts_a_pinned_block():
    index = TierIndex("host", 2)
    assert index.insert(b"a") == (0, None) and index.insert(b"b") == (1, None)
    index.touch(b"a")  # b is now the oldest
    assert index.insert(b"c") == (1, b"b")
    index.pin(b"a")
    index.pin(b"c")
    assert index.insert(b"d") is None  # every slot pinned: the block is not kept
    index.unpin(b"a")
    assert index.insert(b"d") == (0, b"a")


def test_an_evicted_device_block_is_offloaded_and_a_host_eviction_spills_to_disk():
    tiers = KVTiers(KVTierConfig(host_blocks=1, disk_blocks=4, bytes_per_block=1))
    tiers.on_device_evict(7, b"h1")
    first = tiers.take_ops()
    tiers.on_device_evict(8, b"h2")  # the host holds one block: h1 goes to disk
    second = tiers.take_ops()
    assert [(c.src, c.block_hash) for c in first.offload + second.offload] == [
        (7, b"h1"), (8, b"h2")]
    assert [(c.src, c.block_hash) for c in second.spill] == [(0, b"h1")]
    assert b"h2" in tiers.host and tiers.disk is not None and b"h1" in tiers.disk
    # Evicting h2 again while the host holds it copies nothing.
    tiers.on_device_evict(3, b"h2")
    assert not tiers.take_ops()


def test_a_block_offloaded_in_a_batch_is_not_spilled_before_it_lands():
    """Spills run before offloads, so a slot an offload of this batch fills must not be
    picked by a later eviction of the same batch: with no other slot, the block is dropped."""
    tiers = KVTiers(KVTierConfig(host_blocks=1, disk_blocks=4, bytes_per_block=1))
    tiers.on_device_evict(7, b"h1")
    tiers.on_device_evict(8, b"h2")
    ops = tiers.take_ops()
    assert [c.block_hash for c in ops.offload] == [b"h1"] and not ops.spill
    assert tiers.dropped_blocks == 1


def test_load_cost_is_bytes_over_bandwidth():
    config = KVTierConfig(host_blocks=8, disk_blocks=8, bytes_per_block=2_000_000,
                          host_load_gb_per_s=20.0, disk_read_gb_per_s=4.0)
    assert config.load_ms(10) == pytest.approx(1.0)  # 20 MB at 20 GB/s
    assert config.fetch_s(10) == pytest.approx(0.005)


def test_a_disk_tier_needs_a_host_tier():
    with pytest.raises(ValueError, match="host tier"):
        KVTierConfig(host_blocks=0, disk_blocks=4, bytes_per_block=1)


# -- the scheduler ----------------------------------------------------------------------------

def computed(batches) -> dict[str, int]:
    counts: dict[str, int] = {}
    for batch in batches:
        for chunk in batch.chunks:
            counts[chunk.request_id] = counts.get(chunk.request_id, 0) + chunk.num_tokens
    return counts


def run(scheduler: Scheduler, arrivals: list[Arrival], **kwargs):
    batches = []
    result = drive(scheduler, arrivals, on_batch=lambda batch, now: batches.append(batch),
                   **kwargs)
    return result, batches


@pytest.mark.parametrize("host_blocks, disk_blocks", [(400, 0), (130, 400)])
def test_a_follow_up_loads_its_evicted_document_from_a_lower_tier(host_blocks, disk_blocks):
    doc = document(1, 2048)  # 128 blocks; the device holds 160
    arrivals = questions_over(doc, 3, gap_s=5.0, other=2048)
    result, batches = run(tiered(160, host_blocks, disk_blocks), arrivals)
    counts = computed(batches)
    assert counts["q0"] == len(doc) + 20 + 1
    for rid in ("q1", "q2"):  # only the question is computed: the document is loaded
        assert counts[rid] == 20 + 1, counts
        assert result.finished[rid].num_cached_tokens == len(doc)
    # What the device still held was reused there; the rest came up from below (the
    # canaries checked every position before each sampled token).
    loads = sum(len(b.tier_ops.load) for b in batches if b.tier_ops is not None)
    assert len(doc) // BLOCK_SIZE <= loads <= 2 * len(doc) // BLOCK_SIZE


def through_the_disk(doc: tuple[int, ...]) -> list[Arrival]:
    """A question over ``doc``, two long unrelated prompts that push it out of the device
    (200 blocks) and then out of the host tier (80 blocks) to disk, and a follow-up."""
    return [Arrival("q0", 0.0, 0, 2, prompt=doc + document(100, 20)),
            Arrival("x0", 1.0, 0, 2, prompt=document(200, 3000)),
            Arrival("y0", 2.0, 0, 2, prompt=document(201, 3000)),
            Arrival("q1", 5.0, 0, 2, prompt=doc + document(101, 20))]


def test_a_prefix_pushed_to_disk_comes_back_and_hits_are_counted_per_tier():
    doc = document(2, 1024)  # 64 blocks
    scheduler = tiered(200, host_blocks=80, disk_blocks=400)
    result, batches = run(scheduler, through_the_disk(doc))
    manager = scheduler.block_manager
    assert computed(batches)["q1"] == 20 + 1
    assert result.finished["q1"].num_cached_tokens == len(doc)
    assert manager.prefix_hit_tokens == len(doc)
    assert manager.prefix_hit_tokens_disk > 0
    assert manager.prefix_hit_tokens_host + manager.prefix_hit_tokens_disk <= len(doc)
    assert manager.tiers is not None and manager.tiers.fetched_blocks > 0


def test_a_corrupt_disk_block_is_dropped_and_its_tokens_are_computed():
    doc = document(3, 1024)  # 64 blocks
    scheduler = tiered(200, host_blocks=80, disk_blocks=400)
    tiers = scheduler.block_manager.tiers
    assert tiers is not None and tiers.disk is not None
    bad = chain_block_hashes(b"", list(doc))
    from slipstream.agent.scheduler import offline_driver

    original = offline_driver.FakeKvRunner.poll

    def poll(self):  # every block of the document that is on disk went bad there
        self.corrupt_hashes |= set(bad)
        return original(self)

    offline_driver.FakeKvRunner.poll = poll  # type: ignore[method-assign]
    try:
        result, batches = run(scheduler, through_the_disk(doc))
    finally:
        offline_driver.FakeKvRunner.poll = original  # type: ignore[method-assign]
    # The blocks that did not come from disk were reused; from the first corrupt one on,
    # the document was computed, and its output is what it would have been (canaries).
    cached = result.finished["q1"].num_cached_tokens
    assert cached < len(doc) and computed(batches)["q1"] == len(doc) - cached + 20 + 1
    assert scheduler.block_manager.prefix_hit_tokens_disk == 0
    assert tiers.failed_blocks > 0 and not any(h in tiers.disk for h in bad)


def test_a_lower_tier_hit_is_priced_as_a_load_neither_free_nor_recomputed():
    doc = document(4, 4096)
    scheduler = tiered(300, host_blocks=600)
    drive(scheduler, questions_over(doc, 1, gap_s=5.0, other=4096))
    follow_up = Arrival("f", 20.0, 0, 2, prompt=doc + document(9, 20))
    from slipstream.agent.scheduler.offline_driver import make_request

    request = make_request(follow_up)
    scheduler.add(request)
    assert request.prefix_hit_tokens == len(doc)
    manager = scheduler.block_manager
    on_device = len(manager.match_prefix(request.block_hashes, request.num_tokens))
    in_host, _ = manager.match_lower_tiers(request.block_hashes, on_device, request.num_tokens)
    assert in_host >= len(doc) // BLOCK_SIZE // 2
    assert manager.tiers is not None
    load_s = manager.tiers.config.load_ms(in_host) / 1000.0
    assert request.prefix_load_s == pytest.approx(load_s)
    recompute_s = scheduler.prefill_times.remaining_s(request.num_tokens, 0)
    questions_s = scheduler.prefill_times.remaining_s(request.num_tokens, len(doc))
    assert request.prefill_work_s == pytest.approx(questions_s + load_s)
    assert questions_s < request.prefill_work_s < recompute_s


def test_the_packer_charges_the_load_to_the_batch():
    doc = document(5, 2048)
    scheduler = tiered(200, host_blocks=400)
    drive(scheduler, questions_over(doc, 1, gap_s=5.0, other=2048))
    from slipstream.agent.scheduler.offline_driver import make_request

    scheduler.add(make_request(Arrival("f", 30.0, 0, 2, prompt=doc + document(9, 20))))
    batch = scheduler.schedule(30.0)
    assert batch.tier_ops is not None and batch.tier_ops.load
    loaded = len(batch.tier_ops.load)
    tiers = scheduler.block_manager.tiers
    assert tiers is not None
    chunk = batch.chunks[0]
    from slipstream.agent.scheduler.predictor import predict_batch_time_ms

    compute_ms = predict_batch_time_ms(MODEL, [(chunk.num_tokens, chunk.end_pos)], [])
    assert batch.predicted_time_s * 1000.0 == pytest.approx(
        compute_ms + tiers.config.load_ms(loaded))


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(40, 90),
       host_blocks=st.integers(1, 30), disk_blocks=st.integers(0, 300),
       max_batched_tokens=st.integers(8, 300), preemption=st.sampled_from(["recompute", "swap"]),
       policy=st.sampled_from(["fcfs", "lars", "edf"]))
def test_property_tiers_never_change_outputs_and_every_canary_holds(
        seed, num_blocks, host_blocks, disk_blocks, max_batched_tokens, preemption, policy):
    """Random shared prefixes, memory, tier sizes and chunk budgets, with some disk blocks
    corrupt: every canary holds, no block leaks, and outputs equal the run without tiers."""
    rng = random.Random(seed)
    # More documents than a small device pool holds, so prefixes go down to host and disk.
    documents = [document(seed + i, rng.randrange(10, 400)) for i in range(rng.randrange(2, 8))]
    arrivals = []
    for i in range(rng.randrange(4, 20)):
        prompt = rng.choice(documents)[:rng.randrange(1, 400)]
        prompt += document(seed * 100 + i, rng.randrange(0, 40))
        # Spread out, so that later prompts find earlier ones pushed down to host and disk.
        arrivals.append(Arrival(f"r{i}", rng.random() * 3.0, 0, rng.randrange(1, 20),
                                prompt=prompt or (1,)))
    capacity = num_blocks * BLOCK_SIZE
    arrivals = [a for a in arrivals if len(a.prompt or ()) + a.output_tokens + 1 <= capacity]
    outputs = []
    from slipstream.agent.scheduler import offline_driver

    original = offline_driver.FakeKvRunner.poll

    def poll(self):  # an eighth of the blocks go bad on disk
        self.corrupt_hashes = _EveryEighth()
        return original(self)

    for host in (host_blocks, 0):
        scheduler = tiered(num_blocks, host, disk_blocks if host else 0, predictor=None,
                           max_batched_tokens=max_batched_tokens, preemption=preemption,
                           policy=policy)
        offline_driver.FakeKvRunner.poll = poll  # type: ignore[method-assign]
        try:
            result = drive(scheduler, arrivals, max_steps=200_000)
        finally:
            offline_driver.FakeKvRunner.poll = original  # type: ignore[method-assign]
        manager = scheduler.block_manager
        assert manager.kv_blocks_used == 0 and min(manager.device.ref_counts) == 0
        outputs.append({rid: r.output_token_ids for rid, r in result.finished.items()})
    assert outputs[0] == outputs[1]
    assert set(outputs[0]) == {a.request_id for a in arrivals}


class _EveryEighth(set):
    """Block hashes whose disk copy is corrupt: those whose first byte is below 32."""

    def __contains__(self, block_hash: object) -> bool:
        return isinstance(block_hash, bytes) and block_hash[0] < 32


# -- flags and the CRD ------------------------------------------------------------------------

def test_sizes_parse_with_their_unit_and_the_crd_rule_uses_the_same_pattern():
    from slipstream.agent.engine.kv.tier_settings import SIZE_PATTERN, parse_size_bytes
    from slipstream.crds.servingreplica import KV_SIZE_PATTERN

    assert parse_size_bytes("1TiB") == 2**40 and parse_size_bytes("1.5GB") == 1_500_000_000
    with pytest.raises(ValueError, match="unit"):
        parse_size_bytes("64")
    assert KV_SIZE_PATTERN.replace("\\\\", "\\") == SIZE_PATTERN


def test_the_crd_fields_reach_the_serve_config(tmp_path):
    from slipstream.agent.config.serve_config import ServeConfig
    from slipstream.agent.server.serve_configs import engine_config

    path = tmp_path / "engine.yaml"
    path.write_text(ServeConfig.from_layers({
        "model": {"name": "m", "path": "/models/m"},
        "kvTiers": {"hostMemory": "1TiB", "diskPath": "/var/cache/kv", "diskSize": "2TiB"},
    }).to_yaml(only_set=True))
    assert "kvTiers" in path.read_text()
    tiers = engine_config(ServeConfig.load(path)).kv_tiers
    assert (tiers.host_memory_bytes, tiers.disk_size_bytes) == (2**40, 2 * 2**40)
    assert str(tiers.disk_path) == "/var/cache/kv"


def test_a_load_longer_than_the_target_still_goes_in_beside_running_decodes():
    """A prefix whose load alone exceeds the batch target is charged half the target when
    its chunk is sized, so running decodes do not hold it back until they all finish; the
    batch's predicted time still carries the whole load."""
    from slipstream.agent.scheduler.packer import PackerConfig, PrefillBudget

    budget = PrefillBudget(MODEL, PackerConfig(target_batch_time_ms=20.0))
    budget.add_decodes(4, 4 * 1000)
    size = budget.chunk_for(4096, 64, fit_tokens=10_000, load_ms=35.0)
    assert size == 64
    before = budget.time_ms
    budget.add_prefill(4096, size, load_ms=35.0)
    assert budget.time_ms > before + 35.0
