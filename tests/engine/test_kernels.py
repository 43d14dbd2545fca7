"""The torch paged-attention reference against dense attention (whole and in small tiles), and
merge_states against unsharded attention."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.kernels import attention_tiles, torch_ref
from slipstream.kernels.attention import AttentionMetadata, merge_many, merge_states
from slipstream.kernels.attention_tiles import QueryTile, fused_tile_mask, query_tiles
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
    # A query that sees no key (a shard after it) has lse -inf and, by our rule, output 0.
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    out = torch.einsum("hnl,lhd->nhd", probs, v.double())
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


# Bounds small enough that every sequence here spans several tiles: 4 heads x 4 (query, key)
# pairs is tiles of 2 x 2; 4 x 64 is 8 x 8 in the lse path and 1-3 query rows per SDPA call.
SMALL_BOUNDS = (HEADS * 4, HEADS * 64)


@settings(max_examples=40, deadline=None)
@given(
    decodes=st.lists(st.integers(0, 70), max_size=4),
    prefills=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 40)), max_size=3),
    seed=st.integers(0, 2**16),
    max_score_elements=st.sampled_from((torch_ref.MAX_SCORE_ELEMENTS, *SMALL_BOUNDS)),
)
def test_paged_attention_equals_dense(decodes, prefills, seed, max_score_elements):
    metadata = check_paged_against_dense([(cached, 1) for cached in decodes] + list(prefills),
                                         seed, max_score_elements=max_score_elements)
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


def check_paged_against_dense(seqs, seed, num_blocks=64,
                              max_score_elements=torch_ref.MAX_SCORE_ELEMENTS):
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
    backend = TorchReferenceBackend(max_score_elements)
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


def build_shard(keys, values, kv_start, kv_len, generator):
    """A paged cache holding keys ``kv_start:kv_start + kv_len`` of a sequence (a KVP shard,
    or the whole sequence from 0), in shuffled blocks. Returns (k_cache, v_cache, table)."""
    num_blocks = max(1, -(-kv_len // BLOCK))
    table = torch.randperm(num_blocks, generator=generator).tolist()[:-(-kv_len // BLOCK)]
    k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    slots = [table[j // BLOCK] * BLOCK + j % BLOCK for j in range(kv_len)]
    k_cache.view(-1, KV_HEADS, DIM)[slots] = keys[kv_start:kv_start + kv_len]
    v_cache.view(-1, KV_HEADS, DIM)[slots] = values[kv_start:kv_start + kv_len]
    return k_cache, v_cache, table


def shard_attention(query, q_start, keys, values, kv_start, kv_len, max_score_elements,
                    seed=0):
    """Both paths of the backend for one prefill chunk (queries from ``q_start``) over one
    shard of its keys; each against dense float64 attention over the same keys."""
    generator = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table = build_shard(keys, values, kv_start, kv_len, generator)
    new = query.shape[0]
    metadata = AttentionMetadata.build(
        query_lens=[new], kv_lens=[kv_len], query_start_pos=[q_start], block_tables=[table],
        slot_mapping=[-1] * new, block_size=BLOCK, kv_start_pos=[kv_start])
    backend = TorchReferenceBackend(max_score_elements)
    backend.plan(metadata)
    result = backend.run(query, k_cache, v_cache, 1 / math.sqrt(DIM))
    fused = backend.run(query, k_cache, v_cache, 1 / math.sqrt(DIM), return_lse=False)
    expected, expected_lse = dense_attention(
        query, keys[kv_start:kv_start + kv_len], values[kv_start:kv_start + kv_len],
        torch.arange(q_start, q_start + new), torch.arange(kv_start, kv_start + kv_len))
    torch.testing.assert_close(result.output.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.lse_natural.double(), expected_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.output.double(), expected, atol=1e-5, rtol=1e-5)
    return result


def random_sequence(total, new, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(total, KV_HEADS, DIM, generator=generator),
            torch.randn(total, KV_HEADS, DIM, generator=generator),
            torch.randn(new, HEADS, DIM, generator=generator))


@pytest.mark.parametrize("max_score_elements", SMALL_BOUNDS)
@pytest.mark.parametrize("cached,new", [(0, 45), (50, 37), (3, 80)])
def test_a_prompt_of_many_tiles_equals_dense(max_score_elements, cached, new):
    # Fresh (the first fused tile takes SDPA's causal mask), and after a cached prefix.
    keys, values, query = random_sequence(cached + new, new, seed=cached + new)
    shard_attention(query, cached, keys, values, 0, cached + new, max_score_elements)
    assert len(query_tiles(new, cached, 0, cached + new, max_rows=8)) > 1


# Queries at positions 60..99 of a 100-token sequence, against one shard of its keys.
@pytest.mark.parametrize("kv_start,kv_len", [
    (0, 40),  # wholly before the queries: every tile unmasked
    (16, 50),  # ends inside them: the last tiles have a band
    (70, 20),  # starts inside them: rows 60-69 see nothing
    (96, 4),  # a short shard under the last few queries
])
@pytest.mark.parametrize("max_score_elements", SMALL_BOUNDS)
def test_a_kv_shard_in_tiles_equals_dense_over_that_shard(kv_start, kv_len, max_score_elements):
    keys, values, query = random_sequence(100, 40, seed=kv_start)
    result = shard_attention(query, 60, keys, values, kv_start, kv_len, max_score_elements)
    blind = max(kv_start - 60, 0)  # rows before the shard's first key
    assert torch.isneginf(result.lse_natural[:blind]).all()
    assert torch.isfinite(result.lse_natural[blind:]).all()


@pytest.mark.parametrize("kv_len", [0, 8])
def test_a_shard_wholly_after_the_queries_gives_lse_minus_inf_and_zero_output(kv_len):
    keys, values, query = random_sequence(140, 40, seed=kv_len)
    for bound in (*SMALL_BOUNDS, torch_ref.MAX_SCORE_ELEMENTS):
        result = shard_attention(query, 60, keys, values, 128, kv_len, bound)
        assert torch.isneginf(result.lse_natural).all()
        assert not result.output.any()


def test_shards_attended_in_small_tiles_merge_to_the_whole():
    keys, values, query = random_sequence(100, 40, seed=11)
    expected, expected_lse = dense_attention(query, keys, values, torch.arange(60, 100),
                                             torch.arange(100))
    parts = [shard_attention(query, 60, keys, values, start, end - start, HEADS * 16)
             for start, end in [(0, 48), (48, 80), (80, 100), (112, 100 + 12)]]
    merged = merge_many(parts)
    torch.testing.assert_close(merged.output.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged.lse_natural.double(), expected_lse, atol=1e-5, rtol=1e-5)


def test_no_call_materialises_more_scores_than_the_bound(monkeypatch):
    bound = HEADS * 128
    lse_scores, sdpa_scores = [], []
    real_attend = attention_tiles.masked_softmax_attend
    real_sdpa = torch_ref.F.scaled_dot_product_attention

    def attend(query, keys, values, mask, scale, *options):
        out, lse = real_attend(query, keys, values, mask, scale, *options)
        lse_scores.append(lse.numel() * keys.shape[-1])  # (head, query) rows x keys
        return out, lse

    def sdpa(query, keys, values, **kwargs):
        sdpa_scores.append(query.shape[0] * query.shape[1] * query.shape[2] * keys.shape[2])
        return real_sdpa(query, keys, values, **kwargs)

    monkeypatch.setattr(attention_tiles, "masked_softmax_attend", attend)
    monkeypatch.setattr(torch_ref.F, "scaled_dot_product_attention", sdpa)
    # Decodes of 20-31 keys (padded to 32: 4 rows a tile), a prefill of 50 after 40 cached.
    check_paged_against_dense([(25, 1), (19, 1), (30, 1), (22, 1), (28, 1), (40, 50)], seed=3,
                              max_score_elements=bound)
    assert len(lse_scores) > 10 and len(sdpa_scores) > 10
    assert max(lse_scores) <= bound and max(sdpa_scores) <= bound
    # With the default bound the same batch is one call per decode group and per prefill.
    lse_scores.clear()
    check_paged_against_dense([(25, 1), (40, 50)], seed=3)
    assert len(lse_scores) == 2


def test_a_decode_longer_than_the_bound_is_cut_into_key_tiles(monkeypatch):
    calls = []
    real_attend = attention_tiles.masked_softmax_attend

    def attend(query, keys, values, mask, scale, *options):
        calls.append(keys.shape[-1])
        return real_attend(query, keys, values, mask, scale, *options)

    monkeypatch.setattr(attention_tiles, "masked_softmax_attend", attend)
    # One row of 100 keys (112 padded) at a bound of 16 keys for its 4 heads: 7 key tiles.
    check_paged_against_dense([(99, 1), (5, 20)], seed=5, max_score_elements=HEADS * 16)
    assert calls[:7] == [16] * 7


def test_query_tiles_cover_the_rows_that_see_a_key():
    # Queries at 20..29, a shard of keys 25..32: rows 0-4 see nothing.
    tiles = query_tiles(10, 20, 25, 8, max_rows=4)
    assert tiles == [QueryTile(5, 9, visible_keys=4, shared_keys=1),
                     QueryTile(9, 10, visible_keys=5, shared_keys=5)]
    assert query_tiles(10, 20, 0, 0, max_rows=4) == []
    assert query_tiles(10, 20, 30, 5, max_rows=4) == []  # the shard is after every query
    # A chunk after 100 cached keys: each tile sees the prefix plus its own diagonal.
    assert query_tiles(6, 100, 0, 106, max_rows=3) == [
        QueryTile(0, 3, visible_keys=103, shared_keys=101),
        QueryTile(3, 6, visible_keys=106, shared_keys=104)]


def test_fused_tiles_mask_only_the_diagonal_band():
    dtype, cpu = torch.float32, torch.device("cpu")
    assert fused_tile_mask(QueryTile(0, 4, 40, 40), dtype, cpu) == (None, False)
    assert fused_tile_mask(QueryTile(0, 4, 4, 1), dtype, cpu) == (None, True)
    mask, causal = fused_tile_mask(QueryTile(0, 3, 12, 10), dtype, cpu)
    assert not causal and mask.shape == (3, 12)
    assert not mask[:, :10].any()  # the shared keys: visible to every row
    hidden = torch.isneginf(mask[:, 10:])
    assert hidden.tolist() == [[True, True], [False, True], [False, False]]


def test_only_kept_slots_are_written_whichever_way_the_skips_are_counted():
    generator = torch.Generator().manual_seed(0)
    key = torch.randn(5, KV_HEADS, DIM, generator=generator)
    value = torch.randn(5, KV_HEADS, DIM, generator=generator)
    metadata = AttentionMetadata.build(
        query_lens=[5], kv_lens=[5], query_start_pos=[0], block_tables=[[1]],
        slot_mapping=[16, -1, 18, -1, 20], block_size=BLOCK)
    assert metadata.skipped_writes == 2
    for counted in (metadata, dataclasses.replace(metadata, skipped_writes=None)):
        k_cache = torch.full((2, BLOCK, KV_HEADS, DIM), 7.0)
        v_cache = torch.full((2, BLOCK, KV_HEADS, DIM), 7.0)
        backend = TorchReferenceBackend()
        backend.plan(counted)
        backend.write_kv(k_cache, v_cache, key, value)
        flat_k, flat_v = k_cache.view(-1, KV_HEADS, DIM), v_cache.view(-1, KV_HEADS, DIM)
        torch.testing.assert_close(flat_k[[16, 18, 20]], key[[0, 2, 4]])
        torch.testing.assert_close(flat_v[[16, 18, 20]], value[[0, 2, 4]])
        untouched = [slot for slot in range(2 * BLOCK) if slot not in (16, 18, 20)]
        assert (flat_k[untouched] == 7.0).all() and (flat_v[untouched] == 7.0).all()
