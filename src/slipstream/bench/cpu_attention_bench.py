"""The compiled CPU decode steps' attention operator (``slipstream::cpu_decode_attention``,
``kernels/cpu_decode_attention.cpp``) at the default model's shape, its own kernel against
its SDPA path, side by side in one run (``make bench-cpu-attention``).

For each context length and row count it calls the operator for every layer of a 30-layer
cache (SmolLM2-135M: 9 query heads, 3 KV heads of 64), as one decode step does, and reports
the best of ``--trials`` per-layer means for each path, interleaved so that a busy moment hits
both. The rows' blocks are scattered, as they are in a served cache. ``GB/s`` is the KV bytes
a call reads (each row's keys and values) over its time: a short context on two cores is
bound by that read, not by the arithmetic. Writes ``cpu_attention.json`` and
``cpu_attention.png`` under ``--out``.

Usage::

    python -m slipstream.bench.cpu_attention_bench --out results/cpu-attention
    python -m slipstream.bench.cpu_attention_bench --contexts 96 --rows 1,8 --trials 9
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir
from slipstream.kernels import cpu_static_decode
from slipstream.kernels.attention import BLOCK_START, KV_LEN, QUERY_LEN, SEQ_INFO_COLUMNS

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 30, 9, 3, 64, 16


def inputs(rows: int, context: int, generator: torch.Generator) -> tuple:
    """One step's arguments after the cache: rows of ``context`` tokens in scattered blocks."""
    per_row = -(-context // BLOCK)
    total = rows * per_row
    blocks = torch.randperm(total, generator=generator)
    seq_info = torch.zeros(rows, SEQ_INFO_COLUMNS, dtype=torch.int64)
    slots = torch.empty(rows, dtype=torch.int64)
    for row in range(rows):
        seq_info[row, QUERY_LEN], seq_info[row, KV_LEN] = 1, context
        seq_info[row, BLOCK_START] = row * per_row
        last = int(blocks[row * per_row + (context - 1) // BLOCK])
        slots[row] = last * BLOCK + (context - 1) % BLOCK
    query = torch.randn(rows, HEADS, DIM, generator=generator)
    key = torch.randn(rows, KV_HEADS, DIM, generator=generator)
    value = torch.randn(rows, KV_HEADS, DIM, generator=generator)
    return (query, key, value), slots, seq_info, blocks, total


def time_step(arguments: tuple, slots: torch.Tensor, seq_info: torch.Tensor,
              blocks: torch.Tensor, repeats: int) -> float:
    """Mean seconds per layer over ``repeats`` passes through every layer."""
    operator = torch.ops.slipstream.cpu_decode_attention
    query, key, value = arguments
    started = time.perf_counter()
    for _ in range(repeats):
        for layer in range(LAYERS):
            operator(query, key, value, layer, slots, seq_info, blocks, DIM ** -0.5)
    return (time.perf_counter() - started) / repeats / LAYERS


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for rows in sorted({r["rows"] for r in results}):
        mine = [r for r in results if r["rows"] == rows]
        contexts = [r["context"] for r in mine]
        axis.plot(contexts, [r["direct_us"] for r in mine], marker="o",
                  label=f"{rows} row{'s' if rows > 1 else ''}: Slipstream's kernel")
        axis.plot(contexts, [r["sdpa_us"] for r in mine], marker="x", linestyle="--",
                  label=f"{rows} row{'s' if rows > 1 else ''}: through SDPA")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("cached tokens per row")
    axis.set_ylabel("us per layer (lower is better)")
    axis.set_title("CPU decode attention, SmolLM2-135M's heads, per layer")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="96,512,2048",
                        help="comma-separated cached tokens per row (the kernel's own path "
                             "serves up to 4,096)")
    parser.add_argument("--rows", default="1,8", help="comma-separated decode rows per call")
    parser.add_argument("--trials", type=int, default=5,
                        help="timed passes per path; each path's best is kept")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=None,
                        help="write cpu_attention.json and cpu_attention.png here")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    row_counts = [int(r) for r in args.rows.split(",")]
    if any(c < 1 or c > 4096 for c in contexts) or any(r < 1 for r in row_counts):
        parser.error("--contexts takes 1 to 4,096 tokens and --rows positive counts")
    torch.set_num_threads(args.threads)
    built = cpu_static_decode.use_implementation(
        slipstream_cache_dir() / "cpp" / "decode_attention")
    if built != cpu_static_decode.NATIVE:
        parser.error("the C++ decode attention kernel did not build here (it needs a C++ "
                     "compiler, as inductor does)")
    generator = torch.Generator().manual_seed(0)
    results = []
    for rows in row_counts:
        for context in contexts:
            arguments, slots, seq_info, blocks, total = inputs(rows, context, generator)
            caches = [(torch.randn(total, BLOCK, KV_HEADS, DIM, generator=generator),
                       torch.randn(total, BLOCK, KV_HEADS, DIM, generator=generator))
                      for _ in range(LAYERS)]
            best = {"direct": float("inf"), "sdpa": float("inf")}
            with cpu_static_decode.kv_caches_in_use(caches):
                for _ in range(args.trials):
                    for path in best:
                        torch.ops.slipstream_cpu.set_force_sdpa(path == "sdpa")
                        try:
                            time_step(arguments, slots, seq_info, blocks, 1)  # warm
                            best[path] = min(best[path], time_step(arguments, slots, seq_info,
                                                                   blocks, 3))
                        finally:
                            torch.ops.slipstream_cpu.set_force_sdpa(False)
            kv_bytes = rows * context * KV_HEADS * DIM * 4 * 2
            row = {"rows": rows, "context": context, "direct_us": 1e6 * best["direct"],
                   "sdpa_us": 1e6 * best["sdpa"], "sdpa_over_direct": best["sdpa"] / best["direct"],
                   "direct_gb_per_s": kv_bytes / best["direct"] / 1e9,
                   "step_ms_direct": 1e3 * best["direct"] * LAYERS}
            results.append(row)
            print(f"{rows:3d} row(s), {context:5d} tokens: kernel {row['direct_us']:8.1f} us "
                  f"({row['direct_gb_per_s']:5.1f} GB/s of KV), SDPA {row['sdpa_us']:8.1f} us, "
                  f"SDPA / kernel {row['sdpa_over_direct']:.2f}; "
                  f"{row['step_ms_direct']:.2f} ms a {LAYERS}-layer step")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"shape": {"layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM,
                            "block": BLOCK},
                  "threads": args.threads, "trials": args.trials,
                  "machine": f"{platform.processor() or platform.machine()} x {os.cpu_count()}",
                  "load_average": os.getloadavg(), "results": results}
        (args.out / "cpu_attention.json").write_text(json.dumps(report, indent=2) + "\n")
        plot(results, args.out / "cpu_attention.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
