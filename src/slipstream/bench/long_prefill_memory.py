"""How much memory the server grows by while one long prompt is prefilled in fixed chunks
(``make bench-long-prefill-memory``; the goal comes from the long-context issue).

    slipstream serve --model tiny (CPU, engine in its own process, --no-profile,
                                   --max-batched-tokens 8192: a 32K prompt is 4 chunks)
        -> resident memory of the server's process tree once it is ready: the start-up level
    POST /v1/completions: one 32K-token token-id prompt, max_tokens 1
        -> resident memory of the tree every few ms until the answer: the peak
    -> growth = peak - start-up level, beside the KV cache bytes the prompt needs (growth that
       no attention implementation avoids) and the goal of at most +512 MB
    -> results/long-prefill-memory/long_prefill_memory.json and .png

The KV cache is sized to the prompt (``--num-kv-blocks``), so what grows beyond it is the
prefill's working memory: attention masks, scores and gathered keys/values per chunk. Each
process's kernel high-water mark (VmHWM) is recorded too, which catches a spike shorter than
the sampling period. Usage::

    python -m slipstream.bench.long_prefill_memory --out results/long-prefill-memory
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from slipstream.bench.local_process import running
from slipstream.agent.engine.models.tiny_model import PRESETS, TinyModelPreset
from slipstream.agent.parallel.launch import free_port

MB = 1e6  # the figures are in decimal megabytes
GOAL_GROWTH_MB = 512.0
BLOCK_TOKENS = 16  # the engine's KV block size
# Blocks beyond the prompt's own: its one output token and the engine's spare blocks.
SPARE_KV_BLOCKS = 16
SAMPLE_PERIOD_S = 0.02  # a chunk's attention runs for hundreds of ms on a CPU
MODEL_NAME = "long-prefill"


@dataclass(frozen=True)
class Sample:
    t_s: float  # since the request was sent
    rss_bytes: int  # the process tree's resident memory


def kv_cache_bytes(preset: TinyModelPreset, tokens: int, dtype_bytes: int = 4) -> int:
    """Bytes of paged KV cache ``tokens`` tokens occupy: keys and values of every layer, in
    whole blocks. The tiny model is float32."""
    blocks = -(-tokens // BLOCK_TOKENS)
    per_token = (2 * preset.num_hidden_layers * preset.num_key_value_heads * preset.head_dim
                 * dtype_bytes)
    return blocks * BLOCK_TOKENS * per_token


def growth_summary(baseline_bytes: int, samples: list[Sample], kv_bytes: int,
                   goal_mb: float = GOAL_GROWTH_MB) -> dict[str, Any]:
    """The figures the report leads with, from the start-up level and the samples taken
    while the prompt was prefilled."""
    if not samples:
        raise ValueError("no memory sample was taken while the prompt ran")
    peak = max(sample.rss_bytes for sample in samples)
    growth_mb = (peak - baseline_bytes) / MB
    return {"startup_rss_mb": baseline_bytes / MB, "peak_rss_mb": peak / MB,
            "growth_mb": growth_mb, "kv_cache_mb_needed": kv_bytes / MB,
            "growth_beyond_kv_mb": growth_mb - kv_bytes / MB, "goal_growth_mb": goal_mb,
            "meets_goal": growth_mb <= goal_mb}


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants (a process that exits between
    listing and reading counts as 0)."""
    import psutil  # dev extra, as the other live benchmarks

    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass
    return total


def high_water_marks(pid: int) -> dict[str, int]:
    """VmHWM (peak resident bytes since the process started) of each process in the tree,
    keyed by pid and command name."""
    import psutil

    root = psutil.Process(pid)
    marks: dict[str, int] = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
            name = process.name()
        except (OSError, psutil.Error):
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                marks[f"{process.pid}:{name}"] = int(line.split()[1]) * 1024
    return marks


def settle(pid: int, quiet_s: float = 2.0, timeout_s: float = 30.0) -> int:
    """The tree's resident memory once it stopped changing by more than 1 MB for
    ``quiet_s``: the engine core allocates its caches after the server already answers."""
    deadline = time.monotonic() + timeout_s
    last = tree_rss_bytes(pid)
    steady_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = tree_rss_bytes(pid)
        if abs(now - last) > MB:
            steady_since = time.monotonic()
        last = now
        if time.monotonic() - steady_since >= quiet_s:
            break
    return last


def prefill_once(base_url: str, pid: int, prompt: list[int],
                 timeout_s: float) -> tuple[list[Sample], float, dict]:
    """Send the prompt (max_tokens 1) and sample the tree's memory until it is answered."""
    samples: list[Sample] = []
    done = threading.Event()
    started = time.monotonic()

    def sample_until_done() -> None:
        while not done.is_set():
            samples.append(Sample(time.monotonic() - started, tree_rss_bytes(pid)))
            done.wait(SAMPLE_PERIOD_S)

    sampler = threading.Thread(target=sample_until_done, daemon=True)
    sampler.start()
    try:
        reply = httpx.post(f"{base_url}/v1/completions", timeout=timeout_s, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0})
        reply.raise_for_status()
    finally:
        done.set()
        sampler.join()
    return samples, time.monotonic() - started, reply.json().get("usage", {})


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    max_model_len = args.prompt_tokens + 1
    num_blocks = -(-max_model_len // BLOCK_TOKENS) + SPARE_KV_BLOCKS
    return [sys.executable, "-m", "slipstream.cli", "serve", "--device", "cpu",
            "--model", "tiny", "--served-model-name", MODEL_NAME, "--port", str(port),
            "--control-port", "0", "--log-level", "warning", "--no-profile",
            "--max-batched-tokens", str(args.chunk_tokens), "--max-model-len",
            str(max_model_len), "--num-kv-blocks", str(num_blocks)]


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    times = [t for t, _ in report["samples"]]
    memory = [rss / MB for _, rss in report["samples"]]
    startup = summary["startup_rss_mb"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(times, memory, label="server process tree RSS")
    ax.axhline(startup, color="grey", linestyle=":", label=f"start-up level ({startup:,.0f} MB)")
    ax.axhline(startup + summary["kv_cache_mb_needed"], color="tab:green", linestyle="--",
               label=f"+ the prompt's KV cache ({summary['kv_cache_mb_needed']:,.0f} MB)")
    ax.axhline(startup + summary["goal_growth_mb"], color="tab:red", linestyle="--",
               label=f"goal: +{summary['goal_growth_mb']:,.0f} MB")
    ax.set(xlabel="seconds since the request", ylabel="resident memory (MB)",
           title=f"{report['prompt_tokens']:,}-token prompt in {report['chunk_tokens']:,}-token "
                 f"chunks ({report['label'] or 'CPU, tiny model'}): "
                 f"+{summary['growth_mb']:,.0f} MB")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/long-prefill-memory"))
    parser.add_argument("--prompt-tokens", type=int, default=32_768)
    parser.add_argument("--chunk-tokens", type=int, default=8192,
                        help="the server's --max-batched-tokens: the prefill chunk")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--label", default="", help="names the run in the plot and the JSON "
                                                    "(e.g. the commit measured)")
    args = parser.parse_args(argv)
    if args.prompt_tokens <= args.chunk_tokens:
        parser.error("the prompt must be longer than one chunk to be prefilled in chunks")
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = serve_command(args, port)
    env = {k: v for k, v in os.environ.items() if k != "POD_IP"}
    # Token ids above the byte tokens and below the special ones; any fixed pattern will do.
    prompt = [256 + index % 3000 for index in range(args.prompt_tokens)]
    with running(command, args.out / "serve.log", f"http://127.0.0.1:{port}/health",
                 env=env, timeout_s=300) as process:
        baseline = settle(process.pid)
        marks_before = high_water_marks(process.pid)
        samples, elapsed_s, usage = prefill_once(f"http://127.0.0.1:{port}", process.pid,
                                                 prompt, args.timeout_s)
        marks_after = high_water_marks(process.pid)
    summary = growth_summary(baseline, samples, kv_cache_bytes(PRESETS["tiny"],
                                                               args.prompt_tokens + 1))
    report = {"label": args.label, "machine": platform.platform(), "cpus": os.cpu_count(),
              "command": command[1:], "prompt_tokens": args.prompt_tokens,
              "chunk_tokens": args.chunk_tokens, "usage": usage, "elapsed_s": elapsed_s,
              "summary": summary, "vm_hwm_bytes_before": marks_before,
              "vm_hwm_bytes_after": marks_after,
              "samples": [[s.t_s, s.rss_bytes] for s in samples]}
    (args.out / "long_prefill_memory.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "long_prefill_memory.png")
    print(json.dumps({"label": args.label, "elapsed_s": round(elapsed_s, 1), **summary,
                      "vm_hwm_mb_after": {k: v / MB for k, v in marks_after.items()}},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
