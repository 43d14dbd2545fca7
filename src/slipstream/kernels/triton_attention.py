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
        paged_prefill(...)          (triton_prefill.py) grid (query tiles, prefill sequences,
                                    heads): a chunk of queries against the sequence's whole
                                    visible KV (its cached prefix and the chunk, written)

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

import contextvars
import functools
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


# Set (to a compute capability x10) while compile_check.py compiles the CUDA kernels on a
# machine without a GPU: the launches then pick that chip's tiles, though their tensors are
# on the CPU.
COMPILE_ARCH = contextvars.ContextVar("compile_arch", default=0)


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def tile_arch(tensor: torch.Tensor) -> int:
    """The compute capability x10 a launch over ``tensor`` picks its tiles for: its GPU's,
    or 0 under the interpreter (small tiles)."""
    if tensor.device.type == "cuda":
        return _device_arch(tensor.device.index if tensor.device.index is not None
                            else torch.cuda.current_device())
    return COMPILE_ARCH.get()


def merge_warps(head_dim: int) -> int:
    """Warps of a segment merge: its ``[32 segments, head_dim]`` float32 tile fits one warp's
    registers up to 128 wide; 256-wide heads spill there, so two."""
    return max(1, triton.next_power_of_2(head_dim) // 128)


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
    block_n = 64 if tile_arch(query) else MIN_DOT
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
        DIM_PAD=triton.next_power_of_2(head_dim), WRITE_LSE=lse is not None,
        num_warps=merge_warps(head_dim))


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or \
            k_cache.stride() != v_cache.stride():
        raise ValueError("the Triton kernels need contiguous K and V caches of one layout "
                         "[num_blocks, page, kv_heads, head_dim]")
