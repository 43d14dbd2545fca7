"""The norm and the rotary embedding of the decoder in ``llama.py`` (its last two reading
steps), with the options the other families need: Gemma's ``1 + weight`` RMSNorm, and a
second rotary embedding for Gemma 3's sliding layers (its own base, unscaled).

On CUDA the residual add + norm and the rotary embedding run as single Triton kernels
(``kernels/triton_layers.py``); elsewhere, torch ops.
"""

from __future__ import annotations

import math
from typing import overload

import torch
from torch import nn

from slipstream.agent.engine.config import ModelConfig, RopeScaling


def make_norm(config: ModelConfig, size: int) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, config.norm_weight_offset)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        # Gemma stores w and scales by (1 + w): weight_offset 1, the stored tensor unchanged.
        self.weight = nn.Parameter(torch.ones(size) if weight_offset == 0.0
                                   else torch.zeros(size))
        self.eps = eps
        self.weight_offset = weight_offset

    @overload
    def forward(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @overload
    def forward(self, hidden: torch.Tensor, residual: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None):
        """The norm of ``hidden``; with ``residual``, the norm of ``hidden + residual`` and
        that sum (the new residual stream). On CUDA the add and the norm are one kernel
        that writes both in place (``kernels/triton_layers.py``)."""
        if residual is not None:
            if hidden.is_cuda and self.weight.dtype == hidden.dtype and not self.weight_offset:
                from slipstream.kernels.triton_layers import fused_add_rms_norm

                return fused_add_rms_norm(hidden, residual, self.weight, self.eps)
            residual = hidden + residual
            return self._norm(residual), residual
        return self._norm(hidden)

    def _norm(self, hidden: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation, then scale in the input dtype.
        as_float = hidden.float()
        normed = as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:  # Gemma scales in fp32, then rounds
            return (normed * (self.weight.float() + self.weight_offset)).to(hidden.dtype)
        return self.weight * normed.to(hidden.dtype)


def rotary_embeddings(config: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """The rotary embedding of the global layers, and of the sliding layers where their base
    differs (Gemma 3: ``rope_local_theta``, unscaled)."""
    rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
    if config.rope_local_theta is None:
        return rotary, None
    return rotary, RotaryEmbedding(config.head_dim, config.rope_local_theta, RopeScaling())


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor  # a buffer

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", scaled_inv_freq(inv_freq, scaling), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [tokens, 1 (heads), dim]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of query and key: in place and in one kernel on CUDA
    (``kernels/triton_layers.py``), with torch ops elsewhere."""
    if query.is_cuda:
        from slipstream.kernels.triton_layers import rotary_

        return rotary_(query, key, cos, sin)
    return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
