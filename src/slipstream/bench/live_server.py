"""A live `slipstream serve` process for benchmarks: start it, load it, read its metrics.

    LiveServer(model, profile) --subprocess--> slipstream serve (CPU, own port, no control API)
        run_load(requests) --HTTP/SSE--> bench serve metrics (vLLM definitions)
        scrape() --GET /metrics--> histogram sums and counts (per-iteration engine metrics)

Used by ``sim_vs_live``; the server runs in its own process exactly as in production, so what
it measures includes the HTTP/SSE work that shares the process (and its GIL) with the engine.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from slipstream.bench.local_process import stop, wait_ready
from slipstream.bench.serve_bench import LoadConfig, run_load
from slipstream.bench.serve_metrics import serving_metrics
from slipstream.agent.parallel.launch import free_port
from slipstream.sim.traces import TraceRequest

MODEL_NAME = "sim-vs-live"
LATENCY_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


@dataclass(frozen=True)
class ServerSettings:
    model_dir: Path
    profile_dir: Path
    num_kv_blocks: int
    torch_threads: int
    policy: str = "lars"
    target_batch_time_ms: float = 50.0



class LiveServer:
    """``with LiveServer(settings, log) as server:`` a healthy server; stopped on exit."""

    def __init__(self, settings: ServerSettings, log: Path, startup_timeout_s: float = 300) -> None:
        self.settings = settings
        self.log = log
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LiveServer:
        settings = self.settings
        env = {k: v for k, v in os.environ.items() if k != "POD_IP"}
        env["OMP_NUM_THREADS"] = str(settings.torch_threads)
        command = [sys.executable, "-m", "slipstream.cli", "serve", "--device", "cpu",
                   "--model", str(settings.model_dir), "--port", str(self.port),
                   "--control-port", "0", "--profile", str(settings.profile_dir),
                   "--num-kv-blocks", str(settings.num_kv_blocks),
                   "--served-model-name", MODEL_NAME, "--log-level", "warning",
                   "--policy", settings.policy,
                   "--target-batch-time-ms", str(settings.target_batch_time_ms)]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env=env)
        try:
            wait_ready(f"{self.base_url}/health", self.process, self.log,
                       self.startup_timeout_s)
        except RuntimeError:
            stop(self.process)
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.process is not None:
            stop(self.process)

    def run_load(self, requests: list[TraceRequest]) -> dict:
        """Replay ``requests`` with ``bench serve``'s load generator; p50/p99 TTFT and TPOT."""
        config = LoadConfig(base_url=f"{self.base_url}/v1", model=MODEL_NAME,
                            max_token_id=4000, progress=False)
        timings, duration_s = asyncio.run(run_load(requests, config))
        metrics = serving_metrics(timings, duration_s, percentiles=(50.0, 99.0))
        return {"ttft_p50_ms": metrics["p50_ttft_ms"], "ttft_p99_ms": metrics["p99_ttft_ms"],
                "tpot_p50_ms": metrics["p50_tpot_ms"], "tpot_p99_ms": metrics["p99_tpot_ms"],
                "completed": metrics["completed"], "failed": metrics["failed"],
                "duration_s": duration_s}

    def scrape(self) -> dict[str, float]:
        """Every sample of ``/metrics``, keyed as exposed: ``name`` or ``name{labels}``."""
        samples: dict[str, float] = {}
        for line in httpx.get(f"{self.base_url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples
