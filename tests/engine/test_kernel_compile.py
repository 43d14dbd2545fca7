"""The CUDA kernels compile for the chips Slipstream serves on, with no GPU here
(kernels/compile_check.py): Triton's whole pipeline to the cubin, which the interpreter that
runs the other kernel tests never enters. Each check runs in a subprocess, since a kernel
defined under TRITON_INTERPRET=1 (this test session's setting on a CPU) cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KERNELS = {"_write_kv_kernel", "_decode_partial_kernel", "_decode_reduce_kernel",
           "_prefill_kernel", "_merge_segments_kernel", "_add_rms_norm_kernel",
           "_rotary_kernel", "_quantize_fp8_rows_kernel"}


def _run(tmp_path: Path, *args: str, script: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-c", script] if script else \
        [sys.executable, "-m", "slipstream.kernels.compile_check", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200,
                          cwd=tmp_path)


UNAVAILABLE = 3  # compile_check's exit status where this Triton cannot build cubins


def test_every_kernel_compiles_for_hopper_and_ada_without_spilling(tmp_path: Path) -> None:
    out = tmp_path / "compile_check.json"
    done = _run(tmp_path, "--arch", "90", "89", "--shapes", "llama-3-8b", "gemma-2-9b",
                "--quiet", "--json", str(out))
    if done.returncode == UNAVAILABLE:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout + done.stderr
    kernels = json.loads(out.read_text())["kernels"]
    for arch in (90, 89):
        compiled = [k for k in kernels if k["arch"] == arch]
        assert {k["kernel"] for k in compiled} == KERNELS, arch
        # Both head widths reached the prefill kernel, each with its own tiles.
        prefills = {k["case"].split()[0] for k in compiled if k["kernel"] == "_prefill_kernel"}
        assert prefills == {"llama-3-8b", "gemma-2-9b"}
        for kernel in compiled:
            assert not kernel["problems"] and not kernel["error"], kernel
            assert kernel["registers"] > 0 and kernel["blocks_per_sm"] >= 1, kernel
    # Prefill is compute-bound: on Hopper its dots must be warpgroup MMAs (a tile shape or
    # warp count that loses them costs most of the tensor cores' rate); Ada has mma.sync.
    by_arch = {(k["arch"], k["kernel"]): set() for k in kernels}
    for k in kernels:
        by_arch[k["arch"], k["kernel"]].add(k["tensor_cores"])
    assert by_arch[90, "_prefill_kernel"] == {"wgmma"}
    assert by_arch[89, "_prefill_kernel"] == {"mma"}
    assert by_arch[90, "_decode_partial_kernel"] <= {"mma", "wgmma"}
    spilling = [(k["arch"], k["case"], k["kernel"], k["spill_bytes"]) for k in kernels
                if k["spill_bytes"]]
    assert not spilling, f"kernels spill registers to local memory: {spilling}"
    # The tensor-core kernels stage their tiles in shared memory.
    assert all(k["shared_bytes"] > 0 for k in kernels
               if k["kernel"] in ("_prefill_kernel", "_decode_partial_kernel"))


def test_a_tile_too_big_for_the_chip_is_reported(tmp_path: Path) -> None:
    """The check fails where the chip would refuse the launch: 128x128 tiles of 256-wide
    heads in three stages want more shared memory than an H100 grants one block."""
    script = """
import json, sys
from slipstream.kernels import compile_check, triton_prefill
if compile_check.unavailable():
    sys.exit(compile_check.UNAVAILABLE)
triton_prefill.prefill_tiles = lambda longest_query, head_dim, arch: (128, 128, 8, 3)
gemma = tuple(s for s in compile_check.SHAPES if s.name == "gemma-2-9b")
found, case = [], ["prefill"]
with compile_check.compiling_for(compile_check.CHIPS[90], found, case):
    for label, launch in compile_check._attention_cases(gemma[0]):
        if label == "prefill q32 x1":
            launch()
print(json.dumps([r.__dict__ for r in found]))
"""
    done = _run(tmp_path, script=script)
    if done.returncode == UNAVAILABLE:
        pytest.skip("this Triton cannot build cubins here (see compile_check.unavailable)")
    assert done.returncode == 0, done.stdout + done.stderr
    (prefill,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert prefill["kernel"] == "_prefill_kernel"
    assert prefill["shared_bytes"] > 227 * 1024
    assert any("shared memory" in problem for problem in prefill["problems"]), prefill
