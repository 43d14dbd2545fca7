"""Runtime-predictor accuracy on this machine's engine, on batches not used for profiling.

    slipstream profile (grid, calibration load of seed 0) -> profile dir
    fresh random batches (seed 1) -> ModelRunner.execute timed vs the runner's prediction
    a fresh engine load (seed 1)  -> whole LLMEngine steps timed vs the full prediction

Writes ``predictor_bench.json`` and a predicted-vs-actual scatter plot under ``--out``::

    python -m slipstream.bench.predictor_bench --out results/predictor
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.engine.profile.profiler import (calibration_batches, measure_execute_ms,
                                                      predict_ms, profile)
from slipstream.agent.engine.profile.step_calibration import CalibrationLoad, time_engine_steps
from slipstream.agent.engine.models.tiny_model import ensure_default_model
from slipstream.agent.scheduler.predictor import RuntimePredictor


def engine_step_errors(model_dir: Path, profile_dir: Path) -> list[float]:
    """|predicted - measured| / measured for every step of a held-out engine load."""
    predictor = RuntimePredictor.from_directory(profile_dir, cache_dir=None)
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", profile_dir=profile_dir,
                                    num_kv_blocks=4096))
    try:
        timings = time_engine_steps(engine, CalibrationLoad(seed=1))
    finally:
        engine.close()
    return [abs(predict_ms(predictor, t.batch) - t.step_ms) / t.step_ms for t in timings
            if t.batch is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/predictor"))
    parser.add_argument("--model", type=Path, default=None, help="default: the tiny model")
    parser.add_argument("--profile", type=Path, default=None,
                        help="existing profile directory; default: profile now into OUT/profile")
    parser.add_argument("--batches", type=int, default=60)
    args = parser.parse_args(argv)
    model_dir = args.model or ensure_default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    profile_dir = args.profile or profile(model_dir, "cpu", args.out / "profile", repeats=7)
    # Random batches exercise ModelRunner.execute alone: predict it without the host work.
    predictor = RuntimePredictor.from_directory(profile_dir, cache_dir=None,
                                                include_host_overhead=False)
    runner = ModelRunner(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=8192),
                         ModelConfig.from_dir(model_dir))
    rows = []
    with torch.inference_mode():
        for batch in tqdm(calibration_batches(np.random.default_rng(1), args.batches, 2048),
                          desc="evaluating", unit="batch"):
            actual = measure_execute_ms(runner, batch, repeats=5)
            predicted = predict_ms(predictor, batch)
            rows.append({"tokens": batch.num_tokens, "decodes": batch.num_decodes,
                         "prefills": len(batch.chunks) - batch.num_decodes,
                         "actual_ms": actual, "predicted_ms": predicted,
                         "relative_error": abs(predicted - actual) / actual})
    del runner
    step_errors = engine_step_errors(model_dir, profile_dir)
    errors = [row["relative_error"] for row in rows]
    meta = predictor.meta
    summary = {"median_abs_relative_error": statistics.median(errors),
               "p90_abs_relative_error": float(np.percentile(errors, 90)),
               "batches": len(rows),
               "engine_steps_median_abs_relative_error": statistics.median(step_errors),
               "engine_steps_p90_abs_relative_error": float(np.percentile(step_errors, 90)),
               "engine_steps": len(step_errors),
               "profile": str(profile_dir), "model": model_dir.name,
               "iteration_overhead_ms": meta.iteration_overhead_ms,
               "per_sequence_overhead_ms": meta.per_sequence_overhead_ms,
               "host_overhead_ms": meta.host_overhead_ms,
               "host_per_sequence_ms": meta.host_per_sequence_ms}
    (args.out / "predictor_bench.json").write_text(json.dumps({"summary": summary, "batches": rows},
                                                              indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(5, 5))
    measured = [row["actual_ms"] for row in rows]
    axis.scatter(measured, [row["predicted_ms"] for row in rows], s=12)
    top = max(measured + [row["predicted_ms"] for row in rows]) * 1.05
    axis.plot([0, top], [0, top], color="grey", linewidth=1)
    axis.set_xlabel("measured iteration time (ms)")
    axis.set_ylabel("predicted (ms)")
    axis.set_title(f"predictor on {model_dir.name}, CPU: median error "
                   f"{100 * summary['median_abs_relative_error']:.1f}%")
    fig.tight_layout()
    fig.savefig(args.out / "predictor_bench.png", dpi=120)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
