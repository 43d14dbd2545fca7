"""Does the simulator predict the live engine? One workload, measured and simulated.

    slipstream profile --out PROFILE          (the engine's CPU op times, fastest-of-N)
    slipstream serve --profile PROFILE        (live engine, time-budget packer, LARS)
      calibration load (another seed) --> /metrics: mean schedule() time per iteration
      measured load  --> bench serve (vLLM metric definitions)   --> TTFT/TPOT p50, p99
    simulate(same requests, same profile, same scheduler config) --> TTFT/TPOT p50, p99

The profile times the model's layers and the runner's fixed cost per iteration; it does not
contain the time the scheduler itself takes each iteration, which on a small CPU model is a
real share of an iteration. The simulator is therefore run twice: with the profile alone,
and with ``host_overhead_ms`` set to the mean ``schedule()`` time the server reported during
the calibration load (a different workload seed from the one compared). Writes
``sim_vs_live.json`` and ``sim_vs_live.png``::

    python -m slipstream.agent.bench.sim_vs_live --out results/sim-vs-live
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np

from slipstream.agent.bench.serve_bench import LoadConfig, run_load
from slipstream.agent.bench.serve_metrics import serving_metrics
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.predictor import RuntimePredictor
from slipstream.agent.sim.instance import InstanceConfig
from slipstream.agent.sim.report import summarize
from slipstream.agent.sim.simulator import SimConfig, simulate
from slipstream.agent.sim.traces import TraceRequest
from slipstream.agent.sim.workloads import WorkloadSpec, build_workload

NUM_KV_BLOCKS = 4096
MODEL_NAME = "sim-vs-live"


def workload(seed: int, count: int, qps: float, scale: float) -> list[TraceRequest]:
    requests = build_workload(WorkloadSpec(lengths=(("sharegpt", 1.0),), qps=qps,
                                           num_requests=count, seed=seed))
    return [replace(r, prompt_tokens=max(4, min(1024, round(r.prompt_tokens * scale))),
                    output_tokens=max(2, min(64, round(r.output_tokens * scale))))
            for r in requests]


def simulated(requests: list[TraceRequest], profile: Path, host_overhead_ms: float) -> dict:
    model = RuntimePredictor.from_directory(profile, cache_dir=None)
    config = SimConfig(scheduler=SchedulerConfig(policy="lars"),
                       instance=InstanceConfig(num_kv_blocks=NUM_KV_BLOCKS,
                                               host_overhead_ms=host_overhead_ms),
                       long_prompt_tokens=1 << 30)
    result = simulate(requests, config, model)
    summary = summarize(result, 1 << 30, None)["overall"]
    busy = result.busy_s[0] / max(result.end_s, 1e-9)
    return {"ttft_p50_ms": summary["ttft_s"]["p50"] * 1000, "ttft_p99_ms": summary["ttft_s"]["p99"] * 1000,
            "tpot_p50_ms": summary["tpot_ms"]["p50"], "tpot_p99_ms": summary["tpot_ms"]["p99"],
            "busy_fraction": busy}


def start_server(profile: Path, port: int, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "POD_IP"}
    command = [sys.executable, "-m", "slipstream.cli", "serve", "--device", "cpu", "--port",
               str(port), "--profile", str(profile), "--num-kv-blocks", str(NUM_KV_BLOCKS),
               "--served-model-name", MODEL_NAME, "--log-level", "warning", "--policy", "lars"]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    process.terminate()
    raise RuntimeError("server did not become healthy")


def histogram_sum_count(base_url: str, name: str) -> tuple[float, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def measured(requests: list[TraceRequest], base_url: str) -> dict:
    config = LoadConfig(base_url=f"{base_url}/v1", model=MODEL_NAME, max_token_id=4000,
                        progress=False)
    timings, duration_s = asyncio.run(run_load(requests, config))
    metrics = serving_metrics(timings, duration_s, percentiles=(50.0, 99.0))
    return {"ttft_p50_ms": metrics["p50_ttft_ms"], "ttft_p99_ms": metrics["p99_ttft_ms"],
            "tpot_p50_ms": metrics["p50_tpot_ms"], "tpot_p99_ms": metrics["p99_tpot_ms"],
            "completed": metrics["completed"], "failed": metrics["failed"]}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"]
    runs = ["live", "sim_profile_only", "sim_with_host_overhead"]
    x = np.arange(len(keys))
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, run in enumerate(runs):
        ax.bar(x + (i - 1) * 0.27, [results[run][k] for k in keys], 0.27, label=run)
    ax.set_xticks(x, [k.replace("_ms", "") for k in keys])
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"live CPU engine vs simulator ({results['qps']:.1f} QPS, "
                 f"load avg {results['load_average'][0]:.1f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", type=Path, default=None, help="reuse a profile directory")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--utilization", type=float, default=0.6,
                        help="target engine busy fraction, set through the simulator")
    parser.add_argument("--length-scale", type=float, default=0.1)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    profile = args.profile or args.out / "cpu-profile"
    if args.profile is None:
        subprocess.run([sys.executable, "-m", "slipstream.cli", "profile", "--device", "cpu",
                        "--out", str(profile)], check=True)
    # Pick the rate from the simulator: utilization scales with the rate.
    probe = simulated(workload(1, args.num_requests, 1.0, args.length_scale), profile, 0.0)
    qps = args.utilization / probe["busy_fraction"]
    calibration = workload(1, args.num_requests // 2, qps, args.length_scale)
    compared = workload(2, args.num_requests, qps, args.length_scale)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    server = start_server(profile, port, args.out / "serve.log")
    try:
        measured(calibration, base_url)
        schedule_s, iterations = histogram_sum_count(base_url, "slipstream_schedule_time_seconds")
        host_overhead_ms = 1000.0 * schedule_s / max(iterations, 1.0)
        load_before = os.getloadavg()
        live = measured(compared, base_url)
    finally:
        server.terminate()
        server.wait(timeout=30)
    results = {
        "qps": qps, "num_requests": len(compared), "load_average": list(load_before),
        "host_overhead_ms": host_overhead_ms, "live": live,
        "sim_profile_only": simulated(compared, profile, 0.0),
        "sim_with_host_overhead": simulated(compared, profile, host_overhead_ms),
    }
    for run in ("sim_profile_only", "sim_with_host_overhead"):
        results[f"{run}_error"] = {k: results[run][k] / live[k] - 1.0
                                   for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                                             "tpot_p99_ms")}
    (args.out / "sim_vs_live.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / "sim_vs_live.png")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
