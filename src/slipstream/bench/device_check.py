"""``make device-check``: everything the project wants to know from a GPU, in one run that
fits a short lease, written as one JSON file and one plot.

    environment   chip, versions, the measured copy bandwidth and bf16 matmul rate
    gpu_tests     pytest -m gpu on tests/engine (the Triton kernels against torch_ref, graph
                  replay, the no-sync check, FlashInfer when installed)
    serving       `slipstream serve` of Llama-3-8B's body in bf16 (random weights made on the
                  GPU: --load-format dummy), as a user runs it:
                    1 / 32 / 256 streams of 128-token prompts and 128 output tokens
                    one 64K-token prompt alone (time to first token)
                    the convoy (two 64K documents among 8 short chats a second, 30 s) under
                    LARS, then under FCFS on a restarted server
    engine_tier   the rest of tests/engine with the GPU visible, in whatever time is left

The long prompt and the convoys also record ``engine_steps``: the engine's step histograms
(/metrics) over the measurement, so a slow figure says whether the steps, the chunks or the
host were slow; and the runtime profiles measured go to ``runtime-profiles/``.

Each stage runs against a deadline and its result is written as soon as it ends, so a stage
that fails or runs out of time costs only itself. Without CUDA the same code rehearses on the
CPU with the tiny model and small loads (the GPU stages are skipped): CI runs the rehearsal,
so this script cannot rot between the rare runs on a GPU.

Goals (issue "the engine at the GPU's speed") are judged in ``goals``; the chip is named in
the JSON. Usage::

    make device-wheels          # once, here: the wheels a bare GPU machine lacks, into .whl/
    make device-check           # there: installs them, runs this, writes results/device-check/
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from slipstream.bench.device_report import goals, plot, summary
from slipstream.bench.local_process import running
from slipstream.bench.serve_bench import LoadConfig, run_load
from slipstream.bench.serve_metrics import RequestTiming, serving_metrics
from slipstream.sim.traces import TraceRequest
from slipstream.bench.device_probe import environment, run_pytest

MODEL_NAME = "device-check"


@dataclass(frozen=True)
class Scale:
    """The sizes of one run: the GPU's, or the CPU rehearsal's."""

    preset: str
    dtype: str
    max_model_len: int
    prompt_tokens: int
    output_tokens: int
    streams: tuple[int, ...]
    waves: int  # requests per stream count: waves x streams (at least 4 for one stream)
    long_prompt_tokens: int
    convoy_documents: int
    convoy_document_tokens: int
    convoy_rate_per_s: float
    convoy_duration_s: float
    max_token_id: int
    start_timeout_s: float
    extra_serve_args: tuple[str, ...] = ()
    # A second server with these weights (--quantization), batch-1 TPOT against the first.
    quantized: str = ""


GPU_SCALE = Scale(preset="llama3-8b-body", dtype="bfloat16", max_model_len=131_072,
                  prompt_tokens=128, output_tokens=128, streams=(1, 32, 256), waves=2,
                  long_prompt_tokens=65_536, convoy_documents=2,
                  convoy_document_tokens=65_536, convoy_rate_per_s=8.0,
                  convoy_duration_s=30.0, max_token_id=3_500, start_timeout_s=900.0,
                  quantized="fp8")
REHEARSAL_SCALE = Scale(preset="tiny", dtype="float32", max_model_len=8_192,
                        prompt_tokens=16, output_tokens=16, streams=(1, 4, 16), waves=1,
                        long_prompt_tokens=2_048, convoy_documents=2,
                        convoy_document_tokens=2_048, convoy_rate_per_s=4.0,
                        convoy_duration_s=6.0, max_token_id=3_500, start_timeout_s=600.0,
                        extra_serve_args=("--kv-cache-memory", "512MiB"), quantized="int8")


class Deadline:
    def __init__(self, budget_s: float) -> None:
        self.end_s = time.monotonic() + budget_s

    def left_s(self) -> float:
        return self.end_s - time.monotonic()


# -- environment ---------------------------------------------------------------------------------


# -- tests ---------------------------------------------------------------------------------------


# -- serving -------------------------------------------------------------------------------------


@contextmanager
def serve(model_dir: Path, scale: Scale, device: str, policy: str, log: Path,
          cache_dir: Path, extra: tuple[str, ...] = (), start_timeout_s: float | None = None):
    from slipstream.agent.parallel.launch import free_port

    port = free_port()
    argv = [sys.executable, "-m", "slipstream.cli", "serve", "--model", str(model_dir),
            "--load-format", "dummy", "--device", device, "--dtype", scale.dtype,
            "--policy", policy, "--max-model-len", str(scale.max_model_len),
            "--served-model-name", MODEL_NAME, "--port", str(port), "--control-port", "0",
            *scale.extra_serve_args, *extra]
    env = {**os.environ, "SLIPSTREAM_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    with running(argv, log, f"http://127.0.0.1:{port}/health", env=env,
                 timeout_s=min(scale.start_timeout_s, start_timeout_s or scale.start_timeout_s)):
        yield f"http://127.0.0.1:{port}/v1", time.monotonic() - started


def load(base_url: str, scale: Scale, requests: list[TraceRequest], concurrency: int | None,
         seed: int, timeout_s: float) -> tuple[list[RequestTiming], float]:
    config = LoadConfig(base_url=base_url, model=MODEL_NAME, max_concurrency=concurrency,
                        max_token_id=scale.max_token_id, seed=seed, progress=False,
                        timeout_s=timeout_s)
    return asyncio.run(asyncio.wait_for(run_load(requests, config), timeout_s))


def throughput(base_url: str, scale: Scale, streams: int, timeout_s: float) -> dict:
    count = max(4, streams * scale.waves) if streams == 1 else streams * scale.waves
    requests = [TraceRequest(0.0, scale.prompt_tokens, scale.output_tokens)] * count
    timings, duration_s = load(base_url, scale, requests, streams, seed=streams,
                               timeout_s=timeout_s)
    metrics = serving_metrics(timings, duration_s, percentiles=(50.0, 99.0))
    return {"streams": streams, "requests": count, "duration_s": round(duration_s, 2),
            "output_tok_per_s": metrics["output_throughput"],
            "tpot_p50_ms": metrics.get("p50_tpot_ms"), "tpot_p99_ms": metrics.get("p99_tpot_ms"),
            "ttft_p50_s": _ms_to_s(metrics.get("p50_ttft_ms")),
            "ttft_p99_s": _ms_to_s(metrics.get("p99_ttft_ms")),
            "completed": metrics["completed"], "failed": metrics["failed"]}


# The engine's per-step histograms (contracts/metric_names.py): their counts and sums around a
# measurement say how it went when it is slow: how many steps, how large the chunks, and the
# measured against the predicted step time (a step far over its prediction is the kernels',
# many small chunks the packer's, time outside the steps the host's).
STEP_HISTOGRAMS = {"steps": "slipstream_batch_time_actual_seconds",
                   "predicted": "slipstream_batch_time_predicted_seconds",
                   "chunks": "slipstream_prefill_chunk_tokens",
                   "schedule": "slipstream_schedule_time_seconds"}


def step_counters(base_url: str) -> dict[str, float]:
    """``{name}_count`` and ``{name}_sum`` of each of STEP_HISTOGRAMS, summed over labels;
    empty if /metrics does not answer (the measurement itself still counts)."""
    import httpx

    root = base_url.removesuffix("/v1")
    try:
        text = httpx.get(f"{root}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    wanted = {f"{name}_{part}" for name in STEP_HISTOGRAMS.values() for part in ("count", "sum")}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        if name in wanted:
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def step_summary(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the engine did between two ``step_counters``: steps, mean chunk, measured and
    predicted step time (ms), scheduling time."""
    if not before or not after:
        return {}

    def delta(key: str, part: str) -> float:
        name = f"{STEP_HISTOGRAMS[key]}_{part}"
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps, chunks = delta("steps", "count"), delta("chunks", "count")
    predicted = delta("predicted", "count")
    return {"steps": int(steps), "step_s_total": round(delta("steps", "sum"), 3),
            "step_ms_mean": round(1e3 * delta("steps", "sum") / steps, 2) if steps else None,
            "predicted_ms_mean": round(1e3 * delta("predicted", "sum") / predicted, 2)
            if predicted else None,
            "prefill_chunks": int(chunks),
            "chunk_tokens_mean": round(delta("chunks", "sum") / chunks, 1) if chunks else None,
            "schedule_s_total": round(delta("schedule", "sum"), 3)}


def with_steps(base_url: str, action: Callable[[], dict]) -> dict:
    """``action()``'s result with ``engine_steps``: the step histograms' change over it.
    A measurement that fails (a timeout above all) keeps them beside its error, since that
    is when they are wanted."""
    before = step_counters(base_url)
    try:
        result = action()
    except Exception as error:  # noqa: BLE001 - reported with what the engine did meanwhile
        result = {"error": f"{type(error).__name__}: {error}"[:2000]}
    result["engine_steps"] = step_summary(before, step_counters(base_url))
    return result


def long_prompt(base_url: str, scale: Scale, timeout_s: float) -> dict:
    def measure() -> dict:
        timings, duration_s = load(base_url, scale,
                                   [TraceRequest(0.0, scale.long_prompt_tokens, 4)], None,
                                   seed=7, timeout_s=timeout_s)
        timing = timings[0]
        return {"prompt_tokens": scale.long_prompt_tokens, "ttft_s": timing.ttft_s,
                "completed": timing.success, "error": timing.error or None,
                "duration_s": round(duration_s, 2)}
    return with_steps(base_url, measure)


def convoy_workload(scale: Scale, seed: int = 0) -> list[TraceRequest]:
    """Short chats (32-256 prompt tokens, 16-48 output tokens) at Poisson arrivals, and the
    documents (8 output tokens) spread over the first half."""
    rng = np.random.default_rng(seed)
    requests, now = [], 0.0
    while True:
        now += float(rng.exponential(1.0 / scale.convoy_rate_per_s))
        if now >= scale.convoy_duration_s:
            break
        requests.append(TraceRequest(now, int(rng.integers(32, 257)),
                                     int(rng.integers(16, 49)), source="short"))
    for at in np.linspace(0.1, 0.5, scale.convoy_documents) * scale.convoy_duration_s:
        requests.append(TraceRequest(float(at), scale.convoy_document_tokens, 8,
                                     source="long"))
    return sorted(requests, key=lambda r: r.arrival_s)


def convoy(base_url: str, scale: Scale, timeout_s: float) -> dict:
    return with_steps(base_url, lambda: _convoy(base_url, scale, timeout_s))


def _convoy(base_url: str, scale: Scale, timeout_s: float) -> dict:
    requests = convoy_workload(scale)
    timings, duration_s = load(base_url, scale, requests, None, seed=3, timeout_s=timeout_s)
    short = [(r.arrival_s, t.ttft_s) for t, r in zip(timings, requests)
             if r.source == "short" and t.success and t.ttft_s is not None]
    documents = [t for t, r in zip(timings, requests) if r.source == "long"]
    ttfts = [ttft for _, ttft in short]
    return {"short_sent": sum(r.source == "short" for r in requests),
            "short_completed": len(short),
            "documents_sent": len(documents),
            "documents_completed": sum(t.success for t in documents),
            "short_ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
            "short_ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts else None,
            "document_ttft_s": [t.ttft_s for t in documents],
            "errors": sorted({t.error for t in timings if not t.success})[:5],
            "duration_s": round(duration_s, 2), "short_ttft_s": short}


def serving(scale: Scale, device: str, out: Path, deadline: Deadline,
            record: Callable[[dict], None]) -> dict:
    """Both servers and every load; ``record`` is called with the partial result after each
    measurement, so a timeout late in the stage keeps what came before."""
    from slipstream.agent.engine.models.tiny_model import write_tiny_model

    result: dict = {"scale": asdict(scale)}
    work = Path(tempfile.mkdtemp(prefix="device-check-"))
    model_dir = work / scale.preset
    write_tiny_model(model_dir, scale.preset, weights=False)
    result["weight_bytes"] = weight_bytes(model_dir, scale.dtype)
    cache_dir = work / "cache"

    def measure(name: str, action: Callable[[float], dict], reserve_s: float) -> None:
        left = deadline.left_s() - reserve_s
        if left < 10:
            result[name] = {"skipped": f"{deadline.left_s():.0f} s left in the budget"}
        else:
            try:
                result[name] = action(left)
            except Exception as error:  # noqa: BLE001 - one measurement fails alone
                result[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        record(result)

    convoy_reserve_s = 2 * scale.convoy_duration_s + 60
    try:
        with serve(model_dir, scale, device, "lars", out / "server-lars.log",
                   cache_dir) as (url, start_s):
            result["lars_start_s"] = round(start_s, 1)
            result["engine_log"] = engine_log_facts(out / "server-lars.log")
            record(result)
            for streams in scale.streams:
                def streams_load(left: float, streams: int = streams) -> dict:
                    return throughput(url, scale, streams, min(left, 240.0))
                measure(f"streams_{streams}", streams_load, convoy_reserve_s)
            measure("long_prompt", lambda left: long_prompt(url, scale, min(left, 120.0)),
                    convoy_reserve_s)
            measure("convoy_lars", lambda left: convoy(url, scale, min(
                left, 3 * scale.convoy_duration_s + 60)), scale.convoy_duration_s + 30)
    except Exception as error:  # noqa: BLE001 - the server did not come up or died
        result["lars_server_error"] = f"{type(error).__name__}: {error}"[-3000:]
        record(result)
    if deadline.left_s() < scale.convoy_duration_s + 20:
        result["convoy_fcfs"] = {"skipped": f"{deadline.left_s():.0f} s left in the budget"}
    else:
        try:
            with serve(model_dir, scale, device, "fcfs", out / "server-fcfs.log", cache_dir,
                       start_timeout_s=deadline.left_s() - 10) as (url, start_s):
                result["fcfs_start_s"] = round(start_s, 1)
                measure("convoy_fcfs", lambda left: convoy(url, scale, left), 5)
        except Exception as error:  # noqa: BLE001
            result["fcfs_server_error"] = f"{type(error).__name__}: {error}"[-3000:]
    keep_profiles(cache_dir, out)
    record(result)
    # Last, where time is left: the convoys are goals of their own.
    if scale.quantized and deadline.left_s() > 60:
        # The same body with quantized weights (quantized at load from the dummy weights), one
        # stream, no profile (a single stream needs no packer): its TPOT against the first
        # server's in the same run.
        try:
            with serve(model_dir, scale, device, "lars", out / "server-quantized.log", cache_dir,
                       ("--quantization", scale.quantized, "--no-profile"),
                       start_timeout_s=deadline.left_s() - 20) as (url, start_s):
                result["quantized"] = {"weights": scale.quantized, "start_s": round(start_s, 1)}
                measure("quantized_streams_1", lambda left: throughput(
                    url, scale, 1, min(left, 120.0)), 5)
        except Exception as error:  # noqa: BLE001
            result["quantized_server_error"] = f"{type(error).__name__}: {error}"[-3000:]
            record(result)
    return result


def keep_profiles(cache_dir: Path, out: Path) -> None:
    """The runtime profiles the servers measured, under ``out/runtime-profiles``: with them
    the packer's choices on this chip can be replayed in the simulator after the lease."""
    profiles = cache_dir / "runtime-profiles"
    if profiles.is_dir():
        shutil.copytree(profiles, out / "runtime-profiles", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.lock"))


ENGINE_LOG_FACTS = ("attention backend", "weights ", "captured", "graph capture failed", "profiled",
                    "profiling failed", "KV cache:", "packer:")


def engine_log_facts(log: Path) -> list[str]:
    """The start-up lines that say how the engine runs (backend, graphs, profile, KV)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[-300:] for line in lines if any(fact in line for fact in ENGINE_LOG_FACTS)]


def weight_bytes(model_dir: Path, dtype: str) -> int:
    from slipstream.agent.engine.config import ModelConfig

    config = ModelConfig.from_dir(model_dir)
    hidden, layers = config.hidden_size, config.num_layers
    attention = hidden * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    mlp = 3 * hidden * config.intermediate_size
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    parameters = layers * (attention + mlp + 2 * hidden) + hidden + embeddings
    return parameters * (4 if dtype == "float32" else 2)


def _ms_to_s(value: float | None) -> float | None:
    return None if value is None else value / 1000.0


# -- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slipstream.bench.device_check",
        description="Tests and figures from a GPU in one run (a CPU rehearsal without one).")
    parser.add_argument("--out", type=Path, default=Path("results/device-check"),
                        help="where device_check.json, device_check.png and the logs go")
    parser.add_argument("--budget-s", type=float, default=470.0,
                        help="wall-clock budget of the whole run; later stages shrink to fit")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=("gpu_tests", "serving", "engine_tier"),
                        help="stages to leave out")
    parser.add_argument("--rehearsal", action="store_true",
                        help="the CPU rehearsal even where CUDA is available")
    args = parser.parse_args(argv)

    import torch

    on_gpu = torch.cuda.is_available() and not args.rehearsal
    device = "cuda" if on_gpu else "cpu"
    scale = GPU_SCALE if on_gpu else REHEARSAL_SCALE
    deadline = Deadline(args.budget_s)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"rehearsal": not on_gpu, "scale_streams": list(scale.streams),
                    "dtype": scale.dtype, "stages": {}}
    path = args.out / "device_check.json"

    def write() -> None:
        report["duration_s"] = round(time.monotonic() - started, 1)
        report["goals"] = goals(report)
        path.write_text(json.dumps(report, indent=2, default=str))

    def stage(name: str, action: Callable[[], dict]) -> None:
        print(f"[device-check] {name} ({deadline.left_s():.0f} s left)", flush=True)
        try:
            report["stages"][name] = action()
        except Exception as error:  # noqa: BLE001 - a stage fails alone
            report["stages"][name] = {"error": f"{type(error).__name__}: {error}"[:3000]}
        write()

    stage("environment", lambda: environment(device))
    if "gpu_tests" not in args.skip:
        stage("gpu_tests", lambda: run_pytest(["-m", "gpu", "tests/engine"],
                                              min(150.0, deadline.left_s() - 300),
                                              args.out / "gpu-tests.log")
              if on_gpu else {"skipped_stage": "no CUDA device"})
    if "serving" not in args.skip:
        def serving_stage() -> dict:
            def record(partial: dict) -> None:
                report["stages"]["serving"] = partial
                write()
            return serving(scale, device, args.out, Deadline(deadline.left_s() - 20), record)
        stage("serving", serving_stage)
    if "engine_tier" not in args.skip:
        stage("engine_tier", lambda: run_pytest(
            ["-m", "not gpu", "tests/engine", "-n", "8", "--maxfail=30"],
            deadline.left_s() - 10, args.out / "engine-tier.log")
            if on_gpu else {"skipped_stage": "no CUDA device"})
    write()
    plot(report, args.out / "device_check.png")
    print(summary(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
