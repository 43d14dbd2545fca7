"""Prefill attention as Triton kernels: a chunk of queries against its sequence's paged KV
(the cached prefix and the chunk itself, already written), causal within the chunk, with the
KV of a short chunk over a long prefix split into segments merged by log-sum-exp. The
layout, ``seq_info`` and masking rules are those of ``triton_attention.py``, which holds the
KV write and decode kernels and the helpers both share.

    paged_prefill(...)        grid (query tiles, prefill sequences x segments, heads)
        _prefill_kernel       one query tile of one head over its visible KV (or a segment)
        _merge_segments_kernel  the segments of each row merged by their lse
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from slipstream.kernels.triton_attention import (MAX_DECODE_SEGMENTS, MIN_DOT, SEQ_INFO,
                                                 KernelOptions, _check_cache, _dot_precision,
                                                 _last_dim_contiguous, _pow2_at_least,
                                                 _soft_cap, merge_warps, tile_arch)


# -- prefill -----------------------------------------------------------------------------------


LOG2E = tl.constexpr(1.4426950408889634)  # the online softmax runs in base 2
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _prefill_kv_tile(acc, total, max_score, query, kv_tile, end, positions, oldest,
                     k_cache_ptr, v_cache_ptr, block_indices_ptr, block_start, kv_head, kv_pos,
                     cache_block_stride, cache_token_stride, cache_head_stride, dims, dim_mask,
                     scale, softcap, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
                     MASKED: tl.constexpr):
    """One KV tile of the online softmax, in base 2 (``max_score`` is a base-2 maximum).
    Without MASKED every key of the tile is in range and visible to every row."""
    offsets = kv_tile + tl.arange(0, BLOCK_N)
    if MASKED:
        in_range = offsets < end
        block = tl.load(block_indices_ptr + block_start + offsets // PAGE, mask=in_range,
                        other=0).to(tl.int64)
        kv_mask = in_range[:, None] & dim_mask[None, :]
    else:
        block = tl.load(block_indices_ptr + block_start + offsets // PAGE).to(tl.int64)
        kv_mask = dim_mask[None, :]
    kv_rows = (block * cache_block_stride + (offsets % PAGE) * cache_token_stride
               + kv_head * cache_head_stride)
    keys = tl.load(k_cache_ptr + kv_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION)
    if SOFTCAP:
        scores = _soft_cap(scores * scale, softcap) * LOG2E
    else:
        scores = scores * (scale * LOG2E)
    if MASKED:
        key_pos = kv_pos + offsets[None, :]
        visible = in_range[None, :] & (key_pos <= positions[:, None]) \
            & (key_pos >= oldest[:, None])
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(max_score, tl.max(scores, 1))
    # A row that has seen nothing yet keeps max -inf; shift it by 0 instead (no NaN).
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp2(max_score - safe_max)
    probs = tl.exp2(scores - safe_max[:, None])
    total = total * rescale + tl.sum(probs, 1)
    values = tl.load(v_cache_ptr + kv_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values,
                                          input_precision=DOT_PRECISION)
    return acc, total, new_max


@triton.jit(do_not_specialize=["num_segments", "first_token", "window"])
def _prefill_kernel(
        query_ptr, k_cache_ptr, v_cache_ptr, seq_info_ptr, block_indices_ptr, out_ptr, lse_ptr,
        partial_out_ptr, partial_lse_ptr, scale, num_segments, first_token, window, softcap,
        query_token_stride, query_head_stride, out_token_stride, out_head_stride,
        cache_block_stride, cache_token_stride, cache_head_stride,
        GROUP: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr, SPLIT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    tile = tl.program_id(0)
    seq = (tl.program_id(1) // num_segments).to(tl.int64)
    segment = tl.program_id(1) % num_segments
    head = tl.program_id(2)
    info = seq_info_ptr + seq * SEQ_INFO
    token_start = tl.load(info + 0)
    query_len = tl.load(info + 1)
    query_pos = tl.load(info + 2)
    kv_len = tl.load(info + 3)
    kv_pos = tl.load(info + 4)
    block_start = tl.load(info + 5)
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len  # all false for a tile past this sequence's queries
    positions = query_pos + rows
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    tokens = (token_start + rows).to(tl.int64)
    query = tl.load(query_ptr + tokens[:, None] * query_token_stride + head * query_head_stride
                    + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    # KV past the tile's last query is invisible to all its rows. A tile wholly past this
    # sequence's queries (the grid is sized for the longest chunk) reads no KV at all: a
    # 32-token chunk over a 64K prefix beside a 1,000-token prompt would otherwise walk its
    # whole prefix once per idle tile.
    last_row = tl.minimum(query_len, (tile + 1) * BLOCK_M) - 1
    end = tl.maximum(tl.minimum(kv_len, query_pos + last_row - kv_pos + 1), 0)
    end = tl.where(tile * BLOCK_M < query_len, end, 0)
    # With SPLIT, this program reads one segment of that KV (split-KV, as for decodes).
    # KV before the tile's first query's window is invisible to all its rows too.
    first = tl.where(window > 0,
                     tl.maximum(query_pos + tile * BLOCK_M - window + 1 - kv_pos, 0), 0)
    first = tl.minimum(first, end)
    per_segment = tl.cdiv(tl.cdiv(end - first, num_segments), BLOCK_N) * BLOCK_N
    start = first + segment * per_segment
    end = tl.minimum(start + per_segment, end)
    # The oldest key position each row sees (a huge negative number without a window).
    oldest = tl.where(window > 0, positions - window + 1, positions - positions - (1 << 62))
    max_score = tl.full([BLOCK_M], float("-inf"), tl.float32)  # base 2: scores x log2(e)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    # KV tiles that every row of the tile sees whole (below the first row's diagonal, no
    # window) go without masks; only the tiles at the diagonal, the end and a window's edge
    # pay for them. Most of a long prefix is the former.
    visible_to_all = tl.where(window > 0, start,
                              tl.minimum(end, query_pos + tile * BLOCK_M - kv_pos + 1))
    interior_end = start + tl.maximum(visible_to_all - start, 0) // BLOCK_N * BLOCK_N
    for kv_tile in range(start, interior_end, BLOCK_N):
        acc, total, max_score = _prefill_kv_tile(
            acc, total, max_score, query, kv_tile, end, positions, oldest, k_cache_ptr,
            v_cache_ptr, block_indices_ptr, block_start, kv_head, kv_pos, cache_block_stride,
            cache_token_stride, cache_head_stride, dims, dim_mask, scale, softcap, PAGE,
            BLOCK_N, DOT_PRECISION, SOFTCAP, False)
    for kv_tile in range(interior_end, end, BLOCK_N):
        acc, total, max_score = _prefill_kv_tile(
            acc, total, max_score, query, kv_tile, end, positions, oldest, k_cache_ptr,
            v_cache_ptr, block_indices_ptr, block_start, kv_head, kv_pos, cache_block_stride,
            cache_token_stride, cache_head_stride, dims, dim_mask, scale, softcap, PAGE,
            BLOCK_N, DOT_PRECISION, SOFTCAP, True)

    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    lse = tl.where(seen, (max_score + tl.log2(tl.where(seen, total, 1.0))) * LN2,
                   float("-inf"))
    if SPLIT:
        # partial_out [prefill tokens, heads, segments, dim], partial_lse [.., segments]
        rows_out = ((tokens - first_token) * NUM_HEADS + head) * num_segments + segment
        tl.store(partial_out_ptr + rows_out[:, None] * HEAD_DIM + dims[None, :], out,
                 mask=row_mask[:, None] & dim_mask[None, :])
        tl.store(partial_lse_ptr + rows_out, lse, mask=row_mask)
    else:
        tl.store(out_ptr + tokens[:, None] * out_token_stride + head * out_head_stride
                 + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & dim_mask[None, :])
        if WRITE_LSE:
            tl.store(lse_ptr + tokens * NUM_HEADS + head, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_segments", "first_token"])
def _merge_segments_kernel(partial_out_ptr, partial_lse_ptr, out_ptr, lse_ptr, num_segments,
                           first_token, out_token_stride, out_head_stride,
                           NUM_HEADS: tl.constexpr, SEGMENTS_PAD: tl.constexpr,
                           HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                           WRITE_LSE: tl.constexpr):
    """Row ``r`` of the split prefill: its segments merged by their lse into token
    ``first_token + r``."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    token = first_token + row
    segments = tl.arange(0, SEGMENTS_PAD)
    dims = tl.arange(0, DIM_PAD)
    segment_mask = segments < num_segments
    dim_mask = dims < HEAD_DIM
    base = (row * NUM_HEADS + head) * num_segments
    lses = tl.load(partial_lse_ptr + base + segments, mask=segment_mask, other=float("-inf"))
    top = tl.max(lses, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lses - top)
    weight_sum = tl.sum(weights, 0)
    parts = tl.load(partial_out_ptr + (base + segments)[:, None] * HEAD_DIM + dims[None, :],
                    mask=segment_mask[:, None] & dim_mask[None, :], other=0.0)
    seen = weight_sum > 0
    out = tl.sum(parts * weights[:, None], 0) / tl.where(seen, weight_sum, 1.0)
    tl.store(out_ptr + token * out_token_stride + head * out_head_stride + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_mask)
    if WRITE_LSE:
        lse = tl.where(seen, top + tl.log(tl.where(seen, weight_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + token * NUM_HEADS + head, lse)


# Scratch of a split prefill, at most (float32 partial outputs): bounds the segment count.
MAX_SPLIT_SCRATCH_BYTES = 64 << 20


def prefill_segments(query_tiles: int, num_heads: int, longest_kv: int, num_tokens: int,
                     head_dim: int, programs_wanted: int = 264,
                     min_segment_tokens: int = 1024) -> int:
    """KV segments per query tile of a prefill: 1 when the tiles x heads fill the chip;
    otherwise enough to fill it, each at least ``min_segment_tokens`` of KV, within the
    scratch bound. A 64-token chunk over a 64K-token prefix is 32 programs without a split
    (a quarter of an H200's multiprocessors, each walking 1,000 KV tiles in a row)."""
    programs = max(1, query_tiles * num_heads)
    if programs >= programs_wanted or longest_kv < 2 * min_segment_tokens:
        return 1
    by_scratch = MAX_SPLIT_SCRATCH_BYTES // max(1, num_tokens * num_heads * head_dim * 4)
    return max(1, min(MAX_DECODE_SEGMENTS, -(-programs_wanted // programs),
                      longest_kv // min_segment_tokens, by_scratch))


def prefill_tiles(longest_query: int, head_dim: int, arch: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of a prefill launch on a chip of compute
    capability ``arch`` (x10; 0: the interpreter).

    Chosen so that no configuration spills registers (compile_check.py compiles them all
    and reads the cubins): 256-wide heads (Gemma) spill 300+ bytes per thread with 64x64
    tiles on 4 warps; before Hopper (no wgmma), 128-wide heads spill with those too and with
    128-row tiles on 8 warps. Those are the register and shared-memory counts; which tiles
    run fastest has been measured on no chip yet."""
    if not arch:  # the interpreter: small tiles, so tests stay quick
        return MIN_DOT, MIN_DOT, 1, 1
    if head_dim > 128:  # 96 KB of shared memory: an L40S grants a block 99 KB
        return 64, 32, 8, 2
    if arch < 90:
        return 64, 64, 8, 2
    block_m = 128 if longest_query > 64 else 64
    return block_m, 64, (8 if block_m == 128 else 4), 2


def paged_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  seq_info: torch.Tensor, block_indices: torch.Tensor, scale: float,
                  out: torch.Tensor, lse: torch.Tensor | None, longest_query: int,
                  longest_kv: int = 0, num_tokens: int = 0, first_token: int = 0,
                  num_segments: int | None = None,
                  options: KernelOptions = KernelOptions(),
                  query_lens: Sequence[int] | None = None) -> None:
    """Attention of the query chunks of ``seq_info``'s sequences over their paged KV (the
    chunk's own keys must be written already). Host values size the launch, so nothing
    waits for the GPU: ``longest_query`` the grid; ``longest_kv``, ``num_tokens`` (the
    chunks' tokens, the first of them ``first_token`` in the flat dimension) whether to
    split the KV into segments (``prefill_segments``; ``num_segments`` forces a count).
    ``query_lens`` (host ints, one per sequence) lets that choice count only the tiles that
    hold queries; without it every sequence counts as the longest."""
    num_seqs = seq_info.shape[0]
    if num_seqs == 0 or longest_query == 0:
        return
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    query = _last_dim_contiguous(query)
    _check_cache(k_cache, v_cache)
    block_m, block_n, num_warps, num_stages = prefill_tiles(longest_query, head_dim,
                                                            tile_arch(query))
    query_tiles = triton.cdiv(longest_query, block_m)
    if num_segments is None:
        busy_tiles = num_seqs * query_tiles if query_lens is None else sum(
            triton.cdiv(length, block_m) for length in query_lens)
        num_segments = prefill_segments(busy_tiles, num_heads, longest_kv,
                                        num_tokens, head_dim)
    if not 1 <= num_segments <= MAX_DECODE_SEGMENTS:
        raise ValueError(f"num_segments must be 1..{MAX_DECODE_SEGMENTS}, got {num_segments}")
    split = num_segments > 1
    if split:
        if num_tokens <= 0:
            raise ValueError("a split prefill needs num_tokens, the chunks' token count")
        scratch_rows = num_tokens * num_heads * num_segments
        partial_out = torch.empty(scratch_rows * head_dim, dtype=torch.float32,
                                  device=query.device)
        partial_lse = torch.empty(scratch_rows, dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out  # unused
    grid = (query_tiles, num_seqs * num_segments, num_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, seq_info, block_indices, out, lse if lse is not None else out,
        partial_out, partial_lse, scale, num_segments, first_token, options.window,
        options.softcap, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // num_kv_heads, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        DIM_PAD=_pow2_at_least(head_dim), PAGE=k_cache.shape[1], BLOCK_M=block_m,
        BLOCK_N=block_n, WRITE_LSE=lse is not None, SPLIT=split,
        DOT_PRECISION=_dot_precision(query.dtype), SOFTCAP=options.softcap > 0,
        num_warps=num_warps, num_stages=num_stages)
    if split:
        _merge_segments_kernel[(num_tokens, num_heads)](
            partial_out, partial_lse, out, lse if lse is not None else out, num_segments,
            first_token, out.stride(0), out.stride(1), NUM_HEADS=num_heads,
            SEGMENTS_PAD=MAX_DECODE_SEGMENTS, HEAD_DIM=head_dim,
            DIM_PAD=triton.next_power_of_2(head_dim), WRITE_LSE=lse is not None,
            num_warps=merge_warps(head_dim))
