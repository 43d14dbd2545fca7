"""Quantized projections on x86 CPUs with AVX-512 (with or without BF16), through Slipstream's
own kernels (``kernels/cpu_quant_gemm.cpp``: ``slipstream::q4_linear`` and
``slipstream::q8_linear``).

``native_cpu_kernel(weight)`` packs a weight for them where they are built and take its shape,
and answers None otherwise, so that ``quant_kernels.select_kernel`` keeps ATen's packed int4
kernel. The scales and minimums are kept as float16: GGUF stores them so (exact for Q4_0,
Q4_1 and Q8_0), and it is finer than the bfloat16 that ATen's kernel takes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir
from slipstream.agent.engine.models.weight_formats import (Int4Weight, Int8GroupWeight,
                                                          QuantizedWeight)
from slipstream.kernels import cpu_quant_gemm


def _label() -> str:
    """The loaded kernels' products, for layer names: AMX BF16, AVX-512 BF16 or AVX-512F."""
    return {"amx_bf16": "AMX BF16", "avx512_bf16": "AVX-512 BF16", "avx512f": "AVX-512F"}.get(
        cpu_quant_gemm.instructions(), "AVX-512")


class Int4AVX512:
    """int4 group-wise (scale and minimum per group of 32, 64 or 128)."""

    def __init__(self, weight: Int4Weight) -> None:
        self.name = f"int4 {_label()} (slipstream::q4_linear)"
        self.out_features = weight.shape[0]
        self.packed = cpu_quant_gemm.pack_q4(weight.unpacked())
        self.scales = cpu_quant_gemm.pack_scales(weight.scale)
        self.mins = cpu_quant_gemm.pack_scales(weight.minimum)
        self.group_size = weight.group_size

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return cpu_quant_gemm.q4_linear(rows.contiguous(), self.packed, self.scales, self.mins,
                                        self.group_size, self.out_features)


class Int8GroupAVX512:
    """int8 with a scale per group of 32, 64 or 128 (GGUF's Q8_0). A tied embedding looks
    its rows up here too (``rows``), so the matrix is held once."""

    def __init__(self, weight: Int8GroupWeight) -> None:
        self.name = f"int8 {_label()} (slipstream::q8_linear)"
        self.shape = weight.shape
        self.values = cpu_quant_gemm.pack_q8(weight.values)
        self.scales = cpu_quant_gemm.pack_scales(weight.scale)
        self.group_size = weight.group_size
        self._describe = weight.describe()

    def describe(self) -> str:
        return self._describe

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized rows ``index`` (token ids) -> [*index.shape, in] in ``dtype``."""
        values, scales = cpu_quant_gemm.unpack_q8_rows(self.values, self.scales, self.shape,
                                                       self.group_size, index.reshape(-1))
        groups = values.view(-1, self.shape[1] // self.group_size, self.group_size)
        weights = (groups.to(torch.float32) * scales[:, :, None]).view(-1, self.shape[1])
        return weights.to(dtype).view(*index.shape, self.shape[1])

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return cpu_quant_gemm.q8_linear(rows.contiguous(), self.values, self.scales,
                                        self.group_size, self.shape[0])


_enabled = [True]


@contextlib.contextmanager
def native_kernels(enabled: bool) -> Iterator[None]:
    """Models loaded inside run (or, with False, do not run) these kernels: benchmarks load
    one engine of each to compare them side by side."""
    previous, _enabled[0] = _enabled[0], enabled
    try:
        yield
    finally:
        _enabled[0] = previous


def native_cpu_kernels() -> bool:
    """Whether this process's quantized CPU layers load onto these kernels (built and run
    here, and not turned off)."""
    return _enabled[0] and cpu_quant_gemm.available(_build_dir())


def _build_dir() -> Path:
    return slipstream_cache_dir() / "cpp" / "quant_gemm"


def native_cpu_kernel(weight: QuantizedWeight) -> Int4AVX512 | Int8GroupAVX512 | None:
    """Slipstream's kernel for ``weight`` on this CPU, or None where it has none (another
    format, a width or group size it does not take, or kernels that did not build)."""
    if not isinstance(weight, (Int4Weight, Int8GroupWeight)) \
            or not cpu_quant_gemm.packs(weight.shape[1], weight.group_size) \
            or not native_cpu_kernels():
        return None
    return Int4AVX512(weight) if isinstance(weight, Int4Weight) else Int8GroupAVX512(weight)
