"""Small random-weight Qwen3, Gemma 2 and Gemma 3 models, built by transformers' own config and
model classes and saved with ``save_pretrained`` beside the tiny model's tokenizer: the
directories the family tests serve and compare against transformers.

Every norm weight is drawn at random (transformers starts them at 1, or 0 for Gemma's
``1 + weight``), so a norm applied with the wrong offset, or not at all, changes the logits.
Gemma's sliding window is 12 tokens, shorter than most test prompts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

SLIDING_WINDOW = 12
FAMILIES = ("qwen3", "gemma2", "gemma3_text")
_COMMON = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.08)


def hf_config(family: str, ids: dict):
    from transformers import (Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config,
                              Qwen3Config)

    tokens = dict(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=0)
    if family == "qwen2":  # q/k/v biases; for the GGUF tests (Llama-shaped otherwise)
        return Qwen2Config(**_COMMON, **tokens, tie_word_embeddings=False, rope_theta=10_000.0)
    if family == "mistral":  # a sliding window on every layer
        return MistralConfig(**_COMMON, **tokens, sliding_window=SLIDING_WINDOW)
    if family == "qwen3":
        return Qwen3Config(**_COMMON, **tokens, tie_word_embeddings=True, rope_theta=10_000.0)
    gemma = dict(**_COMMON, **tokens, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=24)
    if family == "gemma2":  # sliding, global, sliding, global
        return Gemma2Config(**gemma, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    # Gemma 3: three sliding layers, then a global one; a local RoPE base of its own and
    # linear RoPE scaling on the global layers, as the 4B+ checkpoints have.
    return Gemma3TextConfig(**gemma, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                            rope_parameters={
                                "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                   "rope_theta": 100_000.0},
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": 1_000.0}})


def write_family_model(family: str, tokenizer_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """A random ``family`` model in ``out_dir`` with ``tokenizer_dir``'s tokenizer files."""
    from transformers import AutoModelForCausalLM

    tiny = json.loads((tokenizer_dir / "config.json").read_text())
    eos = tiny["eos_token_id"]
    config = hf_config(family, {"bos": tiny["bos_token_id"], "eos": eos})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(torch.randn_like(parameter) * 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def load_reference(model_dir: Path):
    """transformers' model of ``model_dir`` in float32, eager attention (the path that
    soft-caps attention scores)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval()
