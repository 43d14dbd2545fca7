"""Two small per-layer operations as one Triton kernel each, for CUDA: what eager torch runs as
several launches (and several passes over the activations) on every layer.

    fused_add_rms_norm(hidden, residual, weight)  residual += hidden; hidden = norm(residual)
                                                  -- one pass, both written in place
    rotary_(query, key, cos, sin)                 rotate q and k in place, one launch

Numerics follow the Hugging Face Llama reference, which the model's torch path reproduces:
the residual sum is rounded to the activation dtype, normalised in float32 from that rounded
value, cast back, then multiplied by the weight in the activation dtype. The torch path runs
on a CPU and is what tests compare against (``models/llama.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
