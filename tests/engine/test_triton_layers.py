"""The fused add + RMSNorm and the in-place rotary kernels against the model's torch path
(which the Hugging Face equivalence tests pin): in float32 under Triton's interpreter on a
CPU, or compiled on a CUDA machine (``DEVICE``), and compiled on CUDA in bfloat16."""

from __future__ import annotations

import pytest
import torch

from slipstream.agent.engine.config import RopeScaling
from slipstream.agent.engine.models.norm_rope import RMSNorm, RotaryEmbedding, apply_rotary
from slipstream.kernels.triton_backend import interpreting

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreting(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
# Where the kernels run: a CUDA machine does not set TRITON_INTERPRET, and a compiled kernel
# cannot take CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _norm_case(size: int, rows: int, dtype, device, seed: int):
    generator = torch.Generator().manual_seed(seed)
    norm = RMSNorm(size, 1e-5)
    norm.weight.data = 1 + 0.1 * torch.randn(size, generator=generator)
    norm = norm.to(device=device, dtype=dtype)
    hidden = torch.randn(rows, size, generator=generator).to(device=device, dtype=dtype)
    residual = torch.randn(rows, size, generator=generator).to(device=device, dtype=dtype)
    return norm, hidden, residual


@pytest.mark.parametrize("size,rows", [(64, 5), (100, 3), (16, 1)])
def test_fused_add_rms_norm_equals_add_then_norm(size, rows):
    from slipstream.kernels.triton_layers import fused_add_rms_norm

    norm, hidden, residual = _norm_case(size, rows, torch.float32, DEVICE, seed=size)
    expected_sum = hidden + residual
    expected = norm(expected_sum)
    out, summed = fused_add_rms_norm(hidden.clone(), residual.clone(), norm.weight, norm.eps)
    torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 6, 32), (8, 1, 12)])
def test_rotary_in_place_equals_torch(heads, kv_heads, dim):
    from slipstream.kernels.triton_layers import rotary_

    generator = torch.Generator().manual_seed(dim)
    tokens = 7
    positions = torch.tensor([0, 1, 2, 50, 51, 900, 3], device=DEVICE)
    rotary = RotaryEmbedding(dim, 10_000.0, RopeScaling()).to(DEVICE)
    cos, sin = rotary(positions, torch.float32)
    # q, k and v as views of one fused projection, as the model has them.
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(DEVICE)
    query = fused[:, :heads * dim].view(tokens, heads, dim)
    key = fused[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    value_before = fused[:, (heads + kv_heads) * dim:].clone()
    expected_q, expected_k = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
    rotary_(query, key, cos, sin)
    torch.testing.assert_close(query, expected_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(key, expected_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(fused[:, (heads + kv_heads) * dim:], value_before)  # v untouched


@pytest.mark.gpu
def test_fused_layers_on_cuda_match_torch_in_bfloat16():
    from slipstream.kernels.triton_layers import fused_add_rms_norm, rotary_

    norm, hidden, residual = _norm_case(4096, 33, torch.bfloat16, "cuda", seed=1)
    expected_sum = hidden + residual
    expected = norm._norm(expected_sum)
    out, summed = fused_add_rms_norm(hidden.clone(), residual.clone(), norm.weight, norm.eps)
    torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    rotary = RotaryEmbedding(128, 500_000.0, RopeScaling()).cuda()
    cos, sin = rotary(torch.arange(33, device="cuda") * 97, torch.bfloat16)
    query = torch.randn(33, 32, 128, device="cuda", dtype=torch.bfloat16)
    key = torch.randn(33, 8, 128, device="cuda", dtype=torch.bfloat16)
    expected_q, expected_k = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
    rotary_(query, key, cos, sin)
    torch.testing.assert_close(query.float(), expected_q.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(key.float(), expected_k.float(), atol=2e-2, rtol=2e-2)


def _torch_fp8_rows(rows: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fp8ScaledMM's torch ops, per row, before the cast to e4m3."""
    as_float = torch.nn.functional.pad(rows, (0, 0, 0, padded - rows.shape[0])).float()
    scale = as_float.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) * (1.0 / 448.0)
    return (as_float / scale).clamp(-448.0, 448.0), scale


@pytest.mark.parametrize("rows,size", [(1, 64), (5, 5000), (16, 2048)])
def test_fused_fp8_rows_equal_torchs_before_the_cast(rows, size):
    """The values the kernel casts and its scales are torch's, bit for bit, over several
    2,048-column blocks, padding rows included (zeros). (The interpreter does not
    round to e4m3 as the hardware does, so the cast itself is checked on a GPU.)"""
    from slipstream.kernels.triton_layers import quantize_fp8_rows

    generator = torch.Generator().manual_seed(rows)
    hidden = (torch.randn(rows, size, generator=generator) * 3).to(DEVICE, torch.bfloat16)
    hidden[0, : size // 2] = 0.0  # a row's maximum in its second half
    if rows > 2:
        hidden[2] = 0.0  # a zero row: the smallest scale, zeros out
    values, scales = quantize_fp8_rows(hidden, 16 * -(-rows // 16), torch.float32)
    expected_values, expected_scales = _torch_fp8_rows(hidden, values.shape[0])
    assert torch.equal(scales, expected_scales) and torch.equal(values, expected_values)
    assert not values[rows:].any()


def test_the_fused_fp8_kernel_is_used_only_where_it_matches():
    from slipstream.kernels.triton_layers import checked_fp8_quantizer, quantize_fp8_rows

    def wrong(rows, padded):  # on the rows' device: the check compares, it does not fail
        return (torch.zeros(padded, rows.shape[1], dtype=torch.float8_e4m3fn, device=rows.device),
                torch.ones(padded, 1, device=rows.device))

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert checked_fp8_quantizer(wrong, 64, device) is wrong
    assert checked_fp8_quantizer(quantize_fp8_rows, 64, device) is quantize_fp8_rows


@pytest.mark.gpu
def test_fused_fp8_rows_on_cuda_equal_torchs_bytes():
    from slipstream.kernels.triton_layers import checked_fp8_quantizer, quantize_fp8_rows

    hidden = torch.randn(33, 14336, device="cuda", dtype=torch.bfloat16) * 5
    values, scales = quantize_fp8_rows(hidden, 48)
    expected_values, expected_scales = _torch_fp8_rows(hidden, 48)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(values.view(torch.uint8),
                       expected_values.to(torch.float8_e4m3fn).view(torch.uint8))

    def reference(rows, padded):
        values, scales = _torch_fp8_rows(rows, padded)
        return values.to(torch.float8_e4m3fn), scales

    # So the layer uses the fused kernel on this GPU (Fp8ScaledMM's own check).
    assert checked_fp8_quantizer(reference, 4096, torch.device("cuda")) is quantize_fp8_rows
