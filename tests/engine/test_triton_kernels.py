"""The Triton attention kernels against the torch reference and dense float64 attention.

On a CPU they run under Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``
before anything imports Triton), in float32, and must agree within 1e-5; on a CUDA machine
the same checks run the compiled kernels (``DEVICE``), still in float32 (IEEE dots). The
``gpu`` tests add larger shapes on CUDA, in bfloat16 and float32.
"""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.kernels.attention import AttentionMetadata, merge_many, select_backend
from slipstream.kernels.torch_ref import TorchReferenceBackend
from slipstream.kernels.triton_attention import decode_segments
from slipstream.kernels.triton_backend import TritonBackend, interpreting

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreting(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")

BLOCK = 16
# Where the kernels run: compiled on CUDA, else under the interpreter on CPU tensors (without
# TRITON_INTERPRET, which a CUDA machine does not set, a kernel cannot take CPU pointers).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def dense_attention(query, keys, values, query_pos, key_pos):
    """query [n, H, D], keys/values [L, Hkv, D]; causal by absolute position, float64.
    Returns out [n, H, D] and lse [n, H] (-inf and 0 output where nothing is visible)."""
    group = query.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", query.double(), keys) / math.sqrt(query.shape[-1])
    visible = key_pos[None, :] <= query_pos[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    weights = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(scores),
                          torch.softmax(scores, -1).nan_to_num(0.0))
    return torch.einsum("hnl,lhd->nhd", weights, values), lse.transpose(0, 1)


def paged_case(seqs, heads, kv_heads, dim, device, dtype, seed, num_blocks=None,
               kv_start=None):
    """``seqs``: (cached, new) per sequence, decodes first. Builds shuffled block tables,
    a cache holding the cached part, and the new keys/values/queries."""
    generator = torch.Generator().manual_seed(seed)
    needed = sum(-(-(c + n) // BLOCK) for c, n in seqs)
    num_blocks = num_blocks or needed + 3
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=generator)  # not zeros:
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=generator)  # stale data
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables, dense, slots, queries = [], [], [], []
    for cached, new in seqs:
        table = [free.pop() for _ in range(-(-(cached + new) // BLOCK))]
        keys = torch.randn(cached + new, kv_heads, dim, generator=generator)
        values = torch.randn(cached + new, kv_heads, dim, generator=generator)
        for pos in range(cached):
            k_cache[table[pos // BLOCK], pos % BLOCK] = keys[pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = values[pos]
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, cached + new)]
        tables.append(table)
        dense.append((keys, values))
        queries.append(torch.randn(new, heads, dim, generator=generator))
    metadata = AttentionMetadata.build(
        query_lens=[n for _, n in seqs], kv_lens=[c + n for c, n in seqs],
        query_start_pos=[c + (kv_start[i] if kv_start else 0) for i, (c, _) in enumerate(seqs)],
        block_tables=tables, slot_mapping=slots, block_size=BLOCK, device=device,
        kv_start_pos=kv_start)
    to = dict(device=device, dtype=dtype)
    new_keys = torch.cat([k[c:] for (k, _), (c, _) in zip(dense, seqs)]).to(**to)
    new_values = torch.cat([v[c:] for (_, v), (c, _) in zip(dense, seqs)]).to(**to)
    return (k_cache.to(**to), v_cache.to(**to), metadata, new_keys, new_values,
            torch.cat(queries).to(**to), dense, queries)


def run_backend(backend, case, scale, return_lse=True):
    k_cache, v_cache, metadata, keys, values, query, _, _ = case
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    backend.plan(metadata)
    backend.write_kv(k_cache, v_cache, keys, values)
    return backend.run(query, k_cache, v_cache, scale, return_lse=return_lse), k_cache, v_cache


def check_against_dense(seqs, heads=4, kv_heads=2, dim=16, seed=0, kv_start=None,
                        device=DEVICE, dtype=torch.float32, atol=1e-5):
    case = paged_case(seqs, heads, kv_heads, dim, device, dtype, seed, kv_start=kv_start)
    scale = 1 / math.sqrt(dim)
    result, k_cache, v_cache = run_backend(TritonBackend(device), case, scale)
    row = 0
    for index, ((cached, new), (keys, values), query) in enumerate(zip(seqs, case[6], case[7])):
        shift = kv_start[index] if kv_start else 0
        positions = torch.arange(cached + new)
        expected, expected_lse = dense_attention(query, keys, values, positions[cached:] + shift,
                                                 positions + shift)
        got = result.output[row:row + new].double().cpu()
        torch.testing.assert_close(got, expected, atol=atol, rtol=atol)
        got_lse = result.lse_natural[row:row + new].double().cpu()
        torch.testing.assert_close(got_lse, expected_lse, atol=atol, rtol=atol)
        row += new
    return case, result, k_cache, v_cache


@pytest.mark.parametrize("seqs", [
    [(0, 1)],                                   # a first token alone
    [(37, 1), (5, 1), (140, 1)],                # decodes of different lengths
    [(0, 33)],                                  # a fresh prompt across three tiles
    [(48, 20), (0, 7)],                         # a chunk after a cached prefix, and a fresh one
    [(20, 1), (90, 1), (31, 45), (0, 16)],      # decodes before prefills, as runners list them
    [(300, 3), (0, 70), (129, 17)],             # idle tiles: short chunks over long prefixes
])
def test_triton_equals_dense_in_float32(seqs):
    check_against_dense(seqs)


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 1, 16), (6, 3, 32), (4, 4, 24)])
def test_gqa_groups_and_head_dims(heads, kv_heads, dim):
    # Group sizes 8, 2 and 1; 24 is not a power of two (padded and masked).
    check_against_dense([(25, 1), (3, 1), (16, 18)], heads, kv_heads, dim, seed=heads)


def test_triton_writes_the_same_cache_and_output_as_torch_ref():
    seqs = [(50, 1), (7, 1), (33, 29)]
    case = paged_case(seqs, 4, 2, 16, DEVICE, torch.float32, seed=3)
    scale = 0.25
    triton_result, triton_k, triton_v = run_backend(TritonBackend(DEVICE), case, scale)
    torch_result, torch_k, torch_v = run_backend(TorchReferenceBackend(), case, scale)
    assert torch.equal(triton_k, torch_k) and torch.equal(triton_v, torch_v)
    torch.testing.assert_close(triton_result.output, torch_result.output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(triton_result.lse_natural, torch_result.lse_natural,
                               atol=1e-5, rtol=1e-5)
    no_lse, _, _ = run_backend(TritonBackend(DEVICE), case, scale, return_lse=False)
    assert no_lse.lse_natural is None
    torch.testing.assert_close(no_lse.output, triton_result.output, atol=0, rtol=0)


def test_skipped_slots_leave_the_cache_alone():
    case = paged_case([(10, 6)], 4, 2, 16, DEVICE, torch.float32, seed=5)
    k_cache, v_cache, metadata, keys, values, *_ = case
    metadata = AttentionMetadata.build(
        query_lens=[6], kv_lens=[16], query_start_pos=[10], block_tables=[[0]],
        slot_mapping=[-1, 3, -1, -1, 7, -1], block_size=BLOCK)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    backend = TritonBackend(DEVICE)
    backend.plan(metadata)
    backend.write_kv(k_cache, v_cache, keys, values)
    changed = (k_cache != before_k).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == [3, 7]  # the two real slots, in block 0
    assert torch.equal(k_cache.view(-1, 2, 16)[7], keys[4])
    assert torch.equal(v_cache.view(-1, 2, 16)[3], values[1])


@pytest.mark.parametrize("num_shards", [2, 3])
def test_kv_shards_merge_to_the_unsharded_result(num_shards):
    """KV-cache parallelism: each shard holds a slice of the KV at its own positions; the
    shard after the queries must give lse -inf and output 0."""
    generator = torch.Generator().manual_seed(num_shards)
    heads, kv_heads, dim, total, new = 4, 2, 16, 90, 7
    keys = torch.randn(total, kv_heads, dim, generator=generator)
    values = torch.randn(total, kv_heads, dim, generator=generator)
    query = torch.randn(new, heads, dim, generator=generator)
    positions = torch.arange(total)
    query_pos = positions[60:60 + new]  # queries in the middle: the last shard is after them
    expected, expected_lse = dense_attention(query, keys, values, query_pos, positions)
    bounds = torch.linspace(0, total, num_shards + 1).long().tolist()
    partials = []
    for start, end in zip(bounds, bounds[1:]):
        length = end - start
        table = list(range(-(-length // BLOCK)))[::-1]
        k_cache = torch.zeros(len(table), BLOCK, kv_heads, dim)
        v_cache = torch.zeros_like(k_cache)
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)]
        k_cache.view(-1, kv_heads, dim)[slots] = keys[start:end]
        v_cache.view(-1, kv_heads, dim)[slots] = values[start:end]
        metadata = AttentionMetadata.build(
            query_lens=[new], kv_lens=[length], query_start_pos=[60], block_tables=[table],
            slot_mapping=[-1] * new, block_size=BLOCK, kv_start_pos=[start])
        backend = TritonBackend(DEVICE)
        backend.plan(metadata)
        partials.append(backend.run(query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                    1 / math.sqrt(dim)))
    if num_shards == 3:  # shard [60, 90) starts at the first query: it sees part of it
        assert torch.isfinite(partials[-1].lse_natural).all()
    merged = merge_many(partials)
    torch.testing.assert_close(merged.output.double().cpu(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged.lse_natural.double().cpu(), expected_lse, atol=1e-5,
                               rtol=1e-5)


def test_a_shard_wholly_after_the_query_sees_nothing():
    heads, kv_heads, dim = 4, 2, 16
    k_cache = torch.randn(2, BLOCK, kv_heads, dim, device=DEVICE)
    v_cache = torch.randn(2, BLOCK, kv_heads, dim, device=DEVICE)
    metadata = AttentionMetadata.build(
        query_lens=[1, 3], kv_lens=[20, 20], query_start_pos=[40, 41],
        block_tables=[[0, 1], [0, 1]], slot_mapping=[-1] * 4, block_size=BLOCK,
        kv_start_pos=[100, 100])
    backend = TritonBackend(DEVICE)
    backend.plan(metadata)
    result = backend.run(torch.randn(4, heads, dim, device=DEVICE), k_cache, v_cache, 0.25)
    assert torch.isneginf(result.lse_natural).all()
    assert torch.equal(result.output, torch.zeros_like(result.output))


def test_decode_segments_fill_the_chip_without_empty_tiles():
    assert decode_segments(1, 8, 65536) == 32  # one long decode: split its KV
    assert decode_segments(256, 8, 65536) == 1  # 2,048 programs fill the chip already
    assert decode_segments(1, 8, 100) == 2  # never more segments than 64-token tiles
    assert decode_segments(4, 8, 4096) == 9


def test_many_segments_equal_one():
    case = paged_case([(300, 1), (17, 1)], 4, 2, 16, DEVICE, torch.float32, seed=9)
    k_cache, v_cache, metadata, keys, values, query, _, _ = case
    from slipstream.kernels.triton_attention import paged_decode, write_kv
    write_kv(keys, values, k_cache, v_cache, metadata.slot_mapping)
    outputs = []
    for segments in (1, 5, 32):
        out = torch.empty_like(query)
        lse = torch.empty(query.shape[:2], device=DEVICE)
        paged_decode(query, k_cache, v_cache, metadata.seq_info, metadata.block_indices, 0.25,
                     out, lse, segments)
        outputs.append((out, lse))
    for out, lse in outputs[1:]:
        torch.testing.assert_close(out, outputs[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, outputs[0][1], atol=1e-5, rtol=1e-5)


def test_select_backend_names_the_choices():
    with pytest.raises(ValueError, match="auto, torch, triton, flashinfer"):
        select_backend("cpu", "cudnn")
    assert select_backend("cpu", "auto").name == "torch"
    # Compiled on a CUDA machine; on a CPU under the interpreter.
    assert select_backend(DEVICE, "triton").name == "triton"


# -- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (16, 8, 256)])
def test_triton_on_cuda_equals_torch_ref(dtype, atol, heads, kv_heads, dim):
    # 256-wide heads (Gemma) take their own prefill tiles (prefill_tiles).
    seqs = [(1000, 1), (5, 1), (4000, 1), (700, 300), (0, 517)]
    case = paged_case(seqs, heads, kv_heads, dim, "cuda", dtype, seed=11)
    scale = 1 / math.sqrt(dim)
    triton_result, triton_k, _ = run_backend(TritonBackend("cuda"), case, scale)
    torch_result, torch_k, _ = run_backend(TorchReferenceBackend(), case, scale)
    assert torch.equal(triton_k, torch_k)
    torch.testing.assert_close(triton_result.output.float(), torch_result.output.float(),
                               atol=atol, rtol=atol)
    torch.testing.assert_close(triton_result.lse_natural, torch_result.lse_natural,
                               atol=atol, rtol=atol)


@pytest.mark.gpu
def test_triton_on_cuda_equals_dense_in_float32():
    check_against_dense([(300, 1), (40, 1), (64, 190), (0, 129)], heads=8, kv_heads=2,
                        dim=64, device="cuda", dtype=torch.float32, atol=1e-4)


@pytest.mark.parametrize("segments", [2, 3, 7])
def test_split_kv_prefill_equals_one_pass(segments):
    """A prefill's KV split into segments merged by lse (what a short chunk over a long
    prefix gets on a GPU) equals the single pass, output and lse, also with decodes first
    and a sequence whose early tiles see little of the KV."""
    from slipstream.kernels.triton_attention import paged_decode, write_kv
    from slipstream.kernels.triton_prefill import paged_prefill

    seqs = [(70, 1), (200, 1), (260, 20), (0, 37), (100, 5)]
    case = paged_case(seqs, 4, 2, 16, DEVICE, torch.float32, seed=segments)
    k_cache, v_cache, metadata, keys, values, query, _, _ = case
    write_kv(keys, values, k_cache, v_cache, metadata.slot_mapping)
    num_decodes, num_tokens = metadata.num_decodes, metadata.num_tokens
    results = []
    for count in (1, segments):
        out = torch.full_like(query, float("nan"))  # every row must be written
        lse = torch.full(query.shape[:2], float("nan"), device=DEVICE)
        paged_decode(query, k_cache, v_cache, metadata.seq_info[:num_decodes],
                     metadata.block_indices, 0.25, out, lse, 2)
        paged_prefill(query, k_cache, v_cache, metadata.seq_info[num_decodes:],
                      metadata.block_indices, 0.25, out, lse, 37, longest_kv=280,
                      num_tokens=num_tokens - num_decodes, first_token=num_decodes,
                      num_segments=count)
        assert not out.isnan().any() and not lse.isnan().any()
        results.append((out, lse))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-5, rtol=1e-5)


def test_split_kv_prefill_of_a_kv_shard_after_the_queries_sees_nothing():
    from slipstream.kernels.triton_prefill import paged_prefill

    k_cache = torch.randn(4, BLOCK, 2, 16, device=DEVICE)
    v_cache = torch.randn(4, BLOCK, 2, 16, device=DEVICE)
    metadata = AttentionMetadata.build(
        query_lens=[3], kv_lens=[60], query_start_pos=[10], block_tables=[[0, 1, 2, 3]],
        slot_mapping=[-1] * 3, block_size=BLOCK, kv_start_pos=[100], device=DEVICE)
    out = torch.full((3, 4, 16), float("nan"), device=DEVICE)
    lse = torch.full((3, 4), float("nan"), device=DEVICE)
    paged_prefill(torch.randn(3, 4, 16, device=DEVICE), k_cache, v_cache, metadata.seq_info,
                  metadata.block_indices, 0.25, out, lse, 3, longest_kv=60, num_tokens=3,
                  num_segments=4)
    assert torch.isneginf(lse).all() and torch.equal(out, torch.zeros_like(out))


def test_prefill_segments_split_only_what_leaves_the_chip_idle():
    from slipstream.kernels.triton_prefill import prefill_segments

    # 64 tokens (one tile) x 32 heads over a 64K prefix: 32 programs -> split 9 ways.
    assert prefill_segments(1, 32, 65536, 64, 128) == 9
    # A 2K-token chunk: 16 tiles x 32 heads fill the chip already.
    assert prefill_segments(16, 32, 65536, 2048, 128) == 1
    # A short prefix is not worth splitting.
    assert prefill_segments(1, 32, 1500, 64, 128) == 1
    # The scratch bound: 1,000 tokens x 32 heads x 128 x 4 bytes is 16 MB per segment, so 4
    # segments fit in 64 MB where the 64 programs would want 5.
    assert prefill_segments(2, 32, 65536, 1000, 128) == 4


@pytest.mark.gpu
def test_split_prefill_on_cuda_equals_torch_ref():
    # A 64-token chunk over a 20K-token prefix: 32 heads x 1 tile, split into KV segments.
    seqs = [(20_000, 64), (300, 1)]
    seqs = [seqs[1], seqs[0]]  # decodes first
    case = paged_case(seqs, 32, 8, 128, "cuda", torch.bfloat16, seed=12)
    scale = 1 / math.sqrt(128)
    triton_result, _, _ = run_backend(TritonBackend("cuda"), case, scale)
    torch_result, _, _ = run_backend(TorchReferenceBackend(), case, scale)
    torch.testing.assert_close(triton_result.output.float(), torch_result.output.float(),
                               atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(triton_result.lse_natural, torch_result.lse_natural,
                               atol=2e-2, rtol=2e-2)


def test_the_split_counts_only_tiles_that_hold_queries(monkeypatch):
    """The backend tells the split how many query tiles have work: a 3-token chunk beside a
    130-token prompt is one busy tile plus the prompt's, not the prompt's twice (under the
    interpreter's 16-row tiles 1 + 9, not 9 + 9; on CUDA's 128-row tiles 1 + 2, not 2 + 2)."""
    from slipstream.kernels import triton_attention, triton_prefill

    seen: list[int] = []
    real = triton_prefill.prefill_segments

    def recording(query_tiles, *args, **kwargs):
        seen.append(query_tiles)
        return real(query_tiles, *args, **kwargs)

    monkeypatch.setattr(triton_prefill, "prefill_segments", recording)
    check_against_dense([(300, 3), (0, 130)])
    # The prefill's tile height: the interpreter's, or CUDA's for a chunk over 64 tokens.
    tile = 128 if DEVICE == "cuda" else triton_attention.MIN_DOT
    prompt_tiles = -(-130 // tile)
    assert seen == [1 + prompt_tiles] and 1 + prompt_tiles < 2 * prompt_tiles
