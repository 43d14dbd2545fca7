"""The torch paged-attention reference against dense attention, and merge_states against
unsharded attention."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.kernels.attention import AttentionMetadata, merge_many, merge_states
from slipstream.kernels.torch_ref import TorchReferenceBackend, decode_groups

BLOCK = 16
HEADS, KV_HEADS, DIM = 4, 2, 8


def dense_attention(q, k, v, q_pos, k_pos):
    """q [n, H, D], k/v [L, Hkv, D]: causal by absolute positions. Returns out, lse."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) / math.sqrt(q.shape[-1])
    mask = k_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), v.double())
    return out, lse.transpose(0, 1)


def build_paged(seqs, num_blocks, generator):
    """seqs: list of (cached_len, new_len). Returns caches, metadata pieces and dense tensors."""
    k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    free = torch.randperm(num_blocks, generator=generator).tolist()  # shuffled, non-contiguous
    tables, dense, slot_mapping, queries = [], [], [], []
    for cached, new in seqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BLOCK))]
        keys = torch.randn(total, KV_HEADS, DIM, generator=generator)
        values = torch.randn(total, KV_HEADS, DIM, generator=generator)
        for pos in range(cached):  # pre-existing cache content
            k_cache[table[pos // BLOCK], pos % BLOCK] = keys[pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = values[pos]
        slot_mapping += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, total)]
        tables.append(table)
        dense.append((keys, values))
        queries.append(torch.randn(new, HEADS, DIM, generator=generator))
    return k_cache, v_cache, tables, dense, slot_mapping, queries


@settings(max_examples=40, deadline=None)
@given(
    decodes=st.lists(st.integers(0, 70), max_size=4),
    prefills=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 40)), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_equals_dense(decodes, prefills, seed):
    metadata = check_paged_against_dense([(cached, 1) for cached in decodes] + list(prefills),
                                         seed)
    if metadata is not None:
        assert metadata.num_decodes >= len(decodes)  # one-token rows lead the batch


def test_decodes_of_very_different_kv_lengths_are_grouped_and_exact():
    # One long decode beside short ones: padding all to 2,000 tokens would be 25x the work.
    kv_lens = [40, 2000, 60, 700, 35, 300]
    groups = decode_groups(kv_lens)
    # 2,000 and 700 alone; 300 keeps 60 (only 240 tokens of padding), 40 and 35 start anew.
    assert sorted(map(sorted, groups)) == [[0, 4], [1], [2, 5], [3]]
    seqs = [(kv - 1, 1) for kv in kv_lens] + [(50, 20)]
    check_paged_against_dense(seqs, seed=7, num_blocks=256)


def check_paged_against_dense(seqs, seed, num_blocks=64):
    """Paged attention (both paths) against dense attention; returns the metadata."""
    if not seqs:
        return None
    generator = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, dense, slot_mapping, queries = build_paged(seqs, num_blocks,
                                                                         generator)
    metadata = AttentionMetadata.build(
        query_lens=[new for _, new in seqs], kv_lens=[c + n for c, n in seqs],
        query_start_pos=[c for c, _ in seqs], block_tables=tables,
        slot_mapping=slot_mapping, block_size=BLOCK)
    backend = TorchReferenceBackend()
    backend.plan(metadata)
    new_keys = torch.cat([k[c:] for (k, _), (c, _) in zip(dense, seqs)])
    new_values = torch.cat([v[c:] for (_, v), (c, _) in zip(dense, seqs)])
    backend.write_kv(k_cache, v_cache, new_keys, new_values)
    result = backend.run(torch.cat(queries), k_cache, v_cache, 1 / math.sqrt(DIM))
    fused = backend.run(torch.cat(queries), k_cache, v_cache, 1 / math.sqrt(DIM),
                        return_lse=False)  # the SDPA path the model uses
    assert fused.lse_natural is None
    torch.testing.assert_close(fused.output, result.output, atol=1e-5, rtol=1e-5)

    row = 0
    for (cached, new), (keys, values), query in zip(seqs, dense, queries):
        positions = torch.arange(cached + new)
        expected, expected_lse = dense_attention(query, keys, values, positions[cached:], positions)
        torch.testing.assert_close(result.output[row:row + new].double(), expected,
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result.lse_natural[row:row + new].double(), expected_lse,
                                   atol=1e-5, rtol=1e-5)
        row += new
    return metadata


@pytest.mark.parametrize("num_shards", [2, 3])
def test_merge_states_of_shards_equals_unsharded(num_shards):
    generator = torch.Generator().manual_seed(num_shards)
    total, new = 90, 7
    keys = torch.randn(total, KV_HEADS, DIM, generator=generator)
    values = torch.randn(total, KV_HEADS, DIM, generator=generator)
    query = torch.randn(new, HEADS, DIM, generator=generator)
    positions = torch.arange(total)
    q_pos = positions[total - new:]
    expected, expected_lse = dense_attention(query, keys, values, q_pos, positions)

    # Each shard is its own paged cache holding a contiguous slice of the sequence, as in KVP.
    bounds = torch.linspace(0, total, num_shards + 1).long().tolist()
    partials = []
    for start, end in zip(bounds, bounds[1:]):
        length = end - start
        table = list(range(-(-length // BLOCK)))[::-1]  # reversed: non-contiguous order
        k_cache = torch.zeros(len(table), BLOCK, KV_HEADS, DIM)
        v_cache = torch.zeros_like(k_cache)
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)]
        k_cache.view(-1, KV_HEADS, DIM)[slots] = keys[start:end]
        v_cache.view(-1, KV_HEADS, DIM)[slots] = values[start:end]
        metadata = AttentionMetadata.build(
            query_lens=[new], kv_lens=[length], query_start_pos=[total - new],
            block_tables=[table], slot_mapping=[-1] * new, block_size=BLOCK,
            kv_start_pos=[start])
        backend = TorchReferenceBackend()
        backend.plan(metadata)
        partials.append(backend.run(query, k_cache, v_cache, 1 / math.sqrt(DIM)))

    merged = merge_many(partials)
    torch.testing.assert_close(merged.output.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged.lse_natural.double(), expected_lse, atol=1e-5, rtol=1e-5)


def test_merge_states_with_an_empty_shard_is_identity():
    out = torch.randn(3, HEADS, DIM)
    lse = torch.randn(3, HEADS)
    empty_lse = torch.full_like(lse, float("-inf"))
    merged, merged_lse = merge_states(out, lse, torch.zeros_like(out), empty_lse)
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(merged_lse, lse)
    both_empty, both_lse = merge_states(out, empty_lse, out, empty_lse)
    assert torch.isneginf(both_lse).all() and torch.isfinite(both_empty).all()


def test_run_before_plan_is_a_clear_error():
    backend = TorchReferenceBackend()
    with pytest.raises(RuntimeError, match="plan"):
        backend.run(torch.zeros(1, HEADS, DIM), torch.zeros(1, BLOCK, KV_HEADS, DIM),
                    torch.zeros(1, BLOCK, KV_HEADS, DIM), 1.0)
