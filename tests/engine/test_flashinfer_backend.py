"""FlashInferBackend against the torch reference on the same CUDA tensors (GPU only).

Skipped unless CUDA is available and ``flashinfer`` is installed (the ``gpu`` extra). The
reference computes in float32 from the same half-precision cache, so tolerances cover only
FlashInfer's half-precision softmax-times-values.
"""

from __future__ import annotations

import importlib.util
import math
import random

import pytest
import torch

from slipstream.kernels.attention import AttentionMetadata, merge_many, merge_states
from slipstream.kernels.torch_ref import TorchReferenceBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                       reason="flashinfer-python is not installed"),
]

BLOCK = 16
DEVICE = "cuda"
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
LSE_TOLERANCE = 1e-2
# (query heads, kv heads, head dim): GQA on CUDA-core decode, GQA group 8 on tensor-core
# decode, and plain multi-head attention.
SHAPES = [(8, 2, 128), (16, 2, 64), (4, 4, 128)]


@pytest.fixture(scope="module")
def backend():
    from slipstream.kernels.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(torch.device(DEVICE))


def paged(contexts, kv_heads, head_dim, dtype, generator, capacities=None):
    """Write each (keys, values) context into its own shuffled blocks, with room for
    ``capacities`` tokens (default: the context); return caches and block tables."""
    capacities = capacities or [len(keys) for keys, _ in contexts]
    counts = [max(1, -(-capacity // BLOCK)) for capacity in capacities]
    order = torch.randperm(sum(counts) + 2, generator=generator).tolist()
    k_cache = torch.zeros(len(order), BLOCK, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    tables = []
    for (keys, values), count in zip(contexts, counts):
        table = [order.pop() for _ in range(count)]
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(keys))],
                             dtype=torch.long, device=DEVICE)
        k_cache.view(-1, kv_heads, head_dim)[slots] = keys.to(DEVICE, dtype)
        v_cache.view(-1, kv_heads, head_dim)[slots] = values.to(DEVICE, dtype)
        tables.append(table)
    return k_cache, v_cache, tables


def assert_close(result, expected, dtype):
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(result.output.float(), expected.output.float(),
                               atol=tolerance, rtol=tolerance)
    assert result.lse_natural.dtype == torch.float32
    empty = torch.isneginf(expected.lse_natural)
    assert torch.equal(torch.isneginf(result.lse_natural), empty)
    torch.testing.assert_close(result.lse_natural[~empty], expected.lse_natural[~empty],
                               atol=LSE_TOLERANCE, rtol=LSE_TOLERANCE)
    assert bool((result.output[empty] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(3))
def test_mixed_step_matches_reference(backend, dtype, shape, seed):
    heads, kv_heads, head_dim = shape
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    seqs = [(rng.randint(0, 300), 1) for _ in range(rng.randint(0, 5))]  # (cached, new)
    seqs += [(rng.randint(0, 200), rng.randint(1, 150)) for _ in range(rng.randint(1, 4))]
    contexts = [(torch.randn(c + n, kv_heads, head_dim, generator=generator),
                 torch.randn(c + n, kv_heads, head_dim, generator=generator)) for c, n in seqs]
    # Only the cached part is in the cache before the step; write_kv stores the new tokens.
    k_cache, v_cache, tables = paged(
        [(k[:c], v[:c]) for (k, v), (c, _) in zip(contexts, seqs)], kv_heads, head_dim, dtype,
        generator, capacities=[c + n for c, n in seqs])
    metadata = AttentionMetadata.build(
        query_lens=[n for _, n in seqs], kv_lens=[c + n for c, n in seqs],
        query_start_pos=[c for c, _ in seqs], block_tables=tables,
        slot_mapping=[t[p // BLOCK] * BLOCK + p % BLOCK
                      for t, (c, n) in zip(tables, seqs) for p in range(c, c + n)],
        block_size=BLOCK, device=DEVICE)
    new_keys = torch.cat([k[c:] for (k, _), (c, _) in zip(contexts, seqs)]).to(DEVICE, dtype)
    new_values = torch.cat([v[c:] for (_, v), (c, _) in zip(contexts, seqs)]).to(DEVICE, dtype)

    reference = TorchReferenceBackend()
    reference.plan(metadata)
    backend.plan(metadata)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k_ref, v_ref, new_keys, new_values)
    backend.write_kv(k_cache, v_cache, new_keys, new_values)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)

    scale = 1 / math.sqrt(head_dim)
    for _layer in range(2):  # the second call reuses the step's FlashInfer plan
        query = torch.randn(metadata.num_tokens, heads, head_dim, generator=generator).to(
            DEVICE, dtype)
        assert_close(backend.run(query, k_cache, v_cache, scale),
                     reference.run(query, k_ref, v_ref, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kv_shards_match_reference_and_merge_to_unsharded(backend, dtype):
    """A decode at 150 and a chunk at 200..259 over shards [0,100), [100,230), [230,300).

    This hits every case of the mapping: shards wholly before the queries (non-causal), a shard
    ending inside the chunk, one starting inside it (rows that see nothing), and KV beyond
    the queries (masked)."""
    heads, kv_heads, head_dim = 8, 2, 128
    generator = torch.Generator().manual_seed(7)
    total = 300
    keys = [torch.randn(total, kv_heads, head_dim, generator=generator) for _ in range(2)]
    values = [torch.randn(total, kv_heads, head_dim, generator=generator) for _ in range(2)]
    query_lens, query_start = [1, 60], [150, 200]
    query = torch.randn(61, heads, head_dim, generator=generator).to(DEVICE, dtype)
    scale = 1 / math.sqrt(head_dim)

    def shard_results(start, end):
        k_cache, v_cache, tables = paged(
            [(k[start:end], v[start:end]) for k, v in zip(keys, values)], kv_heads, head_dim,
            dtype, generator)
        metadata = AttentionMetadata.build(
            query_lens=query_lens, kv_lens=[end - start] * 2, query_start_pos=query_start,
            block_tables=tables, slot_mapping=[-1] * 61, block_size=BLOCK, device=DEVICE,
            kv_start_pos=[start] * 2)
        reference = TorchReferenceBackend()
        reference.plan(metadata)
        backend.plan(metadata)
        return (backend.run(query, k_cache, v_cache, scale),
                reference.run(query, k_cache, v_cache, scale))

    partials = []
    for start, end in [(0, 100), (100, 230), (230, 300)]:
        result, expected = shard_results(start, end)
        assert_close(result, expected, dtype)
        partials.append(result)
    assert bool(torch.isneginf(partials[2].lse_natural[:31]).all())  # before shard 2 starts
    unsharded, _ = shard_results(0, total)
    merged = merge_many(partials)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(merged.output.float(), unsharded.output.float(),
                               atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(merged.lse_natural, unsharded.lse_natural,
                               atol=LSE_TOLERANCE, rtol=LSE_TOLERANCE)


def test_float32_is_refused_with_a_clear_error(backend):
    metadata = AttentionMetadata.build(
        query_lens=[1], kv_lens=[5], query_start_pos=[4], block_tables=[[0]],
        slot_mapping=[4], block_size=BLOCK, device=DEVICE)
    cache = torch.zeros(1, BLOCK, 2, 64, device=DEVICE)
    backend.plan(metadata)
    with pytest.raises(TypeError, match="float16/bfloat16"):
        backend.run(torch.zeros(1, 2, 64, device=DEVICE), cache, cache, 0.125)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_merge_states_gpu_matches_torch(dtype):
    from slipstream.kernels.flashinfer_backend import merge_states_gpu

    generator = torch.Generator().manual_seed(3)
    rows, heads, head_dim = 64, 8, 128
    outputs = [torch.randn(rows, heads, head_dim, generator=generator).to(DEVICE, dtype)
               for _ in range(2)]
    lses = [torch.randn(rows, heads, generator=generator).mul(4).to(DEVICE) for _ in range(2)]
    lses[0][:8] = float("-inf")  # a set with no visible KV
    lses[1][4:12] = float("-inf")  # rows 4..7: both empty
    outputs[0][:8] = 0
    outputs[1][4:12] = 0
    expected_output, expected_lse = merge_states(outputs[0], lses[0], outputs[1], lses[1])
    output, lse = merge_states_gpu(outputs[0], lses[0], outputs[1], lses[1])
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(output.float(), expected_output.float(),
                               atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse, expected_lse, atol=1e-3, rtol=1e-3)
    assert bool(torch.isneginf(lse[4:8]).all()) and bool((output[4:8] == 0).all())
