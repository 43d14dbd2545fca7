"""Short-prefill latency per (length, batch) bucket: eager against CUDA-graph replay (GPU only).

For each bucket, a batch of ``B`` fresh prompts of exactly ``L`` tokens (so no padding: the
difference is launch overhead, not wasted work) runs through two model runners with the same
weights: one eager (``cuda_graphs`` off), one replaying the bucket's captured graph. Each side
is timed around ``ModelRunner.sample_logits`` (input preparation + forward + logits, CUDA
synchronised), alternating the two, median of ``--repeats`` after warm-up. Start-up cost
(capture time) and GPU memory are recorded too.

Writes ``cuda_graph_bench.json`` and ``cuda_graph_bench.png`` under ``--out``. Usage::

    python -m slipstream.bench.cuda_graph_bench --out results/cuda-graphs

Without CUDA it says it needs a GPU and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from slipstream.agent.engine.config import (
    DEFAULT_SHORT_PREFILL_BATCH_SIZES, DEFAULT_SHORT_PREFILL_LENGTHS_TOKENS, EngineConfig,
    ModelConfig, ShortPrefillBuckets)
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.engine.step.prefill_buckets import PrefillBucket, all_buckets
from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir, write_tiny_model
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.contracts.sampling import SamplingOptions
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE, blocks_for_tokens

EXIT_NO_GPU = 2
WARMUP_RUNS = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/cuda-graphs"))
    parser.add_argument("--model", type=Path, default=None, metavar="DIR",
                        help="Hugging Face model directory; default: the random-weight "
                             "--preset model, written to the Slipstream cache")
    parser.add_argument("--preset", default="100m", help="tiny-model preset when no --model")
    parser.add_argument("--dtype", default="bfloat16",
                        choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--attention-backend", default="auto",
                        choices=("auto", "torch", "flashinfer"),
                        help="the eager side's attention (the graph side always uses the "
                             "padded torch SDPA path)")
    parser.add_argument("--lengths", default=",".join(map(str,
                                                           DEFAULT_SHORT_PREFILL_LENGTHS_TOKENS)))
    parser.add_argument("--batch-sizes",
                        default=",".join(map(str, DEFAULT_SHORT_PREFILL_BATCH_SIZES)))
    parser.add_argument("--repeats", type=int, default=20)
    return parser.parse_args(argv)


def model_dir_for(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model
    model_dir = slipstream_cache_dir() / "models" / f"bench-{args.preset}-seed0"
    if not (model_dir / "config.json").is_file():
        write_tiny_model(model_dir, args.preset, seed=0)
    return model_dir


def full_bucket_batch(bucket: PrefillBucket, vocab_size: int, salt: int) -> Batch:
    """``B`` prompts of exactly ``L`` tokens in disjoint blocks."""
    blocks_each = blocks_for_tokens(bucket.length_tokens)
    chunks = []
    for row in range(bucket.batch_size):
        tokens = tuple((7919 * (row + salt) + 104729 * j) % (vocab_size - 300) + 10
                       for j in range(bucket.length_tokens))
        first = row * blocks_each
        chunks.append(ScheduledChunk(f"r{row}", tokens, 0,
                                     tuple(range(first, first + blocks_each)), True,
                                     SamplingOptions(temperature=0.0)))
    return Batch(chunks=tuple(chunks))


def timed_ms(runner: ModelRunner, batch: Batch) -> float:
    started = time.perf_counter()
    runner.sample_logits(batch)  # synchronises on CUDA
    return 1000 * (time.perf_counter() - started)


def measure_bucket(eager: ModelRunner, graphed: ModelRunner, bucket: PrefillBucket,
                   vocab_size: int, repeats: int) -> dict:
    eager_ms, graph_ms = [], []
    executor = graphed.short_prefill
    assert executor is not None, "a cuda_graphs runner has a short-prefill executor"
    for repeat in range(WARMUP_RUNS + repeats):
        batch = full_bucket_batch(bucket, vocab_size, salt=repeat)
        if executor.select(batch.chunks) != bucket:
            raise RuntimeError(f"a full batch of {bucket} did not select its own bucket")
        sample = (timed_ms(eager, batch), timed_ms(graphed, batch))
        if repeat >= WARMUP_RUNS:
            eager_ms.append(sample[0])
            graph_ms.append(sample[1])
    eager_median, graph_median = statistics.median(eager_ms), statistics.median(graph_ms)
    return {"length_tokens": bucket.length_tokens, "batch_size": bucket.batch_size,
            "eager_ms": eager_median, "graph_ms": graph_median,
            "speedup": eager_median / graph_median,
            "eager_ms_samples": eager_ms, "graph_ms_samples": graph_ms}


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['length_tokens']}x{r['batch_size']}" for r in results]
    positions = range(len(results))
    figure, (latency, speedup) = plt.subplots(2, 1, figsize=(max(8, len(results) * 0.45), 7),
                                              sharex=True)
    latency.bar([p - 0.2 for p in positions], [r["eager_ms"] for r in results], 0.4,
                label="eager")
    latency.bar([p + 0.2 for p in positions], [r["graph_ms"] for r in results], 0.4,
                label="CUDA graph")
    latency.set_yscale("log")
    latency.set_ylabel("short-prefill latency (ms, median)")
    latency.legend()
    latency.set_title(title)
    speedup.bar(list(positions), [r["speedup"] for r in results], color="tab:green")
    speedup.axhline(1.0, color="black", linewidth=0.8)
    speedup.set_ylabel("eager / graph")
    speedup.set_xticks(list(positions), labels, rotation=60)
    speedup.set_xlabel("bucket (length tokens x batch size)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_bench(args: argparse.Namespace) -> dict:
    model_dir = model_dir_for(args)
    model_config = ModelConfig.from_dir(model_dir)
    buckets = ShortPrefillBuckets(
        lengths_tokens=tuple(int(v) for v in args.lengths.split(",")),
        batch_sizes=tuple(int(v) for v in args.batch_sizes.split(",")),
        max_padding_factor=1.0)  # full buckets only: every timed batch has no padding
    num_blocks = max(buckets.batch_sizes) * blocks_for_tokens(max(buckets.lengths_tokens))

    def runner(cuda_graphs: bool) -> ModelRunner:
        return ModelRunner(EngineConfig(
            model_dir=model_dir, device="cuda", dtype=args.dtype,
            attention_backend=args.attention_backend, num_kv_blocks=num_blocks,
            short_prefill_graphs=cuda_graphs, short_prefill_buckets=buckets,
            cuda_graphs=False), model_config)

    eager, graphed = runner(cuda_graphs=False), runner(cuda_graphs=True)
    executor = graphed.short_prefill
    if executor is None or executor.capture_reserved_bytes is None:
        raise RuntimeError("cuda_graphs=True captured no short-prefill graphs")
    results = [measure_bucket(eager, graphed, bucket, model_config.vocab_size, args.repeats)
               for bucket in all_buckets(buckets)]
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "python": platform.python_version(),
        "model_dir": str(model_dir.name), "dtype": args.dtype,
        "eager_attention_backend": eager.backend.name,
        "num_graphs": executor.num_graphs,
        "capture_s": executor.capture_s,  # warm-up and capture of every bucket
        # Device memory reserved during capture: the shared graph pool and warm-up leftovers.
        "capture_reserved_gib": executor.capture_reserved_bytes / 2**30,
        "kv_block_tokens": BLOCK_SIZE, "repeats": args.repeats, "buckets": results,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_graph_bench needs a CUDA GPU: CUDA graphs are only captured on CUDA, and "
              "this machine has none. Nothing was measured.", file=sys.stderr)
        return EXIT_NO_GPU
    report = run_bench(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cuda_graph_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report["buckets"], args.out / "cuda_graph_bench.png",
         f"{report['model_dir']} {report['dtype']} on {report['device']}")
    for row in report["buckets"]:
        print(f"L={row['length_tokens']:>4} B={row['batch_size']:>3}  eager "
              f"{row['eager_ms']:8.2f} ms  graph {row['graph_ms']:8.2f} ms  "
              f"x{row['speedup']:.2f}")
    print(f"{report['num_graphs']} graphs captured in {report['capture_s']:.1f} s "
          f"({report['capture_reserved_gib']:.2f} GiB reserved); wrote "
          f"{args.out}/cuda_graph_bench.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
