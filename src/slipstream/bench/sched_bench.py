"""Scheduling cost: wall time of one ``Scheduler.schedule()`` with 10,000 waiting requests.

For each policy, 256 requests are brought to steady decoding, then 10,000 more queue up
(prompt and output lengths drawn from the shipped ShareGPT length trace). We then step the scheduler on a fake clock that
follows its own predictions, finishing requests at their output length, and time only the
``schedule()`` calls. Two scenarios:

- ``seats_full``: ``max_num_seqs = 256``, so waiting requests wait for a seat;
- ``seats_open``: ``max_num_seqs = 1024``, so every step also walks the waiting queue in
  policy order and admits from it. To hold the state at 256 running and 10,000 waiting,
  requests admitted by a step are aborted after it and queued again as new ones (untimed).

The predictor is the shipped H100 Llama-3-8B profile, or ``--profile-dir``. Writes
``sched_bench.json`` under ``--out``. Usage::

    python -m slipstream.bench.sched_bench --out results/sched
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any
from pathlib import Path

import numpy as np

from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.config import POLICY_NAMES, SchedulerConfig
from slipstream.agent.scheduler.offline_driver import Arrival, FakeKvRunner, make_request
from slipstream.agent.scheduler.predictor import RuntimePredictor
from slipstream.agent.scheduler.profile_table import VIDUR_H100_LLAMA3_8B_TP8
from slipstream.agent.scheduler.request import FinishReason
from slipstream.agent.scheduler.scheduler import Scheduler
from slipstream.sim.datasets import H100_LLAMA3_8B_TP8_DIR, data_path
from slipstream.sim.traces import read_length_file


def length_sampler(seed: int):
    rng = np.random.default_rng(seed)
    rows = read_length_file(data_path("sharegpt"))
    return lambda: rows[int(rng.integers(len(rows)))]


def step(scheduler: Scheduler, runner: FakeKvRunner, now_s: float) -> tuple[float, float]:
    started = time.perf_counter()
    batch = scheduler.schedule(now_s)
    elapsed = time.perf_counter() - started
    sampled = runner.execute(batch)
    now_s += batch.predicted_time_s or 1e-3
    scheduler.update(batch, sampled, now_s)
    for request_id in sampled:
        request = scheduler.requests[request_id]
        if request.num_output_tokens >= request.max_tokens:
            scheduler.finish(request_id, FinishReason.LENGTH, now_s)
    return elapsed, now_s


def measure(policy: str, predictor, max_num_seqs: int, num_waiting: int, num_running: int,
            steps: int, seed: int) -> dict:
    sample = length_sampler(seed)
    scheduler = Scheduler(
        SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs, target_batch_time_ms=50.0),
        BlockManager(4_000_000), predictor=predictor)
    runner = FakeKvRunner(scheduler.block_manager.block_size, check_kv=False)
    for i in range(num_running):
        prompt, _ = sample()
        scheduler.add(make_request(Arrival(f"run{i}", 0.0, min(prompt, 2048), 100_000,
                                           app_id=f"app{i % 16}")))
    now_s = 0.0
    while any(r.in_prefill for r in scheduler.running) or scheduler.num_waiting:
        _, now_s = step(scheduler, runner, now_s)
    for i in range(num_waiting):
        prompt, output = sample()
        scheduler.add(make_request(Arrival(f"wait{i}", now_s, prompt, output, app_id=f"app{i % 16}")))
    start = {"num_waiting": scheduler.num_waiting, "num_running": scheduler.num_running}
    base = {request.request_id for request in scheduler.running}
    times = []
    for index in range(steps):
        elapsed, now_s = step(scheduler, runner, now_s)
        times.append(elapsed)
        for request in [r for r in scheduler.running if r.request_id not in base]:
            scheduler.finish(request.request_id, FinishReason.ABORT, now_s)
            scheduler.add(make_request(Arrival(f"{request.request_id}.{index}", now_s,
                                               request.prompt_len, request.max_tokens,
                                               app_id=request.app_id)))
    times_ms = sorted(t * 1000 for t in times)
    return {
        **start,
        "steps": steps,
        "median_ms": statistics.median(times_ms),
        "p90_ms": times_ms[int(0.9 * (len(times_ms) - 1))],
        "mean_ms": statistics.fmean(times_ms),
        "end_num_waiting": scheduler.num_waiting,
        "end_num_running": scheduler.num_running,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("results/sched"), help="output directory")
    parser.add_argument("--policies", nargs="+", default=list(POLICY_NAMES), choices=POLICY_NAMES)
    parser.add_argument("--waiting", type=int, default=10_000, help="queued requests")
    parser.add_argument("--running", type=int, default=256, help="running requests")
    parser.add_argument("--steps", type=int, default=300, help="timed schedule() calls")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="Vidur-format profile (default: the shipped H100 Llama-3-8B one)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    profile = args.profile_dir or H100_LLAMA3_8B_TP8_DIR
    meta = None if (profile / "profile.json").exists() else VIDUR_H100_LLAMA3_8B_TP8
    predictor, predictor_name = RuntimePredictor.from_directory(profile, meta=meta), profile.name
    report: dict[str, Any] = {"machine": {"python": platform.python_version(), "processor": platform.processor(),
                          "platform": platform.platform()},
                              "predictor": predictor_name, "results": {}}
    for policy in args.policies:
        report["results"][policy] = {}
        for scenario, seats in (("seats_full", args.running), ("seats_open", 4 * args.running)):
            result = measure(policy, predictor, seats, args.waiting, args.running, args.steps,
                             args.seed)
            report["results"][policy][scenario] = result
            print(f"{policy:9s} {scenario:10s} median {result['median_ms']:.3f} ms  "
                  f"p90 {result['p90_ms']:.3f} ms  (waiting {result['num_waiting']}, "
                  f"running {result['num_running']})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sched_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
