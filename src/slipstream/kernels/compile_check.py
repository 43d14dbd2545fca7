"""Compile every CUDA kernel of the engine for a GPU, on a machine without one.

CI has no GPU, and Triton's interpreter (how the kernels are tested there) runs them as
numpy: it never meets the compiler's rules (a ``tl.dot`` under 16 wide, a layout the
pipeliner refuses), the shared memory a tile needs, or the registers that spill. Triton's
wheel carries its own CUDA assembler, so the whole pipeline down to the cubin runs here:

    python -m slipstream.kernels.compile_check                 H100/H200 (sm_90), the cases
    python -m slipstream.kernels.compile_check --arch 80 89    A100, L40S
    python -m slipstream.kernels.compile_check --json results/kernel-compile/sm90.json

Each case calls the engine's own launch function (``paged_decode``, ``paged_prefill``,
``write_kv``, the layer kernels) with the tile sizes it picks on CUDA and small CPU tensors
of a model's shape; Triton's launch is stopped after its specialisation, and the kernel it
would have compiled is compiled for the chosen chip instead and never run. From the cubin:
registers per thread, local memory (spills), and with the dynamic shared memory the blocks
one multiprocessor can hold; from the PTX, whether the tensor cores are Hopper's (wgmma). A kernel that fails to compile, or asks for more shared memory
than the chip grants a block, fails the check (exit status 1); spills are reported.

What it cannot see: speed, and anything that needs the chip itself (driver, graph capture).
``make device-check`` measures those on a lent GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
    raise ImportError("compile_check needs Triton imported without TRITON_INTERPRET=1 (its "
                      "kernels are decorated for the interpreter otherwise); run it as "
                      "python -m slipstream.kernels.compile_check")
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402 - after the interpreter switch is cleared
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from slipstream.kernels import triton_layers  # noqa: E402
from slipstream.kernels.triton_attention import (COMPILE_ARCH, KernelOptions,  # noqa: E402
                                                 paged_decode, write_kv)
from slipstream.kernels.triton_prefill import paged_prefill  # noqa: E402

KB = 1024


@dataclass(frozen=True)
class Chip:
    """What one CUDA architecture grants a kernel (the CUDA programming guide's table)."""

    arch: int
    names: str
    shared_per_block: int  # the opt-in maximum of dynamic shared memory
    shared_per_sm: int
    max_threads_per_sm: int
    registers_per_sm: int = 64 * KB
    reserved_shared_per_block: int = 1 * KB  # the runtime's own, since sm_80


CHIPS = {
    80: Chip(80, "A100", 163 * KB, 164 * KB, 2048),
    86: Chip(86, "A10, A40, RTX 30", 99 * KB, 100 * KB, 1536),
    89: Chip(89, "L4, L40S, RTX 40", 99 * KB, 100 * KB, 1536),
    90: Chip(90, "H100, H200", 227 * KB, 228 * KB, 2048),
}


@dataclass(frozen=True)
class Shape:
    """The attention and hidden sizes of a model (one tensor-parallel shard where named)."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    window: int = 0
    softcap: float = 0.0
    dtype: torch.dtype = torch.bfloat16


SHAPES = (
    Shape("llama-3-8b", 32, 8, 128, 4096),
    Shape("llama-3-8b-fp16", 32, 8, 128, 4096, dtype=torch.float16),
    Shape("qwen2.5-7b", 28, 4, 128, 3584),  # a GQA group of 7, padded to 16
    Shape("llama-3-70b-tp8", 8, 1, 128, 1024),
    Shape("gemma-2-9b", 16, 8, 256, 3584, window=4096, softcap=50.0),
    Shape("gemma-3-12b", 16, 8, 256, 3840, window=1024),
    Shape("smollm2-135m", 9, 3, 64, 576),
)
PAGE = 16  # the block manager's BLOCK_SIZE


@dataclass
class Compiled:
    """One kernel as one case compiled it for one chip."""

    case: str
    kernel: str
    arch: int
    num_warps: int = 0
    num_stages: int = 0
    shared_bytes: int = 0
    registers: int = 0
    spill_bytes: int = 0  # local memory per thread: registers spilled (0 is the goal)
    blocks_per_sm: int = 0
    tensor_cores: str = ""  # "wgmma" (Hopper's), "mma" (Ampere's, also on Hopper) or none
    seconds: float = 0.0
    error: str = ""
    problems: list[str] = field(default_factory=list)


class _CompileOnlyDriver:
    """What Triton's launcher asks of a driver before it compiles, for a chip not present."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


@contextmanager
def compiling_for(chip: Chip, found: list[Compiled], case: list[str]) -> Iterator[None]:
    """Within: every Triton launch compiles its kernel for ``chip`` into ``found`` (tagged
    with ``case[0]``) and returns without running it; launches pick the CUDA tiles."""
    driver = triton.runtime.driver
    previous_driver, previous_hook = driver._active, knobs.runtime.jit_cache_hook
    seen: set[tuple[str, str]] = set()

    def hook(*, key, fn, compile, **_: object) -> bool:
        name = fn.jit_function.__name__
        if (name, str(key)) not in seen:
            seen.add((name, str(key)))
            found.append(_compile(chip, case[0], fn.jit_function, compile))
        return True  # skip Triton's own compile and the launch

    driver.set_active(_CompileOnlyDriver(chip.arch))
    knobs.runtime.jit_cache_hook = hook
    token = COMPILE_ARCH.set(chip.arch)
    try:
        yield
    finally:
        COMPILE_ARCH.reset(token)
        knobs.runtime.jit_cache_hook = previous_hook
        driver._active = previous_driver


def _compile(chip: Chip, case: str, jit_function, spec: dict) -> Compiled:
    result = Compiled(case, jit_function.__name__, chip.arch, spec["num_warps"],
                      spec["num_stages"])
    source = ASTSource(jit_function, spec["signature"], spec["constants"], spec["configs"][0])
    options = {name: spec[name] for name in ("num_warps", "num_ctas", "num_stages",
                                             "enable_fp_fusion")}
    started = time.perf_counter()
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", chip.arch, 32),
                                options=options)
    except Exception as error:  # noqa: BLE001 - the compiler's refusal is the finding
        result.error = f"{type(error).__name__}: {str(error).strip()[-2000:]}"
        result.problems.append("does not compile")
        return result
    result.seconds = round(time.perf_counter() - started, 2)
    result.shared_bytes = kernel.metadata.shared
    result.registers, result.spill_bytes = _resources(kernel.asm["cubin"])
    result.tensor_cores = tensor_cores(kernel.asm["ptx"])
    result.blocks_per_sm = blocks_per_sm(chip, result.num_warps, result.registers,
                                         result.shared_bytes)
    if result.shared_bytes > chip.shared_per_block:
        result.problems.append(f"needs {result.shared_bytes} B of shared memory, the chip "
                               f"grants a block {chip.shared_per_block} B")
    return result


def _resources(cubin: bytes) -> tuple[int, int]:
    """Registers per thread and local (spill) bytes, from cuobjdump's resource usage."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        report = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage",
                                 str(path)], capture_output=True, text=True, check=True).stdout
    registers = re.search(r"REG:(\d+)", report)
    local = re.search(r"LOCAL:(\d+)", report)
    stack = re.search(r"STACK:(\d+)", report)
    if registers is None or local is None:
        raise RuntimeError(f"cuobjdump gave no resource usage: {report!r}")
    return int(registers.group(1)), int(local.group(1)) + int(stack.group(1) if stack else 0)


def tensor_cores(ptx: str) -> str:
    """Which matrix instructions the kernel's PTX issues: Hopper's warpgroup ``wgmma``, the
    warp-level ``mma.sync``, or none."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    return "mma" if "mma.sync" in ptx else ""


def blocks_per_sm(chip: Chip, num_warps: int, registers: int, shared: int) -> int:
    """Blocks of this kernel one multiprocessor holds at once (registers are given out in
    groups of 256 per warp, shared memory with the runtime's reserve per block)."""
    threads = 32 * num_warps
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_registers = chip.registers_per_sm // (per_warp * num_warps)
    by_shared = chip.shared_per_sm // (shared + chip.reserved_shared_per_block) \
        if shared else 32
    return max(0, min(32, chip.max_threads_per_sm // threads, by_registers, by_shared))


# -- the cases: the engine's launches, at a model's shape ------------------------------------


def _attention_cases(shape: Shape) -> Iterator[tuple[str, Callable[[], object]]]:
    tokens, blocks = 4, 8
    qkv_width = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    # The model's fused projection: q, k and v are strided views of one [tokens, qkv] tensor.
    qkv = torch.zeros(tokens, qkv_width, dtype=shape.dtype)
    query = qkv[:, :shape.heads * shape.head_dim].view(tokens, shape.heads, shape.head_dim)
    key = qkv[:, shape.heads * shape.head_dim:][:, :shape.kv_heads * shape.head_dim] \
        .view(tokens, shape.kv_heads, shape.head_dim)
    cache = torch.zeros(blocks, PAGE, shape.kv_heads, shape.head_dim, dtype=shape.dtype)
    seq_info = torch.zeros(2, 6, dtype=torch.int64)
    block_indices = torch.zeros(blocks, dtype=torch.int64)
    out = torch.zeros(tokens, shape.heads, shape.head_dim, dtype=shape.dtype)
    lse = torch.zeros(tokens, shape.heads, dtype=torch.float32)
    options = KernelOptions.of(shape.window, shape.softcap)
    scale = shape.head_dim ** -0.5

    yield "write_kv", lambda: write_kv(key, key, cache, cache.clone(),
                                       torch.zeros(tokens, dtype=torch.int64))
    def decode(with_lse: bool) -> None:
        paged_decode(query, cache, cache.clone(), seq_info, block_indices, scale, out,
                     lse if with_lse else None, num_segments=8, options=options)

    def prefill(longest_query: int, segments: int, with_lse: bool) -> None:
        paged_prefill(query, cache, cache.clone(), seq_info, block_indices, scale, out,
                      lse if with_lse else None, longest_query=longest_query,
                      longest_kv=65536, num_tokens=tokens, num_segments=segments,
                      options=options)

    for with_lse in (False, True):
        yield f"decode{'+lse' if with_lse else ''}", functools.partial(decode, with_lse)
    # Short chunks and long ones (on sm_90: 64-row tiles on 4 warps, 128-row on 8), each
    # whole and split into KV segments; the log-sum-exp as KV-cache parallelism asks for it.
    for longest_query, segments, with_lse in ((32, 1, False), (1024, 1, True),
                                              (32, 4, True), (1024, 4, False)):
        label = f"prefill q{longest_query} x{segments}{'+lse' if with_lse else ''}"
        yield label, functools.partial(prefill, longest_query, segments, with_lse)


def _layer_cases(shape: Shape, arch: int) -> Iterator[tuple[str, Callable[[], object]]]:
    tokens = 4
    hidden = torch.zeros(tokens, shape.hidden, dtype=shape.dtype)
    weight = torch.zeros(shape.hidden, dtype=shape.dtype)
    yield "add_rms_norm", lambda: triton_layers.fused_add_rms_norm(hidden, hidden.clone(),
                                                                   weight, 1e-6)
    qkv_width = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    qkv = torch.zeros(tokens, qkv_width, dtype=shape.dtype)
    query = qkv[:, :shape.heads * shape.head_dim].view(tokens, shape.heads, shape.head_dim)
    key = qkv[:, shape.heads * shape.head_dim:][:, :shape.kv_heads * shape.head_dim] \
        .view(tokens, shape.kv_heads, shape.head_dim)
    cos = torch.zeros(tokens, 1, shape.head_dim, dtype=shape.dtype)
    yield "rotary", lambda: triton_layers.rotary_(query, key, cos, cos.clone())
    if arch >= 89:  # FP8 weights are served from sm_89 (quant_kernels.Fp8ScaledMM)
        yield "fp8_rows", lambda: triton_layers.quantize_fp8_rows(hidden, 16)


def cases(arch: int, shapes: tuple[Shape, ...] = SHAPES
          ) -> Iterator[tuple[str, Callable[[], object]]]:
    for shape in shapes:
        for label, launch in (*_attention_cases(shape), *_layer_cases(shape, arch)):
            yield f"{shape.name} {label}", launch


def check(chip: Chip, shapes: tuple[Shape, ...] = SHAPES,
          progress: Callable[[str], None] | None = None) -> list[Compiled]:
    found: list[Compiled] = []
    current = [""]
    with compiling_for(chip, found, current):
        for label, launch in cases(chip.arch, shapes):
            current[0] = label
            if progress:
                progress(label)
            launch()
    return found


def _table(results: list[Compiled]) -> str:
    lines = [f"{'case':<44} {'kernel':<24} {'warps':>5} {'shared':>8} {'regs':>4} "
             f"{'spill':>5} {'blocks/SM':>9} {'MMA':>5}"]
    for r in results:
        status = "; ".join(r.problems) if r.problems else ""
        lines.append(f"{r.case:<44} {r.kernel:<24} {r.num_warps:>5} {r.shared_bytes:>8} "
                     f"{r.registers:>4} {r.spill_bytes:>5} {r.blocks_per_sm:>9} {r.tensor_cores:>5}  "
                     f"{status}")
    return "\n".join(lines)


UNAVAILABLE = 3  # the exit status when this Triton cannot compile for CUDA here


def unavailable() -> str | None:
    """Why this Triton cannot build cubins on this machine, or None when it can."""
    if not hasattr(knobs, "runtime") or not hasattr(knobs.runtime, "jit_cache_hook"):
        return f"Triton {triton.__version__} has no jit_cache_hook (3.4 and later do)"
    if not hasattr(triton.runtime.driver, "_active"):
        return f"Triton {triton.__version__}'s driver cannot be swapped"
    try:
        tool = knobs.nvidia.cuobjdump.path
    except Exception as error:  # noqa: BLE001 - the CUDA backend is missing or broken
        return f"Triton's CUDA backend is not usable ({error})"
    return None if tool and Path(tool).exists() else "Triton's wheel carries no cuobjdump"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slipstream.kernels.compile_check",
        description="Compile the engine's Triton kernels for a CUDA chip without one: "
                    "fails on a kernel that does not compile or needs more shared memory "
                    "than the chip grants; reports registers, spills and occupancy.")
    parser.add_argument("--arch", type=int, nargs="+", default=[90], choices=sorted(CHIPS),
                        help="compute capability x10 (90: H100/H200, 80: A100, 89: L40S); "
                             "default 90")
    parser.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES],
                        help="model shapes to compile for (default: all)")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--quiet", action="store_true", help="print only the problems")
    args = parser.parse_args(argv)
    shapes = tuple(s for s in SHAPES if not args.shapes or s.name in args.shapes)
    reason = unavailable()
    if reason:
        print(f"cannot compile for CUDA here: {reason}", file=sys.stderr)
        return UNAVAILABLE
    everything: list[Compiled] = []
    for arch in args.arch:
        chip = CHIPS[arch]
        started = time.perf_counter()

        def progress(label: str, arch: int = arch) -> None:
            if not args.quiet and sys.stderr.isatty():
                print(f"\r\x1b[Ksm_{arch}: {label}", end="", file=sys.stderr, flush=True)

        results = check(chip, shapes, progress)
        if not args.quiet and sys.stderr.isatty():
            print("\r\x1b[K", end="", file=sys.stderr)
        everything.extend(results)
        bad = [r for r in results if r.problems]
        print(f"sm_{arch} ({chip.names}): {len(results)} kernels compiled in "
              f"{time.perf_counter() - started:.0f} s, {len(bad)} with problems, "
              f"{sum(1 for r in results if r.spill_bytes)} spilling registers")
        print(_table(bad if args.quiet else results))
        for r in bad:
            if r.error:
                print(f"\n{r.case} {r.kernel}:\n{r.error}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"triton": triton.__version__,
                   "chips": {a: asdict(CHIPS[a]) for a in args.arch},
                   "kernels": [asdict(r) for r in everything]}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 1 if any(r.problems for r in everything) else 0


if __name__ == "__main__":
    sys.exit(main())
