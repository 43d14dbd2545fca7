"""Slipstream's AVX-512 kernels for quantized CPU layers (kernels/cpu_quant_gemm.cpp):
against the weights' float formula in float64, rows independent of the batch they are in,
the tied embedding read from the LM head's packed copy, compiled decode steps, and the
refusals. They run with whichever products this CPU has (AMX's tdpbf16ps, vdpbf16ps with
AVX-512 BF16, float32 multiply-adds with neither); a test builds the others too where the CPU
has them.
Skipped, with the reason, on a CPU without AVX-512."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from slipstream.agent.engine.models.cpu_quant import (Int4AVX512, Int8GroupAVX512,
                                                      native_cpu_kernel, native_cpu_kernels,
                                                      native_kernels)
from slipstream.agent.engine.models.quant_kernels import (Int4PackedCPU, QuantEmbedding,
                                                          select_kernel)
from slipstream.agent.engine.models.weight_formats import (Int4Weight, Int8GroupWeight,
                                                           Int8Weight, pack_nibbles)
from slipstream.kernels import cpu_quant_gemm

pytestmark = pytest.mark.skipif(not native_cpu_kernels(),
                                reason="this CPU has no AVX-512, or no C++ compiler")


def int4_weight(rows: int, width: int, group: int, seed: int = 0) -> Int4Weight:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (rows, width), generator=generator, dtype=torch.uint8)
    # float16-exact scales and minimums, as a GGUF stores them
    scale = (torch.rand(rows, width // group, generator=generator) * 0.1).half().float()
    minimum = (-torch.rand(rows, width // group, generator=generator) * 0.8).half().float()
    return Int4Weight(pack_nibbles(values), scale, minimum, group)


def int8_weight(rows: int, width: int, group: int, seed: int = 0) -> Int8GroupWeight:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-128, 128, (rows, width), generator=generator, dtype=torch.int8)
    scale = (torch.rand(rows, width // group, generator=generator) * 0.02).half().float()
    return Int8GroupWeight(values, scale, group)


def expected(rows: torch.Tensor, weight: Int4Weight | Int8GroupWeight) -> torch.Tensor:
    """float64 product of the bf16-rounded activations and the exact float weights."""
    return rows.to(torch.bfloat16).double() @ weight.dequantize(torch.float64).T


# Widths with and without a 128-input remainder, output counts that are not multiples of
# the 16-row tile, every group size, one row to more than a register tile's worth.
SHAPES = [(1, 960, 576, 32), (2, 576, 1536, 32), (3, 33, 128, 32), (5, 64, 1536, 64),
          (2, 48, 1024, 128), (7, 17, 96, 32), (33, 40, 192, 64), (1, 8, 640, 128)]


@pytest.mark.parametrize("rows,out,width,group", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matches_the_float_formula(rows, out, width, group, dtype):
    weight = int4_weight(out, width, group)
    x = torch.randn(rows, width).to(dtype)
    got = Int4AVX512(weight)(x)
    assert got.dtype == dtype and got.shape == (rows, out)
    reference = expected(x, weight)
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2  # bf16 output rounding
    assert float((got.double() - reference).abs().max() / reference.abs().max()) < tolerance


@pytest.mark.parametrize("rows,out,width,group", SHAPES)
def test_int8_groups_match_the_float_formula(rows, out, width, group):
    weight = int8_weight(out, width, group)
    x = torch.randn(rows, width)
    got = Int8GroupAVX512(weight)(x)
    reference = expected(x, weight)
    assert float((got.double() - reference).abs().max() / reference.abs().max()) < 1e-5


def test_more_precise_than_atens_kernel():
    """ATen's kernel keeps bf16 scales and rounds its output to bf16; ours keeps the file's
    float16 scales and float32 sums."""
    weight = int4_weight(256, 576, 32, seed=3)
    x = torch.randn(4, 576)
    reference = expected(x, weight)
    ours = (Int4AVX512(weight)(x).double() - reference).abs().max()
    aten = (Int4PackedCPU(weight)(x).double() - reference).abs().max()
    assert ours < aten / 100


@pytest.mark.parametrize("kernel,weight", [
    (Int4AVX512, int4_weight(100, 576, 32)), (Int8GroupAVX512, int8_weight(100, 576, 32))])
def test_a_rows_result_does_not_depend_on_its_batch(kernel, weight):
    run = kernel(weight)
    x = torch.randn(37, 576)
    together = run(x)
    for row in (0, 5, 36):
        assert torch.equal(run(x[row:row + 1]), together[row:row + 1])


def test_the_tied_embedding_reads_the_lm_heads_packed_rows():
    weight = int8_weight(100, 576, 32, seed=5)
    embedding = QuantEmbedding(weight, torch.float32)
    head = embedding.tied_lm_head()
    head.prepare(torch.device("cpu"))
    embedding.prepare(torch.device("cpu"))
    assert embedding.weight_values is head.kernel  # one copy of the matrix
    ids = torch.tensor([[0, 17, 99], [16, 15, 31]])
    assert torch.equal(embedding(ids), weight.rows(ids.flatten(), torch.float32).view(2, 3, 576))


def test_widths_and_formats_it_does_not_take_keep_atens_kernels():
    assert native_cpu_kernel(int4_weight(16, 96, 32)) is not None
    assert native_cpu_kernel(Int8Weight(torch.zeros(16, 64, dtype=torch.int8),
                                        torch.ones(16))) is None  # int8 per channel
    odd = Int4Weight(torch.zeros(16, 40, dtype=torch.uint8), torch.ones(16, 1),
                     torch.zeros(16, 1), 80)
    assert native_cpu_kernel(odd) is None  # a group size of 80
    with native_kernels(False):
        assert isinstance(select_kernel(int4_weight(16, 96, 32), torch.device("cpu")),
                          Int4PackedCPU)
    assert isinstance(select_kernel(int4_weight(16, 96, 32), torch.device("cpu")), Int4AVX512)


def test_bad_arguments_are_refused_in_words():
    kernel = Int4AVX512(int4_weight(32, 128, 32))
    with pytest.raises(RuntimeError, match="columns"):
        cpu_quant_gemm.q4_linear(torch.randn(2, 64), kernel.packed, kernel.scales,
                                 kernel.mins, 32, 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_quant_gemm.q4_linear(torch.randn(2, 128).half(), kernel.packed, kernel.scales,
                                 kernel.mins, 32, 32)
    with pytest.raises(RuntimeError, match="packed uint8 for 48 outputs"):
        cpu_quant_gemm.q4_linear(torch.randn(2, 128), kernel.packed, kernel.scales,
                                 kernel.mins, 32, 48)
    with pytest.raises(RuntimeError, match="groups of 32, 64 or 128"):
        cpu_quant_gemm.q4_linear(torch.randn(2, 128), kernel.packed, kernel.scales,
                                 kernel.mins, 16, 32)


def test_compiled_programs_call_the_operator():
    """Inductor keeps the operator as a call (its shape function) and gives its result."""
    weight = int4_weight(64, 128, 32, seed=7)
    kernel = Int4AVX512(weight)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(kernel(x)) * 2

    x = torch.randn(2, 128)
    compiled = torch.compile(layer, dynamic=False)
    assert torch.allclose(compiled(x), layer(x), rtol=1e-6, atol=1e-6)


def test_the_kernel_benchmark_writes_its_report(tmp_path):
    import json

    from slipstream.bench import cpu_quant_bench

    assert cpu_quant_bench.main(["--rows", "1", "--trials", "1", "--threads", "1",
                                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cpu_quant.json").read_text())
    assert {row["shape"] for row in report["shapes"]} == {name for name, *_ in
                                                          cpu_quant_bench.SHAPES}
    assert all(row["ours_us"] > 0 and row["aten_us"] > 0 for row in report["shapes"])
    assert report["forward"]["1"]["ours_ms"] > 0
    assert report["settings"]["instructions"] == cpu_quant_gemm.instructions()
    assert (tmp_path / "cpu_quant.png").stat().st_size > 0


def _cpu_flags() -> set[str]:
    from slipstream.kernels import cpp_build

    return set(cpp_build.cpu_flags().split())


LABELS = {"amx_bf16": "AMX BF16", "avx512_bf16": "AVX-512 BF16", "avx512f": "AVX-512F"}


def _best_products() -> str:
    flags = _cpu_flags()
    if {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        return "amx_bf16"
    return "avx512_bf16" if "avx512_bf16" in flags else "avx512f"


def test_the_products_are_the_cpus_own():
    """AMX's tdpbf16ps where the CPU has AMX, vdpbf16ps where it has AVX-512 BF16, float32
    multiply-adds where it has neither, unless SLIPSTREAM_CPU_QUANT_KERNEL picks one."""
    expected_products = {"avx512f": "avx512f", "avx512_bf16": "avx512_bf16"}.get(
        os.environ.get(cpu_quant_gemm.DISABLE_ENV, ""), _best_products())
    if expected_products == "avx512_bf16" and "avx512_bf16" not in _cpu_flags():
        expected_products = "avx512f"
    assert cpu_quant_gemm.instructions() == expected_products
    assert Int4AVX512(int4_weight(16, 64, 32)).name.startswith(
        f"int4 {LABELS[expected_products]} ")


def _other_paths() -> list[str]:
    """The kernels this CPU runs besides this process's (each is forced in a subprocess)."""
    paths = {"amx_bf16": ["avx512_bf16", "avx512f"], "avx512_bf16": ["avx512f"]}
    return [path for path in paths.get(cpu_quant_gemm.instructions(), [])
            if path == "avx512f" or "avx512_bf16" in _cpu_flags()]


@pytest.mark.parametrize("path", ["avx512_bf16", "avx512f"])
def test_every_path_gives_the_same_products(path, tmp_path):
    """Built without AMX (SLIPSTREAM_CPU_QUANT_KERNEL=avx512_bf16) or without vdpbf16ps
    (=avx512f) in another process, the kernels give this process's results to float32
    rounding: the same exact products, summed in another order (a wrong layout would be off by
    the size of the outputs). 21 rows: an AMX block of 16 and one of 5."""
    if path not in _other_paths():
        pytest.skip(f"this CPU runs {cpu_quant_gemm.instructions()}: {path} is not another "
                    "path here")
    weights = {"int4": int4_weight(48, 576, 32, seed=11), "int8": int8_weight(48, 576, 32),
               "int4-g128": int4_weight(48, 512, 128, seed=12)}
    x = {"int4": torch.randn(21, 576, generator=torch.Generator().manual_seed(11))}
    x["int8"] = x["int4"]
    x["int4-g128"] = x["int4"][:, :512].contiguous()
    torch.save({"x": x, "weights": weights}, tmp_path / "in.pt")
    script = f"""
import torch
from slipstream.agent.engine.models.cpu_quant import (Int4AVX512, Int8GroupAVX512,
                                                      native_cpu_kernels)
from slipstream.kernels import cpu_quant_gemm
assert native_cpu_kernels()
assert cpu_quant_gemm.instructions() == {path!r}, cpu_quant_gemm.instructions()
data = torch.load({str(tmp_path / "in.pt")!r}, weights_only=False)
kernels = {{"int4": Int4AVX512, "int8": Int8GroupAVX512, "int4-g128": Int4AVX512}}
torch.save({{name: kernels[name](data["weights"][name])(data["x"][name]) for name in kernels}},
           {str(tmp_path / "out.pt")!r})
"""
    environment = {**os.environ, cpu_quant_gemm.DISABLE_ENV: path}
    subprocess.run([sys.executable, "-c", script], env=environment, check=True, timeout=600)
    other = torch.load(tmp_path / "out.pt")
    for name, kernel in (("int4", Int4AVX512), ("int8", Int8GroupAVX512),
                         ("int4-g128", Int4AVX512)):
        ours = kernel(weights[name])(x[name])
        assert float((other[name] - ours).abs().max() / ours.abs().max()) < 1e-5, name


@pytest.mark.skipif(_best_products() != "amx_bf16", reason="this CPU has no AMX")
def test_amx_can_be_turned_off_and_on_in_one_process():
    """The kernel benchmark times AMX and vdpbf16ps side by side: turned off, the kernels
    report and run vdpbf16ps; the two agree to float32 rounding; turned on again, AMX."""
    weight = int4_weight(64, 576, 32, seed=3)
    x = torch.randn(20, 576, generator=torch.Generator().manual_seed(3))
    run = Int4AVX512(weight)
    with_amx = run(x)
    with cpu_quant_gemm.amx(False) as running_amx:
        assert not running_amx and cpu_quant_gemm.instructions() == "avx512_bf16"
        without = run(x)
    assert cpu_quant_gemm.instructions() == "amx_bf16"
    assert not torch.equal(with_amx, without)  # summed in another order: another path ran
    assert float((with_amx - without).abs().max() / with_amx.abs().max()) < 1e-5
