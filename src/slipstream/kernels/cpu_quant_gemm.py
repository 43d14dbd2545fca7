"""Quantized linear layers on x86 CPUs with AVX-512: the operators ``slipstream::q4_linear``
and ``slipstream::q8_linear``, their weight layouts, and the build of their C++ kernels
(``cpu_quant_gemm.cpp``, which says why they exist and how they compute).

``available(build_dir)`` builds the kernels once per process (seconds, then loaded from
``build_dir``) and answers whether they run on this CPU. They multiply with AMX's
``tdpbf16ps`` where the CPU has AMX (Sapphire Rapids and later), else with AVX-512 BF16's
``vdpbf16ps``, else with AVX-512F's float32 multiply-adds on the same bfloat16 weights
(``instructions()`` says which). Where they do not run (no compiler, no
AVX-512, ``SLIPSTREAM_CPU_QUANT_KERNEL=aten``), the engine keeps ATen's packed int4 kernel
(``agent/engine/models/quant_kernels.py``). The operators are registered with
``torch.library`` with shape functions, so compiled decode steps (inductor) call them as they
call any ATen kernel.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from slipstream.kernels import cpp_build

log = logging.getLogger(__name__)

_LIBRARY = torch.library.Library("slipstream", "FRAGMENT")
_LIBRARY.define("q4_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, int group, "
                "int out_features) -> Tensor")
_LIBRARY.define("q8_linear(Tensor x, Tensor values, Tensor scales, int group, "
                "int out_features) -> Tensor")


def _q4_shape(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
              mins: torch.Tensor, group: int, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


def _q8_shape(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
              group: int, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


torch.library.register_fake("slipstream::q4_linear", _q4_shape, lib=_LIBRARY)
torch.library.register_fake("slipstream::q8_linear", _q8_shape, lib=_LIBRARY)

# "aten": keep ATen's kernel; "avx512f": the float32 multiply-adds even where the CPU has
# AVX-512 BF16; "avx512_bf16": vdpbf16ps even where it has AMX (to compare the kernels, and to
# test every path on one machine)
DISABLE_ENV = "SLIPSTREAM_CPU_QUANT_KERNEL"
_SOURCE = Path(__file__).with_name("cpu_quant_gemm.cpp")
_state: dict[str, bool] = {}
_lock = threading.Lock()


def available(build_dir: Path | None) -> bool:
    """Whether ``q4_linear``/``q8_linear`` run here: built (into ``build_dir``, named for
    this CPU and the source, so a cache shared with another machine is not reused) and
    loaded once per process; False with one warning when the build fails."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = False
            if os.environ.get(DISABLE_ENV) == "aten":
                log.info("%s=aten: quantized CPU layers run ATen's int4 kernel", DISABLE_ENV)
            elif build_dir is not None and platform.machine() in ("x86_64", "AMD64") \
                    and _cpu_has_avx512():
                flags = ["-DSLIPSTREAM_QGEMM_NO_BF16"] \
                    if os.environ.get(DISABLE_ENV) == "avx512f" else []
                try:
                    cpp_build.build("slipstream_cpu_quant_gemm", _SOURCE, build_dir, flags,
                                    openmp=True)
                    _state["ok"] = bool(torch.ops.slipstream_cpu_quant.supported())
                    if os.environ.get(DISABLE_ENV) == "avx512_bf16":
                        torch.ops.slipstream_cpu_quant.use_amx(False)
                except Exception as error:  # noqa: BLE001 - ATen's kernel serves instead
                    log.warning("the AVX-512 quantized matmul kernels did not build (%s); "
                                "quantized layers run ATen's int4 kernel", str(error)
                                .splitlines()[0] if str(error) else type(error).__name__)
        return _state["ok"]


def _cpu_has_avx512() -> bool:
    flags = set(cpp_build.cpu_flags().split())
    return {"avx512f", "avx512bw", "avx512vl"} <= flags


def instructions() -> str:
    """The products of the loaded kernels: ``"amx_bf16"`` (AMX's ``tdpbf16ps``),
    ``"avx512_bf16"`` (``vdpbf16ps``), ``"avx512f"`` (float32 multiply-adds) or ``"none"``
    (not loaded: call ``available`` first)."""
    if not _state.get("ok"):
        return "none"
    return str(torch.ops.slipstream_cpu_quant.instructions())


@contextlib.contextmanager
def amx(enabled: bool) -> Iterator[bool]:
    """Inside, the kernels multiply with AMX (``enabled``, where this CPU has it) or with
    vdpbf16ps; yields whether AMX runs. For benchmarks that time both in one process: the
    results differ only in float32 rounding (the same products summed in another order)."""
    previous = instructions() == "amx_bf16"
    try:
        yield bool(torch.ops.slipstream_cpu_quant.use_amx(enabled))
    finally:
        torch.ops.slipstream_cpu_quant.use_amx(previous)


TILE = 16  # output rows per tile (cpu_quant_gemm.cpp)


def packs(width: int, group: int) -> bool:
    """Whether the kernels take a weight of this input width and group size."""
    return group in (32, 64, 128) and width % group == 0


def _tiles(values: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [tiles, slices, 16 rows, 32 inputs], out padded with zero rows."""
    rows, width = values.shape
    padded = F.pad(values, (0, 0, 0, -rows % TILE))
    return padded.view(-1, TILE, width // 32, 32).transpose(1, 2)


def pack_scales(scales: torch.Tensor) -> torch.Tensor:
    """float [out, groups] -> float16 [tiles, groups, 16] (zero for the padding rows)."""
    rows, groups = scales.shape
    padded = F.pad(scales.to(torch.float16), (0, 0, 0, -rows % TILE))
    return padded.view(-1, TILE, groups).transpose(1, 2).contiguous()


def pack_q4(values: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] of 4-bit values (0..15) -> ``q4_linear``'s layout: in slice s of a
    tile, nibble p of word j of 64-byte load l is the weight of row j // 2 and input
    ``32 s + 2 (4 l + p) + j % 2``."""
    tiles = _tiles(values.to(torch.uint8))  # [t, s, row, 32]
    t, s = tiles.shape[:2]
    # input = 8 l + 2 p + e  ->  [t, s, l, row, e, p]: word j = 2 row + e holds p = 0..3
    nibbles = tiles.reshape(t, s, TILE, 4, 4, 2).permute(0, 1, 3, 2, 5, 4)
    low_byte = nibbles[..., 0] | (nibbles[..., 1] << 4)
    high_byte = nibbles[..., 2] | (nibbles[..., 3] << 4)
    return torch.stack([low_byte, high_byte], dim=-1).contiguous().view(-1)


def pack_q8(values: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] -> ``q8_linear``'s layout of ``value + 128``: byte b of word j of
    64-byte load l is the weight of row j // 2 and input ``32 s + 2 (2 l + b) + j % 2``."""
    unsigned = (values.to(torch.int16) + 128).to(torch.uint8)
    tiles = _tiles(unsigned)
    t, s = tiles.shape[:2]
    # input = 4 l + 2 b + e  ->  [t, s, l, row, e, b]
    return tiles.reshape(t, s, TILE, 8, 2, 2).permute(0, 1, 3, 2, 5, 4).contiguous().view(-1)


def unpack_q8_rows(values: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int],
                   group: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``index`` of a ``pack_q8`` weight of ``shape``, back in input order: int16
    [rows, in] values and float32 [rows, in / group] scales (``pack_scales``)."""
    out_features, width = shape
    tiles = values.view(-1, width // 32, 8, TILE, 2, 2)  # [t, s, l, row, e, b]
    tile, row = index // TILE, index % TILE
    picked = tiles[tile, :, :, row]  # [rows, s, l, e, b]
    ordered = picked.permute(0, 1, 2, 4, 3).reshape(-1, width)  # input 32 s + 4 l + 2 b + e
    groups = width // group
    row_scales = scales.view(-1, groups, TILE)[tile, :, row].to(torch.float32)
    return ordered.to(torch.int16) - 128, row_scales


def q4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
              group: int, out_features: int) -> torch.Tensor:
    """``x [rows, in]`` (float32 or bfloat16) times the 4-bit weight ``q * scale + min``
    packed by ``pack_q4``, ``scales`` and ``mins`` by ``pack_scales``: ``[rows, out]`` in
    ``x``'s dtype."""
    return torch.ops.slipstream.q4_linear(x, packed, scales, mins, group, out_features)


def q8_linear(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
              group: int, out_features: int) -> torch.Tensor:
    """``x [rows, in]`` times the 8-bit weight packed by ``pack_q8`` with its float16
    ``scales`` (``pack_scales``): ``[rows, out]``."""
    return torch.ops.slipstream.q8_linear(x, values, scales, group, out_features)
