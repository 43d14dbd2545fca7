"""Mixture-of-experts on the CPU engine: decode throughput against transformers, and the
simulator's step time against the live one (issue 31's goals).

    write_tiny_moe(bench size: Mixtral-style, hidden 256, 4 layers, 8 experts, top-2)
      -> batch-32 decode tokens/s: our engine vs transformers generate() (same directory,
         same thread count)                                             goal: >= 0.8x
      -> slipstream profile (quick grid, as `serve` measures on its first start; cached) -> live engine packing with it: for every
         step made of the 32 decodes only, the predictor's time (what the simulator's clock
         advances by, Batch.predicted_time_s) against the measured step (schedule start to
         the next schedule start)                                        goal: within 20%

Writes ``moe_bench.json`` and ``moe_bench.png`` under ``--out``::

    python -m slipstream.bench.moe_bench --out results/moe
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
from pathlib import Path

import torch

from slipstream.bench.engine_bench import hf_decode, make_engine, ours_decode, prompts_for
from slipstream.bench.sim_vs_live import cached_profile, wait_for_quiet_machine
from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.kv.memory import KVCacheMemory
from slipstream.agent.engine.profile.moe_profile import active_parameters_per_token
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.step.stats import StepStats
from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir
from slipstream.agent.engine.models.tiny_moe import write_tiny_moe
from slipstream.agent.scheduler.predictor import RuntimePredictor
from slipstream.agent.scheduler.scheduler import SchedulerConfig

BATCH = 32


def moe_model_dir(family: str) -> Path:
    model_dir = slipstream_cache_dir() / "models" / f"bench-moe-{family}-seed0"
    if not (model_dir / "config.json").is_file():
        write_tiny_moe(model_dir, family, size="bench")
    return model_dir


def throughput(model_dir: Path, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    prompts = prompts_for(BATCH, args.prompt_len, 4096)
    ours_engine = make_engine(model_dir, max_batched_tokens=BATCH * args.prompt_len)
    ours_decode(ours_engine, prompts_for(BATCH, args.prompt_len, 4096, salt=1), 4)  # warm-up
    ours = max((ours_decode(ours_engine, prompts, args.new_tokens)
                for _ in range(args.repeats)), key=lambda r: r["decode_tokens_per_s"])
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    theirs = max((hf_decode(hf_model, prompts, args.new_tokens) for _ in range(args.repeats)),
                 key=lambda r: r["decode_tokens_per_s"])
    return {"batch": BATCH, "prompt_tokens": args.prompt_len, "new_tokens": args.new_tokens,
            "ours": ours, "transformers": theirs,
            "ratio": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]}


def predicted_vs_live(model_dir: Path, profile: Path, args: argparse.Namespace) -> dict:
    """Mean predicted and measured time of the engine's steps made of BATCH decodes only."""
    # A budget no step reaches: the packer never splits the decodes, and every step still
    # carries the predictor's time.
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", profile_dir=profile,
                                    max_model_len=4096,
                                    kv_cache_memory=KVCacheMemory(size_bytes=2**30)),
                       SchedulerConfig(max_num_seqs=BATCH, target_batch_time_ms=10_000.0))
    steps: list[StepStats] = []
    engine.on_step = steps.append
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts_for(BATCH, args.prompt_len, 4096, salt=2), params)
    tables = RuntimePredictor.from_directory(profile, cache_dir=None)
    rows = []
    for step, following in zip(steps, steps[1:]):
        batch = step.batch
        if batch.num_decodes == BATCH == len(batch.chunks) and batch.predicted_time_s:
            kv_total = sum(chunk.end_pos for chunk in batch.chunks)
            rows.append((batch.predicted_time_s * 1000,
                         (following.schedule_start_s - step.schedule_start_s) * 1000,
                         tables.linear_ms(BATCH) + tables.decode_attention_ms(BATCH, kv_total)
                         - BATCH * tables.per_sequence_overhead_ms,
                         step.forward_s * 1000))
    if not rows:
        raise RuntimeError("no step ran the whole batch of decodes alone")
    predicted, measured, layers, forward = (statistics.fmean(column) for column in zip(*rows))
    return {"steps": len(rows), "predicted_step_ms": predicted, "measured_step_ms": measured,
            "measured_step_ms_median": statistics.median(row[1] for row in rows),
            "error": predicted / measured - 1,
            # The layer tables alone (MoE block, attention, norms) against the model forward:
            # the MoE cost model without the fitted runner and host overheads.
            "tables_forward_ms": layers, "measured_forward_ms": forward,
            "tables_forward_error": layers / forward - 1,
            "fitted_overheads": {"iteration_ms": tables.iteration_overhead_ms,
                                 "per_sequence_ms": tables.per_sequence_overhead_ms}}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    rate = results["throughput"]
    if rate is None:
        left.set_axis_off()
        left.text(0.5, 0.5, "throughput not measured (--skip-throughput)", ha="center")
    else:
        left.bar(["Slipstream", "transformers"], [rate["ours"]["decode_tokens_per_s"],
                                                  rate["transformers"]["decode_tokens_per_s"]],
                 color=["tab:blue", "tab:gray"])
        left.set_ylabel("decode tokens/s")
        left.set_title(f"batch {BATCH} decode: {rate['ratio']:.2f}x (goal >= 0.8x)")
    step = results["sim_vs_live"]
    right.bar(["simulator (profile)", "live engine"],
              [step["predicted_step_ms"], step["measured_step_ms"]],
              color=["tab:orange", "tab:blue"])
    right.set_ylabel(f"ms per step of {BATCH} decodes")
    right.set_title(f"predicted vs live: {100 * step['error']:+.1f}% (goal within 20%)")
    figure.suptitle(f"{results['model']} ({results['parameters']:,} parameters, "
                    f"{results['active_parameters_per_token']:,} active per token), "
                    f"{results['threads']} thread(s)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/moe"))
    parser.add_argument("--family", default="mixtral",
                        choices=("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every side (and the profile)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs per side")
    parser.add_argument("--grid", default="quick", choices=("quick", "small", "full"),
                        help="profile grid (slipstream profile --grid)")
    parser.add_argument("--refresh-profile", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true",
                        help="measure only the simulator against the live step (minutes "
                             "faster: no transformers generate)")
    parser.add_argument("--max-load", type=float, default=1.5,
                        help="wait for a 1-minute load average at most this before starting")
    parser.add_argument("--quiet-patience-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = moe_model_dir(args.family)
    config = ModelConfig.from_dir(model_dir)
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        parameters = sum(math.prod(weights.get_slice(name).get_shape())
                         for name in weights.keys())
    # Other processes on a shared machine slow whatever runs beside them: start quiet.
    load_before = wait_for_quiet_machine(args.max_load, args.quiet_patience_s)
    profile = cached_profile(model_dir, args.grid, args.threads, args.refresh_profile)
    # The live steps right after the profile, so both see the same machine load.
    load_at_live = os.getloadavg()
    sim_vs_live = {**predicted_vs_live(model_dir, profile, args),
                   "load_average_before": load_at_live, "load_average_after": os.getloadavg()}
    results = {"model": f"bench-moe-{args.family}", "parameters": parameters,
               "active_parameters_per_token": active_parameters_per_token(config),
               "threads": args.threads, "profile_grid": args.grid,
               "machine": platform.processor() or platform.machine(),
               "load_average_before": load_before, "load_average_after": os.getloadavg(),
               "throughput": None if args.skip_throughput else throughput(model_dir, args),
               "sim_vs_live": sim_vs_live}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_bench.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / "moe_bench.png")
    rate, step = results["throughput"], results["sim_vs_live"]
    if rate is not None:
        print(f"decode batch {BATCH}: {rate['ours']['decode_tokens_per_s']:.0f} tok/s vs "
              f"transformers {rate['transformers']['decode_tokens_per_s']:.0f} "
              f"({rate['ratio']:.2f}x)")
    print(f"step of {BATCH} decodes: predicted {step['predicted_step_ms']:.2f} ms vs live "
          f"{step['measured_step_ms']:.2f} ms ({100 * step['error']:+.1f}%), load average "
          f"{step['load_average_before'][0]:.2f} -> {step['load_average_after'][0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
