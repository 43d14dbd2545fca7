"""The kernels behind a quantized linear layer, one per (format, device), and the modules the
model holds: ``QuantLinear`` (a projection) and ``QuantEmbedding`` (a token lookup).

    QuantizedWeight (weight_formats.py) --QuantLinear.prepare(device)--> kernel
        CPU with AVX-512 BF16: int4 and int8 in groups (Q4_*, Q8_0) -> Slipstream's own
              (cpu_quant.py, kernels/cpu_quant_gemm.cpp)
        other CPUs: int4 -> _weight_int4pack_mm_for_cpu   int8 -> _weight_int8pack_mm
              int8 in groups (Q8_0) -> two int4 planes on the int4 kernel
        CUDA: int4 -> _weight_int4pack_mm (tinygemm)   int8 -> _weight_int8pack_mm, else
              F.linear on the int8 values then the scale   fp8 -> torch._scaled_mm (sm 8.9+)

On CPU every kernel takes bfloat16 activations (ATen's float32 variants are not vectorised,
float16 was 30-50x slower): activations are rounded to bf16 at the kernel's input.
Slipstream's kernels ran the default model's projections 1.6-2.3x faster than ATen's (1 to
256 rows, two threads; docs/quantization.md). oneDNN (``cpu_matmul.py``) serves float32.

Every kernel has static shapes and no host synchronisation, so decode steps that use it can be
captured in CUDA graphs. A format with no kernel on the device raises ``WeightFormatError`` at
load, in one line that says what to do instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.agent.engine.models.cpu_quant import Int8GroupAVX512, native_cpu_kernel
from slipstream.agent.engine.models.q8_activations import Q8BlockProduct
from slipstream.agent.engine.models.weight_formats import (FP8_MAX, Fp8Weight, Int4Weight,
                                                          WeightFormatError,
                                                          Int8GroupWeight, Int8Weight,
                                                          QuantizedWeight,
                                                          concat_rows, reference_linear,
                                                          to_device)

log = logging.getLogger(__name__)

Kernel = Callable[[torch.Tensor], torch.Tensor]  # [rows, in] -> [rows, out]


class Int4PackedCPU:
    """int4 group-wise on CPU: ATen's packed kernel, which computes ``(q - 8) * scale +
    zero``; our ``q * scale + minimum`` is that with ``zero = minimum + 8 * scale``."""

    name = "int4 packed (_weight_int4pack_mm_for_cpu, bf16 activations)"

    def __init__(self, weight: Int4Weight) -> None:
        # The kernel takes outputs in multiples of 16: pad with zero rows, slice them off.
        self.out_features = weight.shape[0]
        padding = -self.out_features % 16
        values = F.pad(weight.unpacked().to(torch.int32), (0, 0, 0, padding))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 8)
        self.scales_and_zeros = F.pad(_scales_and_zeros(weight), (0, 0, 0, padding))
        self.group_size = weight.group_size

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.to(torch.bfloat16), self.packed, self.group_size, self.scales_and_zeros)
        if out.shape[1] != self.out_features:
            out = out[:, :self.out_features]
        return out.to(rows.dtype)


class Int4Tinygemm:
    """int4 group-wise on CUDA: PyTorch's tinygemm kernel (bf16, the same ``(q - 8) * scale
    + zero`` form), with the weight packed once into its tiled layout."""

    name = "int4 tinygemm (_weight_int4pack_mm, bf16)"

    def __init__(self, weight: Int4Weight) -> None:
        out_features, in_features = weight.shape
        inner_k_tiles = next((tiles for tiles in (8, 4, 2) if in_features % (tiles * 16) == 0),
                             None)
        if inner_k_tiles is None or out_features % 8:
            raise WeightFormatError(
                f"int4 on CUDA needs projections with outputs divisible by 8 and inputs by 32; "
                f"this one is {out_features} x {in_features}: serve it with --quantization int8")
        values = weight.unpacked().to(torch.int32)
        high_low = ((values[:, ::2] << 4) | values[:, 1::2]).to(torch.uint8)
        self.packed = torch.ops.aten._convert_weight_to_int4pack(high_low.contiguous(),
                                                                 inner_k_tiles)
        self.scales_and_zeros = _scales_and_zeros(weight)
        self.group_size = weight.group_size

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm(
            rows.to(torch.bfloat16), self.packed, self.group_size, self.scales_and_zeros
        ).to(rows.dtype)


def _scales_and_zeros(weight: Int4Weight) -> torch.Tensor:
    """[groups, out, 2] bf16 of (scale, minimum + 8 * scale), ATen's int4 layout."""
    zero = weight.minimum + 8 * weight.scale
    return torch.stack([weight.scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()


class Int8PackedMM:
    """int8 per channel through ATen's ``_weight_int8pack_mm`` (bf16 activations on CPU)."""

    name = "int8 packed (_weight_int8pack_mm)"

    def __init__(self, weight: Int8Weight, activation_dtype: torch.dtype) -> None:
        # The CPU kernel reads inputs in steps of 16 (other widths give wrong sums or crash):
        # pad with zero columns, and the activations to match.
        self.input_padding = -weight.shape[1] % 16
        self.values = F.pad(weight.values, (0, self.input_padding)) if self.input_padding \
            else weight.values
        self.activation_dtype = activation_dtype
        self.scale = weight.scale.to(activation_dtype)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        hidden = rows.to(self.activation_dtype)
        if self.input_padding:
            hidden = F.pad(hidden, (0, self.input_padding))
        return torch.ops.aten._weight_int8pack_mm(hidden, self.values, self.scale
                                                  ).to(rows.dtype)


class Int8ThroughFloat:
    """int8 per channel where no int8 kernel runs: the values in the activations' dtype
    through the dense GEMM, then the per-channel scale (exact: the scale factors out)."""

    name = "int8 through the dense GEMM"

    def __init__(self, weight: Int8Weight) -> None:
        self.values, self.scale = weight.values, weight.scale

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.values.to(rows.dtype)) * self.scale.to(rows.dtype)


class Fp8ScaledMM:
    """fp8 e4m3 on CUDA (compute capability 8.9+): activations quantized to e4m3 on the
    device (per token for per-channel weights, per tensor otherwise; no host sync), then
    ``torch._scaled_mm`` with the weight's scales. Rows are padded to 16, as it requires."""

    name = "fp8 torch._scaled_mm"

    def __init__(self, weight: Fp8Weight, device: torch.device) -> None:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise WeightFormatError(
                f"fp8 weights need a GPU with FP8 tensor cores (compute capability 8.9+, Ada or "
                f"Hopper); this one is {major}.{minor}: serve with --quantization int8 or int4, "
                "or from a bf16 checkpoint")
        out_features, in_features = weight.shape
        if out_features % 16 or in_features % 16:
            raise WeightFormatError(
                f"fp8 needs projection widths divisible by 16; this one is {out_features} x "
                f"{in_features}: serve with --quantization int8")
        self.weight_t = weight.values.t()  # [in, out], column-major as _scaled_mm wants
        self.rowwise = weight.per_channel
        self.weight_scale = (weight.scale.view(1, -1) if self.rowwise
                             else weight.scale.reshape(())).float()
        # Per channel: one Triton launch instead of about nine (checked against them).
        from slipstream.kernels.triton_layers import Fp8Quantizer, checked_fp8_quantizer
        self.quantize: Fp8Quantizer = checked_fp8_quantizer(
            self.quantize_torch, in_features, device) if self.rowwise else self.quantize_torch

    def quantize_torch(self, rows: torch.Tensor, padded: int) -> tuple[torch.Tensor, ...]:
        rows = F.pad(rows, (0, 0, 0, padded - rows.shape[0])).float()
        amax = rows.abs().amax(dim=1, keepdim=True) if self.rowwise else rows.abs().amax()
        scale = amax.clamp(min=1e-12) * (1.0 / FP8_MAX)  # a multiply, as the kernel does
        return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        count = rows.shape[0]
        quantized, scale = self.quantize(rows, -(-count // 16) * 16)
        out = torch._scaled_mm(quantized, self.weight_t, scale_a=scale,
                               scale_b=self.weight_scale, out_dtype=torch.bfloat16)
        return out[:count].to(rows.dtype)


class TwoInt4Planes:
    """Group-wise int8 (GGUF's Q8_0) as the sum of two int4 products over its high and low
    nibbles (``Int8GroupWeight.int4_planes``): exact in the weights, on the int4 kernel."""

    name = "two int4 planes"

    def __init__(self, weight: Int8GroupWeight, plane: Callable[[Int4Weight], Kernel]) -> None:
        high, low = weight.int4_planes()
        self.high, self.low = plane(high), plane(low)
        self.name = f"two int4 planes ({getattr(self.high, 'name', '')})"

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return self.high(rows) + self.low(rows)


def select_kernel(weight: QuantizedWeight, device: torch.device,
                  activations: str = "bf16") -> Kernel:
    """The kernel for ``weight`` on ``device`` (the table in the module docstring), built from
    the weight already on the device; WeightFormatError where there is none. ``activations``
    ``q8``: llama.cpp's 8-bit activation blocks instead (``q8_activations.py``)."""
    if activations == "q8":
        return Q8BlockProduct(weight)
    if device.type == "cpu":
        native = native_cpu_kernel(weight)
        if native is not None:
            return native
        if isinstance(weight, Int4Weight):
            return Int4PackedCPU(weight)
        if isinstance(weight, Int8Weight):
            return Int8PackedMM(weight, torch.bfloat16)
        if isinstance(weight, Int8GroupWeight):
            return TwoInt4Planes(weight, Int4PackedCPU)
        raise WeightFormatError(
            f"{weight.describe()} weights have no CPU kernel: serve this checkpoint on a GPU "
            "with compute capability 8.9+, or a float checkpoint with --quantization int8")
    if device.type == "cuda":
        if isinstance(weight, Int4Weight):
            return Int4Tinygemm(weight)
        if isinstance(weight, Int8Weight):
            return _int8_on_cuda(weight)
        if isinstance(weight, Int8GroupWeight):
            return TwoInt4Planes(weight, Int4Tinygemm)
        return Fp8ScaledMM(weight, device)
    raise WeightFormatError(f"{weight.describe()} weights have no kernel on {device.type}: "
                            "serve them on CPU or CUDA")


def _int8_on_cuda(weight: Int8Weight) -> Kernel:
    """ATen's int8 kernel where this PyTorch has it for CUDA (checked on a probe against the
    reference), else the values through the dense GEMM."""
    packed = Int8PackedMM(weight, torch.bfloat16)
    probe = torch.randn(3, weight.shape[1], device=weight.values.device, dtype=torch.bfloat16)
    try:
        agrees = torch.allclose(packed(probe).float(),
                                reference_linear(probe.float(), weight), rtol=2e-2, atol=2e-2)
    except (RuntimeError, NotImplementedError):
        agrees = False
    return packed if agrees else Int8ThroughFloat(weight)


class QuantLinear(nn.Module):
    """A projection whose weight is quantized. Built holding the weight; ``prepare(device)``
    packs it for the device's kernel (after ``fuse_projections`` has concatenated parts)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 shared_with: QuantEmbedding | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not parameters: the state_dict stays the float model's.
        self.quantized: QuantizedWeight | None = weight
        self.bias_values = bias
        self.kernel: Kernel | None = None
        self.kernel_name = ""
        # A tied LM head reads the embedding's weight, moved to the device once.
        self._shared_with = [shared_with] if shared_with is not None else []

    @property
    def description(self) -> str:
        return self.quantized.describe() if self.quantized is not None else self.kernel_name

    def prepare(self, device: torch.device, activations: str = "bf16") -> None:
        if self.kernel is not None or self.quantized is None:
            return
        if self._shared_with:
            self._shared_with[0].prepare(device)
            weight = cast(QuantizedWeight, self._shared_with[0].weight_values)
        else:
            weight = to_device(self.quantized, device)
        kernel = select_kernel(weight, device, activations)
        if self._shared_with and isinstance(kernel, Int8GroupAVX512):  # embedding reads it too
            self._shared_with[0].weight_values = kernel
        self.kernel = kernel
        self.kernel_name = f"{weight.describe()}: {getattr(kernel, 'name', type(kernel).__name__)}"
        self.quantized = None  # what the kernel needs, it keeps
        if self.bias_values is not None:
            self.bias_values = self.bias_values.to(device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel
        if kernel is None:
            raise RuntimeError("QuantLinear.prepare(device) was not called")
        rows = hidden.reshape(-1, self.in_features)
        out = kernel(rows)
        if self.bias_values is not None:
            out = out + self.bias_values
        return out.view(*hidden.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.kernel_name or self.description}")


class QuantEmbedding(nn.Module):
    """Token ids -> rows of a quantized matrix, dequantized on lookup (only the rows asked
    for). A tied LM head shares the same weight object."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_values: QuantizedWeight | Int8GroupAVX512 = weight
        self.dtype = dtype

    def prepare(self, device: torch.device, activations: str = "bf16") -> None:
        """Lookups dequantize rows; there are no activations to quantize. (A tied LM head's
        kernel may already hold the rows, packed its own way.)"""
        if isinstance(self.weight_values, QuantizedWeight):
            self.weight_values = to_device(self.weight_values, device)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight_values.rows(token_ids, self.dtype)

    def tied_lm_head(self) -> QuantLinear:
        """The LM head of a model with tied embeddings: the same quantized matrix."""
        return QuantLinear(cast(QuantizedWeight, self.weight_values), shared_with=self)

    def extra_repr(self) -> str:
        rows, width = self.weight_values.shape
        return f"{rows}, {width}, {self.weight_values.describe()} rows"


def install_quantized(model: nn.Module, quantized: dict[str, QuantizedWeight],
                      loaded: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Put each quantized weight (keyed by the float parameter's name) in the model: a
    ``QuantLinear`` for a projection (taking its bias out of ``loaded``), a
    ``QuantEmbedding`` for the token embedding."""
    for name, weight in quantized.items():
        module_name = name.removesuffix(".weight")
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(getattr(parent, child), nn.Embedding):
            setattr(parent, child, QuantEmbedding(weight, dtype))
        else:
            setattr(parent, child, QuantLinear(weight, loaded.pop(module_name + ".bias", None)))


def fuse_quantized(parts: list[nn.Module]) -> QuantLinear | None:
    """One ``QuantLinear`` over the rows of ``parts`` (q/k/v, gate/up) when they are all
    quantized in one format and layout, not yet packed; else None."""
    linears = [part for part in parts if isinstance(part, QuantLinear)]
    if len(linears) != len(parts) or any(p.quantized is None or p._shared_with
                                         for p in linears):
        return None
    biases = [part.bias_values for part in linears]
    if any(bias is None for bias in biases) and not all(bias is None for bias in biases):
        return None
    weight = concat_rows([cast(QuantizedWeight, part.quantized) for part in linears])
    if weight is None:
        return None
    bias = None if biases[0] is None else torch.cat([cast(torch.Tensor, b) for b in biases])
    return QuantLinear(weight, bias)


def prepare_quantized(model: nn.Module, device: torch.device,
                      activations: str = "bf16") -> dict[str, int]:
    """Pack every quantized layer of ``model`` for ``device`` (``activations``: see
    ``select_kernel``); returns how many layers run each kernel (for the start-up log).
    Raises WeightFormatError for a format the device cannot run."""
    counts: dict[str, int] = {}
    for module in list(model.modules()):
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            module.prepare(device, activations)
            name = module.kernel_name if isinstance(module, QuantLinear) \
                else f"embedding from {module.weight_values.describe()} rows"
            counts[name] = counts.get(name, 0) + 1
    return counts


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model's layers hold: parameters, buffers, and the tensors
    that quantized kernels and oneDNN-reordered layers keep as plain attributes; a storage
    shared by several (a tied embedding and LM head) counts once."""
    seen: set[int] = set()
    total = 0

    def add(tensor: torch.Tensor) -> None:
        nonlocal total
        try:
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # opaque (oneDNN) tensors
            key, size = id(tensor), tensor.numel() * tensor.element_size()
        if key not in seen:
            seen.add(key)
            total += size

    for module in model.modules():
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            add(tensor)
        holders: list[object] = [module]
        if isinstance(module, QuantLinear) and module.kernel is not None:
            holders.append(module.kernel)
        if isinstance(module, QuantEmbedding):
            holders.append(module.weight_values)
        for holder in holders:
            for value in vars(holder).values():
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    add(value)
    return total


def kernel_of(module: nn.Module | None) -> str | None:
    """The kernel a layer runs on, for logs and tests (None: not a quantized layer)."""
    return module.kernel_name if isinstance(module, QuantLinear) else None
