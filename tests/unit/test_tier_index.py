"""The host tier keeps reused blocks ahead of blocks that never were (tier_index.py).

- Probation (never reused) is evicted before the protected segment (reused), each oldest first.
- The protected segment keeps within its share; its oldest go back to probation, not out.
- The reuse bit crosses tiers: a block the device pool found in its cache, or loaded from the
  host, reaches the host's protected segment when the device evicts it; a block computed
  and never found again enters probation.
"""

from __future__ import annotations

import pytest

from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.kv_tiers import KVTierConfig, KVTiers
from slipstream.agent.scheduler.tier_index import TierIndex


def test_probation_is_evicted_before_reused_blocks():
    index = TierIndex("host", 3, protected_fraction=0.67)  # at most 2 protected
    index.insert(b"old-reused", reused=True)
    index.insert(b"fresh1")
    index.insert(b"fresh2")
    assert index.insert(b"new-reused", reused=True) == (1, b"fresh1")
    assert index.insert(b"fresh3") == (2, b"fresh2")
    # Only fresh3 is in probation now: it goes before either reused block, though newer.
    assert index.insert(b"fresh4")[1] == b"fresh3"
    assert index.is_protected(b"old-reused") and index.is_protected(b"new-reused")


def test_the_protected_segment_keeps_its_share_by_demoting_its_oldest():
    index = TierIndex("host", 4, protected_fraction=0.5)  # at most 2 protected
    for name in (b"r1", b"r2", b"r3"):
        index.insert(name, reused=True)
    assert not index.is_protected(b"r1") and b"r1" in index  # demoted, still held
    index.insert(b"fresh")
    # r1 went to the newest end of probation before "fresh" came: it is evicted first.
    assert index.insert(b"r4", reused=True)[1] == b"r1"
    assert len(index) == 4


def test_a_pinned_block_is_skipped_in_either_segment():
    index = TierIndex("host", 2, protected_fraction=0.5)
    index.insert(b"fresh")
    index.insert(b"reused", reused=True)
    index.pin(b"fresh")
    assert index.insert(b"new")[1] == b"reused"
    index.pin(b"new")
    assert index.insert(b"newer") is None


def test_a_lookup_at_arrival_makes_the_found_blocks_the_newest():
    tiers = KVTiers(KVTierConfig(host_blocks=3, bytes_per_block=1, host_protected_fraction=0.0))
    for block, name in enumerate((b"head", b"tail", b"other")):
        tiers.on_device_evict(block, name)
    tiers.take_ops()
    tiers.touch_found([b"head", b"tail"], [])  # a queued request will load these
    assert tiers.host.insert(b"new")[1] == b"other"
    # The prefix's tail goes before its head.
    assert tiers.host.insert(b"newer")[1] == b"tail"


def test_without_a_protected_share_it_is_a_plain_lru():
    index = TierIndex("host", 2)
    index.insert(b"a", reused=True)
    index.insert(b"b")
    assert index.insert(b"c")[1] == b"a"
    with pytest.raises(ValueError, match="protected_fraction"):
        TierIndex("host", 2, protected_fraction=1.0)


def test_the_device_pool_passes_the_reuse_bit_down():
    config = KVTierConfig(host_blocks=8, bytes_per_block=1, host_protected_fraction=0.5)
    manager = BlockManager(2, tiers=config)
    tiers = manager.tiers
    assert isinstance(tiers, KVTiers)
    found, fresh = manager.device.allocate(2)
    manager.device.register(found, b"found")
    manager.device.register(fresh, b"fresh")
    manager.device.note_reused([found])  # a later request took it from the cache
    manager.device.free([found, fresh])
    manager.device.allocate(2)  # evicts both into the host
    assert tiers.host.is_protected(b"found")
    assert b"fresh" in tiers.host and not tiers.host.is_protected(b"fresh")
    # A block handed out again starts unreused.
    assert not any(manager.device.reused)
