"""Does the simulator predict the live engine? One workload, measured and simulated.

    slipstream profile (cached per model)  --> tables + runner and engine-host overheads
    simulate(seed 1 workload) at trial rates --> the rate that keeps the engine ~60% busy
    slipstream serve --profile (LARS, one torch thread, own process)
      idle probe: short requests one at a time --> the request path's TTFT outside the engine
      calibration load (seed 1) --> /metrics: actual vs predicted execution per iteration
      measured load (seed 2)    --> bench serve (vLLM metric definitions) --> TTFT/TPOT p50, p99
    simulate(seed 2 workload, same profile, same scheduler config)       --> TTFT/TPOT p50, p99

The simulator runs twice on the measured workload. "profile only" is the prediction: the
profile holds the model's op tables, the runner's overhead and the engine's own host work per
step (scheduling, output processing), all measured offline by ``slipstream profile``. "with
serving costs" adds what the live server costs beyond the engine (``ServingCosts``), measured
on other workloads, never the compared one: per iteration, how much longer the server's
executions took than the profile predicts during the calibration load (the HTTP/SSE work and
the load generator share the CPU, and the engine's GIL); per request, the idle probe's TTFT
beyond the simulated one. Writes ``sim_vs_live_<preset>.json`` and ``.png`` under ``--out``::

    python -m slipstream.bench.sim_vs_live --model-preset tiny --out results/sim-vs-live
    python -m slipstream.bench.sim_vs_live --model-preset 100m --out results/sim-vs-live
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from slipstream.bench.live_server import LATENCY_KEYS, LiveServer, ServerSettings
from slipstream.agent.engine.models.tiny_model import (ensure_default_model, slipstream_cache_dir,
                                                       write_tiny_model)
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.predictor import RuntimePredictor
from slipstream.agent.scheduler.profile_table import ProfileMeta
from slipstream.sim.instance import InstanceConfig
from slipstream.sim.report import summarize
from slipstream.sim.simulator import SimConfig, simulate
from slipstream.sim.traces import TraceRequest
from slipstream.sim.workloads import WorkloadSpec, build_workload

NUM_KV_BLOCKS = 4096
PROBE_REQUESTS = 20
RUNS = ("live", "sim_profile_only", "sim_with_serving_costs")
# Bump when the profiler's method changes, so cached profiles are measured again.
PROFILE_METHOD_VERSION = "8-warm-greedy-calibration-prefill-term"


@dataclass(frozen=True)
class LivePreset:
    """One model and the workload sized for it (ShareGPT lengths scaled down)."""

    model_preset: str  # `slipstream make-tiny-model --preset`
    num_requests: int
    length_scale: float
    max_prompt_tokens: int
    max_output_tokens: int
    profile_grid: str  # `slipstream profile --grid`
    target_batch_time_ms: float  # the packer's budget, `slipstream serve --target-batch-time-ms`


PRESETS = {
    "tiny": LivePreset("tiny", 400, 0.1, 1024, 64, "full", 50.0),
    # 30-100 ms per step on one CPU core: fewer, shorter requests keep a run to minutes, and
    # a budget that fits a prefill chunk next to the decodes (50 ms barely fits 32 tokens).
    "100m": LivePreset("100m", 160, 0.1, 512, 32, "small", 250.0),
}


def model_dir_for(preset: str) -> Path:
    if preset == "tiny":
        return ensure_default_model()
    model_dir = slipstream_cache_dir() / "models" / f"bench-{preset}-seed0"
    if not (model_dir / "config.json").is_file():
        write_tiny_model(model_dir, preset, seed=0)
    return model_dir


def cached_profile(model_dir: Path, grid: str, torch_threads: int, refresh: bool) -> Path:
    """``slipstream profile`` of ``model_dir``, kept under the cache and keyed by the model's
    files, the grid, the thread count and the profiler's method."""
    weights = sorted(model_dir.glob("*.safetensors"))
    key = hashlib.sha256(json.dumps([
        (model_dir / "config.json").read_text(), [(w.name, w.stat().st_size) for w in weights],
        grid, torch_threads, PROFILE_METHOD_VERSION]).encode()).hexdigest()[:12]
    target = slipstream_cache_dir() / "profiles" / f"cpu-{model_dir.name}-{key}"
    if (target / "profile.json").is_file() and not refresh:
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(torch_threads)}
    subprocess.run([sys.executable, "-m", "slipstream.cli", "profile", "--device", "cpu",
                    "--model", str(model_dir), "--grid", grid, "--out", str(staging)],
                   check=True, env=env)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def workload(preset: LivePreset, seed: int, count: int, qps: float) -> list[TraceRequest]:
    requests = build_workload(WorkloadSpec(lengths=(("sharegpt", 1.0),), qps=qps,
                                           num_requests=count, seed=seed))
    scale = preset.length_scale
    return [replace(r, prompt_tokens=max(4, min(preset.max_prompt_tokens,
                                                round(r.prompt_tokens * scale))),
                    output_tokens=max(2, min(preset.max_output_tokens,
                                             round(r.output_tokens * scale))))
            for r in requests]


@dataclass(frozen=True)
class ServingCosts:
    """What the live server adds to the engine, measured on workloads other than the one
    compared: per iteration (HTTP/SSE work and the load generator sharing the CPU and the
    GIL with the engine thread) and per request (the HTTP request path to the engine and
    the first token's way back, a constant shift of TTFT)."""

    per_iteration_ms: float = 0.0
    request_path_ms: float = 0.0


def simulated(requests: list[TraceRequest], profile: Path, preset: LivePreset,
              costs: ServingCosts = ServingCosts()) -> dict:
    model = RuntimePredictor.from_directory(profile, cache_dir=None)
    config = SimConfig(scheduler=SchedulerConfig(policy="lars",
                                                 target_batch_time_ms=preset.target_batch_time_ms),
                       instance=InstanceConfig(num_kv_blocks=NUM_KV_BLOCKS,
                                               host_overhead_ms=costs.per_iteration_ms),
                       long_prompt_tokens=1 << 30)
    result = simulate(requests, config, model)
    summary = summarize(result, 1 << 30, None)["overall"]
    return {"ttft_p50_ms": summary["ttft_s"]["p50"] * 1000 + costs.request_path_ms,
            "ttft_p99_ms": summary["ttft_s"]["p99"] * 1000 + costs.request_path_ms,
            "tpot_p50_ms": summary["tpot_ms"]["p50"], "tpot_p99_ms": summary["tpot_ms"]["p99"],
            "busy_fraction": result.busy_s[0] / max(result.end_s, 1e-9)}


def rate_for_utilization(preset: LivePreset, profile: Path, count: int, target: float) -> float:
    """The arrival rate at which the simulated engine is ``target`` busy on a seed-1 workload
    (fixed-point iteration: busy time per request shrinks a little as batches grow)."""
    qps = 1.0
    for _ in range(4):
        busy = simulated(workload(preset, 1, count, qps), profile, preset)["busy_fraction"]
        qps *= target / max(busy, 1e-6)
    return qps


def request_path_ms(server: LiveServer, preset: LivePreset, profile: Path) -> float:
    """Live minus simulated median TTFT of short requests sent one at a time to the idle
    server: the time a request spends outside the engine on its way in and out."""
    probe = [TraceRequest(arrival_s=0.5 * i, prompt_tokens=16, output_tokens=4)
             for i in range(PROBE_REQUESTS)]
    server.run_load(probe[:3])  # warm-up: first calls into torch and the HTTP stack
    live = server.run_load(probe)["ttft_p50_ms"]
    return live - simulated(probe, profile, preset)["ttft_p50_ms"]


def serving_overhead_ms(before: dict[str, float], after: dict[str, float],
                        meta: ProfileMeta) -> float:
    """Mean extra execution time per iteration of the live server over the profile's
    prediction of the runner's share of those same batches, from two ``/metrics`` scrapes."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    iterations = delta("slipstream_batch_time_actual_seconds_count")
    if iterations <= 0:
        raise RuntimeError("the calibration load ran no iterations")
    sequences = (delta("slipstream_prefill_chunk_tokens_count")
                 + delta('slipstream_scheduled_tokens_total{phase="decode"}'))
    predicted_ms = 1000.0 * delta("slipstream_batch_time_predicted_seconds_sum")
    # The prediction covers the whole step; the metric times only the runner's execution.
    predicted_ms -= meta.host_overhead_ms * iterations + meta.host_per_sequence_ms * sequences
    actual_ms = 1000.0 * delta("slipstream_batch_time_actual_seconds_sum")
    return max(0.0, (actual_ms - predicted_ms) / iterations)


def wait_for_quiet_machine(max_load: float, patience_s: float) -> tuple[float, ...]:
    """Wait until the 1-minute load average is at most ``max_load`` (other processes on a
    shared machine slow the live run, not the simulated one); returns the load seen."""
    deadline = time.monotonic() + patience_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(10)
    return os.getloadavg()


def compare(preset: LivePreset, args: argparse.Namespace) -> dict:
    model_dir = model_dir_for(preset.model_preset)
    profile = args.profile or cached_profile(model_dir, preset.profile_grid, args.torch_threads,
                                             args.reprofile)
    meta = RuntimePredictor.from_directory(profile, cache_dir=None).meta
    count = args.num_requests or preset.num_requests
    qps = args.qps or rate_for_utilization(preset, profile, count, args.utilization)
    # Half as many calibration requests: enough iterations for a mean, and minutes saved.
    calibration = workload(preset, 1, max(count // 2, 20), qps)
    compared = workload(preset, 2, count, qps)
    load_before = wait_for_quiet_machine(args.max_load_average, args.load_patience_s)
    settings = ServerSettings(model_dir, profile, NUM_KV_BLOCKS, args.torch_threads,
                              target_batch_time_ms=preset.target_batch_time_ms)
    with LiveServer(settings, args.out / f"serve-{preset.model_preset}.log") as server:
        path_ms = request_path_ms(server, preset, profile)
        before = server.scrape()
        server.run_load(calibration)
        costs = ServingCosts(serving_overhead_ms(before, server.scrape(), meta), path_ms)
        load_start = os.getloadavg()
        live = server.run_load(compared)
        load_end = os.getloadavg()
    results = {
        "model_preset": preset.model_preset, "model": model_dir.name, "profile": profile.name,
        "qps": qps, "num_requests": len(compared), "torch_threads": args.torch_threads,
        "engine_layout": "two processes (the serve default: engine core + API process)",
        "target_batch_time_ms": preset.target_batch_time_ms,
        "load_average_before_server": list(load_before),
        "load_average_measured_run": {"start": list(load_start), "end": list(load_end)},
        "profile_overheads_ms": {"runner_fixed": meta.iteration_overhead_ms,
                                 "runner_per_sequence": meta.per_sequence_overhead_ms,
                                 "host_fixed": meta.host_overhead_ms,
                                 "host_per_sequence": meta.host_per_sequence_ms},
        "serving_costs_ms": dataclasses.asdict(costs), "live": live,
        "sim_profile_only": simulated(compared, profile, preset),
        "sim_with_serving_costs": simulated(compared, profile, preset, costs),
    }
    for run in RUNS[1:]:
        results[f"{run}_error"] = {k: results[run][k] / live[k] - 1.0 for k in LATENCY_KEYS}
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.arange(len(LATENCY_KEYS))
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, run in enumerate(RUNS):
        ax.bar(x + (i - 1) * 0.27, [results[run][k] for k in LATENCY_KEYS], 0.27, label=run)
    ax.set_xticks(x, [k.replace("_ms", "") for k in LATENCY_KEYS])
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend()
    load = results["load_average_measured_run"]["start"][0]
    ax.set_title(f"{results['model_preset']} model: live CPU engine vs simulator "
                 f"({results['qps']:.2f} QPS, load avg {load:.1f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--profile", type=Path, default=None,
                        help="use this profile directory instead of the cached one")
    parser.add_argument("--reprofile", action="store_true", help="measure the profile again")
    parser.add_argument("--num-requests", type=int, default=None, help="default: the preset's")
    parser.add_argument("--qps", type=float, default=None,
                        help="arrival rate; default: the simulator's rate for --utilization")
    parser.add_argument("--utilization", type=float, default=0.6,
                        help="target engine busy fraction, set through the simulator")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="intra-op threads of the profiler and the server (OMP_NUM_THREADS); "
                             "one leaves a core to the HTTP server and the load generator")
    parser.add_argument("--max-load-average", type=float, default=1.0,
                        help="wait for the machine's 1-minute load average to drop to this")
    parser.add_argument("--load-patience-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = compare(PRESETS[args.model_preset], args)
    name = f"sim_vs_live_{args.model_preset}"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / f"{name}.png")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
