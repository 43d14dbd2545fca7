"""Paged attention and the KV write as Triton kernels: the CUDA backend that needs no extra
wheel (Triton ships with PyTorch), and the same code under Triton's interpreter on a CPU.

    TritonBackend.plan(metadata)                    (triton_backend.py) once per step
    per layer:
        write_kv(key, value, caches, slots)         one program per token; slot -1 is skipped
        paged_decode(...)                           rows with one query token
            _decode_partial_kernel  grid (decodes, kv_heads, segments): each program reads
                                    one segment of one sequence's KV for all query heads of
                                    one KV head (GQA), online softmax, partial output + lse
            _decode_reduce_kernel   grid (decodes, heads): merges the segments by their lse
        paged_prefill(...)          grid (query tiles, prefill sequences, heads): a chunk of
                                    queries against the sequence's whole visible KV (its
                                    cached prefix and the chunk itself, already written)

The KV cache of one layer is ``[num_blocks, page, kv_heads, head_dim]``. Block tables arrive
flattened (CSR): sequence ``s`` owns ``block_indices[seq_info[s, BLOCK_START]:]``, so a batch
with one 64K-token sequence among short ones moves no padding.

``seq_info`` is ``[sequences, SEQ_INFO_COLUMNS]`` int64, one row per sequence::

    TOKEN_START  first row of its queries in the flat token dimension
    QUERY_LEN    its query tokens in this step
    QUERY_POS    absolute position of its first query token
    KV_LEN       KV tokens of this shard it may read (cached + new)
    KV_POS       absolute position of the shard's first KV token (KV-cache parallelism)
    BLOCK_START  offset of its first block in ``block_indices``

Masking follows ``torch_ref``: the query at absolute position ``p`` sees KV index ``j`` iff
``j < kv_len`` and ``kv_pos + j <= p``, and in a layer with a sliding window ``w`` also
``kv_pos + j > p - w`` (``KernelOptions``; the walk starts at the first row's window). A row
that sees nothing gets output 0 and lse -inf. Soft-capped layers (Gemma 2) map each score to
``cap * tanh(score / cap)`` before the softmax.

Why segments for decode: one decode of a 64K-token context has only ``kv_heads`` (8)
programs' worth of parallelism per sequence, far too few for a GPU of 132 multiprocessors;
splitting its KV into segments that run side by side and merging them by their log-sum-exp
(flash-decoding) keeps the chip busy. The number of segments is a launch parameter, fixed per
batch size under a CUDA graph.

Log-sum-exp values are natural-log (``lse_natural``), as everywhere in our API.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.kernels.attention import SEQ_INFO_COLUMNS

# A dot product needs at least 16 rows, columns and depth on the tensor cores.
MIN_DOT = 16
SEQ_INFO = tl.constexpr(SEQ_INFO_COLUMNS)  # the row stride of seq_info, inside kernels
# Decode KV segments per sequence, at most (a power of two: the merge reads them as one tile).
MAX_DECODE_SEGMENTS = 32


@dataclass(frozen=True)
class KernelOptions:
    """A layer's attention options as the kernels take them: 0 means none."""

    window: int = 0  # keys within this many positions of the query, its own included
    softcap: float = 0.0

    @classmethod
    def of(cls, sliding_window: int | None, logit_softcap: float | None) -> KernelOptions:
        return cls(sliding_window or 0, logit_softcap or 0.0)


@triton.jit
def _soft_cap(scores, softcap):
    # cap * tanh(scores / cap), with tanh(x) = 2 sigmoid(2x) - 1 (portable to the interpreter).
    return softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)


def _pow2_at_least(value: int, floor: int = MIN_DOT) -> int:
    return max(floor, triton.next_power_of_2(value))


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 tensors are the CPU reference's precision: keep them exact on a GPU too
    # (the default would round the operands to tf32).
    return "ieee" if dtype == torch.float32 else "tf32"


# -- the KV write --------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     key_token_stride, key_head_stride, value_token_stride, value_head_stride,
                     cache_slot_stride, cache_head_stride,
                     NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                     HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    # The slot broadcast to the tile: a scalar condition inside a mask is not portable.
    slots = tl.zeros([HEADS_PAD, DIM_PAD], tl.int64) + slot
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM) & (slots >= 0)
    key = tl.load(key_ptr + token * key_token_stride + heads[:, None] * key_head_stride
                  + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * value_token_stride + heads[:, None] * value_head_stride
                    + dims[None, :], mask=mask)
    target = slot * cache_slot_stride + heads[:, None] * cache_head_stride + dims[None, :]
    tl.store(k_cache_ptr + target, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + target, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[tokens, kv_heads, head_dim]`` at their ``slot_mapping``
    slots (``block * page + offset``); a slot of -1 is skipped (no data-dependent shape)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _check_cache(k_cache, v_cache)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim))


# -- decode ------------------------------------------------------------------------------------


# The segment count is a plain argument, not specialised: one compiled kernel serves every
# count (each CUDA graph size has its own), so start-up compiles it once.
@triton.jit(do_not_specialize=["num_segments", "window"])
def _decode_partial_kernel(
        query_ptr, k_cache_ptr, v_cache_ptr, seq_info_ptr, block_indices_ptr,
        partial_out_ptr, partial_lse_ptr, scale, num_segments, window, softcap,
        query_token_stride, query_head_stride,
        cache_block_stride, cache_token_stride, cache_head_stride,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SOFTCAP: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    info = seq_info_ptr + seq * SEQ_INFO
    token = tl.load(info + 0)
    query_pos = tl.load(info + 2)
    kv_len = tl.load(info + 3)
    kv_pos = tl.load(info + 4)
    block_start = tl.load(info + 5)
    # KV index j is visible iff j < kv_len and kv_pos + j <= query_pos.
    visible = tl.maximum(tl.minimum(kv_len, query_pos - kv_pos + 1), 0)
    # A sliding window also hides KV index j <= query_pos - window - kv_pos.
    first = tl.where(window > 0, tl.maximum(query_pos - window + 1 - kv_pos, 0), 0)
    first = tl.minimum(first, visible)
    per_segment = tl.cdiv(tl.cdiv(visible - first, num_segments), BLOCK_N) * BLOCK_N
    start = first + segment * per_segment
    end = tl.minimum(start + per_segment, visible)

    group_rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group_rows
    dims = tl.arange(0, DIM_PAD)
    row_mask = group_rows < GROUP
    dim_mask = dims < HEAD_DIM
    query = tl.load(query_ptr + token * query_token_stride + heads[:, None] * query_head_stride
                    + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    max_score = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for tile in range(start, end, BLOCK_N):
        offsets = tile + tl.arange(0, BLOCK_N)
        in_range = offsets < end
        block = tl.load(block_indices_ptr + block_start + offsets // PAGE, mask=in_range,
                        other=0).to(tl.int64)
        rows = (block * cache_block_stride + (offsets % PAGE) * cache_token_stride
                + kv_head * cache_head_stride)
        kv_mask = in_range[:, None] & dim_mask[None, :]
        keys = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION) * scale
        if SOFTCAP:
            scores = _soft_cap(scores, softcap)
        scores = tl.where(in_range[None, :], scores, float("-inf"))
        new_max = tl.maximum(max_score, tl.max(scores, 1))
        rescale = tl.exp(max_score - new_max)
        probs = tl.exp(scores - new_max[:, None])
        total = total * rescale + tl.sum(probs, 1)
        values = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values,
                                              input_precision=DOT_PRECISION)
        max_score = new_max

    seen = total > 0
    lse = tl.where(seen, max_score + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    out = acc / tl.where(seen, total, 1.0)[:, None]
    # partial_out [decodes, heads, segments, dim] and partial_lse [decodes, heads, segments],
    # both contiguous float32.
    head_rows = (seq * NUM_HEADS + heads) * num_segments + segment
    tl.store(partial_out_ptr + head_rows[:, None] * HEAD_DIM + dims[None, :], out,
             mask=row_mask[:, None] & dim_mask[None, :])
    tl.store(partial_lse_ptr + head_rows, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_segments"])
def _decode_reduce_kernel(partial_out_ptr, partial_lse_ptr, seq_info_ptr, out_ptr, lse_ptr,
                          num_segments, out_token_stride, out_head_stride,
                          NUM_HEADS: tl.constexpr, SEGMENTS_PAD: tl.constexpr,
                          HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                          WRITE_LSE: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    token = tl.load(seq_info_ptr + seq * SEQ_INFO)
    segments = tl.arange(0, SEGMENTS_PAD)
    dims = tl.arange(0, DIM_PAD)
    segment_mask = segments < num_segments
    dim_mask = dims < HEAD_DIM
    base = (seq * NUM_HEADS + head) * num_segments
    lses = tl.load(partial_lse_ptr + base + segments, mask=segment_mask, other=float("-inf"))
    top = tl.max(lses, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lses - top)  # 0 for empty segments
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


def decode_segments(num_decodes: int, num_kv_heads: int, longest_kv: int,
                    programs_wanted: int = 264, tile: int = 64,
                    most: int = MAX_DECODE_SEGMENTS) -> int:
    """How many segments to split each decode's KV into: enough programs to fill the chip
    (``programs_wanted``, two per multiprocessor of an H100/H200 by default), never a
    segment shorter than one tile, at most ``most``."""
    per_row = max(1, -(-programs_wanted // max(1, num_decodes * num_kv_heads)))
    return max(1, min(most, per_row, -(-max(longest_kv, 1) // tile)))


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 seq_info: torch.Tensor, block_indices: torch.Tensor, scale: float,
                 out: torch.Tensor, lse: torch.Tensor | None, num_segments: int,
                 partial_out: torch.Tensor | None = None,
                 partial_lse: torch.Tensor | None = None,
                 options: KernelOptions = KernelOptions()) -> None:
    """Attention of ``seq_info.shape[0]`` one-token rows; writes ``out`` (and ``lse``) at
    each row's ``TOKEN_START``. ``partial_*`` are scratch buffers of at least
    ``[rows, heads, num_segments(, dim)]`` float32 (allocated when not given; a CUDA graph
    passes fixed ones)."""
    num_decodes = seq_info.shape[0]
    if num_decodes == 0:
        return
    if not 1 <= num_segments <= MAX_DECODE_SEGMENTS:
        raise ValueError(f"num_segments must be 1..{MAX_DECODE_SEGMENTS}, got {num_segments}")
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    query = _last_dim_contiguous(query)
    _check_cache(k_cache, v_cache)
    scratch_rows = num_decodes * num_heads * num_segments
    if partial_out is None or partial_lse is None:
        partial_out = torch.empty(scratch_rows * head_dim, dtype=torch.float32,
                                  device=query.device)
        partial_lse = torch.empty(scratch_rows, dtype=torch.float32, device=query.device)
    on_gpu = query.device.type == "cuda"
    block_n = 64 if on_gpu else MIN_DOT
    _decode_partial_kernel[(num_decodes, num_kv_heads, num_segments)](
        query, k_cache, v_cache, seq_info, block_indices, partial_out, partial_lse, scale,
        num_segments, options.window, options.softcap, query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=_pow2_at_least(group), HEAD_DIM=head_dim,
        DIM_PAD=_pow2_at_least(head_dim), PAGE=k_cache.shape[1], BLOCK_N=block_n,
        NUM_HEADS=num_heads, DOT_PRECISION=_dot_precision(query.dtype),
        SOFTCAP=options.softcap > 0, num_warps=4, num_stages=2)
    _decode_reduce_kernel[(num_decodes, num_heads)](
        partial_out, partial_lse, seq_info, out, lse if lse is not None else out,
        num_segments, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, SEGMENTS_PAD=MAX_DECODE_SEGMENTS, HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim), WRITE_LSE=lse is not None, num_warps=1)


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
    on_gpu = query.device.type == "cuda"
    if on_gpu:
        block_m = 128 if longest_query > 64 else 64
        block_n, num_warps, num_stages = 64, (8 if block_m == 128 else 4), 2
    else:  # the interpreter: small tiles, so tests stay quick
        block_m, block_n, num_warps, num_stages = MIN_DOT, MIN_DOT, 1, 1
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
            DIM_PAD=triton.next_power_of_2(head_dim), WRITE_LSE=lse is not None, num_warps=1)


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or \
            k_cache.stride() != v_cache.stride():
        raise ValueError("the Triton kernels need contiguous K and V caches of one layout "
                         "[num_blocks, page, kv_heads, head_dim]")
