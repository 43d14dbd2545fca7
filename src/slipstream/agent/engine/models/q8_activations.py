"""llama.cpp's arithmetic for GGUF blocks served as stored: activations quantized to 8 bits per
block of 32 before the product (``EngineConfig.gguf_activations = "q8"``).

    a projection's input rows (float32)
        --quantize_q8_blocks--> per block of 32: int8 values q, scale d (float16), and for
                                Q8_1 the block's sum s = d * sum(q) (float16)
        --Q8BlockProduct--> per block, llama.cpp's formula, summed over the blocks:
              Q4_1 weights (scale d_w, min m_w):  d_w d (sum q_w q) + m_w s
              Q4_0 weights:                       d_w d (sum (q_w - 8) q)
              Q8_0 weights:                       d_w d (sum q_w q)

Why. The default kernels (``quant_kernels``) read the same 4- and 8-bit weights as llama.cpp
but take the activations in bfloat16 and the block scales in bfloat16, so near-ties in the
greedy argmax break differently and two continuations part. llama.cpp on CPU quantizes each
activation row to Q8_1 (for Q4_1 weights) or Q8_0 (for Q4_0 and Q8_0 weights) first. This
module reproduces that arithmetic so that Slipstream's tokens can match llama.cpp's on the
same file; ggml's reference quantizer (``quantize_row_q8_1_ref``: ``d = max|x| / 127``,
``q = roundf(x / d)``, ``d`` and ``s`` stored as float16) is the specification followed.

How. The per-block formula is a float product in disguise: ``d q`` (an int8 times a float16,
18 significant bits) and ``d_w q_w`` (a float16 times a 4- or 8-bit value) are exact in
float32, and their product summed over a block is ``d_w d sum(q_w q)``. So one float32 GEMM
of the fake-quantized activations against the weights' ``d_w q_w`` computes the first term,
and a small GEMM of the block sums ``s`` against the minimums ``m_w`` the second; only the
order of float32 additions differs from ggml's. The cost is that ``d_w q_w`` is held in
float32 (4 bytes a weight instead of half a byte) and read by oneDNN's float32 GEMM each step,
about the speed and memory of the dequantized float32 model: an accuracy mode, not the fast
path. Q4_K files get the same scheme per sub-block of 32 (llama.cpp uses Q8_K, 256-value
blocks with a float32 scale, for those), so there it is close to llama.cpp, not equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slipstream.agent.engine.models.cpu_matmul import REORDER_FOR_ROWS, onednn_available
from slipstream.agent.engine.models.weight_formats import (Int4Weight, Int8GroupWeight,
                                                           QuantizedWeight, WeightFormatError)

BLOCK = 32  # QK8_0 = QK8_1: values per activation block
Q8_MAX = 127.0


def round_half_away(values: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``: to the nearest integer, halves away from zero (``torch.round`` sends
    halves to even). ``values - trunc(values)`` is exact in floating point, so the test is."""
    whole = torch.trunc(values)
    return whole + torch.where((values - whole).abs() >= 0.5, torch.sign(values),
                               torch.zeros_like(values))


@dataclass(frozen=True)
class Q8Blocks:
    """Activation rows quantized per block of 32, as ggml's Q8_1 holds them (Q8_0 is the same
    without ``block_sum``): float32 tensors carrying exactly the values ggml stores."""

    values: torch.Tensor  # [rows, blocks, 32], integers in [-127, 127]
    scale: torch.Tensor  # [rows, blocks]: d = max|x| / 127, rounded to float16
    block_sum: torch.Tensor  # [rows, blocks]: s = d * sum(values) (d before rounding), float16

    def dequantized(self) -> torch.Tensor:
        """``d q`` as float32 rows [rows, blocks * 32] (exact: 7 bits times 11)."""
        rows = self.values.shape[0]
        return (self.values * self.scale[..., None]).reshape(rows, -1)


def quantize_q8_blocks(rows: torch.Tensor) -> Q8Blocks:
    """ggml's ``quantize_row_q8_1`` of each row of ``rows`` [rows, in] (``in`` a multiple of
    32): per block ``d = amax / 127``, ``q = roundf(x * (1 / d))`` (0 where the block is all
    zeros), ``d`` stored as float16 and ``s`` as float16 of ``sum(q) * d``."""
    count, width = rows.shape
    if width % BLOCK:
        raise ValueError(f"q8 activations need an input width divisible by {BLOCK}, got {width}")
    blocks = rows.to(torch.float32).reshape(count, width // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=-1) / Q8_MAX
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    values = round_half_away(blocks * inverse[..., None])
    block_sum = (values.sum(dim=-1) * scale).to(torch.float16).to(torch.float32)
    return Q8Blocks(values, scale.to(torch.float16).to(torch.float32), block_sum)


class Q8BlockProduct:
    """A group-32 GGUF weight (Q4_0, Q4_1, Q4_K as int4; Q8_0 as int8 in groups) times
    activations quantized per block as llama.cpp does (module docstring)."""

    name = "q8 activations x GGUF blocks (llama.cpp's arithmetic, float32 GEMM)"

    def __init__(self, weight: QuantizedWeight) -> None:
        if not isinstance(weight, (Int4Weight, Int8GroupWeight)) or weight.group_size != BLOCK:
            raise WeightFormatError(
                f"gguf_activations q8 runs GGUF blocks of 32 (Q4_0, Q4_1, Q4_K, Q8_0); "
                f"this layer is {weight.describe()}: use gguf_activations bf16")
        out_features, in_features = weight.shape
        blocks = in_features // BLOCK
        self.minimum: torch.Tensor | None = None
        if isinstance(weight, Int4Weight):
            values = weight.unpacked().to(torch.float32).view(out_features, blocks, BLOCK)
            if torch.equal(weight.minimum, -8 * weight.scale):
                # Q4_0: llama.cpp multiplies (q - 8) by Q8_0 activations, with no block sum.
                values = values - 8
            else:
                self.minimum = weight.minimum.to(torch.float32).contiguous()
        else:
            values = weight.values.to(torch.float32).view(out_features, blocks, BLOCK)
        scaled = (values * weight.scale.to(torch.float32)[..., None]).view(out_features, -1)
        # On CPU, oneDNN's reordered float32 GEMM (cpu_matmul.py); the plain one elsewhere.
        self.onednn = scaled.device.type == "cpu" and onednn_available()
        self.scaled = (torch.ops.mkldnn._reorder_linear_weight(scaled, REORDER_FOR_ROWS)
                       if self.onednn else scaled)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        blocks = quantize_q8_blocks(rows)
        activations = blocks.dequantized()
        if self.onednn:
            out = torch.ops.mkldnn._linear_pointwise(activations, self.scaled, None, "none",
                                                     [], "")
        else:
            out = F.linear(activations, self.scaled)
        if self.minimum is not None:
            out = out + F.linear(blocks.block_sum, self.minimum)
        return out.to(rows.dtype)
