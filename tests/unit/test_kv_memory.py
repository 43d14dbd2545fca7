"""The KV cache is sized from free memory: the rule, the flag, and the refusals."""

from __future__ import annotations

import pytest

from slipstream.agent.engine.kv.memory import (
    DEFAULT_CPU_FRACTION, KVCacheMemory, KVCacheSizeError, plan_kv_cache)

GiB = 2**30
# SmolLM2-135M in fp32: 30 layers x 3 KV heads x 64 dims x (K and V) x 4 bytes per token.
SMOLLM2_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4
BLOCK = 16


def _plan(requested: KVCacheMemory, available: int | None, *, device: str = "cpu",
          max_model_len: int = 8192, max_num_seqs: int = 256):
    return plan_kv_cache(requested=requested, device_type=device, available_bytes=available,
                         bytes_per_block=SMOLLM2_BYTES_PER_TOKEN * BLOCK, block_size=BLOCK,
                         max_model_len=max_model_len, max_num_seqs=max_num_seqs)


@pytest.mark.parametrize("text, fraction, size", [
    ("0.3", 0.3, None), ("1", 1.0, None), ("4GiB", None, 4 * GiB), ("512MiB", None, 512 * 2**20),
    ("2G", None, 2 * 10**9), ("1.5 gib", None, int(1.5 * GiB)), ("100kB", None, 100_000)])
def test_flag_takes_a_fraction_or_a_size_with_a_unit(text, fraction, size):
    assert KVCacheMemory.parse(text) == KVCacheMemory(fraction=fraction, size_bytes=size)


@pytest.mark.parametrize("text", ["0", "1.5", "-0.2", "lots", "4 parsecs", "", "GiB"])
def test_flag_rejects_what_is_neither(text):
    with pytest.raises(ValueError):
        KVCacheMemory.parse(text)


def test_default_on_a_24_gib_machine_is_a_fifth_of_available_ram():
    # A 24 GiB machine with 22 GiB available: 0.2 x 22 GiB = 4.4 GiB of fp32 SmolLM2 KV,
    # 737,280 bytes per 16-token block -> 6,407 blocks (102,512 tokens).
    assert DEFAULT_CPU_FRACTION == 0.2
    plan = _plan(KVCacheMemory(), 22 * GiB)
    assert plan.num_blocks == 6407
    assert plan.total_bytes <= 0.2 * 22 * GiB < plan.total_bytes + plan.bytes_per_block
    assert "0.2 of 22.00 GiB free on cpu" in plan.reason


def test_cuda_default_takes_most_of_the_free_device_memory():
    plan = _plan(KVCacheMemory(), 40 * GiB, device="cuda")
    assert plan.num_blocks == int(0.9 * 40 * GiB) // (SMOLLM2_BYTES_PER_TOKEN * BLOCK)


def test_cache_is_capped_at_what_the_engine_can_use():
    # 4 requests of 8192 tokens need 2,048 blocks; the free memory would give far more.
    plan = _plan(KVCacheMemory(), 22 * GiB, max_num_seqs=4)
    assert plan.num_blocks == 4 * 8192 // BLOCK
    assert "capped" in plan.reason


def test_fixed_size_and_fraction_are_honoured():
    assert _plan(KVCacheMemory.parse("1GiB"), None).num_blocks == GiB // (
        SMOLLM2_BYTES_PER_TOKEN * BLOCK)
    assert _plan(KVCacheMemory(fraction=0.5), 10 * GiB).num_blocks == 5 * GiB // (
        SMOLLM2_BYTES_PER_TOKEN * BLOCK)


def test_an_oversized_request_for_memory_refuses_in_one_line():
    with pytest.raises(KVCacheSizeError) as error:
        _plan(KVCacheMemory.parse("64GiB"), 22 * GiB)
    message = str(error.value)
    assert "\n" not in message
    assert "--kv-cache-memory 64.00 GiB does not fit" in message and "22.00 GiB" in message


def test_a_cache_too_small_for_one_request_refuses_and_says_what_to_change():
    with pytest.raises(KVCacheSizeError, match="too small.*8192-token request needs "
                                               "360.00 MiB.*--max-model-len"):
        _plan(KVCacheMemory.parse("100MiB"), 22 * GiB)
    with pytest.raises(KVCacheSizeError, match="does not fit.*fraction"):
        _plan(KVCacheMemory(fraction=0.01), 22 * GiB)
    # Not even the minimum is free: the default refuses too.
    with pytest.raises(KVCacheSizeError, match="does not fit"):
        _plan(KVCacheMemory(), 200 * 2**20)


def test_default_share_below_one_request_is_raised_to_one_request_when_it_fits():
    plan = _plan(KVCacheMemory(), 1 * GiB)  # 0.2 GiB < 360 MiB, but 360 MiB is free
    assert plan.num_blocks == 8192 // BLOCK
    assert "raised to the minimum" in plan.reason


def test_cpu_cache_pages_are_only_backed_once_written():
    import torch

    from slipstream.agent.engine.kv.memory import allocate_kv_tensor, available_memory_bytes

    def resident_bytes() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096

    before = resident_bytes()
    cache = allocate_kv_tensor((4096, 16, 8, 128), torch.float32, torch.device("cpu"))  # 256 MiB
    grown = resident_bytes() - before
    assert cache.shape == (4096, 16, 8, 128) and cache.dtype == torch.float32
    assert grown < 32 * 2**20, f"an untouched cache took {grown} resident bytes"
    assert not cache[:8].any() and not cache[-8:].any()  # zeroed where read
    half = allocate_kv_tensor((2, 16, 2, 4), torch.bfloat16, torch.device("cpu"))
    assert half.dtype == torch.bfloat16 and not half.any()
    assert 0 < available_memory_bytes(torch.device("cpu"))
