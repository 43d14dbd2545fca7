"""GGUF files of the qwen2, qwen3, gemma2 and gemma3 architectures (written from small random
transformers models as llama.cpp's converter writes them) convert back to directories the
engine serves with transformers' logits and greedy tokens on the original model."""

from __future__ import annotations

import json

import pytest
import torch

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.models.gguf_model import convert
from slipstream.contracts.sampling import SamplingParams
from tests.engine.family_models import load_reference, write_family_model
from tests.engine.gguf_family_writer import write_family_gguf

PROMPTS = [[(31 * j + 11) % 4000 for j in range(30)], [7, 99, 1023, 5, 42]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def qwen2_model_dir(tmp_path_factory, tiny_model_dir):
    return write_family_model("qwen2", tiny_model_dir, tmp_path_factory.mktemp("qwen2") / "m")


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2", "gemma3_text"])
@pytest.mark.parametrize("served", ["converted", "from-the-file"])
def test_gguf_round_trip_serves_transformers_tokens(family, served, family_model_dirs,
                                                    qwen2_model_dir, tmp_path):
    source = qwen2_model_dir if family == "qwen2" else family_model_dirs[family]
    gguf_file = write_family_gguf(source, tmp_path / f"{family}.gguf")
    converted = convert(gguf_file, tmp_path / "hf", weights=served == "converted")
    ours, original = (ModelConfig.from_dir(converted), ModelConfig.from_dir(source))
    windows = [[config.sliding_window_of(i) for i in range(config.num_layers)]
               for config in (ours, original)]
    assert windows[0] == windows[1]
    for field in ("model_type", "qk_norm", "sandwich_norms",
                  "attention_scale", "attn_logit_softcap", "final_logit_softcap",
                  "rope_local_theta", "rope_theta", "rope_scaling", "attention_bias",
                  "tie_word_embeddings", "norm_weight_offset", "embedding_scale"):
        assert getattr(ours, field) == getattr(original, field), field
    config = EngineConfig(model_dir=converted, device="cpu", num_kv_blocks=32,
                          gguf_file=None if served == "converted" else gguf_file)
    tokens = LLMEngine(config).generate(PROMPTS, SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    model = load_reference(source)
    for prompt, got in zip(PROMPTS, tokens):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 pad_token_id=0)
        assert got == out[0, len(prompt):].tolist()
    assert json.loads((converted / "config.json").read_text())["model_type"] == \
        original.model_type
