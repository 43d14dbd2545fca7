"""One process against two: the live server with the engine on a thread of the HTTP process
(``--single-process``) and with the engine in a process of its own (the default), side by
side in one run, on the same machine and model.

    for each model, for each concurrency N, for each layout (interleaved):
        slipstream serve (CPU) --> N streaming requests at once (bench serve's load generator)
        --> output throughput (tok/s), TTFT p50/p99, TPOT p50/p99

Writes ``server_bench.json`` and ``server_bench.png`` under ``--out``. Usage::

    python -m slipstream.bench.server_bench --out results/server \\
        --models tiny --concurrency 1 64 256 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from slipstream.bench.local_process import stop, wait_ready
from slipstream.bench.serve_bench import LoadConfig, run_load
from slipstream.bench.serve_metrics import serving_metrics
from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir, write_tiny_model
from slipstream.agent.parallel.launch import free_port
from slipstream.sim.traces import TraceRequest

MODEL_NAME = "server-bench"
LAYOUTS = {"one_process": ["--single-process"], "two_processes": ["--engine-process"]}
# Optional third arm: the engine core with one torch thread per CPU instead of the default
# (every CPU but one), to show what the spare CPU is worth to a compute-bound model.
ALL_THREADS = "two_processes_all_threads"
# Optional arm: two API processes in front of the engine core (--api-processes 2).
TWO_API = "two_api_processes"


def layout_args(layout: str) -> list[str]:
    if layout == ALL_THREADS:
        return ["--engine-process", "--engine-threads", str(len(os.sched_getaffinity(0)))]
    if layout == TWO_API:
        return ["--engine-process", "--api-processes", "2"]
    return LAYOUTS[layout]


def wait_listening(pid: int, port: int, count: int, timeout_s: float = 120.0) -> None:
    """Wait until ``count`` processes of the server listen on ``port``: with
    --api-processes the others start once the first one serves."""
    import psutil  # dev extra, as the benchmarks

    def listens(process: psutil.Process) -> bool:
        try:
            return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                       for c in process.net_connections(kind="tcp"))
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        root = psutil.Process(pid)
        if sum(listens(p) for p in [root, *root.children(recursive=True)]) >= count:
            return
        time.sleep(0.25)
    raise RuntimeError(f"fewer than {count} API processes listen on port {port}")


def model_dir(preset: str) -> Path:
    path = slipstream_cache_dir() / "models" / f"bench-{preset}-seed0"
    if not (path / "config.json").is_file():
        write_tiny_model(path, preset, seed=0)
    return path


def measure(preset: str, layout: str, concurrency: int, args: argparse.Namespace,
            log_dir: Path) -> dict[str, Any]:
    port = free_port()
    command = [sys.executable, "-m", "slipstream.cli", "serve", "--device", "cpu",
               "--model", str(model_dir(preset)), "--port", str(port), "--control-port", "0",
               "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs",
               str(args.max_num_seqs), "--served-model-name", MODEL_NAME,
               "--log-level", "warning", "--no-profile", *layout_args(layout)]
    env = {k: v for k, v in os.environ.items() if k != "POD_IP"}
    log = log_dir / f"serve-{preset}-{layout}-{concurrency}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", process, log, 300)
        if layout == TWO_API:
            wait_listening(process.pid, port, 2)
        requests = [TraceRequest(arrival_s=0.0, prompt_tokens=args.prompt_tokens,
                                 output_tokens=args.output_tokens)
                    for _ in range(concurrency)]
        config = LoadConfig(base_url=f"http://127.0.0.1:{port}/v1", model=MODEL_NAME,
                            max_concurrency=concurrency, max_token_id=4000, progress=False,
                            timeout_s=args.timeout_s)
        timings, duration_s = asyncio.run(run_load(requests, config))
    finally:
        stop(process)
    metrics = serving_metrics(timings, duration_s, percentiles=(50.0, 99.0))
    return {"output_tok_per_s": metrics["output_throughput"],
            "ttft_p50_ms": metrics["p50_ttft_ms"], "ttft_p99_ms": metrics["p99_ttft_ms"],
            "tpot_p50_ms": metrics["p50_tpot_ms"], "tpot_p99_ms": metrics["p99_tpot_ms"],
            "completed": metrics["completed"], "failed": metrics["failed"],
            "duration_s": duration_s}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("output_tok_per_s", "output tok/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
            ("ttft_p99_ms", "TTFT p99 (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)"))
    models = list(report["results"])
    fig, axes = plt.subplots(len(models), len(keys), figsize=(4 * len(keys), 3.4 * len(models)),
                             squeeze=False)
    for row, preset in enumerate(models):
        by_n = report["results"][preset]
        levels = sorted(by_n, key=int)
        for col, (key, label) in enumerate(keys):
            ax = axes[row][col]
            for layout in [name for name in (*LAYOUTS, ALL_THREADS, TWO_API)
                           if name in by_n[levels[0]]]:
                ax.plot([int(n) for n in levels], [by_n[n][layout][key] for n in levels],
                        marker="o", label=layout.replace("_", " "))
            ax.set(xscale="log", xlabel="concurrent streams", ylabel=label,
                   title=f"{preset}: {label}")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/server"))
    parser.add_argument("--models", nargs="+", default=["tiny"], help="tiny-model presets")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256, 1000])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="the server's --max-num-seqs (its default)")
    parser.add_argument("--num-kv-blocks", type=int, default=8192)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--all-threads-arm", action="store_true",
                        help="add a third arm: the engine in its own process with one torch "
                             "thread per CPU (--engine-threads) instead of every CPU but one")
    parser.add_argument("--api-processes-arm", action="store_true",
                        help="add an arm: the engine in its own process behind two API "
                             "processes (--api-processes 2)")
    args = parser.parse_args(argv)
    layouts = [*LAYOUTS, *([ALL_THREADS] if args.all_threads_arm else []),
               *([TWO_API] if args.api_processes_arm else [])]
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "machine": platform.platform(), "processor": platform.processor(),
        "cpus": os.cpu_count(), "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "max_num_seqs": args.max_num_seqs,
        "results": {}}
    for preset in args.models:
        report["results"][preset] = {}
        for concurrency in args.concurrency:
            row = {}
            for layout in layouts:  # side by side: one right after the other
                row[layout] = measure(preset, layout, concurrency, args, args.out)
                print(f"{preset} N={concurrency} {layout}: {json.dumps(row[layout])}",
                      flush=True)
            row["throughput_ratio"] = (row["two_processes"]["output_tok_per_s"]
                                       / max(row["one_process"]["output_tok_per_s"], 1e-9))
            if ALL_THREADS in row:
                row["all_threads_throughput_ratio"] = (
                    row[ALL_THREADS]["output_tok_per_s"]
                    / max(row["one_process"]["output_tok_per_s"], 1e-9))
            if TWO_API in row:  # against one API process in front of the same core
                row["api_processes_throughput_ratio"] = (
                    row[TWO_API]["output_tok_per_s"]
                    / max(row["two_processes"]["output_tok_per_s"], 1e-9))
            report["results"][preset][str(concurrency)] = row
            (args.out / "server_bench.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "server_bench.png")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
