"""Small per-layer operations as one Triton kernel each, for CUDA: what eager torch runs as
several launches (and several passes over the activations) on every layer.

    fused_add_rms_norm(hidden, residual, weight)  residual += hidden; hidden = norm(residual)
                                                  -- one pass, both written in place
    rotary_(query, key, cos, sin)                 rotate q and k in place, one launch
    quantize_fp8_rows(rows, padded_rows)          e4m3 rows and their scales for _scaled_mm

Numerics follow the Hugging Face Llama reference, which the model's torch path reproduces:
the residual sum is rounded to the activation dtype, normalised in float32 from that rounded
value, cast back, then multiplied by the weight in the activation dtype. The torch path runs
on a CPU and is what tests compare against (``models/llama.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)


@triton.jit
def _add_rms_norm_kernel(hidden_ptr, residual_ptr, weight_ptr, size, eps,
                         hidden_stride, residual_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < size
    hidden = tl.load(hidden_ptr + row * hidden_stride + columns, mask=mask, other=0.0)
    residual = tl.load(residual_ptr + row * residual_stride + columns, mask=mask, other=0.0)
    summed = (hidden.to(tl.float32) + residual.to(tl.float32)).to(hidden.dtype)
    tl.store(residual_ptr + row * residual_stride + columns, summed, mask=mask)
    value = summed.to(tl.float32)
    inverse_rms = 1.0 / tl.sqrt(tl.sum(value * value, 0) / size + eps)
    normed = (value * inverse_rms).to(hidden.dtype)
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0)
    out = (weight.to(tl.float32) * normed.to(tl.float32)).to(hidden.dtype)
    tl.store(hidden_ptr + row * hidden_stride + columns, out, mask=mask)


def fused_add_rms_norm(hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + hidden`` normalised: returns ``(normed, summed)``, computed in place in
    ``hidden`` and ``residual`` (both ``[tokens, size]``, last dimension contiguous)."""
    rows, size = hidden.shape
    if hidden.stride(-1) != 1 or residual.stride(-1) != 1 or weight.dtype != hidden.dtype:
        raise ValueError("fused_add_rms_norm needs contiguous rows and a weight of the "
                         "activations' dtype")
    if rows:
        block = triton.next_power_of_2(size)
        _add_rms_norm_kernel[(rows,)](hidden, residual, weight, size, eps, hidden.stride(0),
                                      residual.stride(0), BLOCK=block,
                                      num_warps=min(16, max(1, block // 256)))
    return hidden, residual


@triton.jit
def _rotary_kernel(query_ptr, key_ptr, cos_ptr, sin_ptr, query_token_stride, query_head_stride,
                   key_token_stride, key_head_stride, cos_stride,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    columns = tl.arange(0, HALF_PAD)
    column_mask = columns < HALF
    # cos/sin rows are [cos(f), cos(f)]: the first half is enough.
    cos = tl.load(cos_ptr + token * cos_stride + columns, mask=column_mask, other=0.0)
    sin = tl.load(sin_ptr + token * cos_stride + columns, mask=column_mask, other=0.0)
    for which in tl.static_range(2):
        if which == 0:
            base, token_stride, head_stride, count = (query_ptr, query_token_stride,
                                                      query_head_stride, NUM_HEADS)
        else:
            base, token_stride, head_stride, count = (key_ptr, key_token_stride,
                                                      key_head_stride, NUM_KV_HEADS)
        mask = (heads[:, None] < count) & column_mask[None, :]
        first = base + token * token_stride + heads[:, None] * head_stride + columns[None, :]
        x1 = tl.load(first, mask=mask, other=0.0)
        x2 = tl.load(first + HALF, mask=mask, other=0.0)
        # As torch computes x * cos + rotate_half(x) * sin in the activation dtype.
        new1 = (x1 * cos[None, :]).to(x1.dtype) - (x2 * sin[None, :]).to(x1.dtype)
        new2 = (x2 * cos[None, :]).to(x1.dtype) + (x1 * sin[None, :]).to(x1.dtype)
        tl.store(first, new1, mask=mask)
        tl.store(first + HALF, new2, mask=mask)


def rotary_(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the rotary embedding to ``query`` ``[tokens, heads, dim]`` and ``key``
    ``[tokens, kv_heads, dim]`` in place (views of a fused projection are fine); ``cos`` and
    ``sin`` are ``[tokens, 1, dim]`` as ``RotaryEmbedding`` makes them."""
    tokens, num_heads, dim = query.shape
    num_kv_heads = key.shape[1]
    if query.stride(-1) != 1 or key.stride(-1) != 1 or dim % 2:
        raise ValueError("rotary_ needs an even head dimension with contiguous elements")
    cos, sin = cos.reshape(tokens, dim), sin.reshape(tokens, dim)
    if tokens:
        half = dim // 2
        _rotary_kernel[(tokens,)](
            query, key, cos, sin, query.stride(0), query.stride(1), key.stride(0),
            key.stride(1), cos.stride(0), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
            HEADS_PAD=triton.next_power_of_2(max(num_heads, num_kv_heads)), HALF=half,
            HALF_PAD=triton.next_power_of_2(half))
    return query, key


# -- fp8 activations -----------------------------------------------------------------------

FP8_E4M3_MAX = 448.0


@triton.jit
def _quantize_fp8_rows_kernel(rows_ptr, out_ptr, scale_ptr, count, size, rows_stride,
                              max_value, inverse_max, BLOCK: tl.constexpr):
    """Row ``r < count``: its absolute maximum over ``max_value`` is its scale, and the row
    divided by it is cast to e4m3; a padding row (``r >= count``) is zeros, as torch pads."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    real = row < count
    readable = tl.where(real, size, 0)  # a padding row reads nothing
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, size, BLOCK):
        value = tl.load(rows_ptr + row * rows_stride + start + columns,
                        mask=start + columns < readable, other=0.0)
        amax = tl.maximum(amax, tl.abs(value.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, 0), 1e-12) * inverse_max  # as torch does: x * (1/448)
    for start in range(0, size, BLOCK):
        mask = start + columns < size
        value = tl.load(rows_ptr + row * rows_stride + start + columns,
                        mask=start + columns < readable, other=0.0)
        quantized = tl.clamp(tl.math.div_rn(value.to(tl.float32), scale), -max_value,
                             max_value)
        tl.store(out_ptr + row * size + start + columns,
                 quantized.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_fp8_rows(rows: torch.Tensor, padded_rows: int,
                      dtype: torch.dtype = torch.float8_e4m3fn
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` ``[n, k]`` as e4m3 with one float32 scale per row (``[padded_rows, k]`` and
    ``[padded_rows, 1]``, padding rows zero): what ``torch._scaled_mm`` takes with row-wise
    scales, in one launch where torch runs about eight (cast, abs, max, clamp, two divides,
    clamp, cast) plus the padding. The arithmetic is torch's (``Fp8ScaledMM``): the scale
    times the float32 reciprocal of 448, IEEE division of the row by it, then the cast. ``dtype`` float32 keeps the values before the cast (tests:
    Triton's interpreter does not round to e4m3 as the hardware does)."""
    count, size = rows.shape
    if rows.stride(-1) != 1 or padded_rows < count:
        raise ValueError("quantize_fp8_rows needs contiguous rows and padded_rows >= rows")
    out = torch.empty(padded_rows, size, dtype=dtype, device=rows.device)
    scale = torch.empty(padded_rows, 1, dtype=torch.float32, device=rows.device)
    if padded_rows:
        block = min(2048, triton.next_power_of_2(size))
        _quantize_fp8_rows_kernel[(padded_rows,)](
            rows, out, scale, count, size, rows.stride(0), FP8_E4M3_MAX, 1.0 / FP8_E4M3_MAX,
            BLOCK=block,
            num_warps=max(1, min(8, block // 256)))
    return out, scale


Fp8Quantizer = Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]]


def checked_fp8_quantizer(reference: Fp8Quantizer, size: int,
                          device: torch.device) -> Fp8Quantizer:
    """``quantize_fp8_rows`` where it gives ``reference``'s bytes and scales on a probe of 5
    rows of ``size`` (padded to 16) on ``device``; otherwise ``reference``, with a warning.
    The fused kernel has not met every GPU yet; a mismatch costs speed, never tokens."""
    probe = torch.randn(5, size, device=device, dtype=torch.bfloat16) * 3.0
    try:
        fused = quantize_fp8_rows(probe, 16)
        expected = reference(probe, 16)
        same = torch.equal(fused[0].view(torch.uint8), expected[0].view(torch.uint8)) and \
            torch.equal(fused[1], expected[1].reshape(fused[1].shape))
    except Exception as error:  # noqa: BLE001 - a compiler or driver refusal: the reference
        log.warning("the fused fp8 activation kernel failed on %s (%s); quantizing with "
                    "torch ops", device, error)
        return reference
    if not same:
        log.warning("the fused fp8 activation kernel differs from torch's on %s; quantizing "
                    "with torch ops", device)
        return reference
    return quantize_fp8_rows
