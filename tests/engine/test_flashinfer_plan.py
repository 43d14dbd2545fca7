"""CPU checks of the FlashInfer adapter: the launch mapping and the import fallback.

FlashInfer itself needs a GPU, so here each planned launch is evaluated with a few lines of
torch that follow FlashInfer's documented paged semantics (CSR page tables, last-page length,
causal rule with the queries at the end of the KV, base-2 LSE). Assembled, the launches must
reproduce the torch reference, which is the spec, for any mix of decodes, prefill chunks and
KV shards.
"""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.kernels.attention import AttentionMetadata, select_backend
from slipstream.kernels.flashinfer_plan import plan_launches, split_sequence
from slipstream.kernels.torch_ref import TorchReferenceBackend

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8
LN_2 = math.log(2.0)


def flashinfer_semantics(query, k_cache, v_cache, launch, scale):
    """One paged launch as FlashInfer defines it; returns (output, lse_base2) per launch row."""
    qo, kv = launch.qo_indptr.tolist(), launch.kv_indptr.tolist()
    outputs, lses = [], []
    for request in range(len(qo) - 1):
        q = query[qo[request]:qo[request + 1]]
        pages = launch.kv_indices[kv[request]:kv[request + 1]].long()
        kv_len = (len(pages) - 1) * BLOCK + int(launch.kv_last_page_len[request])
        keys = k_cache[pages].reshape(-1, KV_HEADS, DIM)[:kv_len].repeat_interleave(
            HEADS // KV_HEADS, dim=1)
        values = v_cache[pages].reshape(-1, KV_HEADS, DIM)[:kv_len].repeat_interleave(
            HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q.double(), keys.double()) * scale
        if launch.causal:
            row = torch.arange(len(q))[:, None]
            scores = scores.masked_fill(
                torch.arange(kv_len)[None, :] > row + kv_len - len(q), float("-inf"))
        lses.append((torch.logsumexp(scores, -1) / LN_2).transpose(0, 1))
        outputs.append(torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), values.double()))
    return torch.cat(outputs), torch.cat(lses)


def run_planned(metadata, query, k_cache, v_cache, scale):
    launches = plan_launches(metadata)
    output = torch.zeros(query.shape, dtype=torch.float64)
    lse = torch.full(query.shape[:2], float("-inf"), dtype=torch.float64)
    for launch in launches.launches():
        out, lse_base2 = flashinfer_semantics(query[launch.rows], k_cache, v_cache, launch, scale)
        output[launch.rows] = out
        lse[launch.rows] = lse_base2 * LN_2
    return launches, output, lse


@st.composite
def shard_steps(draw):
    """Sequences as (query_start, query_len, kv_start, kv_len); decodes first."""
    decodes = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(-12, 12),
                                      st.integers(0, 30)), max_size=3))
    prefills = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(2, 20),
                                       st.integers(-25, 25), st.integers(0, 40)),
                             min_size=0 if decodes else 1, max_size=3))
    seqs = [(start, 1, max(0, start + shift), length) for start, shift, length in decodes]
    seqs += [(start, n, max(0, start + shift), length) for start, n, shift, length in prefills]
    return seqs


@settings(max_examples=60, deadline=None)
@given(seqs=shard_steps(), seed=st.integers(0, 2**16))
def test_launches_reproduce_reference(seqs, seed):
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [max(1, -(-kv_len // BLOCK)) for *_, kv_len in seqs]
    free = torch.randperm(sum(blocks_per_seq) + 3, generator=generator).tolist()
    tables = [[free.pop() for _ in range(count)] for count in blocks_per_seq]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator)
    metadata = AttentionMetadata.build(
        query_lens=[n for _, n, _, _ in seqs], kv_lens=[kv_len for *_, kv_len in seqs],
        query_start_pos=[start for start, *_ in seqs], block_tables=tables,
        slot_mapping=[-1] * sum(n for _, n, _, _ in seqs), block_size=BLOCK,
        kv_start_pos=[kv_start for _, _, kv_start, _ in seqs])
    query = torch.randn(metadata.num_tokens, HEADS, DIM, generator=generator)
    scale = 1 / math.sqrt(DIM)

    reference = TorchReferenceBackend()
    reference.plan(metadata)
    expected = reference.run(query, k_cache, v_cache, scale)
    launches, output, lse = run_planned(metadata, query, k_cache, v_cache, scale)

    torch.testing.assert_close(output, expected.output.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected.lse_natural.double(), atol=1e-5, rtol=1e-5)
    assert launches.rows_without_kv == int(torch.isneginf(expected.lse_natural[:, 0]).sum())


def test_unsharded_step_is_one_decode_and_one_causal_launch_over_contiguous_rows():
    # Two decodes and two prefill chunks, KV starting at position 0 as without KVP.
    seqs = [(9, 1), (4, 1), (0, 7), (5, 3)]  # (cached tokens, new tokens)
    tables = [[0, 1, 2], [3, 4], [5, 6], [7, 8]]
    metadata = AttentionMetadata.build(
        query_lens=[n for _, n in seqs], kv_lens=[c + n for c, n in seqs],
        query_start_pos=[c for c, _ in seqs], block_tables=tables,
        slot_mapping=[-1] * 12, block_size=BLOCK)
    launches = plan_launches(metadata)
    assert launches.prefill_full is None and launches.rows_without_kv == 0
    assert launches.decode.rows == slice(0, 2) and launches.prefill_causal.rows == slice(2, 12)
    assert launches.prefill_causal.causal and not launches.decode.causal
    assert launches.decode.kv_indptr.tolist() == [0, 3, 2 + 3]
    assert launches.decode.kv_indices.tolist() == [0, 1, 2, 3, 4]
    assert launches.decode.kv_last_page_len.tolist() == [2, 1]  # 10 = 2*4+2, 5 = 4+1
    assert launches.prefill_causal.qo_indptr.tolist() == [0, 7, 10]
    assert launches.prefill_causal.kv_last_page_len.tolist() == [3, 4]
    assert all(t.dtype == torch.int32 for t in (launches.decode.kv_indices,
                                                 launches.prefill_causal.qo_indptr))


@pytest.mark.parametrize(("kv_start", "kv_len", "band", "after"), [
    (0, 40, (0, 10, 40), None),      # queries 30..39 at the end of their own KV: causal
    (0, 20, None, (0, 10, 20)),      # shard wholly before the queries: non-causal, all of it
    (25, 10, (0, 5, 10), (5, 5, 10)),  # shard ends mid-chunk: band rows then "after" rows
    (34, 20, (4, 6, 6), None),       # shard starts mid-chunk: 4 rows see nothing
    (40, 8, None, None),             # shard wholly after the queries
    (0, 0, None, None),              # empty shard
])
def test_split_sequence_cases(kv_start, kv_len, band, after):
    got_band, got_after = split_sequence(seq=0, first_row=0, query_start=30, query_len=10,
                                         kv_start=kv_start, kv_len=kv_len)
    as_tuple = (lambda s: None if s is None else (s.first_row, s.num_rows, s.kv_len))
    assert as_tuple(got_band) == band
    assert as_tuple(got_after) == after


def test_module_imports_and_falls_back_without_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    module = importlib.reload(importlib.import_module("slipstream.kernels.flashinfer_backend"))
    with pytest.raises(ImportError, match="flashinfer-python"):
        module.FlashInferBackend("cuda")
    with pytest.raises(ImportError, match="flashinfer-python"):
        module.merge_states_gpu(*[torch.zeros(1, 1, 1)] * 4)
    assert select_backend("cuda").name == "triton"  # auto: our Triton kernels instead
    with pytest.raises(ImportError):
        select_backend("cuda", prefer="flashinfer")


def test_cpu_selects_torch_backend():
    assert isinstance(select_backend("cpu"), TorchReferenceBackend)
    with pytest.raises(ValueError, match="CUDA only"):
        select_backend("cpu", prefer="flashinfer")
