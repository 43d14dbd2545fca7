"""Weight formats: how a linear layer's weight is stored, and how a float weight becomes one.

    checkpoint tensor (float, GGUF blocks, fp8 + scales, AWQ int32 words)
        --quantize_* / gguf_weights / hf_quantized--> a QuantizedWeight (this module)
        --QuantLinear / QuantEmbedding (quant_kernels.py)--> a kernel chosen for the device
        --> the model's projections, which never branch on the format (models/llama.py)

The design, in one place:

- **Formats.** ``dense`` is an ordinary float tensor (fp32/bf16/fp16) in an ``nn.Linear``.
  The quantized ones keep integer (or fp8) values with float scales, weight-only (activations
  stay in the model's dtype):
    - ``int8``: one scale per output channel, ``w = q * scale``, ``q`` in [-127, 127]; or
      one per group of 32 inputs (GGUF's Q8_0), run as two exact int4 planes;
    - ``int4``: groups of ``group_size`` (32/64/128) along the input, each with a scale and a
      minimum, ``w = q * scale + minimum``, ``q`` in [0, 15]. A zero point ``z`` (AWQ, GPTQ)
      is the minimum ``-z * scale``; GGUF's Q4_1 blocks (32 weights, a scale ``d`` and a min
      ``m``) are exactly group 32, and Q4_0 (``d * (q - 8)``) is the minimum ``-8 d``;
    - ``fp8``: e4m3 values with a scale per output channel or one per tensor,
      ``w = float(q) * scale``.
- **Kernels.** Each format has a kernel per device (``quant_kernels.KERNELS``); where there
  were several candidates, the one in the table won a measurement on that device (the figures
  are in ``quant_kernels``' docstring and docs/quantization.md). Choosing once, offline, keeps a
  server's numerics the same from one start to the next. A format with no kernel on the device
  fails at start-up with one line that names the format and what to do; nothing is silently
  served in another precision. ``reference_linear`` (dequantize, then ``F.linear``) is the
  numerical reference the tests hold every kernel to.
- **Where the format lives.** Behind the linear layer, as tensor-parallel sharding does: the
  loader replaces a projection's ``nn.Linear`` by a ``QuantLinear`` holding its weight, and
  ``fuse_projections`` concatenates q/k/v and gate/up whatever their format (rows of
  group-wise formats concatenate as they are).
- **Embeddings** are looked up from quantized rows (``QuantizedWeight.rows``): a tied LM head
  and the token embedding share one int8 matrix, as the Q8_0 ``token_embd`` of a GGUF does.

Everything here is plain torch on any device; nothing is packed for a kernel yet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FORMATS = ("int8", "int4", "fp8")
GROUP_SIZES = (32, 64, 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT4_LEVELS = 15


@dataclass(frozen=True)
class Int8Weight:
    """``values`` int8 [out, in], ``scale`` float32 [out]: ``w = values * scale``."""

    values: torch.Tensor
    scale: torch.Tensor
    format = "int8"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.values.shape[1])

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self.values[index].to(torch.float32) * self.scale[index, None]).to(dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0], device=self.values.device), dtype)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.values, self.scale)

    def describe(self) -> str:
        return "int8"


@dataclass(frozen=True)
class Int8GroupWeight:
    """``values`` int8 [out, in], ``scale`` float32 [out, in/group_size]: ``w = values *
    scale`` with one scale per group of inputs (GGUF's Q8_0: 32 weights per scale)."""

    values: torch.Tensor
    scale: torch.Tensor
    group_size: int
    format = "int8"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.values.shape[1])

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        values = self.values[index].to(torch.float32)
        rows, columns = values.shape
        groups = values.view(rows, columns // self.group_size, self.group_size)
        return (groups * self.scale[index, :, None]).view(rows, columns).to(dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0], device=self.values.device), dtype)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.values, self.scale)

    def describe(self) -> str:
        return f"int8-g{self.group_size}"

    def int4_planes(self) -> tuple[Int4Weight, Int4Weight]:
        """Two int4 weights whose sum is this one exactly: with ``u = q + 128 = 16 h + l``,
        ``d q = (16 d) h - 128 d + d l`` (the high nibbles with scale 16 d and minimum
        -128 d, the low ones with scale d and minimum 0). So int4 kernels run it."""
        unsigned = (self.values.to(torch.int16) + 128).to(torch.uint8)
        high, low = unsigned >> 4, unsigned & 0xF
        zero = torch.zeros_like(self.scale)
        return (Int4Weight(pack_nibbles(high), 16 * self.scale, -128 * self.scale,
                           self.group_size),
                Int4Weight(pack_nibbles(low), self.scale.clone(), zero, self.group_size))


@dataclass(frozen=True)
class Int4Weight:
    """``packed`` uint8 [out, in/2] (the even input column in the low nibble),
    ``scale`` and ``minimum`` float32 [out, in/group_size]: ``w = q * scale + minimum``."""

    packed: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    group_size: int
    format = "int4"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    def unpacked(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """The 4-bit values as uint8 [rows, in], in 0..15."""
        packed = self.packed if index is None else self.packed[index]
        return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        values = self.unpacked(index).to(torch.float32)
        rows, columns = values.shape
        groups = values.view(rows, columns // self.group_size, self.group_size)
        weights = groups * self.scale[index, :, None] + self.minimum[index, :, None]
        return weights.view(rows, columns).to(dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0], device=self.packed.device), dtype)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed, self.scale, self.minimum)

    def describe(self) -> str:
        return f"int4-g{self.group_size}"


@dataclass(frozen=True)
class Fp8Weight:
    """``values`` float8_e4m3fn [out, in], ``scale`` float32 [out] or [1] (per tensor)."""

    values: torch.Tensor
    scale: torch.Tensor
    format = "fp8"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.values.shape[1])

    @property
    def per_channel(self) -> bool:
        return self.scale.numel() > 1

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scale = self.scale[index, None] if self.per_channel else self.scale
        return (self.values[index].to(torch.float32) * scale).to(dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0], device=self.values.device), dtype)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.values, self.scale)

    def describe(self) -> str:
        return "fp8-" + ("channel" if self.per_channel else "tensor")


class WeightFormatError(ValueError):
    """A weight format this device cannot run; the message says what to do."""


QuantizedWeight = Int8Weight | Int8GroupWeight | Int4Weight | Fp8Weight


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, in] in 0..15 -> uint8 [rows, in/2], even columns in the low nibble."""
    if values.shape[-1] % 2:
        raise ValueError(f"int4 needs an even input width, got {values.shape[-1]}")
    pairs = values.to(torch.uint8).view(*values.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of a float ``weight`` [out, in]."""
    weight = weight.to(torch.float32)
    scale = (weight.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    values = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(values.contiguous(), scale.contiguous())


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Asymmetric group-wise int4 of ``weight`` [out, in]: each group's minimum maps to 0 and
    its maximum to 15 (what llama.cpp's Q4_1 and AWQ's zero points do)."""
    rows, columns = weight.shape
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")
    if columns % group_size:
        raise ValueError(f"int4 with group size {group_size} needs input widths divisible by "
                         f"it; this model has a projection {columns} wide "
                         f"(--quantization-group-size 32 or 64 may fit)")
    groups = weight.to(torch.float32).reshape(rows, columns // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (high - low) / INT4_LEVELS
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group
    values = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, INT4_LEVELS)
    return Int4Weight(pack_nibbles(values.reshape(rows, columns)).contiguous(),
                      scale.contiguous(), low.contiguous(), group_size)


def quantize_fp8(weight: torch.Tensor, per_channel: bool = True) -> Fp8Weight:
    """e4m3 of ``weight`` [out, in], scaled so each channel's (or the tensor's) largest
    magnitude lands on 448."""
    weight = weight.to(torch.float32)
    amax = weight.abs().amax(dim=1) if per_channel else weight.abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    divisor = scale[:, None] if per_channel else scale
    values = (weight / divisor).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(values.contiguous(), scale.contiguous())


def quantize(weight: torch.Tensor, format_name: str, group_size: int = 64) -> QuantizedWeight:
    """``weight`` in ``format_name`` (int8, int4 with ``group_size``, fp8 per channel)."""
    if format_name == "int8":
        return quantize_int8(weight)
    if format_name == "int4":
        return quantize_int4(weight, group_size)
    if format_name == "fp8":
        return quantize_fp8(weight)
    raise ValueError(f"unknown weight format {format_name!r}; one of {', '.join(FORMATS)}")


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """The parts stacked along the output dimension (fusing q/k/v or gate/up), or None when
    they are not all of one format and layout (their products then stay separate)."""
    first = parts[0]
    if isinstance(first, Int8GroupWeight):
        groups = [p for p in parts if isinstance(p, Int8GroupWeight)]
        if len(groups) == len(parts) and all(p.group_size == first.group_size for p in groups):
            return Int8GroupWeight(torch.cat([p.values for p in groups]),
                                   torch.cat([p.scale for p in groups]), first.group_size)
        return None
    if isinstance(first, Int8Weight) and all(isinstance(p, Int8Weight) for p in parts):
        int8 = [p for p in parts if isinstance(p, Int8Weight)]
        return Int8Weight(torch.cat([p.values for p in int8]), torch.cat([p.scale for p in int8]))
    if isinstance(first, Int4Weight):
        int4 = [p for p in parts if isinstance(p, Int4Weight)]
        if len(int4) == len(parts) and all(p.group_size == first.group_size for p in int4):
            return Int4Weight(torch.cat([p.packed for p in int4]),
                              torch.cat([p.scale for p in int4]),
                              torch.cat([p.minimum for p in int4]), first.group_size)
    if isinstance(first, Fp8Weight):
        fp8 = [p for p in parts if isinstance(p, Fp8Weight)]
        if len(fp8) == len(parts) and all(p.per_channel for p in fp8):
            return Fp8Weight(torch.cat([p.values for p in fp8]),
                             torch.cat([p.scale for p in fp8]))
        if len(fp8) == len(parts):  # per-tensor scales differ: one scale per output channel
            return Fp8Weight(torch.cat([p.values for p in fp8]),
                             torch.cat([p.scale.expand(p.shape[0]) for p in fp8]))
    return None


def to_device(weight: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    if isinstance(weight, Int4Weight):
        return replace(weight, packed=weight.packed.to(device), scale=weight.scale.to(device),
                       minimum=weight.minimum.to(device))
    if isinstance(weight, Int8GroupWeight):
        return replace(weight, values=weight.values.to(device), scale=weight.scale.to(device))
    return replace(weight, values=weight.values.to(device), scale=weight.scale.to(device))


def reference_linear(hidden: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of the dequantized weight in float32: what every kernel must approach."""
    dense = weight.dequantize(torch.float32)
    out = hidden.to(torch.float32) @ dense.T
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(hidden.dtype)
