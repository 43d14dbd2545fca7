"""KV tiers on the real (tiny, random-weight) model: a document evicted from a small device
pool comes back from host memory or disk instead of being recomputed, greedy outputs are
identical with the tiers on and off, and a failing tier (corrupt or unwritable disk blocks,
a host tier too small to hold anything) never fails a request."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.kv.tier_settings import KVTierSettings
from slipstream.agent.engine.kv.tier_store import DiskTier, KVTierStore
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.scheduler import SchedulerConfig

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
DEVICE_BLOCKS = 80  # 1,280 tokens: one 1,024-token document, not two


def make_engine(model_dir, host_bytes: int = 0, disk: Path | None = None,
                disk_bytes: int = 0) -> LLMEngine:
    tiers = KVTierSettings(host_memory_bytes=host_bytes, disk_path=disk,
                           disk_size_bytes=disk_bytes)
    return LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=DEVICE_BLOCKS,
                                  kv_tiers=tiers),
                     SchedulerConfig(max_batched_tokens=256))


def block_bytes(engine: LLMEngine) -> int:
    tiers = engine.block_manager.tiers
    assert tiers is not None
    return tiers.config.bytes_per_block


def conversation(seed: int = 0, others: int = 1) -> list[list[int]]:
    """Question 1 over document A, then prompts over ``others`` other documents that evict A
    from the device (and with two, from a one-document host tier on to disk), then question
    2 over A."""
    rng = random.Random(seed)
    doc_a = [rng.randrange(4000) for _ in range(1024)]
    middle = [[rng.randrange(4000) for _ in range(1024)] + [21 + i, 22] for i in range(others)]
    return [doc_a + [11, 12, 13], *middle, doc_a + [31, 32, 33, 34]]


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [engine.generate([prompt], PARAMS)[0] for prompt in prompts]


def test_an_evicted_document_comes_back_from_the_host_tier(tiny_model_dir):
    plain = run(make_engine(tiny_model_dir), conversation())
    engine = make_engine(tiny_model_dir, host_bytes=64 << 20)
    assert run(engine, conversation()) == plain
    stats = engine.stats()
    # The follow-up found the whole document: what B left on the device, the rest (most
    # of it) in the host tier, loaded back.
    assert stats.prefix_cache_hit_tokens == 1024
    assert stats.prefix_cache_hit_tokens_host >= 512
    assert stats.kv_tier_bytes_loaded >= stats.prefix_cache_hit_tokens_host // 16 * \
        block_bytes(engine)
    assert stats.kv_tier_bytes_offloaded > 0 and stats.kv_host_blocks_used > 0
    assert stats.kv_blocks_used == 0


def test_an_evicted_document_comes_back_from_the_disk_tier(tiny_model_dir, tmp_path):
    plain = run(make_engine(tiny_model_dir), conversation(others=2))
    probe = make_engine(tiny_model_dir, host_bytes=1 << 20)
    host_bytes = 72 * block_bytes(probe)  # holds one document, so B pushes A on to disk
    probe.close()
    engine = make_engine(tiny_model_dir, host_bytes, tmp_path / "kv", 64 << 20)
    assert run(engine, conversation(others=2)) == plain
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == 1024
    assert stats.prefix_cache_hit_tokens_disk > 0
    assert stats.kv_tier_bytes_spilled > 0 and stats.kv_tier_bytes_fetched > 0
    assert list((tmp_path / "kv").glob("slot-*.kvb"))


def test_a_corrupt_disk_block_is_dropped_and_the_output_is_unchanged(tiny_model_dir, tmp_path):
    plain = run(make_engine(tiny_model_dir), conversation(others=2))
    probe = make_engine(tiny_model_dir, host_bytes=1 << 20)
    host_bytes = 72 * block_bytes(probe)
    probe.close()
    engine = make_engine(tiny_model_dir, host_bytes, tmp_path / "kv", 64 << 20)
    prompts = conversation(others=2)
    outputs = run(engine, prompts[:3])
    store = engine.runner.kv_tiers
    assert store is not None
    store.drain()  # let every spill land, then damage every file on disk
    for path in (tmp_path / "kv").glob("slot-*.kvb"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    outputs += run(engine, prompts[3:])
    assert outputs == plain
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens_disk == 0 and stats.kv_tier_failed_blocks > 0


def test_a_disk_that_cannot_be_written_fails_no_request(tiny_model_dir, tmp_path, monkeypatch):
    plain = run(make_engine(tiny_model_dir), conversation(others=2))
    probe = make_engine(tiny_model_dir, host_bytes=1 << 20)
    host_bytes = 72 * block_bytes(probe)
    probe.close()

    def full(self, slot, block_hash, payload):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DiskTier, "write", full)
    engine = make_engine(tiny_model_dir, host_bytes, tmp_path / "kv", 64 << 20)
    assert run(engine, conversation(others=2)) == plain
    assert engine.stats().kv_tier_failed_blocks > 0


def test_a_host_tier_smaller_than_a_block_is_refused_with_a_message(tiny_model_dir):
    with pytest.raises(ValueError, match="kv-host-memory"):
        make_engine(tiny_model_dir, host_bytes=1000)


def test_greedy_output_is_identical_with_tiers_under_pressure(tiny_model_dir, tmp_path):
    """Many questions over three documents through a tiny device pool: every request
    completes, with the output it has without tiers."""
    rng = random.Random(3)
    docs = [[rng.randrange(4000) for _ in range(rng.randrange(300, 700))] for _ in range(3)]
    prompts = [rng.choice(docs) + [rng.randrange(4000) for _ in range(rng.randrange(1, 30))]
               for _ in range(8)]
    plain = make_engine(tiny_model_dir).generate(prompts, PARAMS)
    probe = make_engine(tiny_model_dir, host_bytes=1 << 20)
    host_bytes = 40 * block_bytes(probe)
    probe.close()
    engine = make_engine(tiny_model_dir, host_bytes, tmp_path / "kv", 64 << 20)
    assert engine.generate(prompts, PARAMS) == plain
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("failing", ["load", "offload"])
def test_a_failing_host_copy_falls_back_to_recompute(tiny_model_dir, monkeypatch, failing):
    """A load onto the device that fails part-way leaves blocks that do not hold what their
    hashes say: they are forgotten and their requests recomputed. An offload that fails is
    forgotten by the host tier. Either way the outputs are those without tiers."""
    plain = run(make_engine(tiny_model_dir), conversation())
    original = KVTierStore._copy
    failures = []

    def copy(source, destination, copies):
        # The device pool has DEVICE_BLOCKS slots, the host tier thousands.
        loading = failing == "load" and destination[0][0].shape[0] == DEVICE_BLOCKS
        offloading = failing == "offload" and source[0][0].shape[0] == DEVICE_BLOCKS
        if (loading or offloading) and not failures:
            failures.append(len(copies))
            original(source, destination, copies[: len(copies) // 2])  # half, then it breaks
            raise RuntimeError("injected failure")
        return original(source, destination, copies)

    monkeypatch.setattr(KVTierStore, "_copy", staticmethod(copy))
    engine = make_engine(tiny_model_dir, host_bytes=64 << 20)
    assert run(engine, conversation()) == plain
    assert failures
    stats = engine.stats()
    assert stats.kv_blocks_used == 0
    if failing == "offload":
        assert stats.kv_tier_failed_blocks > 0


def test_the_disk_format_is_checked_field_by_field(tmp_path):
    """The documented layout: a 48-byte header (magic, version, reserved, payload length,
    block hash, BLAKE2b-128 of the payload), then the payload; any mismatch is refused."""
    import struct

    from slipstream.agent.engine.kv.tier_store import HEADER, CorruptBlock, checksum

    disk = DiskTier(tmp_path, num_blocks=4, payload_bytes=64)
    payload = bytes(range(64))
    disk.write(2, b"h" * 16, payload)
    raw = disk.file(2).read_bytes()
    assert HEADER.size == 48 and len(raw) == 48 + 64
    assert struct.unpack_from("<4sHHQ16s16s", raw) == (b"SKV1", 1, 0, 64, b"h" * 16,
                                                         checksum(payload))
    assert disk.read(2, b"h" * 16) == payload
    with pytest.raises(CorruptBlock, match="another block"):
        disk.read(2, b"g" * 16)
    for offset, what in ((0, "version"), (48 + 10, "checksum")):
        damaged = bytearray(raw)
        damaged[offset] ^= 0xFF
        disk.file(2).write_bytes(bytes(damaged))
        with pytest.raises(CorruptBlock, match=what):
            disk.read(2, b"h" * 16)
    disk.file(2).write_bytes(raw[:40])
    with pytest.raises(CorruptBlock, match="shorter than a header"):
        disk.read(2, b"h" * 16)
    disk.file(2).write_bytes(raw[:-1])
    with pytest.raises(CorruptBlock, match="payload bytes"):
        disk.read(2, b"h" * 16)
