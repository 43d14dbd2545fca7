"""Quantized CPU matmuls, Slipstream's AVX-512 kernels against ATen's packed int4 kernel,
side by side in one run, on the default model's projection shapes (``make bench-cpu-quant``).

For each row count (1 is a one-stream decode step, 256 a prefill chunk) it times every
projection of SmolLM2-135M (q/k/v fused, o, gate/up fused, down: int4 in groups of 32, as
its Q4_1 blocks are served; the tied LM head: int8 in groups of 32, as its Q8_0 blocks are,
which ATen runs as two int4 planes) on random weights of those shapes, each kernel's best of
``--trials`` runs, interleaved so that a busy moment hits both. It reports per shape and for
one whole forward (30 layers plus the LM head) and writes ``cpu_quant.json`` and
``cpu_quant.png`` under ``--out``. The report names the products the kernels used here:
``amx_bf16`` on a CPU with AMX (then the same kernels with ``vdpbf16ps`` are timed too,
interleaved, as a third column), ``avx512_bf16``, or, on a CPU without AVX-512 BF16 (or with
``SLIPSTREAM_CPU_QUANT_KERNEL=avx512f``), ``avx512f``.

The weights here stay in cache between calls; in a real step they come from memory, which
bounds one-row products on a CPU (``decode_step_bench --gguf --gguf-aten`` times the step).

Usage::

    python -m slipstream.bench.cpu_quant_bench --out results/cpu-quant
    python -m slipstream.bench.cpu_quant_bench --rows 1,2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from slipstream.agent.engine.models.cpu_quant import (Int4AVX512, Int8GroupAVX512,
                                                      native_cpu_kernels)
from slipstream.agent.engine.models.quant_kernels import Int4PackedCPU, TwoInt4Planes
from slipstream.agent.engine.models.weight_formats import (Int4Weight, Int8GroupWeight,
                                                           pack_nibbles)
from slipstream.kernels import cpp_build, cpu_quant_gemm

# SmolLM2-135M: (name, outputs, inputs, how many per forward)
SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30),
          ("down", 576, 1536, 30), ("lm_head (int8)", 49152, 576, 1)]


def _int4(outputs: int, inputs: int) -> Int4Weight:
    values = torch.randint(0, 16, (outputs, inputs), dtype=torch.uint8)
    scale = (torch.rand(outputs, inputs // 32) * 0.1).half().float()
    minimum = (-torch.rand(outputs, inputs // 32) * 0.8).half().float()
    return Int4Weight(pack_nibbles(values), scale, minimum, 32)


def _int8(outputs: int, inputs: int) -> Int8GroupWeight:
    values = torch.randint(-128, 128, (outputs, inputs), dtype=torch.int8)
    return Int8GroupWeight(values, (torch.rand(outputs, inputs // 32) * 0.02).half().float(), 32)


def _best_us(run: Callable[[], torch.Tensor], calls: int, trials: int) -> list[float]:
    run()
    times = []
    for _ in range(trials):
        started = time.perf_counter()
        for _ in range(calls):
            run()
        times.append((time.perf_counter() - started) / calls * 1e6)
    return times


def measure(rows_list: list[int], trials: int) -> list[dict]:
    """Per row count and shape, the best time of each kernel; on a CPU with AMX also the same
    kernels with vdpbf16ps instead (``vdpbf16ps_us``), interleaved with the other two."""
    results = []
    with_amx = cpu_quant_gemm.instructions() == "amx_bf16"
    for rows in rows_list:
        for name, outputs, inputs, per_forward in SHAPES:
            ours: Callable[[torch.Tensor], torch.Tensor]
            aten: Callable[[torch.Tensor], torch.Tensor]
            if name.startswith("lm_head"):
                weight8 = _int8(outputs, inputs)
                ours, aten = Int8GroupAVX512(weight8), TwoInt4Planes(weight8, Int4PackedCPU)
            else:
                weight4 = _int4(outputs, inputs)
                ours, aten = Int4AVX512(weight4), Int4PackedCPU(weight4)
            x = torch.randn(rows, inputs)
            calls = max(3, int(2e8 / (rows * outputs * inputs + 1e6)))
            ours_us, vector_us, aten_us = [], [], []
            for _ in range(trials):  # interleaved
                ours_us += _best_us(lambda: ours(x), calls, 1)
                if with_amx:
                    with cpu_quant_gemm.amx(False):
                        vector_us += _best_us(lambda: ours(x), calls, 1)
                aten_us += _best_us(lambda: aten(x), calls, 1)
            row = {"rows": rows, "shape": name, "outputs": outputs, "inputs": inputs,
                   "per_forward": per_forward, "ours_us": min(ours_us),
                   "aten_us": min(aten_us), "speedup": min(aten_us) / min(ours_us)}
            vector = ""
            if with_amx:
                row["vdpbf16ps_us"] = min(vector_us)
                vector = f"  (vdpbf16ps {min(vector_us):9.1f} us)"
            results.append(row)
            print(f"rows {rows:4d} {name:15s} {outputs:6d}x{inputs:<5d} ours "
                  f"{min(ours_us):9.1f} us  ATen {min(aten_us):9.1f} us  "
                  f"{min(aten_us) / min(ours_us):.2f}x{vector}", flush=True)
    return results


def forwards(results: list[dict]) -> dict[int, dict]:
    totals: dict[int, dict] = {}
    for row in results:
        total = totals.setdefault(row["rows"], {"ours_ms": 0.0, "aten_ms": 0.0})
        total["ours_ms"] += row["ours_us"] * row["per_forward"] / 1000
        total["aten_ms"] += row["aten_us"] * row["per_forward"] / 1000
        if "vdpbf16ps_us" in row:
            total["vdpbf16ps_ms"] = total.get("vdpbf16ps_ms", 0.0) + \
                row["vdpbf16ps_us"] * row["per_forward"] / 1000
    for total in totals.values():
        total["speedup"] = total["aten_ms"] / total["ours_ms"]
        if "vdpbf16ps_ms" in total:
            total["amx_speedup"] = total["vdpbf16ps_ms"] / total["ours_ms"]
    return totals


def plot(totals: dict[int, dict], path: Path, instructions: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(totals)
    figure, axis = plt.subplots(figsize=(7, 4))
    positions = range(len(rows))
    bars = [("aten_ms", "ATen packed int4 (Q8_0 as two int4 planes)")]
    if all("vdpbf16ps_ms" in totals[r] for r in rows):
        bars.append(("vdpbf16ps_ms", "Slipstream (avx512_bf16)"))
    bars.append(("ours_ms", f"Slipstream ({instructions})"))
    width = 0.8 / len(bars)
    for i, (key, label) in enumerate(bars):
        offset = (i - (len(bars) - 1) / 2) * width
        axis.bar([p + offset for p in positions], [totals[r][key] for r in rows], width,
                 label=label)
    for p, r in zip(positions, rows):  # over ATen's kernel, above the last bar
        axis.annotate(f"{totals[r]['speedup']:.2f}x", (p + 0.4 - width / 2, totals[r]["ours_ms"]),
                      ha="center", va="bottom", fontsize=8)
    axis.set_xticks(list(positions), [f"{r} row{'s' if r > 1 else ''}" for r in rows])
    axis.set_yscale("log")
    axis.set_ylabel("matmul time of one forward (ms, log)")
    axis.set_title("SmolLM2-135M's quantized projections on this CPU")
    axis.legend(fontsize=8, title="labels: Slipstream over ATen", title_fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/cpu-quant"))
    parser.add_argument("--rows", default="1,2,8,32,256", help="activation rows, comma-separated")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--trials", type=int, default=5, help="interleaved runs per kernel")
    args = parser.parse_args(argv)
    if not native_cpu_kernels():
        parser.error("Slipstream's kernels do not run here (no AVX-512, no C++ compiler, "
                     "or SLIPSTREAM_CPU_QUANT_KERNEL=aten)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = measure([int(r) for r in args.rows.split(",")], args.trials)
    totals = forwards(results)
    print(f"Slipstream's kernels multiply with {cpu_quant_gemm.instructions()} here")
    for rows, total in sorted(totals.items()):
        vector = (f"; vdpbf16ps {total['vdpbf16ps_ms']:.2f} ms, AMX "
                  f"{total['amx_speedup']:.2f}x that" if "vdpbf16ps_ms" in total else "")
        print(f"one forward at {rows} rows: ours {total['ours_ms']:.2f} ms, ATen "
              f"{total['aten_ms']:.2f} ms: {total['speedup']:.2f}x{vector}")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"settings": {"threads": args.threads, "trials": args.trials,
                           "machine": platform.processor() or platform.machine(),
                           "cpu": cpp_build.cpu_model(),
                           "torch": torch.__version__,
                           "instructions": cpu_quant_gemm.instructions(),
                           "load_average": os.getloadavg()},
              "shapes": results, "forward": {str(r): t for r, t in totals.items()}}
    (args.out / "cpu_quant.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(totals, args.out / "cpu_quant.png", cpu_quant_gemm.instructions())
    print(f"wrote {args.out / 'cpu_quant.json'} and {args.out / 'cpu_quant.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
