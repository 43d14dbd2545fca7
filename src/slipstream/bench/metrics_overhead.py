"""What the per-step metrics cost on the engine's hot path, at a fixed decode batch.

    LLMEngine.step() x N with on_step=None   (arm "off")
    LLMEngine.step() x N with on_step=StepMetrics.observe, the agent's observer   (arm "on")

The two arms alternate step by step on one engine, so the KV length (which grows as the
batch decodes) and machine noise affect both alike; the A/B figure is the median, over
consecutive (off, on) pairs, of the relative difference. Because a few microseconds vanish in the step-to-step jitter of a shared CPU, the
observer is also timed on its own, on real batches and StepStats captured from the engine,
and reported as a share of the median step. Writes JSON. Usage::

    python -m slipstream.bench.metrics_overhead --out results/metrics [--preset tiny]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.kv.memory import KVCacheMemory
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.step.model_runner import resolve_device
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.step.stats import StepStats
from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir, write_tiny_model
from slipstream.agent.scheduler.scheduler import SchedulerConfig
from slipstream.agent.server.step_metrics import StepMetrics


def _model_dir(preset: str) -> Path:
    model_dir = slipstream_cache_dir() / "models" / f"bench-{preset}-seed0"
    if not (model_dir / "config.json").is_file():
        write_tiny_model(model_dir, preset, seed=0)
    return model_dir


def _start_batch(engine: LLMEngine, batch_size: int, prompt_len: int, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(batch_size):
        engine.add_request([(7919 * i + 104729 * j) % (vocab - 300) + 10
                            for j in range(prompt_len)], params)
    while engine.scheduler.num_waiting or any(r.in_prefill for r in engine.scheduler.running):
        engine.step()


def _timed_steps(engine: LLMEngine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times


def _observer_cost_s(captured: list[StepStats], repeats: int) -> float:
    """Seconds per ``StepMetrics.observe`` call on real steps."""
    observer = StepMetrics()
    started = time.perf_counter()
    for _ in range(repeats):
        for step in captured:
            observer.observe(step)
    return (time.perf_counter() - started) / (repeats * len(captured))


def run_benchmark(args: argparse.Namespace) -> dict:
    engine = LLMEngine(EngineConfig(model_dir=_model_dir(args.preset), device=args.device,
                                    kv_cache_memory=KVCacheMemory(size_bytes=2**30)),
                       SchedulerConfig(max_num_seqs=args.batch_size, max_batched_tokens=4096))
    total_steps = 2 * args.pairs + 30
    _start_batch(engine, args.batch_size, args.prompt_len, max_tokens=total_steps + 8)
    observer = StepMetrics()
    _timed_steps(engine, 10)  # warm-up
    off: list[float] = []
    on: list[float] = []
    for _ in range(args.pairs):
        engine.on_step = None
        off.extend(_timed_steps(engine, 1))
        engine.on_step = observer.observe
        on.extend(_timed_steps(engine, 1))
    captured: list[StepStats] = []
    engine.on_step = captured.append
    _timed_steps(engine, 10)
    engine.on_step = None
    assert all(len(step.batch.chunks) == args.batch_size for step in captured), \
        "the batch shrank: raise max_tokens"
    observer_s = _observer_cost_s(captured, repeats=2000)
    off_median, on_median = statistics.median(off), statistics.median(on)
    return {
        "preset": args.preset, "device": str(resolve_device(engine.config.device)),
        "batch_size": args.batch_size, "steps_per_arm": len(off),
        "step_ms_median_metrics_off": 1000 * off_median,
        "step_ms_median_metrics_on": 1000 * on_median,
        "ab_overhead_fraction_of_medians": on_median / off_median - 1,
        "ab_overhead_fraction_median_of_pairs": statistics.median(
            b / a - 1 for a, b in zip(off, on)),
        "step_ms_p90_metrics_off": 1000 * statistics.quantiles(off, n=10)[-1],
        "step_ms_p90_metrics_on": 1000 * statistics.quantiles(on, n=10)[-1],
        "observer_us_per_step": 1e6 * observer_s,
        "observer_fraction_of_step": observer_s / off_median,
        "goal_fraction": 0.02,
        "platform": platform.platform(), "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/metrics"))
    parser.add_argument("--preset", default="tiny", help="tiny-model preset (tiny, 100m)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=300, help="(off, on) step pairs")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1 keeps a shared CPU's noise down)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run_benchmark(args)
    result["torch_threads"] = args.threads
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"metrics_overhead_{args.preset}_{result['device']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
