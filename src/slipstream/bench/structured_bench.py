"""What a JSON-schema grammar costs decode throughput: the same engine, every request with a
grammar vs none, at batch 1 and 8, side by side in one run.

    arm "none":    B requests, no grammar
    arm "grammar": B requests, each under a JSON-schema grammar (llguidance masks)

Each measurement starts B requests, lets their prefills finish, then times ``--steps``
decode steps (B tokens each). The arms alternate round by round on one engine, so machine
noise hits both alike; the figure per (batch, arm) is the median over rounds, and the
overhead is ``1 - grammar / none`` of those medians. The schema is an open-ended list of
records, so no request finishes inside the timed steps: every step of the grammar arm
computes every row's mask (beside the forward) and advances every matcher. Writes JSON and
a PNG. Usage::

    python -m slipstream.bench.structured_bench --out results/structured [--preset tiny]
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
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.sampling.grammar import json_schema_grammar
from slipstream.agent.engine.kv.memory import KVCacheMemory
from slipstream.agent.engine.step.model_runner import resolve_device
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir, write_tiny_model
from slipstream.agent.scheduler.scheduler import SchedulerConfig

# An extraction-style schema: nested objects, enums, bounded integers, strings and arrays.
# minItems keeps the output open for far longer than the timed steps.
SCHEMA = {
    "type": "object",
    "properties": {
        "source": {"type": "string", "maxLength": 32},
        "records": {
            "type": "array", "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
                    "label": {"type": "string", "maxLength": 24},
                    "kind": {"enum": ["person", "place", "thing", "event"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                             "maxItems": 4},
                },
                "required": ["id", "label", "kind", "score", "tags"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["source", "records"],
    "additionalProperties": False,
}
ARMS = ("none", "grammar")


def _model_dir(preset: str) -> Path:
    model_dir = slipstream_cache_dir() / "models" / f"bench-{preset}-seed0"
    if not (model_dir / "config.json").is_file():
        write_tiny_model(model_dir, preset, seed=0)
    return model_dir


def decode_tokens_per_s(engine: LLMEngine, batch_size: int, grammar: str | None,
                        steps: int, prompt_len: int, seed: int) -> tuple[float, float]:
    """Start ``batch_size`` requests, finish their prefills, then time ``steps`` decode
    steps; aborts the requests afterwards. Returns decode tokens/s (wall clock) and the
    process's CPU milliseconds per step (every thread: the engine's and the mask helper's),
    which a loaded machine stretches far less than the wall clock."""
    vocab = engine.model_config.vocab_size
    ids = []
    for i in range(batch_size):
        params = SamplingParams(max_tokens=steps + 64, temperature=1.0, seed=seed + i,
                                ignore_eos=True, grammar=grammar)
        prompt = [(7919 * (i + seed) + 104729 * j) % (vocab - 300) + 10
                  for j in range(prompt_len)]
        ids.append(engine.add_request(prompt, params))
    while engine.scheduler.num_waiting or any(r.in_prefill for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm-up decode steps
        engine.step()
    produced = 0
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(steps):
        produced += sum(len(out.new_token_ids) for out in engine.step())
    elapsed = time.perf_counter() - started
    cpu_ms_per_step = 1e3 * (time.process_time() - cpu_started) / steps
    finished_early = [rid for rid in ids if rid not in engine.scheduler.requests]
    for request_id in ids:
        engine.abort(request_id)
    if finished_early or produced != batch_size * steps:
        raise RuntimeError(f"a request finished inside the timed steps ({finished_early}); "
                           "raise minItems or lower --steps")
    return produced / elapsed, cpu_ms_per_step


def run_benchmark(args: argparse.Namespace) -> dict:
    engine = LLMEngine(EngineConfig(model_dir=_model_dir(args.preset), device=args.device,
                                    kv_cache_memory=KVCacheMemory(size_bytes=2**30),
                                    # the prompts and the timed steps stay far below this; a
                                    # 131K context (the 100m preset's) would not fit in 1 GiB
                                    max_model_len=8192),
                       SchedulerConfig(max_num_seqs=max(args.batch_sizes),
                                       max_batched_tokens=4096))
    grammar = json_schema_grammar(SCHEMA)
    error = engine.grammar.check(grammar)
    if error is not None:
        raise RuntimeError(f"the benchmark schema does not compile: {error}")
    decode_tokens_per_s(engine, 1, grammar, 4, args.prompt_len, seed=0)  # builds llguidance's tokenizer
    samples: dict[int, dict[str, list[float]]] = {b: {arm: [] for arm in ARMS}
                                                  for b in args.batch_sizes}
    cpu: dict[int, dict[str, list[float]]] = {b: {arm: [] for arm in ARMS}
                                              for b in args.batch_sizes}
    for round_index in range(args.rounds):
        for batch_size in args.batch_sizes:
            for arm in ARMS:
                tokens_per_s, cpu_ms_per_step = decode_tokens_per_s(
                    engine, batch_size, grammar if arm == "grammar" else None, args.steps,
                    args.prompt_len, seed=1000 * round_index)
                samples[batch_size][arm].append(tokens_per_s)
                cpu[batch_size][arm].append(cpu_ms_per_step)
    rows = []
    for batch_size in args.batch_sizes:
        medians = {arm: statistics.median(samples[batch_size][arm]) for arm in ARMS}
        cpu_ms = {arm: statistics.median(cpu[batch_size][arm]) for arm in ARMS}
        rows.append({
            "batch_size": batch_size,
            "decode_tokens_per_s_none": medians["none"],
            "decode_tokens_per_s_grammar": medians["grammar"],
            "grammar_over_none": medians["grammar"] / medians["none"],
            "slowdown_fraction": 1 - medians["grammar"] / medians["none"],
            "samples_none": samples[batch_size]["none"],
            "samples_grammar": samples[batch_size]["grammar"],
            "cpu_ms_per_step_none": cpu_ms["none"],
            "cpu_ms_per_step_grammar": cpu_ms["grammar"],
            "cpu_overhead_fraction": cpu_ms["grammar"] / cpu_ms["none"] - 1,
        })
    engine.close()
    return {
        "preset": args.preset, "device": str(resolve_device(args.device)),
        "steps_per_measurement": args.steps, "rounds": args.rounds,
        "prompt_len": args.prompt_len, "schema": SCHEMA, "rows": rows,
        "goal": "at most 10% slower with grammars at batch 8",
        "goal_met_at_batch_8": next((r["slowdown_fraction"] <= 0.10 for r in rows
                                     if r["batch_size"] == 8), None),
        "platform": platform.platform(), "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    positions = range(len(rows))
    none = [r["decode_tokens_per_s_none"] for r in rows]
    guided = [r["decode_tokens_per_s_grammar"] for r in rows]
    ax.bar([p - width / 2 for p in positions], none, width, label="no grammar")
    ax.bar([p + width / 2 for p in positions], guided, width, label="JSON-schema grammar")
    for p, row in zip(positions, rows):
        ax.annotate(f"{100 * row['slowdown_fraction']:+.1f}%",
                    (p + width / 2, row["decode_tokens_per_s_grammar"]),
                    ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(positions), [f"batch {r['batch_size']}" for r in rows])
    ax.set_ylabel("decode tokens/s (median over rounds)")
    ax.set_title(f"Grammar overhead ({result['preset']}, {result['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/structured"))
    parser.add_argument("--preset", default="tiny", help="tiny-model preset (tiny, 100m)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=48, help="timed decode steps per sample")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per arm")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1 keeps a shared CPU's noise down)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run_benchmark(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"structured_{args.preset}_{result['device']}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{stem}.png")
    for row in result["rows"]:
        print(f"batch {row['batch_size']}: {row['decode_tokens_per_s_none']:.1f} tok/s without "
              f"grammar, {row['decode_tokens_per_s_grammar']:.1f} with "
              f"({100 * row['slowdown_fraction']:+.1f}% slower); CPU per step "
              f"{row['cpu_ms_per_step_none']:.2f} vs {row['cpu_ms_per_step_grammar']:.2f} ms "
              f"({100 * row['cpu_overhead_fraction']:+.1f}%)")
    print(f"wrote {args.out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
