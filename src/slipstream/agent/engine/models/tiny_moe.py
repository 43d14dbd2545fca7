"""Small random-weight mixture-of-experts directories, written by transformers' own model
classes (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), for the equality tests and ``make bench-moe``.

    write_tiny_moe(dir, family) -> config.json + model.safetensors (transformers'
        save_pretrained) + the tiny Llama's tokenizer files (tiny_model.py), so the directory
        also serves through `slipstream serve`

Needs ``transformers`` (a dev dependency): nothing else in the engine imports this module.
Weights are drawn with a spread of order one per layer (not transformers' std 0.02), so that
routing and greedy tokens depend on every weight.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from slipstream.agent.engine.models.tiny_model import ensure_default_model

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_COMMON: dict[str, Any] = dict(vocab_size=4096, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=4096, tie_word_embeddings=False,
                               bos_token_id=4080, eos_token_id=[4081, 4084])
# (hidden, layers, experts, top-k, expert intermediate) per size.
SIZES = {"tiny": (64, 3, 8, 2, 32), "bench": (256, 4, 8, 2, 256)}


def tiny_moe_config(family: str, size: str = "tiny") -> Any:
    """transformers' config object of a small ``family`` model."""
    import transformers

    hidden, num_layers, experts, top_k, expert_width = SIZES[size]
    common = dict(_COMMON, hidden_size=hidden, num_hidden_layers=num_layers,
                  num_experts_per_tok=top_k)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=expert_width,
                                          num_local_experts=experts)
    if family == "qwen2_moe":  # a shared expert, and one dense layer among the sparse ones
        return transformers.Qwen2MoeConfig(
            **common, intermediate_size=2 * expert_width, moe_intermediate_size=expert_width,
            shared_expert_intermediate_size=2 * expert_width, num_experts=experts,
            mlp_only_layers=[1], norm_topk_prob=False, use_sliding_window=False)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, intermediate_size=2 * expert_width, moe_intermediate_size=expert_width,
            num_experts=experts, norm_topk_prob=True)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=expert_width,
                                        num_experts=experts, norm_topk_prob=False,
                                        clip_qkv=8.0)
    raise ValueError(f"unknown MoE family {family!r}; known: {', '.join(FAMILIES)}")


def write_tiny_moe(out_dir: str | Path, family: str, size: str = "tiny", seed: int = 0) -> Path:
    """Write a random ``family`` model of ``size`` to ``out_dir``; returns the directory."""
    import transformers

    out_dir = Path(out_dir)
    config = tiny_moe_config(family, size)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.1 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith(".bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
            elif "embed_tokens" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator)
                                * parameter.shape[-1] ** -0.5)
    model.save_pretrained(out_dir)
    tokenizer_source = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_source / name, out_dir / name)
    return out_dir
