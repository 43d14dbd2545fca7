"""Sliding windows and score soft-capping in the paged attention backends, against dense
attention by absolute positions: the torch reference (every tile size) and the Triton kernels
(decode segments, split prefills) under the interpreter, including KV shards that start past
position 0, as KV-cache parallelism gives them."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.kernels.attention import AttentionMetadata
from slipstream.kernels.torch_ref import TorchReferenceBackend
from slipstream.kernels.triton_attention import KernelOptions, paged_decode
from slipstream.kernels.triton_prefill import paged_prefill
from tests.engine.test_kernels import BLOCK, DIM, HEADS, KV_HEADS, build_paged

# (cached, new) per sequence: decodes first (new == 1), then prefill chunks.
SEQS = [(40, 1), (7, 1), (70, 1), (0, 37), (25, 30)]


def dense(q, k, v, q_pos, k_pos, window, softcap):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) / math.sqrt(DIM)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    age = q_pos[:, None] - k_pos[None, :]
    mask = (age >= 0) & (age < (window or 1 << 30))
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("hnl,lhd->nhd", probs, v.double()), torch.logsumexp(scores, -1).T


def setup(seed, kv_start=0):
    """Paged caches holding every key of SEQS (new ones too); with ``kv_start``, only the keys
    from that position on (a later KV shard)."""
    generator = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, full, slots, queries = build_paged(SEQS, 64, generator)
    metadata = AttentionMetadata.build(
        query_lens=[n for _, n in SEQS], kv_lens=[max(0, c + n - kv_start) for c, n in SEQS],
        query_start_pos=[c for c, _ in SEQS], block_tables=tables, slot_mapping=slots,
        block_size=BLOCK, kv_start_pos=[kv_start] * len(SEQS))
    # Every key of the shard (the new ones too) in place, its first at the table's slot 0.
    for table, (keys, values) in zip(tables, full):
        for pos in range(kv_start, keys.shape[0]):
            slot = pos - kv_start
            k_cache[table[slot // BLOCK], slot % BLOCK] = keys[pos]
            v_cache[table[slot // BLOCK], slot % BLOCK] = values[pos]
    return k_cache, v_cache, full, torch.cat(queries), metadata


def expected(queries, full, window, softcap, kv_start=0):
    outs, lses = [], []
    for (cached, new), (keys, values), rows in zip(SEQS, full,
                                                   queries.split([n for _, n in SEQS])):
        q_pos = torch.arange(cached, cached + new)
        k_pos = torch.arange(kv_start, max(kv_start, cached + new))  # may be empty
        out, lse = dense(rows, keys[kv_start:], values[kv_start:], q_pos, k_pos, window,
                         softcap)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("window,softcap,kv_start", [
    (9, None, 0), (1, None, 0), (16, 5.0, 0), (None, 5.0, 0), (13, None, 20)])
@pytest.mark.parametrize("max_score_elements", [HEADS * 4, HEADS * 64, 1 << 24])
def test_torch_reference_windows_and_softcap_equal_dense(window, softcap, kv_start,
                                                         max_score_elements):
    k_cache, v_cache, full, queries, metadata = setup(seed=1, kv_start=kv_start)
    backend = TorchReferenceBackend(max_score_elements)
    backend.plan(metadata)
    result = backend.run(queries, k_cache, v_cache, 1 / math.sqrt(DIM), True, window, softcap)
    no_lse = backend.run(queries, k_cache, v_cache, 1 / math.sqrt(DIM), False, window, softcap)
    out, lse = expected(queries, full, window, softcap, kv_start)
    torch.testing.assert_close(result.output.double(), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.lse_natural.double(), lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(no_lse.output, result.output)


@pytest.mark.parametrize("window,softcap,kv_start,segments", [
    (9, None, 0, 1), (9, None, 0, 3), (16, 5.0, 0, 2), (13, 5.0, 20, 2)])
def test_triton_windows_and_softcap_equal_the_torch_reference(window, softcap, kv_start,
                                                              segments):
    k_cache, v_cache, full, queries, metadata = setup(seed=2, kv_start=kv_start)
    reference = TorchReferenceBackend()
    reference.plan(metadata)
    want = reference.run(queries, k_cache, v_cache, 1 / math.sqrt(DIM), True, window, softcap)
    # On a CUDA machine the compiled kernels, else the interpreter, on the same inputs.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    queries, k_cache, v_cache = queries.to(device), k_cache.to(device), v_cache.to(device)
    seq_info, blocks = metadata.seq_info.to(device), metadata.block_indices.to(device)
    out = torch.zeros_like(queries)
    lse = torch.zeros(queries.shape[:2], device=device)
    options = KernelOptions.of(window, softcap)
    decodes = metadata.num_decodes
    paged_decode(queries, k_cache, v_cache, seq_info[:decodes], blocks, 1 / math.sqrt(DIM),
                 out, lse, segments, options=options)
    paged_prefill(queries, k_cache, v_cache, seq_info[decodes:], blocks, 1 / math.sqrt(DIM),
                  out, lse,
                  max(metadata.query_lens[decodes:]), longest_kv=max(metadata.kv_lens),
                  num_tokens=queries.shape[0] - decodes, first_token=decodes,
                  num_segments=segments, options=options)
    torch.testing.assert_close(out.cpu(), want.output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), want.lse_natural, atol=1e-5, rtol=1e-5)
